"""Float64 PyTorch Mamba-3 SISO block (docs/mamba3.md, "What the block computes")
in the token-by-token RECURRENCE form, for autograd (the gradient reference of
Mamba3Block.backward).

Same math as mojolearn.reference.mamba3 (the float64 NumPy reference; checked
against it by tests/test_mamba3_backward.py), written with torch ops so that
``torch.autograd`` gives the vector-Jacobian product (the in_proj split and
the state fold, plain slicing and arithmetic, are that module's own; the
kernel's forward is checked against it independently):

    S_t = exp(adt_t) S_{t-1} + exp(adt_t) dt_t (1 - sg_t) v_{t-1} k_{t-1}^T
          + dt_t sg_t v_t k_t^T,     y_t = S_t q_t + D v_t,   o = y silu(z)

with q, k rotated by the running angles, a zero initial state and
``out = x + out_proj @ o``. Gradient conventions (PyTorch's own):
  * A = minimum(-phi(dd_A), -1e-4): torch.minimum splits the gradient in
    half at an exact tie, passes it all where -phi < -1e-4, none otherwise;
  * mod2pi(v) = v - C floor(v / C): floor has gradient 0, so d mod2pi/dv = 1;
  * softplus uses the threshold 20 (identity above), its gradient there is 1.
Everything is float64; the angle modulus is float32(2 pi) as in the kernel.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from mojolearn.reference.mamba3 import TWO_PI32, _fold_token, _in_proj_parts

__all__ = ["mamba3_torch", "mamba3_grads", "token_step", "TWO_PI32", "GRAD_NAMES"]

GRAD_NAMES = ("x", "block_norm.weight", "in_proj.weight", "dt_bias", "B_norm.weight",
              "C_norm.weight", "B_bias", "C_bias", "D", "out_proj.weight")


def _rmsnorm(v, w):
    r = 1.0 / torch.sqrt((v * v).mean(dim=-1, keepdim=True) + 1e-5)
    return w * (v * r)


def _softplus(v):
    return torch.where(v > 20.0, v, torch.log1p(torch.exp(torch.clamp(v, max=20.0))))


def _silu(v):
    return v / (1.0 + torch.exp(-v))


def _phi(u):
    return torch.where(u >= 0, 1.0 + u, 1.0 / (1.0 - torch.clamp(u, max=0.0)))


def _rotate(t, cos, sin):
    a, b = t[..., 0:64:2], t[..., 1:64:2]
    ra = a * cos - b * sin
    rb = a * sin + b * cos
    rot = torch.stack((ra, rb), dim=-1).reshape(*t.shape[:-1], 64)
    return torch.cat((rot, t[..., 64:]), dim=-1)


def token_step(W: dict, xt, theta, mod=TWO_PI32):
    """One token's inputs to the recurrence, from x_t (B, d) and the angles
    before it: (z, v, dt, sg, adt, qr, kr, theta after it)."""
    floor_a = torch.tensor(-1e-4, dtype=xt.dtype)
    proj = _rmsnorm(xt, W["block_norm.weight"]) @ W["in_proj.weight"].T
    z, v, Bp, Cp, dd_dt, dd_A, trap, ang = _in_proj_parts(proj, xt.shape[1] // 32)
    A = torch.minimum(-_phi(dd_A), floor_a)
    dt = _softplus(dd_dt + W["dt_bias"])
    adt = A * dt
    sg = 1.0 / (1.0 + torch.exp(-trap))
    k = _rmsnorm(Bp, W["B_norm.weight"])[:, None, :] + W["B_bias"][None]
    q = _rmsnorm(Cp, W["C_norm.weight"])[:, None, :] + W["C_bias"][None]
    theta = theta + torch.tanh(ang)[:, None, :] * math.pi * dt[:, :, None]
    theta = theta - mod * torch.floor(theta / mod)
    cos, sin = torch.cos(theta), torch.sin(theta)
    qr, kr = _rotate(q, cos, sin), _rotate(k, cos, sin)
    return z, v, dt, sg, adt, qr, kr, theta


def mamba3_torch(W: dict, x, mod=TWO_PI32):
    """y (B, L, d) of a zero-state prefill; W: name -> float64 tensor."""
    Bsz, L, d = x.shape
    di = 2 * d
    H, P, N, R = di // 64, 64, 128, 32
    theta = torch.zeros((Bsz, H, R), dtype=x.dtype)
    S = torch.zeros((Bsz, H, P, N), dtype=x.dtype)
    kp = torch.zeros((Bsz, H, N), dtype=x.dtype)
    vp = torch.zeros((Bsz, H, P), dtype=x.dtype)
    ys = []
    for t in range(L):
        xt = x[:, t]
        z, v, dt, sg, adt, qr, kr, theta = token_step(W, xt, theta, mod)
        S = _fold_token(S, torch.exp(adt), dt, sg, vp, kp, v, kr)
        y = torch.einsum("bhpn,bhn->bhp", S, qr) + W["D"][None, :, None] * v
        o = y.reshape(Bsz, di) * _silu(z)
        ys.append(xt + o @ W["out_proj.weight"].T)
        kp, vp = kr, v
    return torch.stack(ys, dim=1)


def mamba3_grads(weights: dict, x, grad_output):
    """Autograd of sum(y * grad_output) in float64: {name: float64 ndarray}
    for 'x' and every constructor weight (the constructor's shapes)."""
    nthreads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: extra threads only contend
    try:
        return _grads(weights, x, grad_output)
    finally:
        torch.set_num_threads(nthreads)


def _grads(weights, x, grad_output):
    with torch.enable_grad():
        W = {k: torch.tensor(np.asarray(v, dtype=np.float64), requires_grad=True)
             for k, v in weights.items()}
        xt = torch.tensor(np.asarray(x, dtype=np.float64), requires_grad=True)
        g = torch.tensor(np.asarray(grad_output, dtype=np.float64))
        y = mamba3_torch(W, xt)
        assert y.dtype == torch.float64
        (y * g).sum().backward()
    out = {"x": xt.grad.numpy().copy()}
    for k, v in W.items():
        out[k] = v.grad.numpy().copy()
    return out
