"""A GGUF file of a Mamba ("mamba", Falcon-Mamba included) or Mamba-2
("mamba2") model as a Checkpoint: its metadata as a transformers-style
config, its tensor names and layouts mapped to the blocks' (docs/checkpoints.md,
"GGUF files").

What llama.cpp's converter changed, and how it is read back:

- ``A_log`` is stored as ``ssm_a`` = -exp(A_log), computed in float32 by
  torch: given to the blocks as weight ``A`` (used as is, not recomputed);
- the convolution weight is squeezed to (C, 4): the blocks take that shape;
- Mamba-2's ``A`` and ``D`` get a trailing axis (H, 1) and its gated norm
  is (groups, d_inner / groups): reshaped back (same values in C order);
- ``dt_bias`` is named ``ssm_dt.bias``;
- a head equal to the embedding is left out (the model is tied);
- Falcon-Mamba is "mamba" with ``ssm.dt_b_c_rms`` true; llama.cpp norms dt,
  B and C with the layer norm's eps (``attention.layer_norm_rms_epsilon``),
  so that eps is the blocks' ``bcdt_rms_eps``.
"""
from __future__ import annotations

import re
import struct

from .gguf import read_gguf

ARCHS = ("mamba", "mamba2")
# the file's tensor names (per layer after "blk.{i}.") -> the checkpoint names
_TOP = {"token_embd.weight": "backbone.embeddings.weight",
        "output_norm.weight": "backbone.norm_f.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm.weight": "norm.weight", "ssm_in.weight": "mixer.in_proj.weight",
          "ssm_conv1d.weight": "mixer.conv1d.weight", "ssm_conv1d.bias": "mixer.conv1d.bias",
          "ssm_x.weight": "mixer.x_proj.weight", "ssm_dt.weight": "mixer.dt_proj.weight",
          "ssm_a": "mixer.A", "ssm_d": "mixer.D", "ssm_norm.weight": "mixer.norm.weight",
          "ssm_out.weight": "mixer.out_proj.weight"}
_DT_BIAS = {"mamba": "mixer.dt_proj.bias", "mamba2": "mixer.dt_bias"}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
# metadata key (after "<arch>.") -> transformers config field
_FIELDS = {"embedding_length": "hidden_size", "block_count": "num_hidden_layers",
           "ssm.conv_kernel": "conv_kernel", "ssm.inner_size": "intermediate_size",
           "ssm.state_size": "state_size", "ssm.group_count": "n_groups",
           "attention.layer_norm_rms_epsilon": "layer_norm_epsilon",
           "vocab_size": "vocab_size"}


def _float32_shortest(v: float) -> float:
    """The shortest decimal that rounds to the same float32 as v (metadata
    floats are float32: 1e-5 is stored as 9.99999974738e-06)."""
    bits = struct.pack("<f", v)
    for digits in range(1, 10):
        s = float(f"{v:.{digits}g}")
        if struct.pack("<f", s) == bits:
            return s
    return v


def gguf_config(meta: dict, path) -> tuple:
    """(transformers-style config, {config field: metadata key}) of a GGUF
    file's metadata; ValueError naming the file and the key otherwise."""
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"{path}: metadata key general.architecture = {arch!r}: only "
                         f"{', '.join(map(repr, ARCHS))} models are read")
    cfg = {"model_type": arch}
    keys = {}
    for suffix, field in _FIELDS.items():
        key = f"{arch}.{suffix}"
        if key in meta:
            v = meta[key]
            cfg[field] = _float32_shortest(v) if isinstance(v, float) else v
            keys[field] = key
    for need in ("hidden_size", "num_hidden_layers"):
        if need not in cfg:
            key = next(k for k, f in _FIELDS.items() if f == need)
            raise ValueError(f"{path}: metadata key {arch}.{key} is missing")
    rank = meta.get(f"{arch}.ssm.time_step_rank")
    if rank is not None:  # Mamba-1: dt's rank; Mamba-2: the head count
        field = "time_step_rank" if arch == "mamba" else "num_heads"
        cfg[field] = rank
        keys[field] = f"{arch}.ssm.time_step_rank"
    if arch == "mamba" and meta.get("mamba.ssm.dt_b_c_rms", False) is not False:
        if meta["mamba.ssm.dt_b_c_rms"] is not True:
            raise ValueError(f"{path}: metadata key mamba.ssm.dt_b_c_rms = "
                             f"{meta['mamba.ssm.dt_b_c_rms']!r} must be a bool")
        cfg["model_type"] = "falcon_mamba"
        cfg["mixer_rms_eps"] = cfg.get("layer_norm_epsilon", 1e-5)
        keys["mixer_rms_eps"] = f"{arch}.attention.layer_norm_rms_epsilon"
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        cfg["eos_token_id"] = eos
        keys["eos_token_id"] = "tokenizer.ggml.eos_token_id"
    return cfg, keys


