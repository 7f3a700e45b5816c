"""mamba_ssm configs (``MambaConfig`` as ``MambaLMHeadModel.save_pretrained``
writes it) checked against the fixed blocks.

The model: ``MixerModel`` of ``n_layer`` blocks, each ``x + mixer(norm(x))``
with an RMSNorm (``rms_norm``) of eps 1e-5, a final RMSNorm ``norm_f``,
the embedding padded to a multiple of ``pad_vocab_size_multiple`` rows, the
LM head tied when ``tie_embeddings``. ``ssm_cfg`` holds the mixer module's
keyword arguments (``layer`` picks Mamba1 / Mamba2 / Mamba3). Each option
is either the block's fixed value, an initialisation or kernel choice that
does not change the float32 function (accepted, ignored), or refused by
name; an option this table does not know is refused too.
"""
from __future__ import annotations

import math

from .configs import _equal, _fail, _is_int, check_dt_limit, check_layers, check_n_groups
from .families import FAMILIES, by_ssm_layer

# top-level MambaConfig fields that do not change the float32 function
_TOP_IGNORED = ("residual_in_fp32", "fused_add_norm", "initializer_cfg", "architectures",
                "transformers_version", "torch_dtype", "dtype", "bos_token_id",
                "eos_token_id", "pad_token_id", "_name_or_path")
_TOP = ("d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "attn_layer_idx",
        "attn_cfg", "rms_norm", "pad_vocab_size_multiple", "tie_embeddings", "norm_epsilon")


def _unknown(field, value, what, known):
    raise ValueError(f"config field {field} = {value!r} is not {what} mojolearn knows, so "
                     f"its effect cannot be checked (known: {', '.join(known)})")


def check_mamba_ssm_config(cfg: dict) -> dict:
    """The summary (as configs.check_config) of a mamba_ssm config."""
    unknown = sorted(k for k in cfg if k not in _TOP and k not in _TOP_IGNORED)
    if unknown:
        _unknown(unknown[0], cfg[unknown[0]], "a MambaConfig field", _TOP)
    ssm = cfg.get("ssm_cfg") or {}
    if not isinstance(ssm, dict):
        _fail("ssm_cfg", ssm, "a JSON object")
    layer = ssm.get("layer", "Mamba1")
    fam = by_ssm_layer(layer)
    if fam is None:
        _fail("ssm_cfg.layer", layer, "one of " + ", ".join(repr(f.ssm_layer) for f in FAMILIES))
    d = cfg.get("d_model")
    if not _is_int(d) or d < 1:
        _fail("d_model", d, "a positive int")
    if d % fam.min_multiple:
        _fail("d_model", d, f"a multiple of {fam.min_multiple} for {fam.title}")
    n_layers = check_layers(cfg.get("n_layer"), "n_layer")
    if cfg.get("d_intermediate", 0) != 0:
        _fail("d_intermediate", cfg["d_intermediate"], "0 (no MLP after the mixer)")
    if cfg.get("attn_layer_idx") not in (None, []):
        _fail("attn_layer_idx", cfg["attn_layer_idx"], "[] (no attention layers)")
    if cfg.get("rms_norm", True) is not True:
        _fail("rms_norm", cfg["rms_norm"], "True (RMSNorm, not LayerNorm)")
    if not _equal(cfg.get("norm_epsilon", 1e-5), 1e-5):
        _fail("norm_epsilon", cfg["norm_epsilon"], 1e-5)
    tie = cfg.get("tie_embeddings", True)
    if not isinstance(tie, bool):
        _fail("tie_embeddings", tie, "a bool")
    vocab = cfg.get("vocab_size")
    if not _is_int(vocab) or vocab < 1:
        _fail("vocab_size", vocab, "a positive int")
    mult = cfg.get("pad_vocab_size_multiple", 8)
    if not _is_int(mult) or mult < 1:
        _fail("pad_vocab_size_multiple", mult, "a positive int")
    fixed, ignored = fam.ssm_options()
    dt_limit = None
    n_groups = 1 if "n_groups" in fam.block_options else None
    for name, value in ssm.items():
        field = f"ssm_cfg.{name}"
        if name == "layer" or name in ignored:
            continue
        if name == "dt_rank" and fam.dt_rank:
            if value != "auto" and not _equal(value, math.ceil(d / 16)):
                _fail(field, value, f"'auto' or ceil(d_model / 16) = {math.ceil(d / 16)}")
        elif name == "d_ssm" and layer == "Mamba2":
            if value is not None and not _equal(value, 2 * d):
                _fail(field, value, f"None or 2 * d_model = {2 * d} (no gated-MLP part)")
        elif name == "dt_limit" and "dt_limit" in fam.block_options:
            dt_limit = check_dt_limit(value, field)
        elif name == "ngroups" and "n_groups" in fam.block_options:
            n_groups = check_n_groups(value, d, field)
        elif name in fixed:
            if not _equal(value, fixed[name]):
                _fail(field, value, fixed[name])
        else:
            _unknown(field, value, f"a {layer} option", sorted(set(fixed) | set(ignored)))
    if "dt_limit" in fam.block_options and dt_limit is None:
        dt_limit = (0.0, math.inf)
    return {"kind": fam.kind, "format": "mamba_ssm", "d_model": d, "n_layers": n_layers,
            "vocab_size": vocab + (-vocab % mult), "tie": tie, "dt_limit": dt_limit,
            "n_groups": n_groups}
