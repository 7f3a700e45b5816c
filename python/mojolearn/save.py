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
from pathlib import Path

from . import _intake
from .safetensors import write_safetensors

_INPUT_NORM = {"mamba": "norm.weight", "mamba2": "block_norm.weight",
               "mamba3": "block_norm.weight"}


def save_checkpoint(folder, kind: str, layers: list, embeddings, final_norm, lm_head=None,
                    *, config: dict | None = None) -> Path:
    """Write a checkpoint folder that load_checkpoint and MambaLM read.

    Parameters
    ----------
    folder : str or PathLike
        Created if missing; config.json and model.safetensors are overwritten.
    kind : {'mamba', 'mamba2', 'mamba3'}
    layers : list of dict
        One weight dict per layer, under the block's names (Mamba1Block /
        Mamba2Block / Mamba3Block), float32.
    embeddings : float32 buffer (vocab_size, d_model)
    final_norm : float32 buffer (d_model,)
    lm_head : float32 buffer (vocab_size, d_model) or None
        None: tied to the embeddings.
    config : dict or None
        Extra config.json fields (e.g. Mamba-2's time_step_limit).

    Returns
    -------
    pathlib.Path of the folder.
    """
    if kind not in _INPUT_NORM:
        raise ValueError(f"kind must be 'mamba', 'mamba2' or 'mamba3', got {kind!r}")
    if not layers:
        raise ValueError("layers must hold at least one layer's weights")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    emb = _intake.float32_view(embeddings, "embeddings", ndim=(2,))
    tensors = {"backbone.embeddings.weight": embeddings,
               "backbone.norm_f.weight": final_norm}
    if lm_head is not None:
        tensors["lm_head.weight"] = lm_head
    norm = _INPUT_NORM[kind]
    for i, w in enumerate(layers):
        for name, value in w.items():
            key = "norm.weight" if name == norm else f"mixer.{name}"
            tensors[f"backbone.layers.{i}.{key}"] = value
    cfg = {"model_type": kind, "hidden_size": emb.shape[1], "num_hidden_layers": len(layers),
           "vocab_size": emb.shape[0], "tie_word_embeddings": lm_head is None,
           "layer_norm_epsilon": 1e-5}
    if kind == "mamba2":
        cfg.update({"state_size": 128, "head_dim": 64, "num_heads": emb.shape[1] * 2 // 64,
                    "n_groups": 1, "expand": 2, "chunk_size": 256})
    elif kind == "mamba3":
        cfg.update({"state_size": 128, "head_dim": 64, "num_heads": emb.shape[1] * 2 // 64,
                    "expand": 2, "chunk_size": 64})
    cfg.update(config or {})
    write_safetensors(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return folder