_CK_KEY = re.compile(r"(?<![\w.])(?:backbone\.)?(?:layers\.(\d+)\.([\w.]+)|"
                     r"embeddings\.weight|norm_f\.weight|lm_head\.weight)(?![\w.])")
_FROM_CK = {v: k for k, v in _LAYER.items()}
_FROM_CK.update({"mixer.A_log": "ssm_a", "mixer.dt_proj.bias": "ssm_dt.bias",
                 "mixer.dt_bias": "ssm_dt.bias"})
_TOP_FROM_CK = {v.replace("backbone.", ""): k for k, v in _TOP.items()}


def _gguf_name(m) -> str:
    """The file's name of a checkpoint key (a regex match of _CK_KEY)."""
    if m.group(1) is None:
        return _TOP_FROM_CK[m.group(0).replace("backbone.", "")]
    return f"blk.{m.group(1)}.{_FROM_CK.get(m.group(2), m.group(2))}"


def _renamed(err: Exception, fields: dict, path) -> Exception:
    """err with the config fields and checkpoint keys it names replaced by
    the file's metadata keys and tensor names."""
    msg = str(err)
    for old in sorted(fields, key=len, reverse=True):
        msg = re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w.])", fields[old], msg)
    return type(err)(f"{path}: {_CK_KEY.sub(_gguf_name, msg)}")


def load_gguf_checkpoint(path, lazy: bool = False):
    """The Checkpoint of a GGUF file (mojolearn.checkpoints.load_checkpoint
    calls it for a path ending in .gguf)."""
    from ._assemble import assemble
    from .configs import check_config
    g = read_gguf(path)
    cfg, keys = gguf_config(g.metadata, path)
    # the converter leaves out a head equal to the embedding: then it is tied
    cfg["tie_word_embeddings"] = "output.weight" not in g.tensors
    fields = {f"config field {f}": f"metadata key {k}" for f, k in keys.items()}
    try:
        summary = check_config(cfg)
    except (ValueError, TypeError) as e:
        raise _renamed(e, fields, path) from None
    arch = g.metadata["general.architecture"]
    d = summary["d_model"]
    tensors, names = {}, {}
    for name, t in g.tensors.items():
        m = _BLK.match(name)
        if m is None:
            key = _TOP.get(name, name)
        else:
            rest = _DT_BIAS[arch] if m.group(2) == "ssm_dt.bias" else \
                _LAYER.get(m.group(2), m.group(2))
            key = f"backbone.layers.{m.group(1)}.{rest}"
            t = _block_layout(arch, rest, t, d)
        tensors[key] = t if lazy else t.load()
        names[key] = name
    try:
        ck = assemble(cfg, summary, tensors, None)
    except (ValueError, TypeError) as e:
        raise _renamed(e, fields, path) from None
    ck.format = "gguf"
    ck._keys = [{n: names[k] for n, k in layer.items()} for layer in ck._keys]
    return ck


def _block_layout(arch, rest, t, d):
    """Mamba-2's (H, 1) A and D and its (groups, d_inner / groups) gated
    norm under the blocks' 1-D shapes (the same values in C order)."""
    if arch != "mamba2":
        return t
    shape = t.shape
    if rest in ("mixer.A", "mixer.D") and len(shape) == 2 and shape[1] == 1:
        return t.reshaped((shape[0],))
    if rest == "mixer.norm.weight" and len(shape) == 2 and shape[0] * shape[1] == 2 * d:
        return t.reshaped((2 * d,))
    return t
