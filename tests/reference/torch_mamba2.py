"""A float64 torch Mamba-2 block that starts from a Mamba2State, for
autograd references of Mamba2Block.backward(x, g, state, grad_state=...).

transformers' Mamba2Block (tests/reference/hf_mamba.py) starts a prefill
only from an initial h, not from a conv window or an open chunk, so this
is the block written from its definition (docs/mamba2.md), token by token
as mojolearn.reference.mamba2.mamba2_numpy (in exact arithmetic the
chunked form is this recurrence): tests/test_mamba2_state_grad.py checks
its forward equal to mamba2_numpy and its zero-state gradients equal to
autograd of the float64 Mamba2Block.

From a state with s buffered rows: the rows j < s (post-SiLU xBC and raw
dt, read from the state) enter the recurrence after the state's h (the h
at their chunk's start) and have no output; then the L tokens, the conv
window continuing the state's. The final state: h at the last chunk end
reached (the start h if none was), the open chunk's rows (the state's own
rows among them while no chunk was completed), the last four conv inputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.reference.state_autograd import state_vjp

STATE = ("conv_window", "h", "buffer_xbc", "buffer_dtraw")
CHUNK = 256


def _rms(v, w):
    return w * (v * torch.rsqrt((v * v).mean(-1, keepdim=True) + 1e-5))


def forward(W: dict, x, st: dict, s: int, dt_limit=(0.0, float("inf")), n_groups=1):
    """(y (B, L, d), final state {name: tensor}; the buffers hold only the
    final state's rows, (B, rows, ...)) of the block from state st (float64
    tensors in the Mamba2State layouts) with s buffered rows; n_groups
    groups of B and C (head h reads group h // (H / n_groups); the gated
    norm runs per group)."""
    b, l, d = x.shape
    di = 2 * d
    H, P, N, G = di // 64, 64, 128, n_groups
    cd = di + 2 * G * N
    hg = torch.arange(H) // (H // G)
    lo, hi = dt_limit
    conv_w = W["conv1d.weight"].reshape(cd, 4)
    a = -torch.exp(W["A_log"])
    h = st["h"]
    hchunk = h  # h at the start of the chunk being filled
    rows = []  # that chunk's (xBC, dtraw) rows

    def scan(xbc, dtraw, h):
        dt = torch.clamp(F.softplus(dtraw + W["dt_bias"]), lo, hi)     # (B, H)
        xv = xbc[:, :di].reshape(b, H, P)
        bt = xbc[:, di:di + G * N].reshape(b, G, N)[:, hg]               # (B, H, N)
        return (torch.exp(dt * a)[:, :, None, None] * h
                + (dt[:, :, None] * xv)[:, :, :, None] * bt[:, :, None, :])

    for j in range(s):
        xbc, dtraw = st["buffer_xbc"][:, j], st["buffer_dtraw"][:, j]
        h = scan(xbc, dtraw, h)
        rows.append((xbc, dtraw))
    win = st["conv_window"]
    ys = []
    for t in range(l):
        xt = x[:, t]
        proj = _rms(xt, W["block_norm.weight"]) @ W["in_proj.weight"].T
        z, raw, dtraw = proj[:, :di], proj[:, di:di + cd], proj[:, di + cd:]
        win = torch.cat([win[:, :, 1:], raw[:, :, None]], dim=2)
        xbc = F.silu((win * conv_w).sum(2) + W["conv1d.bias"])
        h = scan(xbc, dtraw, h)
        y = (torch.einsum("bhpn,bhn->bhp", h, xbc[:, di + G * N:].reshape(b, G, N)[:, hg])
             + W["D"][None, :, None] * xbc[:, :di].reshape(b, H, P))
        yg = (y.reshape(b, di) * F.silu(z)).reshape(b, G, di // G)
        g = _rms(yg, W["norm.weight"].reshape(G, di // G)).reshape(b, di)
        ys.append(xt + g @ W["out_proj.weight"].T)
        rows.append((xbc, dtraw))
        if len(rows) == CHUNK:  # the chunk is complete: folded into h
            hchunk, rows = h, []
    final = {"conv_window": win, "h": hchunk,
             "buffer_xbc": torch.stack([r[0] for r in rows], 1) if rows else x[:, :0, :0],
             "buffer_dtraw": torch.stack([r[1] for r in rows], 1) if rows else x[:, :0, :0]}
    return torch.stack(ys, dim=1), final


def state_grads(weights, x, g, *state_and_cot, s, dt_limit=(0.0, float("inf")), n_groups=1):
    """float64 autograd of sum(y g) + <cot, final state> (buffer rows past
    the final buffered_tokens carry no cotangent): {name: ndarray} for x,
    every weight and 'state.<name>'."""
    return state_vjp(lambda W, xt, st: forward(W, xt, st, s, dt_limit, n_groups), weights, x, g,
                     STATE, state_and_cot[:len(STATE)], state_and_cot[len(STATE):])
