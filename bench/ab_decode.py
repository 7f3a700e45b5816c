#!/usr/bin/env python
"""Paired A/B of decode steps between two builds of the kernel binaries.

On a shared VM the speed of the same binary moves 10-30% from one minute to
the next, so two runs measured one after the other can not resolve a 5-10%
change. This script starts one worker process per binary folder (each with
MOJOLEARN_LIB_DIR set to it), opens a decode session in each on the same
weights, state and tokens, and then alternates short bursts of steps between
them (A then B, B then A, ...). Each pair of bursts is measured within a few
milliseconds of each other, and the median of the per-pair ratios B/A (with
its quartiles) is the result. Run it in both orders (swap A and B) to see
the bias of going second.

Usage (repository root; each folder holds libmojolearn_cpu*.so)::

    PYTHONPATH=python:. python bench/ab_decode.py --block 2 --batch 8 DIR_A DIR_B \\
        [--target baseline] [--pairs 60] [--steps 2] [--ctx 128] [--clock cpu]

--target baseline forces the x86-64-v3 (AVX2) binary in both workers.
--clock cpu times each burst in process CPU seconds instead of wall seconds:
with MOJOLEARN_NUM_THREADS=1 (the kernels then run on the calling thread) a
burst that the scheduler pauses for a neighbour's process is not charged
for the pause, which on a crowded machine narrows the quartiles. The
steps of a run continue one sequence from a --ctx token prefill, so a B=8
Mamba-2 run measures the chunk rows after ctx.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = 1024  # distinct inputs a worker cycles through


def _worker(block: int, batch: int, ctx: int, d: int, clock: str = "wall") -> None:
    """Serve bursts: read a step count per line, run that many steps, print
    the mean seconds per step."""
    import numpy as np
    import mojolearn
    from mojolearn.reference.weights import random_input
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from phases import BLOCKS  # (bench/: the block number -> weights, class table)
    make, cls = BLOCKS[block]
    blk = getattr(mojolearn, cls)(make(d, seed=1))
    state = blk.allocate_state(batch)
    if ctx:
        blk.forward(random_input(batch, ctx, d, seed=3), state)
    # contiguous (B, d) tokens, so each step takes the session's one-call path
    toks = np.ascontiguousarray(random_input(batch, TOKENS, d, seed=2).transpose(1, 0, 2))
    pos = 0
    now = time.process_time if clock == "cpu" else time.perf_counter
    with blk.decode_session(state) as s:
        for _ in range(4):  # warm-up
            s.step(toks[pos])
            pos += 1
        print("ready", flush=True)
        for line in sys.stdin:
            n = int(line)
            t0 = now()
            for t in range(n):
                s.step(toks[(pos + t) % TOKENS])
            print(f"{(now() - t0) / n:.9f}", flush=True)
            pos += n


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir_a")
    p.add_argument("dir_b")
    p.add_argument("--block", type=int, choices=(1, 2, 3), default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--target", default="", help="MOJOLEARN_CPU_TARGET of both workers")
    p.add_argument("--pairs", type=int, default=60)
    p.add_argument("--steps", type=int, default=2, help="steps per burst")
    p.add_argument("--ctx", type=int, default=128, help="prefill tokens before the steps")
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall seconds, or process CPU seconds (use with MOJOLEARN_NUM_THREADS=1)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        _worker(a.block, a.batch, a.ctx, a.d, a.clock)
        return
    procs = []
    for folder in (a.dir_a, a.dir_b):
        env = dict(os.environ, MOJOLEARN_LIB_DIR=os.path.abspath(folder),
                   MOJOLEARN_CPU_TARGET=a.target,
                   PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), ROOT]))
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", a.dir_a, a.dir_b,
               "--block", str(a.block), "--batch", str(a.batch), "--ctx", str(a.ctx),
               "--d", str(a.d), "--clock", a.clock]
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"the worker for {folder} did not start")
        procs.append(proc)
    ta, tb, ratios = [], [], []
    try:
        for r in range(a.pairs):
            got = [0.0, 0.0]
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                procs[i].stdin.write(f"{a.steps}\n")
                procs[i].stdin.flush()
                got[i] = float(procs[i].stdout.readline())
            ta.append(got[0])
            tb.append(got[1])
            ratios.append(got[1] / got[0])
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait()
    q = statistics.quantiles(ratios, n=4)
    print(f"Mamba-{a.block} B={a.batch} ({a.target or 'default binary'}, {a.clock} clock), "
          f"{a.pairs} pairs of "
          f"{a.steps} steps after a {a.ctx}-token prefill: A median {statistics.median(ta) * 1e3:.4f}"
          f" ms, B median {statistics.median(tb) * 1e3:.4f} ms; paired B/A median "
          f"{statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")


if __name__ == "__main__":
    main()
