"""Small independent float64 NumPy Mamba-1 / Mamba-2 blocks, per-token recurrence form.

Written straight from SPEC.md sections 1-3, sharing no code with transformers; used to
check that ``hf_mamba`` (transformers in float64) computes what the spec says, and
reusable by other tests as a second float64 reference. Everything is float64; inputs
and weights are widened exactly. These loop over tokens in Python: fine for the short
sequences of unit tests (hundreds of tokens), not for benchmarks.

Mamba-2 here is the exact-arithmetic recurrence of SPEC.md section 3 item 5
(``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t + D x_t``), one group,
gate applied before the gated RMSNorm; it does not model the 256-token chunking, which
changes only rounding.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["mamba1_numpy", "mamba2_numpy", "rmsnorm", "silu", "softplus"]

EPS = 1e-5


def rmsnorm(v: np.ndarray, w: np.ndarray) -> np.ndarray:
    """RMSNorm over the last axis: w * (v / sqrt(mean(v^2) + 1e-5))."""
    r = 1.0 / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + EPS)
    return w * (v * r)


def silu(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return v / (1.0 + np.exp(-v))


def softplus(v: np.ndarray) -> np.ndarray:
    """v if v > 20 else log1p(exp(v)) (PyTorch's threshold 20)."""
    return np.where(v > 20.0, v, np.log1p(np.exp(np.minimum(v, 20.0))))


def _w64(weights: dict) -> dict:
    return {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}


def _conv_step(window: np.ndarray, new_row: np.ndarray, w: np.ndarray, b: np.ndarray):
    """Push new_row (B, C) into window (B, C, 4) (oldest first); depthwise conv + bias."""
    window = np.concatenate([window[:, :, 1:], new_row[:, :, None]], axis=2)
    return window, np.sum(window * w[None], axis=2) + b


def mamba1_numpy(weights: dict, x, conv_state=None, h=None):
    """Mamba-1 block (SPEC.md section 2) token by token in float64.

    Returns ``(y (B, L, d), conv_state (B, 2d, 4), h (B, 2d, 16))``, float64; the states
    are those after the last token. ``conv_state``/``h`` None mean zeros.
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
        delta = softplus(dtr @ W["dt_proj.weight"].T + W["dt_proj.bias"])  # (B, di)
        hs = (np.exp(delta[:, :, None] * A[None]) * hs
              + (delta[:, :, None] * Bv[:, None, :]) * u[:, :, None])
        yc = np.einsum("bcn,bn->bc", hs, Cv) + u * W["D"]
        ys[:, t] = xt + (yc * silu(gate)) @ W["out_proj.weight"].T
    return ys, window, hs


def mamba2_numpy(weights: dict, x, h0=None, dt_limit=(0.0, math.inf)):
    """Mamba-2 block (SPEC.md section 3) as the per-token recurrence in float64.

    Returns ``(y (B, L, d), h_last (B, H, 64, 128))``; ``h0`` None means zeros; the conv
    window starts at zeros. dt = clip(softplus(dtraw + dt_bias), lo, hi).
    """
    W = _w64(weights)
    x = np.asarray(x, dtype=np.float64)
    Bsz, L, d = x.shape
    di = 2 * d
    H, P, N = di // 64, 64, 128
    CD = di + 2 * N
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
        Bt, Ct = xbc[:, di:di + N], xbc[:, di + N:]
        dt = np.clip(softplus(dtraw + W["dt_bias"]), lo, hi)              # (B, H)
        hs = (np.exp(dt * A)[:, :, None, None] * hs
              + (dt[:, :, None] * xv)[:, :, :, None] * Bt[:, None, None, :])
        y = np.einsum("bhpn,bn->bhp", hs, Ct) + W["D"][None, :, None] * xv
        g = rmsnorm(y.reshape(Bsz, di) * silu(z), W["norm.weight"])
        ys[:, t] = xt + g @ W["out_proj.weight"].T
    return ys, hs
