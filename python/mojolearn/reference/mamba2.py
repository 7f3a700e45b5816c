"""Float64 NumPy reference of the Mamba-2 block (:class:`mojolearn.Mamba2Block`).

Reference of the kernel module ``mojo/mojolearn_kernels/mamba2/forward.mojo`` (the
forward). It is the exact-arithmetic per-token recurrence of the block
(docs/mamba2.md, "What the block computes")::

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,    y_t = h_t C_t + D x_t

with n_groups groups of B and C (head h reads group h // (H / n_groups))
and the gate applied before the gated RMSNorm, which normalises each
group's d_inner / n_groups channels on its own. It does not
model the kernel's 256-token chunking, which changes only rounding. How the
test suite uses it (through transformers' ``Mamba2Block``):
:mod:`mojolearn.reference`.
"""
from __future__ import annotations

import math

import numpy as np

from .ops import _conv_step, _w64, rmsnorm, silu, softplus

__all__ = ["mamba2_numpy"]


def mamba2_numpy(weights: dict, x, h0=None, dt_limit=(0.0, math.inf), n_groups: int = 1):
    """The Mamba-2 block as the per-token recurrence, in float64.

    Parameters
    ----------
    weights : dict of str to array
        :class:`mojolearn.Mamba2Block` weights (names and shapes of the
        constructor, e.g. from :func:`mojolearn.reference.weights.mamba2_weights`);
        widened to float64.
    x : array (B, L, d_model)
        Input activations (d_model a multiple of 32); widened to float64.
    h0 : array (B, H, 64, 128), optional
        SSM state before the first token, H = 2 d_model / 64; None means
        zeros. The conv window always starts at zeros.
    dt_limit : (float, float)
        ``dt = clip(softplus(dtraw + dt_bias), lo, hi)``, as the block's
        ``dt_limit``; the default clips nothing.
    n_groups : int
        Groups of B and C, as the block's ``n_groups``.

    Returns
    -------
    y : ndarray (B, L, d_model), float64
        The block output, residual included (what ``forward`` returns).
    h_last : ndarray (B, H, 64, 128), float64
        The SSM state after the last token (the block's ``h_last_``).
    """
    W = _w64(weights)
    x = np.asarray(x, dtype=np.float64)
    Bsz, L, d = x.shape
    di = 2 * d
    H, P, N, G = di // 64, 64, 128, int(n_groups)
    CD = di + 2 * G * N
    head_group = np.arange(H) // (H // G)                                # (H,)
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    conv_w = W["conv1d.weight"].reshape(CD, 4)
    A = -np.exp(W["A_log"])                                              # (H,)
    window = np.zeros((Bsz, CD, 4))
    hs = np.zeros((Bsz, H, P, N)) if h0 is None else np.array(h0, np.float64)
    ys = np.empty((Bsz, L, d))
    for t in range(L):
        xt = x[:, t]
        proj = rmsnorm(xt, W["block_norm.weight"]) @ W["in_proj.weight"].T
        z, xbc, dtraw = proj[:, :di], proj[:, di:di + CD], proj[:, di + CD:]
        window, cv = _conv_step(window, xbc, conv_w, W["conv1d.bias"])
        xbc = silu(cv)
        xv = xbc[:, :di].reshape(Bsz, H, P)
        Bt = xbc[:, di:di + G * N].reshape(Bsz, G, N)[:, head_group]      # (B, H, N)
        Ct = xbc[:, di + G * N:].reshape(Bsz, G, N)[:, head_group]
        dt = np.clip(softplus(dtraw + W["dt_bias"]), lo, hi)              # (B, H)
        hs = (np.exp(dt * A)[:, :, None, None] * hs
              + (dt[:, :, None] * xv)[:, :, :, None] * Bt[:, :, None, :])
        y = np.einsum("bhpn,bhn->bhp", hs, Ct) + W["D"][None, :, None] * xv
        yg = (y.reshape(Bsz, di) * silu(z)).reshape(Bsz, G, di // G)
        wn = W["norm.weight"].reshape(G, di // G)
        g = np.stack([rmsnorm(yg[:, k], wn[k]) for k in range(G)], axis=1).reshape(Bsz, di)
        ys[:, t] = xt + g @ W["out_proj.weight"].T
    return ys, hs
