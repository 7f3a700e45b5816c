"""A float64 torch Mamba-1 block with a start state and ragged rows, for
autograd references of Mamba1Block.backward(x, g, state, grad_state=...,
lengths=...).

transformers' MambaBlock (tests/reference/hf_mamba.py) cannot start a
multi-token prefill from a given conv window, so this is the block written
from its definition (docs/numerics.md, "Mamba-1"), token by token, as
mojolearn.reference.mamba1.mamba1_numpy; tests/test_mamba1_state_grad.py
checks its forward equal to mamba1_numpy (with a state) and its zero-state
gradients equal to autograd of the float64 MambaBlock. Ragged rows: row b's
state stops changing after lengths[b] tokens (its final state is the state
there) and its later outputs are dropped.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

STATE = ("conv_window", "h")


def _plain_rmsnorm(v, eps):
    return v * torch.rsqrt((v * v).mean(-1, keepdim=True) + eps)


def forward(W: dict, x, conv_window, h, lengths=None, bcdt_rms_eps=None):
    """(y (B, L, d), final conv window (B, di, 4), final h (B, di, 16)),
    float64 torch tensors; W: {name: float64 tensor}. Padded outputs are 0.
    bcdt_rms_eps: Falcon-Mamba's weightless norms of dt, B and C (None: none)."""
    b, l, d = x.shape
    di, r, n = 2 * d, math.ceil(d / 16), 16
    conv_w = W["conv1d.weight"].reshape(di, 4)
    a = -torch.exp(W["A_log"])
    lens = torch.tensor([l] * b if lengths is None else list(lengths))
    win, hs, ys = conv_window, h, []
    for t in range(l):
        xt = x[:, t]
        xn = W["norm.weight"] * (xt * torch.rsqrt((xt * xt).mean(-1, keepdim=True) + 1e-5))
        proj = xn @ W["in_proj.weight"].T
        hid, gate = proj[:, :di], proj[:, di:]
        nwin = torch.cat([win[:, :, 1:], hid[:, :, None]], dim=2)
        u = F.silu((nwin * conv_w).sum(2) + W["conv1d.bias"])
        xdbl = u @ W["x_proj.weight"].T
        dtr, bv, cv = xdbl[:, :r], xdbl[:, r:r + n], xdbl[:, r + n:]
        if bcdt_rms_eps is not None:
            dtr, bv, cv = (_plain_rmsnorm(v, bcdt_rms_eps) for v in (dtr, bv, cv))
        delta = F.softplus(dtr @ W["dt_proj.weight"].T + W["dt_proj.bias"])  # threshold 20
        nh = (torch.exp(delta[:, :, None] * a) * hs
              + (delta[:, :, None] * bv[:, None, :]) * u[:, :, None])
        yc = (nh * cv[:, None, :]).sum(-1) + u * W["D"]
        y = xt + (yc * F.silu(gate)) @ W["out_proj.weight"].T
        live = (t < lens)[:, None]
        win = torch.where(live[:, :, None], nwin, win)
        hs = torch.where(live[:, :, None], nh, hs)
        ys.append(torch.where(live, y, torch.zeros_like(y)))
    return torch.stack(ys, 1), win, hs


def grads(weights: dict, x, g, conv_window, h, g_conv_window, g_h, lengths=None,
          bcdt_rms_eps=None) -> dict:
    """Autograd of sum(y * g) + sum(final window * g_conv_window) +
    sum(final h * g_h), all float64: {'x', each weight, 'state.conv_window',
    'state.h'} as NumPy arrays (weights in their given shapes)."""
    def leaf(a):
        return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=True)
    W = {k: leaf(v) for k, v in weights.items()}
    xs, cw, hh = leaf(x), leaf(conv_window), leaf(h)
    with torch.enable_grad():
        y, wf, hf = forward(W, xs, cw, hh, lengths, bcdt_rms_eps)
        loss = ((y * torch.as_tensor(np.asarray(g, np.float64))).sum()
                + (wf * torch.as_tensor(np.asarray(g_conv_window, np.float64))).sum()
                + (hf * torch.as_tensor(np.asarray(g_h, np.float64))).sum())
        loss.backward()
    out = {"x": xs.grad.numpy(), "state.conv_window": cw.grad.numpy(), "state.h": hh.grad.numpy()}
    out.update({k: v.grad.numpy() for k, v in W.items()})
    return out
