"""Float64 NumPy building blocks shared by the block references
(:mod:`mojolearn.reference.mamba1`, ``mamba2``, ``mamba3``).

These are the elementwise definitions the kernels implement in float32
(``mojo/mojolearn_kernels/norms.mojo``, ``numerics.mojo``): RMSNorm with
eps 1e-5, SiLU, and softplus with PyTorch's threshold 20. Every function
takes and returns float64 arrays (inputs are widened by NumPy's rules;
pass float64 to be sure nothing is computed in float32).
"""
from __future__ import annotations

import numpy as np

__all__ = ["rmsnorm", "silu", "softplus", "EPS"]

#: The RMSNorm epsilon of every norm in the blocks.
EPS = 1e-5


def rmsnorm(v: np.ndarray, w: np.ndarray) -> np.ndarray:
    """RMSNorm over the last axis: ``w * (v / sqrt(mean(v^2) + 1e-5))``.

    ``v`` is (..., n), ``w`` is (n,); returns (..., n), float64 for float64
    inputs.
    """
    r = 1.0 / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + EPS)
    return w * (v * r)


def silu(v: np.ndarray) -> np.ndarray:
    """SiLU, ``v / (1 + exp(-v))``, elementwise (any shape, float64)."""
    with np.errstate(over="ignore"):
        return v / (1.0 + np.exp(-v))


def softplus(v: np.ndarray) -> np.ndarray:
    """Softplus, ``v`` if ``v > 20`` else ``log1p(exp(v))`` (PyTorch's
    threshold 20), elementwise (any shape, float64)."""
    return np.where(v > 20.0, v, np.log1p(np.exp(np.minimum(v, 20.0))))


def _w64(weights: dict) -> dict:
    """The weight dict widened exactly to float64 arrays."""
    return {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}


def _conv_step(window: np.ndarray, new_row: np.ndarray, w: np.ndarray, b: np.ndarray):
    """Push new_row (B, C) into window (B, C, 4) (oldest first); depthwise conv + bias."""
    window = np.concatenate([window[:, :, 1:], new_row[:, :, None]], axis=2)
    return window, np.sum(window * w[None], axis=2) + b
