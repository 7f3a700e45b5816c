#!/usr/bin/env python
"""Phase times of decode steps (the per-phase tables of bench/RESULTS.md).

Runs a decode session of each block (d_model, batch from the arguments)
with mojolearn.debug's phase timing on and prints the mean microseconds per
step of every phase, best of a few rounds. A debugging aid, not a
comparison: the ratios in RESULTS.md come from the bench_*.py scripts.

Usage (from the repository root)::

    PYTHONPATH=python:. python bench/phases.py [--d 768] [--batch 8] [--steps 200]
        [--no-session-cache]
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

import mojolearn
from mojolearn import _abi, debug
from mojolearn.reference.weights import (mamba1_weights, mamba2_weights, mamba3_weights,
                                         random_input)
from _harness import cpu_name  # (bench/ is the script's folder)

BLOCKS = {1: (mamba1_weights, "Mamba1Block"), 2: (mamba2_weights, "Mamba2Block"),
          3: (mamba3_weights, "Mamba3Block")}




def step_phases(kind: int, d: int, b: int, steps: int, rounds: int,
                cache: bool = True) -> list[dict]:
    make, cls = BLOCKS[kind]
    block = getattr(mojolearn, cls)(make(d, seed=1))
    x = random_input(b, steps, d, seed=2)
    best = None
    for _ in range(rounds):
        state = block.allocate_state(b)
        opts = {} if kind == 1 else {"cache": cache}  # (Mamba-1 sessions have no cache)
        with block.decode_session(state, **opts) as s:
            for t in range(min(steps, 20)):  # warm the caches and the pool
                s.step(np.ascontiguousarray(x[:, t]))
            with debug.timing_phases() as timing:
                for t in range(steps):
                    s.step(np.ascontiguousarray(x[:, t]))
        rows = [r for r in timing.result if r["calls"] >= steps]
        total = sum(r["seconds"] for r in rows)
        if best is None or total < best[0]:
            best = (total, rows)
    return best[1]


def prefill_stages(kind: int, d: int, b: int, length: int, rounds: int) -> dict:
    """Milliseconds per forward stage of one prefill (B = b, L = length, no
    state), summed over the chunks, best round by wall time."""
    make, cls = BLOCKS[kind]
    block = getattr(mojolearn, cls)(make(d, seed=1))
    x = random_input(b, length, d, seed=2)
    block.forward(x)
    op = {1: _abi.OP_M1_FORWARD, 2: _abi.OP_M2_FORWARD, 3: _abi.OP_M3_FORWARD}[kind]
    names = debug.STAGES[op]
    first = 0 if kind == 3 else 1  # Mamba-1/2: phase 0 loads the state
    best = None
    for _ in range(rounds):
        t0 = time.perf_counter()
        with debug.timing_phases() as timing:
            block.forward(x)
        wall = time.perf_counter() - t0
        ms = {"wall": wall * 1e3}
        rows = [r for r in timing.result if r["op_id"] == op]
        # Mamba-1/2: phase 0 loads the state and the last one saves it
        last = max(r["phase"] for r in rows) if first else None
        for r in rows:
            k = r["phase"] - first
            if k >= 0 and r["phase"] != last:
                name = names[k % len(names)]
                ms[name] = ms.get(name, 0.0) + r["seconds"] * 1e3
        if best is None or ms["wall"] < best["wall"]:
            best = ms
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--blocks", default="1,2,3")
    p.add_argument("--prefill", type=int, default=0, metavar="L",
                   help="time the stages of a B x L prefill instead of decode steps")
    p.add_argument("--no-session-cache", action="store_true",
                   help="Mamba-2/3 sessions without their speed cache (decode_session(cache=False))")
    a = p.parse_args(argv)
    mojolearn.set_num_threads(a.threads)
    info = mojolearn._loader.describe(mojolearn._loader.library())
    print(f"CPU: {cpu_name()}; binary {info.get('arch', '?')}; {a.threads} threads; "
          f"d={a.d} B={a.batch}, {a.steps} steps, best of {a.rounds}")
    for kind in (int(k) for k in a.blocks.split(",")):
        if a.prefill:
            ms = prefill_stages(kind, a.d, a.batch, a.prefill, a.rounds)
            print(f"\nMamba-{kind} prefill B={a.batch} L={a.prefill} (ms per forward, "
                  f"stages summed over the chunks):")
            for name, v in ms.items():
                print(f"  {name:<16}{v:>9.1f}")
            continue
        rows = step_phases(kind, a.d, a.batch, a.steps, a.rounds, not a.no_session_cache)
        print(f"\nMamba-{kind} decode step (mean us per step):")
        print(debug.format_phase_times(rows))
        print(f"{'total':<42}{sum(r['seconds'] for r in rows) / a.steps * 1e6:>10.1f}")


if __name__ == "__main__":
    os.environ.setdefault("MOJOLEARN_NUM_THREADS", "2")
    main()
