"""Writing checkpoints that ``load_checkpoint`` reads (no PyTorch needed).

``save_checkpoint`` writes a folder with ``config.json`` and
``model.safetensors``: transformers' layout for Mamba ('mamba') and Mamba-2
('mamba2'), and mojolearn's layout for Mamba-3 ('mamba3', the same keys).
It is how a Mamba-3 model trained with mojolearn (or built for a test) is
handed to ``MambaLM``.

Keys written (float32, little-endian):

- ``backbone.embeddings.weight`` (vocab_size, d_model)
- ``backbone.layers.{i}.norm.weight``: the block's input norm (Mamba-1
  ``norm.weight``, Mamba-2/3 ``block_norm.weight``)
- ``backbone.layers.{i}.mixer.<name>``: every other block weight
- ``backbone.norm_f.weight`` (d_model,)
- ``lm_head.weight`` (vocab_size, d_model), unless tied
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from . import _intake
from .safetensors import write_safetensors

_FILES = ("model.safetensors", "config.json")  # written in this order


def save_checkpoint(folder, kind: str, layers: list, embeddings, final_norm, lm_head=None,
                    *, config: dict | None = None) -> Path:
    """Write a checkpoint folder that load_checkpoint and MambaLM read.

    Every argument is checked before anything is written, and the files are
    written into a temporary folder next to ``folder`` first: a refused or
    interrupted save leaves ``folder`` as it was (a new folder appears only
    whole, by one rename; in an existing folder each file is replaced whole,
    config.json last).

    Parameters
    ----------
    folder : str or PathLike
        Created if missing (with its parents); config.json and
        model.safetensors are replaced, other files are left alone.
    kind : {'mamba', 'mamba2', 'mamba3'}
        A kind of mojolearn.families ('mamba1' is accepted for 'mamba').
    layers : list of dict
        One weight dict per layer, under the block's names (Mamba1Block /
        Mamba2Block / Mamba3Block), float32, in the block's shapes.
        Mamba-2's n_groups is read from layer 0's conv1d.bias (2 d_model
        + 256 n_groups entries) and written to config.json.
    embeddings : float32 buffer (vocab_size, d_model)
    final_norm : float32 buffer (d_model,)
    lm_head : float32 buffer (vocab_size, d_model) or None
        None: tied to the embeddings.
    config : dict or None
        Extra config.json fields, which win over the written ones; str keys,
        JSON values. The block options live here: Mamba-2's
        ``{"time_step_limit": [lo, hi]}``; a Falcon-Mamba model (Mamba-1
        blocks with ``bcdt_rms_eps``) is saved with kind 'mamba' and
        ``{"model_type": "falcon_mamba", "mixer_rms_eps": eps}``.

    Returns
    -------
    pathlib.Path of the folder.
    """
    tensors, cfg = _checked(kind, layers, embeddings, final_norm, lm_head, config)
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"folder {folder} exists and is not a folder")
    text = json.dumps(cfg, indent=2) + "\n"
    parent = folder.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.saving-", dir=parent))
    try:
        write_safetensors(tmp / "model.safetensors", tensors)
        (tmp / "config.json").write_text(text)
        if not folder.exists():
            os.rename(tmp, folder)  # the whole folder at once
            return folder
        for name in _FILES:  # each file whole; config.json (what marks a folder) last
            os.replace(tmp / name, folder / name)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _checked(kind, layers, embeddings, final_norm, lm_head, config):
    """(tensors by checkpoint key, config dict), every input checked;
    ValueError / TypeError naming the argument or weight otherwise."""
    from .families import family
    fam = family(kind)
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__len__"):
        raise TypeError(f"layers must be a list of weight dicts, got {type(layers).__name__}")
    if not len(layers):
        raise ValueError("layers must hold at least one layer's weights")
    emb = _intake.float32_view(embeddings, "embeddings", ndim=(2,))
    vocab, d = emb.shape
    if vocab < 1 or d < 1:
        raise ValueError(f"embeddings must have shape (vocab_size >= 1, d_model >= 1), "
                         f"got {emb.shape}")
    fam.check_d_model(d, "embeddings' d_model")
    norm = _intake.float32_view(final_norm, "final_norm", ndim=(1,))
    if norm.shape != (d,):
        raise ValueError(f"final_norm must have shape ({d},), got {norm.shape}")
    tensors = {"backbone.embeddings.weight": embeddings, "backbone.norm_f.weight": final_norm}
    if lm_head is not None:
        head = _intake.float32_view(lm_head, "lm_head", ndim=(2,))
        if head.shape != emb.shape:
            raise ValueError(f"lm_head must have shape {emb.shape}, got {head.shape}")
        tensors["lm_head.weight"] = lm_head
    n_groups = _groups_of(fam, layers[0], d)
    shapes = fam.weight_shapes(d, n_groups)
    for i, w in enumerate(layers):
        if not hasattr(w, "keys"):
            raise TypeError(f"layers[{i}] must be a dict of weights, got {type(w).__name__}")
        names = set(w.keys())
        if names != set(shapes):
            raise ValueError(f"layers[{i}]: missing {sorted(set(shapes) - names)}; unknown "
                             f"{sorted(map(str, names - set(shapes)))} ({fam.title} weights)")
        for name, want in shapes.items():
            key = f"backbone.layers.{i}.{fam.checkpoint_name(name)}"
            v = _intake.float32_view(w[name], key)
            options = want if isinstance(want[0], tuple) else (want,)
            if v.shape not in options:
                raise ValueError(f"{key} (layers[{i}][{name!r}]) must have shape "
                                 f"{' or '.join(map(str, options))}, got {v.shape}")
            tensors[key] = w[name]
    cfg = {"model_type": fam.model_type, "hidden_size": d, "num_hidden_layers": len(layers),
           "vocab_size": vocab, "tie_word_embeddings": lm_head is None,
           "layer_norm_epsilon": 1e-5}
    cfg.update(fam.saved_config(d, n_groups))
    if config is not None:
        if not hasattr(config, "items") or not all(isinstance(k, str) for k in config):
            raise TypeError("config must be a dict with str keys")
        cfg.update(config)
    try:
        json.dumps(cfg)
    except (TypeError, ValueError) as e:
        raise TypeError(f"config must hold JSON values only ({e})") from None
    return tensors, cfg


def _groups_of(fam, w, d: int) -> int:
    """Mamba-2's n_groups as layer 0's conv1d.bias tells it (x | B | C
    channels: 2 d + 256 n_groups); 1 for other families, and when the bias
    says nothing valid (the shape check then names it)."""
    if "n_groups" not in fam.block_options or not hasattr(w, "keys") or "conv1d.bias" not in w:
        return 1
    try:
        shape = _intake.float32_view(w["conv1d.bias"], "conv1d.bias").shape
    except (TypeError, ValueError):
        return 1
    bc = shape[0] - 2 * d if len(shape) == 1 else 0
    heads = 2 * d // 64
    g = bc // 256 if bc > 0 and bc % 256 == 0 else 1
    return g if heads and heads % g == 0 else 1
