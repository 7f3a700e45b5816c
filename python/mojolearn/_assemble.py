"""Checkpoint tensors sorted into per-layer block weights, checked against
the config before anything per layer is allocated.

Order of the checks (each a ValueError naming the field or the tensor):
the layer indices the tensor names hold against the config's layer count
(so a config claiming 2**40 layers fails at once), each tensor's shape
against the family's (in the file format's layout), the tensors missing or
unused, the embedding rows against the config's vocab_size.
"""
from __future__ import annotations

import re

from .families import family
from .safetensors import LazyTensor

LAYER_KEY = re.compile(r"^(?:backbone\.)?layers\.(\d+)\.(.+)$")
EMBED_KEYS = ("embeddings.weight", "embedding.weight")
GIVEN_A = "A"  # the blocks' name for -exp(A_log) given in place of A_log (mamba/_base.py)
_LAYERS_FIELD = {"transformers": "num_hidden_layers", "mamba_ssm": "n_layer"}


def shape_of(v) -> tuple:
    s = getattr(v, "shape", None)
    if s is None:
        s = memoryview(v).shape
    return tuple(int(x) for x in s)


def _reshaped(value, shape):
    """The same values (C order) under another shape of as many elements."""
    if hasattr(value, "reshaped"):  # a GGUF tensor
        return value.reshaped(shape)
    if isinstance(value, LazyTensor):
        return LazyTensor(value.path, value.name, value.dtype, shape, value._begin, 0)
    return value.reshape(shape)


def _given_instead(name: str, layer: dict) -> bool:
    """Whether the layer gives A_log as A (its -exp, as GGUF files store it)."""
    return name == "A_log" and GIVEN_A in layer


def _check_layer_count(layer_keys: dict, n: int, fmt: str) -> None:
    present = sorted({i for i, _ in layer_keys.values()})
    if len(present) != n or (present and present[-1] != n - 1):
        field = _LAYERS_FIELD.get(fmt, "num_hidden_layers")
        if not present:
            held = "none"
        elif present == list(range(len(present))):
            held = f"layers 0..{present[-1]}"
        else:
            gaps = sorted(set(range(present[-1] + 1)) - set(present))[:10]
            held = f"layers up to {present[-1]}, without {gaps}"
        raise ValueError(f"config field {field} = {n} does not match the weights, which hold "
                         f"{held}")


def assemble(cfg, summary, tensors, folder=None):
    """The Checkpoint of checked tensors (mojolearn.checkpoints.Checkpoint)."""
    from .checkpoints import Checkpoint
    from .configs import eos_token_ids
    fam = family(summary["kind"])
    fmt = summary.get("format", "transformers")
    d, n = summary["d_model"], summary["n_layers"]
    want = {}
    for name, shape in fam.weight_shapes(d, summary.get("n_groups") or 1).items():
        options = shape if isinstance(shape[0], tuple) else (shape,)
        stored = fam.stored_shape(fmt, name, options[0])
        want[name] = (options[0], options + ((stored,) if stored not in options else ()))
    layer_keys, top, unknown = {}, {}, []
    for key in tensors:
        m = LAYER_KEY.match(key)
        if m is None:
            top[key[len("backbone."):] if key.startswith("backbone.") else key] = key
        else:
            layer_keys[key] = (int(m.group(1)), m.group(2))
    _check_layer_count(layer_keys, n, fmt)  # before n of anything is made
    layers = [dict() for _ in range(n)]
    keys = [dict() for _ in range(n)]
    for key, (i, rest) in layer_keys.items():
        name = fam.block_name(rest)
        if name == GIVEN_A and "A_log" in want:  # A itself (GGUF), in place of A_log
            want.setdefault(GIVEN_A, want["A_log"])
        if name not in want:
            unknown.append(key)
            continue
        value = tensors[key]
        shape = shape_of(value)
        block_shape, accepted = want[name]
        if shape not in accepted:
            raise ValueError(f"tensor {key} has shape {shape}; config (d_model {d}, "
                             f"{fam.title}) needs {block_shape}")
        if name != "conv1d.weight" and shape != block_shape:
            value = _reshaped(value, block_shape)
        layers[i][name] = value
        keys[i][name] = key
    embed = next((top.pop(k) for k in EMBED_KEYS if k in top), None)
    norm_f = top.pop("norm_f.weight", None)
    head = top.pop("lm_head.weight", None)
    unknown += list(top.values())
    if unknown:
        raise ValueError(f"checkpoint has tensors the {fam.title} blocks do not use: "
                         f"{sorted(unknown)[:20]}")
    missing = [f"layers.{i}.{fam.checkpoint_name(k)}" for i in range(n) for k in want
               if k != GIVEN_A and k not in layers[i] and not _given_instead(k, layers[i])]
    if embed is None:
        missing.append("embeddings.weight")
    if norm_f is None:
        missing.append("norm_f.weight")
    if head is None and not summary["tie"]:
        missing.append("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing[:20]}")
    emb = tensors[embed]
    es = shape_of(emb)
    if len(es) != 2 or es[1] != d or es[0] < 1:
        raise ValueError(f"tensor {embed} has shape {es}; needs (vocab_size >= 1, {d})")
    vocab = summary.get("vocab_size")
    if vocab is not None and vocab != es[0]:
        field = "vocab_size" if fmt != "mamba_ssm" else \
            f"vocab_size (padded to a multiple of pad_vocab_size_multiple: {vocab})"
        raise ValueError(f"config field {field} = {cfg.get('vocab_size')} does not match "
                         f"tensor {embed}, which has {es[0]} rows")
    if shape_of(tensors[norm_f]) != (d,):
        raise ValueError(f"tensor {norm_f} has shape {shape_of(tensors[norm_f])}; "
                         f"needs ({d},)")
    lm = emb
    if not summary["tie"]:
        if shape_of(tensors[head]) != es:
            raise ValueError(f"tensor {head} has shape {shape_of(tensors[head])}; needs {es}")
        lm = tensors[head]
    eos = eos_token_ids(folder, cfg, es[0])
    return Checkpoint(fam.kind, cfg, summary, layers, emb, tensors[norm_f], lm,
                      eos_token_ids=eos, keys=keys)
