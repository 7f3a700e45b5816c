"""Loading Mamba, Mamba-2 and Mamba-3 checkpoints (no PyTorch needed).

``load_checkpoint(source)`` turns a Hugging Face ``MambaForCausalLM`` /
``MambaModel``, ``FalconMambaForCausalLM`` (Mamba-1 layout; blocks with
``bcdt_rms_eps = mixer_rms_eps``) or ``Mamba2ForCausalLM`` /
``Mamba2Model`` checkpoint into a
:class:`Checkpoint`: one weight dict per layer for ``Mamba1Block`` /
``Mamba2Block``, plus the token embeddings, the final norm and the LM head,
all float32 ``mojolearn.Array``. Mamba-3 checkpoints use mojolearn's layout
(model_type 'mamba3', the same keys under ``layers.{i}.mixer.`` as the
Mamba3Block weights; ``mojolearn.save.save_checkpoint`` writes one).

``source`` is a folder holding ``config.json`` and ``model.safetensors``
(or a sharded ``model.safetensors.index.json``), or a state_dict (a mapping
of names to torch tensors, NumPy arrays or float32 buffers) with an optional
``config``. Safetensors files are parsed here (8-byte little-endian header
length, JSON header, raw little-endian data); PyTorch is never imported for
them.

Dtypes: F32 is read as is; BF16 and F16 are widened exactly to float32;
anything else (F64 included: it would have to be rounded) is refused with a
TypeError naming the tensor.

Configurations the fixed blocks cannot represent are refused with a
ValueError naming the config field (see ``check_config``).

Key mapping (an optional ``backbone.`` prefix is accepted):

=================================  ===============================================  ===================
checkpoint key                     Mamba-1 block                                    Mamba-2 block
=================================  ===============================================  ===================
layers.{i}.norm.weight             norm.weight                                      block_norm.weight
layers.{i}.mixer.norm.weight       (none)                                           norm.weight
layers.{i}.mixer.<name>            <name>                                           <name>
embeddings.weight                  Checkpoint.embeddings                            (same)
norm_f.weight                      Checkpoint.final_norm                            (same)
lm_head.weight                     Checkpoint.lm_head (the embeddings when tied)    (same)
=================================  ===============================================  ===================
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

__all__ = ["load_checkpoint", "read_safetensors", "check_config", "Checkpoint"]

_LAYER_KEY = re.compile(r"^(?:backbone\.)?layers\.(\d+)\.(.+)$")
_EMBED_KEYS = ("embeddings.weight", "embedding.weight")

_M1_MIXER = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight",
             "dt_proj.weight", "dt_proj.bias", "A_log", "D", "out_proj.weight")
_M2_MIXER = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
             "norm.weight", "out_proj.weight")

from .safetensors import (  # noqa: F401  (read_safetensors is public here too)
    LazyTensor, _from_raw, _numel, lazy_safetensors, read_safetensors,
)


def _to_float32(value, name: str):
    """float32 Array from a torch tensor, a NumPy array or a buffer; only
    exact conversions (float32, bfloat16, float16)."""
    dt = getattr(value, "dtype", None)
    dname = str(dt) if dt is not None else None
    if dname is not None and dname.startswith("torch."):
        import torch  # the value is a torch tensor: torch is importable
        t = value.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            raw = t.view(torch.int16).numpy().tobytes()
            return _from_raw(raw, "BF16", tuple(t.shape), name)
        if t.dtype == torch.float16:
            return _from_raw(t.numpy().tobytes(), "F16", tuple(t.shape), name)
        if t.dtype == torch.float32:
            return _from_raw(t.numpy().tobytes(), "F32", tuple(t.shape), name)
        raise TypeError(f"tensor {name} has dtype {dname[6:]}; only float32, bfloat16 and "
                        "float16 (widened exactly) can be loaded")
    if dname == "bfloat16":  # NumPy with ml_dtypes
        return _from_raw(value.view("uint16").tobytes(), "BF16", tuple(value.shape), name)
    try:
        mv = memoryview(value)
    except TypeError:
        raise TypeError(f"tensor {name} must be a tensor or buffer, got "
                         f"{type(value).__name__}") from None
    fmt = mv.format.lstrip("@=<")
    kind = {"f": "F32", "e": "F16"}.get(fmt)
    if kind is None:
        raise TypeError(f"tensor {name} has dtype {dname or 'format ' + repr(mv.format)}; only "
                        "float32, bfloat16 and float16 (widened exactly) can be loaded")
    return _from_raw(mv.tobytes(), kind, tuple(mv.shape), name)


# --------------------------------------------------------------------------- config
def _fail(field, value, want):
    raise ValueError(f"config field {field} = {value!r} cannot be represented: the block "
                     f"needs {want}")


def _get(cfg, field, default=None):
    return cfg.get(field, default)


def _kind_of(cfg: dict, keys=()) -> str:
    mt = cfg.get("model_type")
    if mt in ("mamba", "mamba2", "mamba3"):
        return mt
    if mt == _FALCON:
        return "mamba"
    if mt is not None:
        raise ValueError(f"config field model_type = {mt!r} is not a Mamba, Mamba-2 or "
                         "Mamba-3 model ('mamba', 'falcon_mamba', 'mamba2' or 'mamba3')")
    for k in keys:
        if k.endswith("mixer.x_proj.weight"):
            return "mamba"
        if k.endswith("mixer.B_norm.weight"):
            return "mamba3"
        if k.endswith("mixer.dt_bias"):
            return "mamba2"
    raise ValueError("cannot tell whether this is a Mamba, Mamba-2 or Mamba-3 checkpoint: "
                     "give a config with model_type 'mamba', 'mamba2' or 'mamba3'")


def check_config(config) -> dict:
    """Check that a transformers Mamba / Mamba-2 config fits the fixed blocks.

    Returns a summary dict {kind, d_model, n_layers, vocab_size, tie,
    dt_limit}; raises ValueError naming the first field the blocks cannot
    represent (Mamba-1: state_size 16, conv_kernel 4, expand 2,
    intermediate_size 2 * hidden_size, time_step_rank ceil(hidden_size / 16),
    use_bias False, use_conv_bias True, hidden_act silu, layer_norm_epsilon
    1e-5; Mamba-2 additionally hidden_size % 32 == 0, state_size 128,
    head_dim 64, num_heads 2 * hidden_size / 64, n_groups 1, chunk_size 256,
    rms_norm True and norm_before_gate False where present, time_step_limit
    two numbers lo <= hi).
    """
    cfg = _config_dict(config)
    kind = _kind_of(cfg)
    d = _get(cfg, "hidden_size")
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        _fail("hidden_size", d, "a positive int")
    n_layers = _get(cfg, "num_hidden_layers", _get(cfg, "n_layer"))
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        _fail("num_hidden_layers", n_layers, "a positive int")
    expect = {"conv_kernel": 4, "expand": 2, "use_bias": False, "use_conv_bias": True,
              "layer_norm_epsilon": 1e-5}
    if kind == "mamba":
        expect["state_size"] = 16
    elif kind == "mamba3":
        if d % 32:
            _fail("hidden_size", d, "a multiple of 32 for Mamba-3")
        expect.update({"state_size": 128, "head_dim": 64, "num_heads": 2 * d // 64,
                       "chunk_size": 64})
    else:
        if d % 32:
            _fail("hidden_size", d, "a multiple of 32 for Mamba-2")
        expect.update({"state_size": 128, "head_dim": 64, "n_groups": 1, "chunk_size": 256,
                       "num_heads": 2 * d // 64})
    for field, want in expect.items():
        got = _get(cfg, field, want)
        if isinstance(want, bool):
            ok = got is want
        else:
            ok = not isinstance(got, bool) and isinstance(got, (int, float)) and got == want
        if not ok:
            _fail(field, got, want)
    act = _get(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        _fail("hidden_act", act, "'silu'")
    inter = _get(cfg, "intermediate_size")
    if inter is not None and inter != 2 * d:
        _fail("intermediate_size", inter, 2 * d)
    dt_limit = None
    if kind == "mamba":
        r = _get(cfg, "time_step_rank", "auto")
        if r != "auto" and (isinstance(r, bool) or r != math.ceil(d / 16)):
            _fail("time_step_rank", r, f"ceil(hidden_size / 16) = {math.ceil(d / 16)}")
    elif kind == "mamba2":
        if "rms_norm" in cfg and cfg["rms_norm"] is not True:
            _fail("rms_norm", cfg["rms_norm"], True)
        if "norm_before_gate" in cfg and cfg["norm_before_gate"] is not False:
            _fail("norm_before_gate", cfg["norm_before_gate"], "False (gate before the norm)")
        lim = _get(cfg, "time_step_limit", (0.0, math.inf))
        try:
            lo, hi = (_number(v) for v in lim)
        except (TypeError, ValueError):
            _fail("time_step_limit", lim, "two numbers (lo, hi)")
        if math.isnan(lo) or math.isnan(hi) or lo > hi:
            _fail("time_step_limit", lim, "lo <= hi, no NaN")
        dt_limit = (lo, hi)
    return {"kind": kind, "d_model": d, "n_layers": n_layers,
            "vocab_size": _get(cfg, "vocab_size"),
            "tie": bool(_get(cfg, "tie_word_embeddings", kind != "mamba2")),
            "dt_limit": dt_limit, "bcdt_rms_eps": _falcon_eps(cfg)}


# -- Falcon-Mamba (model_type 'falcon_mamba') --------------------------------
# Mamba-1's layout and tensor names; its mixer adds weightless RMS norms of
# dt, B and C with eps mixer_rms_eps (Mamba1Block's bcdt_rms_eps option).
_FALCON = "falcon_mamba"


def _falcon_eps(cfg: dict):
    """mixer_rms_eps of a falcon_mamba config (transformers' default 1e-6);
    None for every other model type."""
    if cfg.get("model_type") != _FALCON:
        return None
    v = cfg.get("mixer_rms_eps", 1e-6)
    try:
        from .mamba.mamba1 import check_bcdt_rms_eps
        return check_bcdt_rms_eps(_number(v))
    except (TypeError, ValueError):
        _fail("mixer_rms_eps", v, "a positive number")


def _number(v) -> float:
    """A config number; transformers writes inf as {"__float__": "Infinity"}."""
    if isinstance(v, dict) and set(v) == {"__float__"}:
        v = v["__float__"]
    if isinstance(v, bool):
        raise TypeError("a bool is not a number")
    return float(v)


def _read_json(path: Path, what: str) -> dict:
    """A JSON object read from path; ValueError naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: {what} must be a JSON object, got {type(value).__name__}")
    return value


def _config_dict(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        return _read_json(Path(config), "config")
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if hasattr(config, "keys"):
        return dict(config)
    raise TypeError(f"config must be a dict, a transformers config or a path to config.json, "
                    f"got {type(config).__name__}")


def _infer_config(tensors: dict) -> dict:
    """A config read off the tensor shapes (for a state_dict without config).

    What shapes cannot show (layer_norm_epsilon, chunk_size, time_step_limit,
    hidden_act) is taken to be the block's fixed value.
    """
    keys = list(tensors)
    kind = _kind_of({}, keys)
    shapes = {k: tuple(_shape(v)) for k, v in tensors.items()}
    layer0 = {m.group(2): k for k in keys if (m := _LAYER_KEY.match(k)) and m.group(1) == "0"}
    if "norm.weight" not in layer0:
        raise ValueError("state_dict has no layers.0.norm.weight")
    d = shapes[layer0["norm.weight"]][0]
    n_layers = 1 + max(int(m.group(1)) for k in keys if (m := _LAYER_KEY.match(k)))
    cfg = {"model_type": kind, "hidden_size": d, "num_hidden_layers": n_layers,
           "use_bias": "mixer.in_proj.bias" in layer0,
           "use_conv_bias": "mixer.conv1d.bias" in layer0}
    conv = shapes.get(layer0.get("mixer.conv1d.weight"))
    if conv:
        cfg["conv_kernel"] = conv[-1]
    out = shapes.get(layer0.get("mixer.out_proj.weight"))
    if out and len(out) == 2 and d:
        cfg["intermediate_size"] = out[1]
        cfg["expand"] = out[1] / d if out[1] % d else out[1] // d
    alog = shapes.get(layer0.get("mixer.A_log"))
    if kind == "mamba":
        if alog and len(alog) == 2:
            cfg["state_size"] = alog[1]
        dtw = shapes.get(layer0.get("mixer.dt_proj.weight"))
        if dtw and len(dtw) == 2:
            cfg["time_step_rank"] = dtw[1]
    else:
        if alog and out:
            h = alog[0]
            cfg["num_heads"] = h
            cfg["head_dim"] = out[1] // h if h else 0
            if conv:
                cfg["state_size"] = (conv[0] - out[1]) // 2  # assuming n_groups = 1
    emb = next((shapes[p + k] for k in _EMBED_KEYS for p in ("backbone.", "")
                if p + k in shapes), None)
    if emb:
        cfg["vocab_size"] = emb[0]
    cfg["tie_word_embeddings"] = not any(k.endswith("lm_head.weight") for k in keys)
    return cfg


def _shape(v):
    s = getattr(v, "shape", None)
    if s is None:
        s = memoryview(v).shape
    return tuple(int(x) for x in s)


# --------------------------------------------------------------------------- checkpoint
class Checkpoint:
    """A loaded Mamba / Mamba-2 checkpoint, ready for mojolearn blocks.

    Attributes
    ----------
    kind : {'mamba', 'mamba2', 'mamba3'}
    config : dict
        The transformers config (as read, or inferred from the tensors).
    d_model : int
        Model dimension.
    n_layers : int
        Number of layers.
    vocab_size : int
        Rows of the embedding table.
    layers : list of dict
        One weight dict per layer (float32 mojolearn.Array) under the
        Mamba1Block / Mamba2Block / Mamba3Block names.
    embeddings : float32 mojolearn.Array, shape (vocab_size, d_model)
    final_norm : float32 mojolearn.Array, shape (d_model,)
        RMSNorm weight (eps 1e-5) applied after the last layer.
    lm_head : float32 mojolearn.Array, shape (vocab_size, d_model)
        The embeddings themselves when tie_word_embeddings.
    tie_word_embeddings : bool
    dt_limit : (float, float) or None
        Mamba-2's time_step_limit; None for Mamba-1 and Mamba-3.
    bcdt_rms_eps : float or None
        Falcon-Mamba's mixer_rms_eps (its blocks are Mamba1Block with that
        option); None for every other model.
    """

    def __init__(self, kind, config, summary, layers, embeddings, final_norm, lm_head):
        self.kind = kind
        self.config = config
        self.d_model = summary["d_model"]
        self.n_layers = summary["n_layers"]
        self.vocab_size = _shape(embeddings)[0]
        self.tie_word_embeddings = summary["tie"]
        self.dt_limit = summary["dt_limit"]
        self.bcdt_rms_eps = summary.get("bcdt_rms_eps")  # Falcon-Mamba's mixer_rms_eps
        self.layers = layers
        self.embeddings = embeddings
        self.final_norm = final_norm
        self.lm_head = lm_head

    @property
    def block_class(self):
        """Mamba1Block, Mamba2Block or Mamba3Block."""
        import mojolearn
        return {"mamba": mojolearn.Mamba1Block, "mamba2": mojolearn.Mamba2Block,
                "mamba3": mojolearn.Mamba3Block}[self.kind]

    def blocks(self, *, weight_format: str = "float32", numeric_mode: str = "identical") -> list:
        """One block per layer (Mamba1Block, Mamba2Block with dt_limit, or
        Mamba3Block).

        weight_format 'bfloat16' or 'int8' packs the projection weights with
        mojolearn.lowbit first (the blocks then compute on the rounded
        values; see docs/checkpoints.md).
        """
        return [self.block(i, weight_format=weight_format, numeric_mode=numeric_mode)
                for i in range(self.n_layers)]

    def block(self, i: int, *, weight_format: str = "float32",
              numeric_mode: str = "identical"):
        """The block of layer i (lazy tensors are read now, and not kept)."""
        from . import lowbit
        kw = {"numeric_mode": numeric_mode}
        if self.kind == "mamba2":
            kw["dt_limit"] = self.dt_limit
        if self.bcdt_rms_eps is not None:
            kw["bcdt_rms_eps"] = self.bcdt_rms_eps
        w = {k: _loaded(v) for k, v in self.layers[i].items()}
        if weight_format != "float32":
            w = lowbit.pack(w, weight_format)
        return self.block_class(w, **kw)

    def embed(self, token_ids):
        """Embedding rows for token ids (a (B, L) nested sequence or a 2-D
        integer array): a float32 mojolearn.Array (B, L, d_model)."""
        from ._array import Array
        rows = [list(r) for r in token_ids]
        if not rows or any(len(r) != len(rows[0]) for r in rows) or not rows[0]:
            raise ValueError("token_ids must be a non-empty (B, L) grid of ints")
        d, vocab = self.d_model, self.vocab_size
        out = Array((len(rows), len(rows[0]), d), zero=False)
        dst = memoryview(out).cast("B").cast("f")
        src = memoryview(_loaded(self.embeddings)).cast("B").cast("f")
        k = 0
        for r in rows:
            for t in r:
                t = int(t)
                if not 0 <= t < vocab:
                    raise ValueError(f"token id {t} is outside [0, {vocab})")
                dst[k * d:(k + 1) * d] = src[t * d:(t + 1) * d]
                k += 1
        return out

    def __repr__(self):
        return (f"Checkpoint(kind={self.kind!r}, d_model={self.d_model}, "
                f"n_layers={self.n_layers}, vocab_size={self.vocab_size})")


def _loaded(v):
    """The tensor's float32 Array (a LazyTensor is read now)."""
    return v.load() if isinstance(v, LazyTensor) else v


def _folder_tensors(folder: Path, lazy: bool = False) -> dict:
    read = lazy_safetensors if lazy else read_safetensors
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        return read(single)
    if index.is_file():
        wmap = _read_json(index, "the shard index").get("weight_map", {})
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise ValueError(f"{index}: weight_map must map tensor names to file names")
        by_file = {}
        for name, fname in wmap.items():
            by_file.setdefault(fname, []).append(name)
        out = {}
        for fname, names in sorted(by_file.items()):
            out.update(read(folder / fname, names))
        return out
    if (folder / "pytorch_model.bin").is_file():
        raise ValueError(f"{folder} holds pytorch_model.bin only; reading it needs PyTorch: "
                         "load it with torch.load(...) and pass the state_dict (and config)")
    raise ValueError(f"{folder} has no model.safetensors (or model.safetensors.index.json)")


def load_checkpoint(source, config=None, *, lazy: bool = False) -> Checkpoint:
    """Load a transformers Mamba or Mamba-2 checkpoint for mojolearn blocks.

    Parameters
    ----------
    source : str, PathLike or mapping
        A folder with config.json and model.safetensors (or a sharded
        model.safetensors.index.json), or a state_dict: a mapping of names to
        torch tensors, NumPy arrays or float32 buffers (with or without the
        ``backbone.`` prefix).
    config : dict, transformers config, path to config.json, or None
        For a state_dict; None infers the dimensions from the tensor shapes
        (and assumes the block's fixed eps, chunk size and dt limit). For a
        folder, overrides config.json when given.
    lazy : bool, default False
        For a folder: read only the safetensors headers now; the tensors
        are :class:`mojolearn.safetensors.LazyTensor` and are read when a
        block, the embeddings or a row range is needed (``Checkpoint.block``,
        ``MambaLM``), so a large model is never held twice.

    Returns
    -------
    Checkpoint

    Raises
    ------
    ValueError naming the config field the blocks cannot represent, a
    missing / unknown / mis-shaped tensor; TypeError naming a tensor of a
    dtype that cannot be widened exactly to float32.
    """
    if isinstance(source, (str, os.PathLike)):
        folder = Path(source)
        if not folder.is_dir():
            hint = ""
            if not folder.exists() and not folder.is_absolute() and \
                    len(folder.parts) == 2 and not str(source).startswith("."):
                hint = (" (Hub ids are not downloaded: fetch the repository first, e.g. with "
                        "huggingface_hub.snapshot_download, and pass its local folder)")
            raise ValueError(f"{folder} is not a folder{hint}")
        if config is None:
            cfg_path = folder / "config.json"
            if not cfg_path.is_file():
                raise ValueError(f"{folder} has no config.json")
            config = cfg_path
        cfg = _config_dict(config)
        summary = check_config(cfg)  # refuse before reading any tensor
        tensors = _folder_tensors(folder, lazy)
    elif hasattr(source, "keys"):
        cfg = _config_dict(config) if config is not None else _infer_config(source)
        summary = check_config(cfg)
        tensors = {k: _to_float32(source[k], k) for k in source.keys()}
    else:
        raise TypeError(f"source must be a folder path or a state_dict mapping, got "
                        f"{type(source).__name__}")
    return _assemble(cfg, summary, tensors)


def _expected_shapes(kind: str, d: int) -> dict:
    di = 2 * d
    if kind == "mamba":
        r = math.ceil(d / 16)
        return {"norm.weight": (d,), "in_proj.weight": (2 * di, d),
                "conv1d.weight": (di, 1, 4), "conv1d.bias": (di,),
                "x_proj.weight": (r + 32, di), "dt_proj.weight": (di, r),
                "dt_proj.bias": (di,), "A_log": (di, 16), "D": (di,),
                "out_proj.weight": (d, di)}
    if kind == "mamba3":
        from .mamba.mamba3 import mamba3_weight_shapes
        return mamba3_weight_shapes(d)
    h, cd = di // 64, di + 256
    return {"block_norm.weight": (d,), "in_proj.weight": (2 * di + 256 + h, d),
            "conv1d.weight": (cd, 1, 4), "conv1d.bias": (cd,), "dt_bias": (h,),
            "A_log": (h,), "D": (h,), "norm.weight": (di,), "out_proj.weight": (d, di)}


def _assemble(cfg, summary, tensors) -> Checkpoint:
    kind, d, n = summary["kind"], summary["d_model"], summary["n_layers"]
    want = _expected_shapes(kind, d)
    layers = [dict() for _ in range(n)]
    top = {}
    unknown = []
    for key, value in tensors.items():
        m = _LAYER_KEY.match(key)
        if m is None:
            top[key[len("backbone."):] if key.startswith("backbone.") else key] = (key, value)
            continue
        i, rest = int(m.group(1)), m.group(2)
        if rest == "norm.weight":
            name = "norm.weight" if kind == "mamba" else "block_norm.weight"  # (mamba2, mamba3)
        elif rest.startswith("mixer."):
            name = rest[len("mixer."):]
        else:
            name = None
        if i >= n or name not in want:
            unknown.append(key)
            continue
        shape = _shape(value)
        if name == "conv1d.weight" and len(shape) == 2:
            shape = (shape[0], 1, shape[1])
        if shape != want[name]:
            raise ValueError(f"tensor {key} has shape {shape}; config (hidden_size {d}) "
                             f"needs {want[name]}")
        layers[i][name] = value
    embed = next((top.pop(k) for k in _EMBED_KEYS if k in top), None)
    norm_f = top.pop("norm_f.weight", None)
    head = top.pop("lm_head.weight", None)
    unknown += [k for k, _ in top.values()]
    if unknown:
        raise ValueError(f"checkpoint has tensors the {kind} blocks do not use: "
                         f"{sorted(unknown)[:20]}")
    missing = [f"layers.{i}.{k}" for i in range(n) for k in want if k not in layers[i]]
    if embed is None:
        missing.append("embeddings.weight")
    if norm_f is None:
        missing.append("norm_f.weight")
    if head is None and not summary["tie"]:
        missing.append("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing[:20]}")
    emb = embed[1]
    es = _shape(emb)
    if len(es) != 2 or es[1] != d:
        raise ValueError(f"tensor {embed[0]} has shape {es}; needs (vocab_size, {d})")
    if _shape(norm_f[1]) != (d,):
        raise ValueError(f"tensor {norm_f[0]} has shape {_shape(norm_f[1])}; needs ({d},)")
    lm = emb
    if not summary["tie"]:
        if _shape(head[1]) != es:
            raise ValueError(f"tensor {head[0]} has shape {_shape(head[1])}; needs {es}")
        lm = head[1]
    return Checkpoint(kind, cfg, summary, layers, emb, norm_f[1], lm)
