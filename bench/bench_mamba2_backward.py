#!/usr/bin/env python
"""Benchmark: Mamba2Block.backward against PyTorch autograd of transformers'
Mamba2Block (float32, CPU), time and peak memory.

For each configuration and each side, a fresh child process:
  * builds the block from ``mojolearn.reference.weights.mamba2_weights(d, seed=0)``
    and the inputs from ``random_input`` (x seed 1, grad_output seed 2);
  * mojolearn: times ``block.backward(x, dy)`` (which recomputes the forward);
  * transformers: times ``y = block(x); y.backward(dy)`` with x and every
    parameter requiring grad (``Mamba2Block(cfg).eval()``, its CPU torch
    path: chunked SSD, chunk 256), grads reset to None before each call;
  * best of N after one warm-up; ``resource.getrusage(RUSAGE_SELF).ru_maxrss``
    before the first call and at the end (native memory included; tracemalloc
    would not see it). "peak over baseline" is what the calls added.
Threads: ``--threads`` (default 2) on both sides (torch.set_num_threads,
mojolearn.set_num_threads, OMP/MKL_NUM_THREADS; NumPy's OpenBLAS gets 1). Nothing here
asserts a speed. The mojolearn row also reports the backward workspace
(``workspace_bytes`` of OP_M2_BACKWARD), the dominant allocation.

Usage (repository root)::

    PYTHONPATH=python:. python bench/bench_mamba2_backward.py [--quick] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from _harness import measure_in_child, time_with_rss, worker_spec  # noqa: E402
FULL = [(768, 1, 128), (768, 8, 1024)]
QUICK = [(256, 1, 128), (256, 2, 300)]


def _worker(spec: str) -> None:
    side, d, B, L, threads, reps = worker_spec(spec)
    sys.path[:0] = [str(ROOT / "python"), str(ROOT)]
    from mojolearn.reference.weights import mamba2_weights, random_input
    w = mamba2_weights(d, seed=0)
    extra = {}
    x = random_input(B, L, d, seed=1)
    g = random_input(B, L, d, seed=2)
    if side == "mojolearn":
        import mojolearn
        mojolearn.set_num_threads(threads)
        from mojolearn import _abi
        block = mojolearn.Mamba2Block(w)
        op = _abi.OP_M2_BACKWARD
        extra["workspace_bytes"] = block._lib.workspace_bytes(
            op, _abi.op_spec(block._lib, op).pack(b=B, l=L, d=d))

        def call():
            return block.backward(x, g)
    else:
        import torch
        torch.set_num_threads(threads)
        from bench_mamba2 import hf_block
        block, _cfg = hf_block(w, d)
        xt = torch.from_numpy(x).requires_grad_(True)
        gt = torch.from_numpy(g)

        def call():
            xt.grad = None
            for p in block.parameters():
                p.grad = None
            y = block(xt)
            y.backward(gt)
            return xt.grad
    print(json.dumps({"side": side, "d": d, "B": B, "L": L, "threads": threads,
                      **time_with_rss(call, reps), **extra}))


def measure(side, d, B, L, threads, reps):
    return measure_in_child(__file__, side, d, B, L, threads, reps)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", metavar="FILE.json")
    p.add_argument("--sides", default="mojolearn,transformers",
                   help="comma-separated subset of mojolearn,transformers")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return
    load0 = os.getloadavg()[0]
    rows, raw = [], []
    for d, B, L in (QUICK if args.quick else FULL):
        reps = args.reps if B * L <= 1024 else max(1, args.reps - 1)
        sides = args.sides.split(",")
        m = measure("mojolearn", d, B, L, args.threads, reps) if "mojolearn" in sides else None
        t = measure("transformers", d, B, L, args.threads, reps) if "transformers" in sides else None
        raw += [r for r in (m, t) if r]

        def ms(r):
            return f"{r['best_s'] * 1e3:.1f}" if r else "-"

        def mem(r):
            if not r:
                return "-"
            return (f"{r['rss_peak_kib'] / 1024:.0f} "
                    f"(+{(r['rss_peak_kib'] - r['rss_before_kib']) / 1024:.0f})")
        speed = f"{t['best_s'] / m['best_s']:.2f}x" if m and t else "-"
        ws = f"{m['workspace_bytes'] / 2**20:.0f}" if m else "-"
        rows.append(f"| {d} | {B} | {L} | {ms(m)} | {ms(t)} | {speed} | {mem(m)} | {ws} | "
                    f"{mem(t)} |")
    load1 = os.getloadavg()[0]
    table = "\n".join(
        [f"threads={args.threads}, load average {load0:.2f} -> {load1:.2f}",
         "| d | B | L | mojolearn backward ms | transformers fwd+bwd ms | speed-up | "
         "mojolearn peak RSS MiB (+ over baseline) | mojolearn workspace MiB | "
         "transformers peak RSS MiB (+) |",
         "|---|---|---|---|---|---|---|---|---|"] + rows)
    print(table)
    if load0 > 1.0 or load1 > 1.0:
        print("warning: the machine was busy; numbers are unreliable")
    if args.out:
        Path(args.out).write_text(json.dumps({"raw": raw, "markdown": table,
                                              "load": [load0, load1]}, indent=1))


if __name__ == "__main__":
    main()
