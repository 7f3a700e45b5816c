"""Loading Mamba, Mamba-2 and Mamba-3 checkpoints (no PyTorch needed).

``load_checkpoint(source)`` turns a checkpoint into a :class:`Checkpoint`:
one weight dict per layer for the family's block (``Mamba1Block``,
``Mamba2Block``, ``Mamba3Block``), plus the token embeddings, the final
norm, the LM head and the end-of-text ids, all float32 ``mojolearn.Array``.

Formats read (docs/checkpoints.md has the name maps):

- transformers' ``MambaForCausalLM`` / ``FalconMambaForCausalLM`` /
  ``Mamba2ForCausalLM`` folders (config.json with ``model_type``;
  Falcon-Mamba's blocks are Mamba1Block with ``bcdt_rms_eps =
  mixer_rms_eps``), and mojolearn's Mamba-3 layout
  (``model_type`` 'mamba3', what ``mojolearn.save.save_checkpoint`` writes);
- mamba_ssm's ``MambaLMHeadModel`` folders (config.json with ``d_model``,
  ``n_layer``, ``ssm_cfg``) for Mamba-1, Mamba-2 and Mamba-3;
- weights in ``model.safetensors``, a sharded
  ``model.safetensors.index.json`` or ``pytorch_model.bin`` (read by
  mojolearn.pytorch_bin's restricted reader, without PyTorch);
- a state_dict (names to torch tensors, NumPy arrays or float32 buffers);
- a Hub id "org/name" through huggingface_hub's cache (mojolearn.hub);
- a llama.cpp GGUF file (a path ending in .gguf) of a Mamba, Falcon-Mamba
  or Mamba-2 model (mojolearn.gguf, mojolearn._gguf_checkpoint).

Dtypes: F32 is read as is; BF16 and F16 are widened exactly to float32;
anything else (F64 included: it would have to be rounded) is refused with a
TypeError naming the tensor. The config is checked before any tensor is
read (mojolearn.configs), and against the tensor names and shapes before
anything per layer is allocated; errors name the field or the tensor.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ._assemble import EMBED_KEYS as _EMBED_KEYS, LAYER_KEY as _LAYER_KEY
from ._assemble import assemble as _assemble, shape_of as _shape
from .configs import check_config, config_dict, kind_of, read_json
from .families import family
from .safetensors import (  # noqa: F401  (read_safetensors is public here too)
    LazyTensor, _from_raw, _numel, lazy_safetensors, read_safetensors,
)

__all__ = ["load_checkpoint", "read_safetensors", "check_config", "Checkpoint"]


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


def _infer_config(tensors: dict) -> dict:
    """A config read off the tensor shapes (for a state_dict without config).

    What shapes cannot show (layer_norm_epsilon, chunk_size, time_step_limit,
    hidden_act) is taken to be the block's fixed value.
    """
    keys = list(tensors)
    kind = kind_of({}, keys)
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
    if family(kind).dt_rank:
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
                # x | B | C channels: B and C are n_groups * state_size each,
                # and the block's state_size is 128 (else: one group, and
                # the state size is named when refused)
                bc = conv[0] - out[1]
                if bc > 0 and bc % 256 == 0:
                    cfg["state_size"], cfg["n_groups"] = 128, bc // 256
                else:
                    cfg["state_size"] = bc // 2
    emb = next((shapes[p + k] for k in _EMBED_KEYS for p in ("backbone.", "")
                if p + k in shapes), None)
    if emb:
        cfg["vocab_size"] = emb[0]
    cfg["tie_word_embeddings"] = not any(k.endswith("lm_head.weight") for k in keys)
    return cfg


# --------------------------------------------------------------------------- checkpoint
class Checkpoint:
    """A loaded Mamba / Mamba-2 / Mamba-3 checkpoint, ready for mojolearn blocks.

    Attributes
    ----------
    kind : {'mamba', 'mamba2', 'mamba3'}
        The family's canonical kind (mojolearn.families).
    format : {'transformers', 'mamba_ssm', 'gguf'}
        The config format read.
    config : dict
        The config (as read, or inferred from the tensors).
    d_model : int
        Model dimension.
    n_layers : int
        Number of layers.
    vocab_size : int
        Rows of the embedding table (mamba_ssm: the padded vocabulary).
    layers : list of dict
        One weight dict per layer (float32 mojolearn.Array, or LazyTensor
        when lazy) under the Mamba1Block / Mamba2Block / Mamba3Block names.
    embeddings : float32 mojolearn.Array, shape (vocab_size, d_model)
    final_norm : float32 mojolearn.Array, shape (d_model,)
        RMSNorm weight (eps 1e-5) applied after the last layer.
    lm_head : float32 mojolearn.Array, shape (vocab_size, d_model)
        The embeddings themselves when tie_word_embeddings.
    tie_word_embeddings : bool
    dt_limit : (float, float) or None
        Mamba-2's time_step_limit; None for Mamba-1 and Mamba-3.
    n_groups : int or None
        Mamba-2's groups of B and C (transformers' n_groups, mamba_ssm's
        ngroups; Mamba-Codestral: 8); None for Mamba-1 and Mamba-3.
    bcdt_rms_eps : float or None
        Falcon-Mamba's mixer_rms_eps (its blocks are Mamba1Block with that
        option); None for every other model.
    eos_token_ids : tuple of int
        End-of-text ids: generation_config.json's eos_token_id, else the
        config's (an int or a list); () when neither gives one.
    """

    def __init__(self, kind, config, summary, layers, embeddings, final_norm, lm_head,
                 *, eos_token_ids=(), keys=None):
        self.kind = kind
        self.format = summary.get("format", "transformers")
        self.config = config
        self.d_model = summary["d_model"]
        self.n_layers = summary["n_layers"]
        self.vocab_size = _shape(embeddings)[0]
        self.tie_word_embeddings = summary["tie"]
        self.dt_limit = summary["dt_limit"]
        self.n_groups = summary.get("n_groups")
        self.bcdt_rms_eps = summary.get("bcdt_rms_eps")
        self.eos_token_ids = tuple(eos_token_ids)
        self.layers = layers
        self.embeddings = embeddings
        self.final_norm = final_norm
        self.lm_head = lm_head
        self._summary = summary
        self._keys = keys  # per layer: block name -> the checkpoint's key

    @property
    def family(self):
        """The mojolearn.families.Family of this checkpoint."""
        return family(self.kind)

    @property
    def block_class(self):
        """Mamba1Block, Mamba2Block or Mamba3Block."""
        return self.family.block_class

    def blocks(self, *, weight_format=None, numeric_mode: str = "identical") -> list:
        """One block per layer (Mamba1Block, Mamba2Block with dt_limit and
        n_groups, or Mamba3Block).

        weight_format None (the default) keeps each weight as the file
        stores it (a GGUF file's q4_0 / q8_0 matrices stay packed, the rest
        is float32); 'float32' expands packed weights exactly; 'bfloat16',
        'int8', 'q4_0' or 'q8_0' packs every projection weight with
        mojolearn.lowbit first (from the exact expansion of a packed one;
        the blocks then compute on the rounded values; see
        docs/checkpoints.md).
        """
        return [self.block(i, weight_format=weight_format, numeric_mode=numeric_mode)
                for i in range(self.n_layers)]

    def block(self, i: int, *, weight_format=None, numeric_mode: str = "identical"):
        """The block of layer i (lazy tensors are read now, and not kept).
        An error about one weight names it by its checkpoint key
        (``backbone.layers.3.mixer.D``); weight_format as in ``blocks``."""
        from . import lowbit
        fam = self.family
        kw = {"numeric_mode": numeric_mode}
        # an option a summary does not hold (None) keeps the block's default
        kw.update({opt: self._summary[opt] for opt in fam.block_options
                   if self._summary.get(opt) is not None})
        w = {k: _loaded(v) for k, v in self.layers[i].items()}
        try:
            if weight_format is not None:
                w = lowbit.pack(w, weight_format)
            return fam.block_class(w, **kw)
        except (ValueError, TypeError) as e:
            raise type(e)(self._named(i, str(e))) from None

    def _named(self, i: int, msg: str) -> str:
        """msg with the first block weight name it mentions replaced by the
        layer's checkpoint key."""
        keys = self._keys[i] if self._keys else {}
        for name in sorted(keys, key=len, reverse=True):
            m = re.search(rf"(?<![\w.]){re.escape(name)}(?![\w.])", msg)
            if m:
                return msg[:m.start()] + keys[name] + msg[m.end():]
        return f"layer {i}: {msg}"

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
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    binary = folder / "pytorch_model.bin"
    if single.is_file():
        out = lazy_safetensors(single)
    elif index.is_file():
        wmap = read_json(index, "the shard index").get("weight_map", {})
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise ValueError(f"{index}: weight_map must map tensor names to file names")
        by_file = {}
        for name, fname in wmap.items():
            if "/" in fname or "\\" in fname or fname in ("", ".", ".."):
                raise ValueError(f"{index}: weight_map names a file outside the folder: "
                                 f"{fname!r}")
            by_file.setdefault(fname, []).append(name)
        out = {}
        for fname, names in sorted(by_file.items()):
            out.update(lazy_safetensors(folder / fname, names))
    elif binary.is_file():
        from .pytorch_bin import read_pytorch_bin
        out = read_pytorch_bin(binary)
    else:
        raise ValueError(f"{folder} has no model.safetensors, model.safetensors.index.json "
                         "or pytorch_model.bin")
    return out if lazy else {k: v.load() for k, v in out.items()}


