"""Checkpoint configs: read, recognised and checked against the fixed blocks.

Two config formats are read (docs/checkpoints.md):

- transformers' (``model_type`` 'mamba' / 'falcon_mamba' / 'mamba2', and
  mojolearn's 'mamba3'): ``hidden_size``, ``num_hidden_layers``,
  ``vocab_size``, ...; Falcon-Mamba is Mamba-1 whose blocks normalise dt,
  B and C (``Mamba1Block(bcdt_rms_eps=mixer_rms_eps)``);
- mamba_ssm's (``MambaConfig``: ``d_model``, ``n_layer``, ``vocab_size``,
  ``ssm_cfg`` with ``layer`` 'Mamba1' / 'Mamba2' / 'Mamba3' and the module's
  options, ``rms_norm``, ``pad_vocab_size_multiple``, ``tie_embeddings``).

``check_config`` turns either into one summary; every value the fixed
blocks cannot represent is refused with a ValueError naming the field (a
mamba_ssm module option as ``ssm_cfg.<name>``). The family facts (fixed
values, d_model rule) come from mojolearn.families.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from . import _json
from .families import FAMILIES, by_model_type, family

__all__ = ["check_config", "config_format", "eos_token_ids"]


def _fail(field, value, want):
    raise ValueError(f"config field {field} = {value!r} cannot be represented: the block "
                     f"needs {want}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> float:
    """A config number; transformers writes inf as {"__float__": "Infinity"}."""
    if isinstance(v, dict) and set(v) == {"__float__"}:
        v = v["__float__"]
    if isinstance(v, bool):
        raise TypeError("a bool is not a number")
    return float(v)


def _equal(got, want) -> bool:
    if isinstance(want, bool) or want is None:
        return got is want
    return not isinstance(got, bool) and isinstance(got, (int, float)) and got == want


MAX_JSON_BYTES = 64 << 20  # config files and shard indexes are kilobytes


def read_json(path: Path, what: str) -> dict:
    """A JSON object read from path; ValueError naming the file otherwise."""
    with open(path, "rb") as f:
        raw = f.read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise ValueError(f"{path}: {what} is larger than {MAX_JSON_BYTES} bytes")
    value = _json.loads(raw, f"{path}: {what}")
    if not isinstance(value, dict):
        raise ValueError(f"{path}: {what} must be a JSON object, got {type(value).__name__}")
    return value


def config_dict(config) -> dict:
    """A config as a dict: given as a dict, a transformers config object or a
    path to config.json."""
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        return read_json(Path(config), "config")
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if hasattr(config, "keys"):
        return dict(config)
    raise TypeError(f"config must be a dict, a transformers config or a path to config.json, "
                    f"got {type(config).__name__}")


def config_format(cfg: dict) -> str:
    """'mamba_ssm' for a mamba_ssm MambaConfig (d_model, n_layer, no
    model_type), else 'transformers'."""
    if "model_type" not in cfg and ("d_model" in cfg or "ssm_cfg" in cfg):
        return "mamba_ssm"
    return "transformers"


def kind_of(cfg: dict, keys=()) -> str:
    """The family kind a transformers config (or, without model_type, the
    tensor names) describes."""
    mt = cfg.get("model_type")
    if mt is not None:
        fam = by_model_type(mt)
        if fam is None:
            known = [t for f in FAMILIES for t in (f.model_type,) + f.variant_model_types]
            raise ValueError(f"config field model_type = {mt!r} is not a Mamba, Mamba-2 or "
                             f"Mamba-3 model ({', '.join(map(repr, known))})")
        return fam.kind
    for k in keys:
        if k.endswith("mixer.x_proj.weight"):
            return "mamba"
        if k.endswith("mixer.B_norm.weight"):
            return "mamba3"
        if k.endswith("mixer.dt_bias"):
            return "mamba2"
    raise ValueError("cannot tell whether this is a Mamba, Mamba-2 or Mamba-3 checkpoint: "
                     "give a config with model_type 'mamba', 'mamba2' or 'mamba3' (or "
                     "mamba_ssm's d_model, n_layer and ssm_cfg)")


def check_config(config) -> dict:
    """Check that a checkpoint config fits the fixed blocks.

    Returns a summary dict {kind, format, d_model, n_layers, vocab_size,
    tie, dt_limit, n_groups, bcdt_rms_eps} (n_groups: Mamba-2's groups of B
    and C, else None; bcdt_rms_eps: a falcon_mamba config's
    mixer_rms_eps, default 1e-6, else None; vocab_size: the embedding rows the weights must have,
    None when the config does not say); raises ValueError naming the first
    field the blocks cannot represent. transformers configs (Mamba-1:
    state_size 16, conv_kernel 4, expand 2, intermediate_size 2 *
    hidden_size, time_step_rank ceil(hidden_size / 16), use_bias False,
    use_conv_bias True, hidden_act silu, layer_norm_epsilon 1e-5; Mamba-2
    additionally hidden_size % 32 == 0, state_size 128, head_dim 64,
    num_heads 2 * hidden_size / 64, n_groups dividing num_heads, chunk_size 256, rms_norm
    True and norm_before_gate False where present, time_step_limit two
    numbers lo <= hi) and mamba_ssm configs (docs/checkpoints.md) are read.
    """
    cfg = config_dict(config)
    if config_format(cfg) == "mamba_ssm":
        from ._mamba_ssm_config import check_mamba_ssm_config
        return check_mamba_ssm_config(cfg)
    fam = family(kind_of(cfg))
    d = cfg.get("hidden_size")
    if not _is_int(d) or d < 1:
        _fail("hidden_size", d, "a positive int")
    if d % fam.min_multiple:
        _fail("hidden_size", d, f"a multiple of {fam.min_multiple} for {fam.title}")
    n_layers = check_layers(cfg.get("num_hidden_layers", cfg.get("n_layer")),
                            "num_hidden_layers")
    for field, want in fam.fixed_config(d).items():
        got = cfg.get(field, want)
        if not _equal(got, want):
            _fail(field, got, want)
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        _fail("hidden_act", act, "'silu'")
    inter = cfg.get("intermediate_size")
    if inter is not None and inter != 2 * d:
        _fail("intermediate_size", inter, 2 * d)
    dt_limit = None
    if fam.dt_rank:
        r = cfg.get("time_step_rank", "auto")
        if r != "auto" and (isinstance(r, bool) or r != math.ceil(d / 16)):
            _fail("time_step_rank", r, f"ceil(hidden_size / 16) = {math.ceil(d / 16)}")
    if "dt_limit" in fam.block_options:
        if "rms_norm" in cfg and cfg["rms_norm"] is not True:
            _fail("rms_norm", cfg["rms_norm"], True)
        if "norm_before_gate" in cfg and cfg["norm_before_gate"] is not False:
            _fail("norm_before_gate", cfg["norm_before_gate"], "False (gate before the norm)")
        dt_limit = check_dt_limit(cfg.get("time_step_limit", (0.0, math.inf)),
                                  "time_step_limit")
    n_groups = None
    if "n_groups" in fam.block_options:
        n_groups = check_n_groups(cfg.get("n_groups", 1), d, "n_groups")
    bcdt_rms_eps = None
    if cfg.get("model_type") in fam.variant_model_types:  # falcon_mamba
        bcdt_rms_eps = check_mixer_rms_eps(cfg.get("mixer_rms_eps", 1e-6))
    return {"kind": fam.kind, "format": "transformers", "d_model": d, "n_layers": n_layers,
            "vocab_size": check_vocab(cfg.get("vocab_size"), "vocab_size"),
            "tie": bool(cfg.get("tie_word_embeddings", fam.tied_by_default)),
            "dt_limit": dt_limit, "n_groups": n_groups, "bcdt_rms_eps": bcdt_rms_eps}


def check_n_groups(v, d: int, field: str) -> int:
    """Mamba-2's groups of B and C: a positive int dividing the 2 d / 64 heads."""
    heads = 2 * d // 64
    if not _is_int(v) or v < 1 or heads % v:
        _fail(field, v, f"a positive divisor of the {heads} heads")
    return v


