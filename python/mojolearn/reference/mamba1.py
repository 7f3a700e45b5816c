"""Float64 NumPy reference of the Mamba-1 block (:class:`mojolearn.Mamba1Block`).

Reference of the kernel module ``mojo/mojolearn_kernels/mamba1/forward.mojo`` (the
forward: prefill, continuation and decode). Written from the block's
definition (docs/numerics.md, "Mamba-1"), token by token, sharing no code
with the kernel or with transformers; how the test suite uses it (through
transformers' ``MambaBlock``): :mod:`mojolearn.reference`.
"""
from __future__ import annotations

import math

import numpy as np

from .ops import _conv_step, _w64, rmsnorm, silu, softplus

__all__ = ["mamba1_numpy"]


def _plain_rmsnorm(v, eps):
    """The weightless RMS norm over the last axis: ``v / sqrt(mean(v^2) + eps)``."""
    return v * (1.0 / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps))


def mamba1_numpy(weights: dict, x, conv_state=None, h=None, *, bcdt_rms_eps=None):
    """The Mamba-1 block, token by token, in float64.

    Parameters
    ----------
    weights : dict of str to array
        :class:`mojolearn.Mamba1Block` weights (names and shapes of the
        constructor, e.g. from :func:`mojolearn.reference.weights.mamba1_weights`);
        widened to float64.
    x : array (B, L, d_model)
        Input activations; widened to float64.
    conv_state : array (B, 2 d_model, 4), optional
        Conv window before the first token (oldest row first), the
        ``conv_window`` of a :class:`mojolearn.Mamba1State`; None means zeros.
    h : array (B, 2 d_model, 16), optional
        SSM state before the first token (a state's ``h``); None means zeros.
    bcdt_rms_eps : float or None
        None: the plain Mamba-1 block. A number: the Falcon-Mamba variant,
        whose x_proj outputs dt, B and C are each normalised by a weightless
        RMS norm with this eps (``v / sqrt(mean(v^2) + eps)``) before use
        (the block option of the same name).

    Returns
    -------
    y : ndarray (B, L, d_model), float64
        The block output, residual included (what ``forward`` returns).
    conv_state : ndarray (B, 2 d_model, 4), float64
        The conv window after the last token.
    h : ndarray (B, 2 d_model, 16), float64
        The SSM state after the last token.
    """
    W = _w64(weights)
    x = np.asarray(x, dtype=np.float64)
    Bsz, L, d = x.shape
    di, R, N = 2 * d, math.ceil(d / 16), 16
    conv_w = W["conv1d.weight"].reshape(di, 4)
    A = -np.exp(W["A_log"])                                  # (di, N)
    window = np.zeros((Bsz, di, 4)) if conv_state is None else np.array(conv_state, np.float64)
    hs = np.zeros((Bsz, di, N)) if h is None else np.array(h, np.float64)
    ys = np.empty((Bsz, L, d))
    for t in range(L):
        xt = x[:, t]
        proj = rmsnorm(xt, W["norm.weight"]) @ W["in_proj.weight"].T       # (B, 2di)
        hid, gate = proj[:, :di], proj[:, di:]
        window, cv = _conv_step(window, hid, conv_w, W["conv1d.bias"])
        u = silu(cv)                                                      # (B, di)
        xdbl = u @ W["x_proj.weight"].T
        dtr, Bv, Cv = xdbl[:, :R], xdbl[:, R:R + N], xdbl[:, R + N:]
        if bcdt_rms_eps is not None:
            dtr, Bv, Cv = (_plain_rmsnorm(v, bcdt_rms_eps) for v in (dtr, Bv, Cv))
        delta = softplus(dtr @ W["dt_proj.weight"].T + W["dt_proj.bias"])  # (B, di)
        hs = (np.exp(delta[:, :, None] * A[None]) * hs
              + (delta[:, :, None] * Bv[:, None, :]) * u[:, :, None])
        yc = np.einsum("bcn,bn->bc", hs, Cv) + u * W["D"]
        ys[:, t] = xt + (yc * silu(gate)) @ W["out_proj.weight"].T
    return ys, window, hs
