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
        [--evict-mb MB]
        [--roots] [--lm FOLDER [--format float32] [--prefill L]]

--roots: DIR_A and DIR_B are repository roots (worktrees): each worker
imports that root's python/ package with the binaries built there, so a
change of the Python layer is measured too. --lm FOLDER: instead of one
block, each worker decodes --batch requests of 16-token prompts together
through a whole MambaLM checkpoint (Batcher.step: embedding, every layer,
the head and the next tokens); with --prefill L, each step is instead one
L-token prompt through a fresh Batcher's first step (bench_lm.py's prefill).

--target baseline forces the x86-64-v3 (AVX2) binary in both workers.
--evict-mb MB (one block): before each step, untimed, write over an MB
megabyte buffer, so the step reads its weights and state from memory as a
layer of a whole model does (a 24-layer model's weights and states do not
stay in the last-level cache from one step to the next).
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


def _serve(step, clock: str, evict_mb: int = 0) -> None:
    """Print "ready", then per line read a step count, run that many
    step() calls and print the mean seconds per call. evict_mb > 0: before
    each step (untimed) write over a buffer that large, so the step finds
    its weights and state in memory, not in the caches, as a layer of a
    whole model does."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    junk = bytearray(evict_mb << 20)
    marks = [b"\x01" * (len(junk) // 64), bytes(len(junk) // 64)]  # a byte per line
    print("ready", flush=True)
    for line in sys.stdin:
        n = int(line)
        total = 0.0
        for i in range(n):
            if evict_mb:
                junk[::64] = marks[i % 2]
            t0 = now()
            step()
            total += now() - t0
        print(f"{total / n:.9f}", flush=True)


def _lm_worker(folder: str, fmt: str, batch: int, clock: str, prefill: int = 0) -> None:
    """Serve bursts of Batcher steps of `batch` rows decoding together, or
    (prefill > 0) of prefills: one prompt of `prefill` tokens through a
    fresh Batcher's first step (as bench_lm.py times it)."""
    import mojolearn
    lm = mojolearn.MambaLM(folder, weight_format=fmt)
    if prefill:
        prompt = [(7 * i + 3) % lm.vocab_size for i in range(prefill)]

        def first_step():
            pb = lm.batcher(prefill_chunk=None)
            pb.submit(prompt, max_new_tokens=1)
            pb.step()
        first_step()  # warm-up
        _serve(first_step, clock)
        return
    b = lm.batcher(prefill_chunk=None)
    vocab = lm.vocab_size
    for r in range(batch):
        b.submit([(11 * r + 5 * i + 1) % vocab for i in range(16)], max_new_tokens=1 << 30)
    for _ in range(6):  # the prefill, the rows opening, warm-up
        b.step()
    _serve(b.step, clock)


def _worker(block: int, batch: int, ctx: int, d: int, clock: str = "wall",
            evict_mb: int = 0) -> None:
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
    pos = [0]
    with blk.decode_session(state) as s:
        def step():
            s.step(toks[pos[0] % TOKENS])
            pos[0] += 1
        for _ in range(4):  # warm-up
            step()
        _serve(step, clock, evict_mb)


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
    p.add_argument("--evict-mb", type=int, default=0, metavar="MB",
                   help="one block: write over MB megabytes before each step (untimed)")
    p.add_argument("--roots", action="store_true",
                   help="DIR_A and DIR_B are repository roots: their python/ and binaries")
    p.add_argument("--lm", default=None, metavar="FOLDER",
                   help="decode --batch rows of this MambaLM checkpoint instead of one block")
    p.add_argument("--format", default="float32", help="the MambaLM's weight_format (--lm)")
    p.add_argument("--prefill", type=int, default=0, metavar="L",
                   help="with --lm: time prefills of one L-token prompt instead of decode steps")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        if a.lm:
            _lm_worker(a.lm, a.format, a.batch, a.clock, a.prefill)
        else:
            _worker(a.block, a.batch, a.ctx, a.d, a.clock, a.evict_mb)
        return
    procs = []
    for folder in (a.dir_a, a.dir_b):
        root = os.path.abspath(folder) if a.roots else ROOT
        env = dict(os.environ, MOJOLEARN_CPU_TARGET=a.target,
                   PYTHONPATH=os.pathsep.join([os.path.join(root, "python"), ROOT]))
        if not a.roots:
            env["MOJOLEARN_LIB_DIR"] = os.path.abspath(folder)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", a.dir_a, a.dir_b,
               "--block", str(a.block), "--batch", str(a.batch), "--ctx", str(a.ctx),
               "--d", str(a.d), "--clock", a.clock, "--evict-mb", str(a.evict_mb)]
        if a.lm:
            cmd += ["--lm", os.path.abspath(a.lm), "--format", a.format,
                    "--prefill", str(a.prefill)]
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
    what = f"MambaLM {os.path.basename(a.lm)} {a.format}" if a.lm else f"Mamba-{a.block}"
    if a.lm and a.prefill:
        what += f" {a.prefill}-token prefill,"
    else:
        what += f" B={a.batch}"
    print(f"{what} ({a.target or 'default binary'}, {a.clock} clock), "
          f"{a.pairs} pairs of "
          f"{a.steps} steps" + ("" if a.lm else f" after a {a.ctx}-token prefill")
          + f": A median {statistics.median(ta) * 1e3:.4f}"
          f" ms, B median {statistics.median(tb) * 1e3:.4f} ms; paired B/A median "
          f"{statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")


if __name__ == "__main__":
    main()
