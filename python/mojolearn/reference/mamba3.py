"""Float64 NumPy reference of the Mamba-3 SISO block (:class:`mojolearn.Mamba3Block`).

Reference of the kernel module ``mojo/mojolearn_kernels/mamba3/forward.mojo`` (the
forward); the backward (``mamba3/backward.mojo``) is checked against torch
autograd of the same recurrence written with torch ops
(``tests/reference/torch_mamba3.py``), whose forward equals this function to
1e-12. It is the token-by-token RECURRENCE form of the block (docs/mamba3.md,
"What the block computes"), not chunked, sharing no code with the kernel::

    S_t = exp(adt_t) S_{t-1} + exp(adt_t) dt_t (1 - sg_t) v_{t-1} k_{t-1}^T
          + dt_t sg_t v_t k_t^T,     y_t = S_t q_t + D v_t,   o = y silu(z)

with q, k rotated by the running angles. The state in and out is the tuple
``(theta (B, H, 32), S (B, H, 64, 128), k (B, H, 128) rotated, v (B, H, 64))``,
also the Input_States form of mamba_ssm (and of
:meth:`mojolearn.Mamba3State.set_input_states`): passing a state continues
exactly. Everything is float64; the only float32 quantity is
:data:`TWO_PI32`: the angle modulus is float32(2 pi), as in the kernel (and in
a float32 framework).
"""
from __future__ import annotations

import math

import numpy as np

from .ops import rmsnorm, silu, softplus

__all__ = ["mamba3_numpy", "TWO_PI32"]

#: The angle modulus, float32(2 pi) widened to float64 (as in the kernel).
TWO_PI32 = float(np.float32(2 * math.pi))


def _in_proj_parts(proj, heads):
    """in_proj's output (B, rows) cut into its parts, in row order: z (B,
    2d), v (B, H, 64), B and C (B, 128 each), dd_dt, dd_A, trap (B, H
    each) and the angles (B, 32). Slicing only, so a NumPy array or a torch
    tensor alike (the autograd reference of the tests shares it)."""
    di, n = heads * 64, 128
    c = 2 * di
    cuts = [c, c + n, c + 2 * n, c + 2 * n + heads, c + 2 * n + 2 * heads,
            c + 2 * n + 3 * heads, c + 2 * n + 3 * heads + 32]
    rest = [proj[:, lo:hi] for lo, hi in zip(cuts, cuts[1:])]
    return (proj[:, :di], proj[:, di:c].reshape(proj.shape[0], heads, 64), *rest)


def _fold_token(S, alpha, dt, sg, v_prev, k_prev, v, k):
    """S (B, H, 64, 128) after one token, alpha = exp(A dt) given (B, H):
    alpha S + alpha dt (1 - sg) v_prev k_prev^T + dt sg v k^T. Arithmetic
    only, so NumPy arrays or torch tensors alike (the autograd reference of
    the tests shares it)."""
    a = alpha[:, :, None, None]
    beta = (dt * (1.0 - sg))[:, :, None, None]
    gamma = (dt * sg)[:, :, None, None]
    return (a * S + a * beta * (v_prev[:, :, :, None] * k_prev[:, :, None, :])
            + gamma * (v[:, :, :, None] * k[:, :, None, :]))


def _phi(u):
    return np.where(u >= 0, 1.0 + u, 1.0 / (1.0 - np.minimum(u, 0.0)))


def _rotate(t, cos, sin):
    """Rotate interleaved pairs (2r, 2r+1), r < 32, of t (..., 128)."""
    out = t.copy()
    a, b = t[..., 0:64:2], t[..., 1:64:2]
    out[..., 0:64:2] = a * cos - b * sin
    out[..., 1:64:2] = a * sin + b * cos
    return out


def mamba3_numpy(weights: dict, x, state=None, mod=TWO_PI32, theta_f32=False):
    """The Mamba-3 SISO block, token by token, in float64.

    Parameters
    ----------
    weights : dict of str to array
        :class:`mojolearn.Mamba3Block` weights (names and shapes of the
        constructor, e.g. from :func:`mojolearn.reference.weights.mamba3_weights`);
        widened to float64.
    x : array (B, L, d_model)
        Input activations (d_model a multiple of 32); widened to float64.
    state : tuple (theta, S, k, v), optional
        The state before the first token, H = 2 d_model / 64: theta
        (B, H, 32), S (B, H, 64, 128), k (B, H, 128) (rotated), v (B, H, 64).
        None means zeros (equivalently: no input states).
    mod : float
        The angle modulus (default :data:`TWO_PI32`, as the kernel).
    theta_f32 : bool
        Round the angles to float32 after every token, as a float32 state
        does (the rest stays float64); see docs/mamba3.md, accuracy.

    Returns
    -------
    y : ndarray (B, L, d_model), float64
        The block output, residual included (what ``forward`` returns).
    state : tuple (theta, S, k, v) of float64 ndarrays
        The state after the last token (``S`` is the block's ``h_last_``).
    """
    W = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    x = np.asarray(x, dtype=np.float64)
    Bsz, L, d = x.shape
    di = 2 * d
    H, P, N, R = di // 64, 64, 128, 32
    if state is None:
        theta = np.zeros((Bsz, H, R))
        S = np.zeros((Bsz, H, P, N))
        kp = np.zeros((Bsz, H, N))
        vp = np.zeros((Bsz, H, P))
    else:
        theta, S, kp, vp = (np.array(a, dtype=np.float64) for a in state)
    ys = np.empty((Bsz, L, d))
    for t in range(L):
        xt = x[:, t]
        proj = rmsnorm(xt, W["block_norm.weight"]) @ W["in_proj.weight"].T
        z, v, Bp, Cp, dd_dt, dd_A, trap, ang = _in_proj_parts(proj, H)
        A = np.minimum(-_phi(dd_A), -1e-4)
        dt = softplus(dd_dt + W["dt_bias"])                          # (B, H)
        adt = A * dt
        sg = 1.0 / (1.0 + np.exp(-trap))
        k = rmsnorm(Bp, W["B_norm.weight"])[:, None, :] + W["B_bias"][None]   # (B, H, N)
        q = rmsnorm(Cp, W["C_norm.weight"])[:, None, :] + W["C_bias"][None]
        theta = theta + np.tanh(ang)[:, None, :] * math.pi * dt[:, :, None]
        theta = theta - mod * np.floor(theta / mod)
        if theta_f32:
            theta = theta.astype(np.float32).astype(np.float64)
        cos, sin = np.cos(theta), np.sin(theta)
        qr, kr = _rotate(q, cos, sin), _rotate(k, cos, sin)
        S = _fold_token(S, np.exp(adt), dt, sg, vp, kp, v, kr)
        y = np.einsum("bhpn,bhn->bhp", S, qr) + W["D"][None, :, None] * v
        o = y.reshape(Bsz, di) * silu(z)
        ys[:, t] = xt + o @ W["out_proj.weight"].T
        kp, vp = kr, v
    return ys, (theta, S, kp, vp)