def load_checkpoint(source, config=None, *, lazy: bool = False,
                    download: bool = False) -> Checkpoint:
    """Load a Mamba, Mamba-2 or Mamba-3 checkpoint for mojolearn blocks.

    Parameters
    ----------
    source : str, PathLike or mapping
        A folder with config.json and the weights (model.safetensors, a
        sharded model.safetensors.index.json, or pytorch_model.bin), in
        transformers' or mamba_ssm's layout; a llama.cpp GGUF file (a path
        ending in .gguf; its metadata is the config, its ``ssm_a`` the
        blocks' weight ``A``: docs/checkpoints.md); a Hub id "org/name" (read from
        huggingface_hub's cache, see ``download``); or a state_dict: a
        mapping of names to torch tensors, NumPy arrays or float32 buffers
        (with or without the ``backbone.`` prefix).
    config : dict, transformers config, path to config.json, or None
        For a state_dict; None infers the dimensions from the tensor shapes
        (and assumes the block's fixed eps, chunk size and dt limit). For a
        folder, overrides config.json when given.
    lazy : bool, default False
        For a folder: read only the headers now; the tensors are
        :class:`mojolearn.safetensors.LazyTensor` and are read when a
        block, the embeddings or a row range is needed (``Checkpoint.block``,
        ``MambaLM``), so a large model is never held twice.
    download : bool, default False
        For a Hub id missing from the cache: download it (never when
        HF_HUB_OFFLINE=1).

    Returns
    -------
    Checkpoint

    Raises
    ------
    ValueError naming the config field the blocks cannot represent, a
    missing / unknown / mis-shaped tensor, a config that disagrees with the
    weights; TypeError naming a tensor of a dtype that cannot be widened
    exactly to float32.
    """
    folder = None
    if isinstance(source, (str, os.PathLike)) and str(source).endswith(".gguf"):
        if config is not None:
            raise ValueError("config cannot be given with a GGUF file: its metadata is the "
                             "config")
        if not Path(source).is_file():
            raise ValueError(f"{source} is not a file")
        from ._gguf_checkpoint import load_gguf_checkpoint
        return load_gguf_checkpoint(source, lazy)
    if isinstance(source, (str, os.PathLike)):
        from . import hub
        folder = Path(source)
        if not folder.is_dir() and hub.is_hub_id(source):
            folder = hub.resolve(source, download=download)
        if not folder.is_dir():
            raise ValueError(f"{folder} is not a folder")
        if config is None:
            cfg_path = folder / "config.json"
            if not cfg_path.is_file():
                raise ValueError(f"{folder} has no config.json")
            config = cfg_path
        cfg = config_dict(config)
        summary = check_config(cfg)  # refuse before reading any tensor
        tensors = _folder_tensors(folder, lazy)
    elif hasattr(source, "keys"):
        cfg = config_dict(config) if config is not None else _infer_config(source)
        summary = check_config(cfg)
        tensors = {k: _to_float32(source[k], k) for k in source.keys()}
    else:
        raise TypeError(f"source must be a folder path, a Hub id or a state_dict mapping, "
                        f"got {type(source).__name__}")
    return _assemble(cfg, summary, tensors, folder)

