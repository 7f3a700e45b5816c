#!/usr/bin/env python
"""Benchmark: mojolearn Mamba2Block against transformers' Mamba2Block (float32, CPU).

Measured in one run, same weights and inputs on both sides, same thread count
(default 2, applied to mojolearn and torch):

(a) prefill tokens/s: ``Mamba2Block.forward(x)`` vs transformers ``Mamba2Block(x)``
    (plain float32, eval mode, ``torch.inference_mode()``, its torch path:
    ``mamba_ssm`` / ``causal_conv1d`` are not installed);
(b) decode ms/token: 256 steps after a 128-token prefill,
    ``block.step(x_t, state)`` and ``decode_session(state).step(x_t)`` vs transformers' cached step
    (``block(x_t, cache=DynamicCache(config=cfg))``); only the steps are timed.
    The 256 steps cross the chunk boundary at token 256, so the fold is included.

Timing is best-of-N (``time.perf_counter``, GC off while timing). Nothing here
asserts a speed. Run it on an idle machine.

Usage (from the repository root)::

    PYTHONPATH=python:. python bench/bench_mamba2.py [--quick] [--threads N]
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="d=256 and 768 at B=1 only")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=256, help="timed decode steps")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    return p.parse_args(argv)


def hf_block(weights, d):
    import torch
    from transformers import Mamba2Config
    from transformers.models.mamba2 import modeling_mamba2 as hf
    di = 2 * d
    cfg = Mamba2Config(hidden_size=d, num_heads=di // 64, head_dim=64, state_size=128,
                       n_groups=1, expand=2, conv_kernel=4, chunk_size=256, use_bias=False,
                       use_conv_bias=True, hidden_act="silu", layer_norm_epsilon=1e-5,
                       norm_before_gate=False, rms_norm=True, time_step_limit=(0.0, math.inf),
                       residual_in_fp32=False, num_hidden_layers=1)
    block = hf.Mamba2Block(cfg, layer_idx=0).eval()
    sd = {}
    for k, v in weights.items():
        if k == "block_norm.weight":
            sd["norm.weight"] = torch.from_numpy(v.copy())
        elif k == "conv1d.weight":
            sd["mixer.conv1d.weight"] = torch.from_numpy(v.reshape(-1, 1, 4).copy())
        else:
            sd[f"mixer.{k}"] = torch.from_numpy(v.copy())
    block.load_state_dict(sd, strict=True)
    return block, cfg


from _harness import SETTLE_S, busy_warm  # noqa: E402  (bench/ is on sys.path)


def best(fn, reps, budget):
    time.sleep(SETTLE_S)
    fn()
    times = []
    t_end = time.perf_counter() + budget
    gc.collect()
    gc.disable()
    try:
        while len(times) < reps and (len(times) < 2 or time.perf_counter() < t_end):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return min(times)


def main(argv=None):
    args = parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    # NumPy only moves data here (PyTorch uses MKL): one OpenBLAS thread, so
    # no idle OpenBLAS worker spins on a core the measured sides need
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    sys.path[:0] = [str(ROOT / "python"), str(ROOT)]
    import numpy as np
    import mojolearn
    from mojolearn.reference.weights import mamba2_weights, random_input
    torch = None
    if not args.no_hf:
        import torch
        torch.set_num_threads(args.threads)
        from transformers import DynamicCache
    mojolearn.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    dims = (256, 768)
    batches = (1,) if args.quick else (1, 8)
    lengths = (128,) if args.quick else (128, 1024)
    rows_p, rows_d = [], []
    for d in dims:
        w = mamba2_weights(d, seed=0)
        ours = mojolearn.Mamba2Block(w)
        hb, cfg = hf_block(w, d) if torch else (None, None)
        for B in batches:
            for L in lengths:
                x = random_input(B, L, d, seed=1)
                t_o = best(lambda: ours.forward(x), 20, 2.0)
                t_h = diff = float("nan")
                if torch:
                    xt = torch.from_numpy(x)
                    with torch.inference_mode():
                        diff = float(np.abs(np.asarray(ours.forward(x)) - hb(xt).numpy()).max())
                        t_h = best(lambda: hb(xt), 5, 3.0)
                rows_p.append((d, B, L, B * L / t_o, B * L / t_h, t_h / t_o, diff))
            # decode: 128-token prefill, then args.steps timed steps
            ctx = random_input(B, 128, d, seed=3)
            toks = random_input(B, args.steps, d, seed=4)
            xs = [np.ascontiguousarray(toks[:, t]) for t in range(args.steps)]
            best_o = best_s = float("inf")
            time.sleep(SETTLE_S)
            for _ in range(2):
                st = ours.allocate_state(B)
                busy_warm(lambda: ours.forward(ctx, st))
                st = ours.allocate_state(B)
                ours.forward(ctx, st)
                gc.disable()
                t0 = time.perf_counter()
                for xv in xs:
                    ours.step(xv, st)
                best_o = min(best_o, (time.perf_counter() - t0) / args.steps)
                gc.enable()
                st = ours.allocate_state(B)
                ours.forward(ctx, st)
                with ours.decode_session(st) as sess:
                    gc.disable()
                    t0 = time.perf_counter()
                    for xv in xs:
                        sess.step(xv)
                    best_s = min(best_s, (time.perf_counter() - t0) / args.steps)
                    gc.enable()
            ms_h = float("nan")
            if torch:
                xp = [torch.from_numpy(np.ascontiguousarray(toks[:, t:t + 1]))
                      for t in range(args.steps)]
                time.sleep(SETTLE_S)
                with torch.inference_mode():
                    busy_warm(lambda: hb(torch.from_numpy(ctx)))
                    cache = DynamicCache(config=cfg)
                    hb(torch.from_numpy(ctx), cache=cache)
                    gc.disable()
                    t0 = time.perf_counter()
                    for xv in xp:
                        hb(xv, cache=cache)
                    ms_h = (time.perf_counter() - t0) / args.steps * 1e3
                    gc.enable()
            rows_d.append((d, B, best_o * 1e3, best_s * 1e3, ms_h, ms_h / (best_s * 1e3)))
    load1 = os.getloadavg()[0]
    print(f"threads={args.threads}  load average {load0:.2f} -> {load1:.2f}"
          + ("  (machine busy: numbers unreliable)" if max(load0, load1) > 0.5 + args.threads else ""))
    print("\nPrefill (tokens/s)\n")
    print("| d | B | L | mojolearn | transformers f32 | speedup | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for d, B, L, o, h, s, df in rows_p:
        print(f"| {d} | {B} | {L} | {o:,.0f} | {h:,.0f} | {s:.1f}x | {df:.2e} |")
    print(f"\nDecode (ms/token, {args.steps} steps after a 128-token prefill)\n")
    print("| d | B | mojolearn step | mojolearn session | transformers cached step | "
          "speedup (session) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for d, B, o, se, h, s in rows_d:
        print(f"| {d} | {B} | {o:.3f} | {se:.3f} | {h:.3f} | {s:.1f}x |")


if __name__ == "__main__":
    main()
