#!/usr/bin/env python
"""Benchmark: Mamba3Block.backward against PyTorch autograd of bench's float32
PyTorch Mamba-3 (bench/bench_mamba3.py TorchMamba3.prefill, chunked, CPU),
time and peak memory.

For each configuration and each side, a fresh child process:
  * builds the block from ``mojolearn.reference.weights.mamba3_weights(d,
    seed=0)`` and the inputs from ``random_input`` (x seed 1, grad_output seed 2);
  * mojolearn: times ``block.backward(x, dy)`` (which recomputes the forward);
  * PyTorch: times ``y = m.prefill(x); y.backward(dy)`` with x and every weight
    requiring grad, grads reset to None before each call;
  * best of N after one warm-up; ``resource.getrusage(RUSAGE_SELF).ru_maxrss``
    before the first call and at the end (native memory included).
Threads: ``--threads`` (default 2) on both sides. Nothing here asserts a speed.

Usage (repository root)::

    PYTHONPATH=python:. python bench/bench_mamba3_backward.py [--quick] [--out FILE.json]
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
QUICK = [(256, 1, 128), (256, 2, 256)]


def _worker(spec: str) -> None:
    side, d, B, L, threads, reps = worker_spec(spec)
    sys.path[:0] = [str(ROOT / "python"), str(ROOT)]
    from mojolearn.reference.weights import mamba3_weights, random_input
    w = mamba3_weights(d, seed=0)
    x = random_input(B, L, d, seed=1)
    g = random_input(B, L, d, seed=2)
    if side == "mojolearn":
        import mojolearn
        mojolearn.set_num_threads(threads)
        block = mojolearn.Mamba3Block(w)

        def call():
            return block.backward(x, g)
    else:
        import torch
        torch.set_num_threads(threads)
        from bench_mamba3 import TorchMamba3
        m = TorchMamba3(w)
        params = list(m.w.values())
        for p in params:
            p.requires_grad_(True)
        xt = torch.from_numpy(x).requires_grad_(True)
        gt = torch.from_numpy(g)

        def call():
            xt.grad = None
            for p in params:
                p.grad = None
            y = m.prefill(xt)
            y.backward(gt)
            return xt.grad
    print(json.dumps({"side": side, "d": d, "B": B, "L": L, "threads": threads,
                      **time_with_rss(call, reps)}))


def measure(side, d, B, L, threads, reps):
    return measure_in_child(__file__, side, d, B, L, threads, reps)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", metavar="FILE.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return
    load0 = os.getloadavg()[0]
    rows, raw = [], []
    for d, B, L in (QUICK if args.quick else FULL):
        reps = args.reps if B * L <= 1024 else max(1, args.reps - 1)
        m = measure("mojolearn", d, B, L, args.threads, reps)
        t = measure("torch", d, B, L, args.threads, reps)
        raw += [m, t]
        mb = lambda r: (r["rss_peak_kib"] - r["rss_before_kib"]) / 1024
        rows.append(f"| {d} | {B} | {L} | {m['best_s']*1e3:.1f} | {t['best_s']*1e3:.1f} | "
                    f"{t['best_s'] / m['best_s']:.2f}x | {m['rss_peak_kib']/1024:.0f} "
                    f"(+{mb(m):.0f}) | {t['rss_peak_kib']/1024:.0f} (+{mb(t):.0f}) |")
    load1 = os.getloadavg()[0]
    table = "\n".join(
        [f"threads={args.threads}, load average {load0:.2f} -> {load1:.2f}",
         "| d | B | L | mojolearn backward ms | PyTorch fwd+bwd ms | speed-up | "
         "mojolearn peak RSS MiB (+ over baseline) | PyTorch peak RSS MiB (+) |",
         "|---|---|---|---|---|---|---|---|"] + rows)
    print(table)
    if load0 > 1.0 or load1 > 1.0:
        print("warning: the machine was busy; numbers are unreliable")
    if args.out:
        Path(args.out).write_text(json.dumps({"raw": raw, "markdown": table,
                                              "load": [load0, load1]}, indent=1))


if __name__ == "__main__":
    main()
