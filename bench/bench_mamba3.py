#!/usr/bin/env python
"""Benchmark: mojolearn Mamba3Block against a float32 PyTorch Mamba-3 (SISO), CPU.

There is no CPU Mamba-3 in transformers or mamba_ssm (their kernels are
Triton/CUDA), so the other side is what a user would write in PyTorch from
the same math (docs/mamba3.md), float32, eager, ``torch.inference_mode()``:

- prefill: the chunked form (Q = 64): quadratic attention-like intra-chunk
  term with the exp(segsum) decay mask, chunk states, a short loop over
  chunks for the inter-chunk recurrence;
- decode: the recurrent step ``S = a S + a beta v_prev k_prev^T + gamma v k^T``,
  ``y = S q``.

Measured in one run, same weights and inputs, same thread count (default 2):
prefill tokens/s at d in {256, 768}, B in {1, 8}, L in {128, 1024}; decode
ms/token (per step call) after a 60-token prefill. The sides take turns
(3 turns each for prefill, 5 rounds for decode; best kept), each turn after
a settle pause and a warm-up, so a slow spell of a shared machine lands on
both sides.
The max |difference| between the two outputs is printed as a sanity check.
Nothing here asserts a speed.

Usage (from the repository root)::

    PYTHONPATH=python:. python bench/bench_mamba3.py [--quick] [--threads N]
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time

FULL_PREFILL = [(d, b, l) for d in (256, 768) for b in (1, 8) for l in (128, 1024)]
FULL_DECODE = [(d, b) for d in (256, 768) for b in (1, 8)]
QUICK_PREFILL = [(256, 1, 128), (768, 1, 128)]
QUICK_DECODE = [(256, 1), (768, 1)]
Q = 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small subset")
    p.add_argument("--threads", type=int, default=2, help="threads on both sides")
    p.add_argument("--decode-steps", type=int, default=256, help="timed steps per round")
    p.add_argument("--only", choices=("prefill", "decode"), help="one of the two tables")
    return p.parse_args(argv)


# ------------------------------------------------------------ PyTorch side
class TorchMamba3:
    """Float32 PyTorch Mamba-3 SISO block (chunked prefill, recurrent decode)."""

    def __init__(self, weights):
        import torch
        self.t = torch
        self.w = {k: torch.from_numpy(v.copy()) for k, v in weights.items()}
        self.d = self.w["block_norm.weight"].shape[0]
        self.di = 2 * self.d
        self.h = self.di // 64

    def _rms(self, v, w):
        t = self.t
        return w * (v * t.rsqrt((v * v).mean(-1, keepdim=True) + 1e-5))

    def _pre(self, x):
        """Per-token projections: x (B, L, d) -> dict of (B, L, ...) tensors."""
        t, w, di, h = self.t, self.w, self.di, self.h
        proj = self._rms(x, w["block_norm.weight"]) @ w["in_proj.weight"].T
        z, v, bp, cp, dd_dt, dd_a, trap, ang = t.split(
            proj, [di, di, 128, 128, h, h, h, 32], dim=-1)
        phi = t.where(dd_a >= 0, 1 + dd_a, 1 / (1 - t.clamp(dd_a, max=0)))
        a = t.clamp(-phi, max=-1e-4)
        dt = t.nn.functional.softplus(dd_dt + w["dt_bias"])
        k = self._rms(bp, w["B_norm.weight"]).unsqueeze(-2) + w["B_bias"]
        q = self._rms(cp, w["C_norm.weight"]).unsqueeze(-2) + w["C_bias"]
        return dict(z=z, v=v.unflatten(-1, (h, 64)), k=k, q=q, dt=dt, adt=a * dt,
                    sg=t.sigmoid(trap), ang=t.tanh(ang) * math.pi)

    def _rotate(self, u, theta):
        t = self.t
        cos, sin = t.cos(theta), t.sin(theta)
        a, b = u[..., 0:64:2], u[..., 1:64:2]
        rot = t.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        return t.cat([rot, u[..., 64:]], dim=-1)

    def prefill(self, x):
        t, w, h = self.t, self.w, self.h
        bsz, L, _ = x.shape
        p = self._pre(x)
        dt, sg, adt = p["dt"], p["sg"], p["adt"]                       # (B, L, H)
        theta = t.cumsum(p["ang"].unsqueeze(-2) * dt.unsqueeze(-1), dim=1)
        theta = theta - 2 * math.pi * t.floor(theta / (2 * math.pi))
        qr, kr = self._rotate(p["q"], theta), self._rotate(p["k"], theta)  # (B, L, H, N)
        beta = t.nn.functional.pad((dt * (1 - sg))[:, 1:], (0, 0, 0, 1))
        scale = dt * sg + beta
        diag = (p["q"] * p["k"]).sum(-1) * beta                            # remove beta on diag
        nc = -(-L // Q)
        pad = nc * Q - L

        def chunk(u):
            u = t.nn.functional.pad(u, (0, 0) * (u.dim() - 2) + (0, pad))
            return u.unflatten(1, (nc, Q))
        qc, kc, vc = chunk(qr), chunk(kr * scale.unsqueeze(-1)), chunk(p["v"])
        ac = chunk(adt)                                                    # (B, nc, Q, H)
        cum = t.cumsum(ac, dim=2)
        seg = cum.unsqueeze(3) - cum.unsqueeze(2)                          # (B, nc, Qi, Qj, H)
        mask = t.tril(t.ones(Q, Q, dtype=t.bool)).unsqueeze(-1)
        decay = t.exp(t.where(mask, seg, -t.inf))
        scores = t.einsum("bcihn,bcjhn->bcijh", qc, kc) * decay
        y = t.einsum("bcijh,bcjhp->bcihp", scores, vc)
        last = cum[:, :, -1:, :]
        states = t.einsum("bcjh,bcjhn,bcjhp->bchpn", t.exp(last - cum), kc, vc)
        hstate = t.zeros(bsz, h, 64, 128)
        inter = []
        for c in range(nc):
            inter.append(hstate)
            hstate = t.exp(last[:, c, 0]).unsqueeze(-1).unsqueeze(-1) * hstate + states[:, c]
        hs = t.stack(inter, dim=1)                                         # (B, nc, H, P, N)
        y = y + t.einsum("bchpn,bcihn->bcihp", hs, qc) * t.exp(cum).unsqueeze(-1)
        y = y.flatten(1, 2)[:, :L]
        y = y + (w["D"].unsqueeze(-1) - diag.unsqueeze(-1)) * p["v"]
        o = y.flatten(-2) * t.nn.functional.silu(p["z"])
        return x + o @ w["out_proj.weight"].T

    def new_state(self, bsz):
        t, h = self.t, self.h
        return dict(theta=t.zeros(bsz, h, 32), S=t.zeros(bsz, h, 64, 128),
                    k=t.zeros(bsz, h, 128), v=t.zeros(bsz, h, 64))

    def step(self, x, s):
        """x (B, d) -> (B, d); s updated in place (recurrent form)."""
        t, w = self.t, self.w
        p = self._pre(x)
        dt, sg = p["dt"], p["sg"]                                          # (B, H)
        th = s["theta"] + p["ang"].unsqueeze(-2) * dt.unsqueeze(-1)
        th = th - 2 * math.pi * t.floor(th / (2 * math.pi))
        qr, kr = self._rotate(p["q"], th), self._rotate(p["k"], th)
        alpha = t.exp(p["adt"])
        S = s["S"]
        S.mul_(alpha[..., None, None])
        S.add_(t.einsum("bhp,bhn->bhpn", s["v"], s["k"]) * (alpha * dt * (1 - sg))[..., None, None])
        S.add_(t.einsum("bhp,bhn->bhpn", p["v"], kr) * (dt * sg)[..., None, None])
        y = t.einsum("bhpn,bhn->bhp", S, qr) + w["D"].unsqueeze(-1) * p["v"]
        s["theta"], s["k"], s["v"] = th, kr, p["v"]
        o = y.flatten(-2) * t.nn.functional.silu(p["z"])
        return x + o @ w["out_proj.weight"].T


# -------------------------------------------------------------- harness
from _harness import SETTLE_S, busy_warm  # noqa: E402  (bench/ is on sys.path)


ROUNDS = 3  # prefill turns per side
ROUND_S = 0.5  # seconds of timed calls per turn (at least `reps` calls)


def best_of(fn, reps, seconds=1.0):
    """Best time of at least `reps` calls and at least `seconds` of calls
    (the same rule for both sides), after the other side's pool threads
    stopped spinning and the cores are back at full clock."""
    time.sleep(SETTLE_S)
    fn()
    busy_warm(fn)
    best = math.inf
    gc.disable()
    try:
        n = 0
        t_end = time.perf_counter() + seconds
        while n < reps or time.perf_counter() < t_end:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
            n += 1
    finally:
        gc.enable()
    return best


def main(argv=None):
    args = parse_args(argv)
    n = args.threads
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    # NumPy only moves data here (PyTorch uses MKL): one OpenBLAS thread, so
    # no idle OpenBLAS worker spins on a core the measured sides need
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    import numpy as np
    import torch
    import mojolearn
    from mojolearn.reference.weights import mamba3_weights, random_input
    torch.set_num_threads(n)
    mojolearn.set_num_threads(n)
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    prefill = QUICK_PREFILL if args.quick else FULL_PREFILL
    decode = QUICK_DECODE if args.quick else FULL_DECODE
    if args.only == "decode":
        prefill = []
    elif args.only == "prefill":
        decode = []
    print(f"# Mamba-3 SISO, float32, CPU, {n} threads each side; torch {torch.__version__}; "
          f"load average at start {load:.2f}")
    print("\n| d | B | L | mojolearn tok/s | torch tok/s | ratio | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    blocks = {}
    for d, b, L in prefill:
        w = mamba3_weights(d, seed=0)
        if d not in blocks:
            blocks[d] = (mojolearn.Mamba3Block(w), TorchMamba3(w))
        mb, tb = blocks[d]
        x = random_input(b, L, d, seed=1)
        xt = torch.from_numpy(x)
        reps = 3 if b * L >= 8192 else 8
        ym = np.asarray(mb.forward(x))
        with torch.inference_mode():
            yt = tb.prefill(xt).numpy()
        # the sides take turns (ROUNDS each, best kept): a slow spell of this
        # shared machine then lands on both sides, not on one side's turn
        tt = tm = math.inf
        for _ in range(ROUNDS):
            with torch.inference_mode():
                tt = min(tt, best_of(lambda: tb.prefill(xt), reps, ROUND_S))
            tm = min(tm, best_of(lambda: mb.forward(x), reps, ROUND_S))
        print(f"| {d} | {b} | {L} | {b * L / tm:,.0f} | {b * L / tt:,.0f} | "
              f"{tt / tm:.2f}x | {np.abs(ym - yt).max():.2e} |", flush=True)
    print("\n| d | B | mojolearn step ms | mojolearn session ms | torch ms/step "
          "| ratio (session) | ratio (step) | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    steps = args.decode_steps
    rounds = 5  # best of: each round re-prefills 60 tokens, then times the steps
    for d, b in decode:
        w = mamba3_weights(d, seed=0)
        if d not in blocks:
            blocks[d] = (mojolearn.Mamba3Block(w), TorchMamba3(w))
        mb, tb = blocks[d]
        warm = 16  # untimed steps first: the cores are back at full clock
        x = random_input(b, 60 + warm + steps + 1, d, seed=2)
        xs = [np.ascontiguousarray(x[:, i]) for i in range(x.shape[1])]

        def ours(use_session):
            time.sleep(SETTLE_S)  # let PyTorch's pool threads stop spinning
            busy_warm(lambda: mb.forward(x[:, :60]))
            st = mb.allocate_state(b)
            mb.forward(x[:, :60], st)
            if use_session:
                with mb.decode_session(st) as sess:
                    for i in range(warm):
                        sess.step(xs[60 + i])
                    t0 = time.perf_counter()
                    ys = [sess.step(xs[60 + warm + i]) for i in range(steps)]
                    return time.perf_counter() - t0, ys
            for i in range(warm):
                mb.step(xs[60 + i], st)
            t0 = time.perf_counter()
            ys = [mb.step(xs[60 + warm + i], st) for i in range(steps)]
            return time.perf_counter() - t0, ys

        def theirs():
            time.sleep(SETTLE_S)
            with torch.inference_mode():
                busy_warm(lambda: tb.prefill(torch.from_numpy(x[:, :60])))
                ts = tb.new_state(b)
                for i in range(60 + warm):
                    tb.step(torch.from_numpy(xs[i]), ts)
                xts = [torch.from_numpy(xs[60 + warm + i]) for i in range(steps)]
                t0 = time.perf_counter()
                ys = [tb.step(xts[i], ts) for i in range(steps)]
                return time.perf_counter() - t0, ys

        tm = math.inf
        runs, tr = [], []
        for _ in range(rounds):  # the sides take turns, as for prefill
            tm = min(tm, ours(False)[0] / steps)
            runs.append(ours(True))
            tr.append(theirs())
        tsess = min(r[0] for r in runs) / steps
        ym = [np.asarray(v) for v in runs[0][1]]
        tt = min(r[0] for r in tr) / steps
        yt = tr[0][1]
        diff = max(np.abs(a[:, 0] - c.numpy()).max() for a, c in zip(ym, yt))
        print(f"| {d} | {b} | {tm * 1e3:.3f} | {tsess * 1e3:.3f} | {tt * 1e3:.3f} | "
              f"{tt / tsess:.2f}x | {tt / tm:.2f}x | {diff:.2e} |", flush=True)
    try:
        print(f"\nload average at end {os.getloadavg()[0]:.2f}")
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