def check_mixer_rms_eps(v) -> float:
    """Falcon-Mamba's mixer_rms_eps (the eps of its dt, B and C norms)."""
    from ._intake import positive_float32
    try:
        return positive_float32(_number(v), "mixer_rms_eps")
    except (TypeError, ValueError):
        _fail("mixer_rms_eps", v, "a positive number float32 can hold")


def check_layers(n, field: str) -> int:
    if not _is_int(n) or n < 1:
        _fail(field, n, "a positive int")
    return n


def check_vocab(v, field: str):
    """vocab_size as given (None when absent); a positive int otherwise."""
    if v is not None and (not _is_int(v) or v < 1):
        _fail(field, v, "a positive int")
    return v


def check_dt_limit(lim, field: str) -> tuple:
    try:
        lo, hi = (_number(v) for v in lim)
    except (TypeError, ValueError):
        _fail(field, lim, "two numbers (lo, hi)")
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        _fail(field, lim, "lo <= hi, no NaN")
    return (lo, hi)


def eos_token_ids(folder, cfg: dict, vocab_size: int) -> tuple:
    """The end-of-text token ids: generation_config.json's eos_token_id in
    folder, else the config's; an int or a list of ints, each in
    [0, vocab_size); None or absent: (). ValueError naming the file and the
    field otherwise."""
    sources = []
    if folder is not None and (Path(folder) / "generation_config.json").is_file():
        path = Path(folder) / "generation_config.json"
        sources.append((read_json(path, "generation config"), "generation_config.json"))
    sources.append((cfg, "config"))
    for data, where in sources:
        value = data.get("eos_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        for t in ids:
            if not _is_int(t) or not 0 <= t < vocab_size:
                raise ValueError(f"{where} field eos_token_id = {value!r}: {t!r} is not a token "
                                 f"id of this model (ints in [0, {vocab_size}))")
        return tuple(dict.fromkeys(ids))
    return ()
