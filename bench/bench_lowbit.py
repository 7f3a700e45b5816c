#!/usr/bin/env python
"""Benchmark: blocks on packed weights (mojolearn.lowbit) against float32.

For Mamba-1/2/3 at one d_model (default 768), measured in one process:

(a) bytes a block holds (its weight copies plus its prepared blob), per
    weight format ('float32', 'bfloat16', 'int8', 'q8_0', 'q4_0');
(b) decode ms/token (B = 1): a Mamba-1/2 decode session's step, Mamba-3's
    ``step``, per format, in interleaved short rounds (every block in each
    round, so a load change hits them alike); best and median of the rounds;
(c) prefill ms (B = 1, L = --prefill-len) per format, interleaved the same way.

Each packed block has a float32 twin built on ``unpack(packed)`` (same
values; outputs checked byte-identical first). The two float32 twins do the
same work on different values: their difference shows the noise. Threads: --threads (default 1, the steadiest on a shared machine).
This is a benchmark, never a test: nothing here asserts a speed.

Usage (from the repository root)::

    PYTHONPATH=python:. python bench/bench_lowbit.py [--d 768] [--rounds 7]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

FORMATS = ("float32", "bfloat16", "int8", "q8_0", "q4_0")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--steps", type=int, default=16, help="decode steps per round")
    p.add_argument("--prefill-len", type=int, default=128)
    p.add_argument("--blocks", default="1,2,3", help="which Mamba versions")
    return p.parse_args(argv)


def _weights(version, d):
    from mojolearn.reference.weights import mamba1_weights, mamba2_weights, mamba3_weights
    return {1: mamba1_weights, 2: mamba2_weights, 3: mamba3_weights}[version](d, seed=0)


def _blocks(version, d):
    """{fmt: block}, and for each packed format its float32 twin on the
    expanded values (the formats' grids differ, so each gets its own)."""
    import mojolearn
    from mojolearn import lowbit
    cls = getattr(mojolearn, f"Mamba{version}Block")
    w = _weights(version, d)
    out = {}
    for fmt in FORMATS[1:]:
        packed = lowbit.pack(w, fmt)
        out[fmt] = cls(packed)
        out[f"float32 ({fmt} values)"] = cls(lowbit.unpack(packed)[0])
    return out


def _stepper(block, d):
    """A function running one decode token (B = 1), and what to close after."""
    import numpy as np
    x = np.random.default_rng(1).random((1, d), dtype=np.float32)
    state = block.allocate_state(1)
    block.forward(x[:, None, :], state)
    if hasattr(block, "decode_session"):
        s = block.decode_session(state)
        return (lambda: s.step(x)), s
    return (lambda: block.step(x, state)), None


def _time(fn, n):
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def run(args):
    import numpy as np
    import mojolearn
    mojolearn.set_num_threads(args.threads)
    d = args.d
    print(f"d_model={d}, threads={args.threads}, rounds={args.rounds}")
    for version in (int(v) for v in args.blocks.split(",")):
        blocks = _blocks(version, d)
        x = np.random.default_rng(2).random((1, args.prefill_len, d), dtype=np.float32)
        for fmt in FORMATS[1:]:  # the comparison is meaningful only if the bits agree
            a = bytes(memoryview(blocks[fmt].forward(x)))
            assert a == bytes(memoryview(blocks[f"float32 ({fmt} values)"].forward(x)))
        print(f"\nMamba-{version}")
        print("| block | bytes held | of float32 | decode ms/token best (median) | "
              f"prefill ms L={args.prefill_len} best (median) |")
        print("|---|---:|---:|---:|---:|")
        steppers = {k: _stepper(b, d) for k, b in blocks.items()}
        dec = {k: [] for k in blocks}
        pre = {k: [] for k in blocks}
        gc.disable()
        try:
            for k, (fn, _) in steppers.items():  # warm-up
                _time(fn, 8)
            for _ in range(args.rounds):
                for k, (fn, _) in steppers.items():
                    dec[k].append(_time(fn, args.steps))
                for k, b in blocks.items():
                    pre[k].append(_time(lambda: b.forward(x), 1))
        finally:
            gc.enable()
        for _, s in steppers.values():
            if s is not None:
                s.close()
        ref = blocks["float32 (bfloat16 values)"]._held_bytes()
        for k, b in sorted(blocks.items()):
            held = b._held_bytes()
            print(f"| {k} | {held:,} | {held / ref:.2f} | "
                  f"{1e3 * min(dec[k]):.3f} ({1e3 * statistics.median(dec[k]):.3f}) | "
                  f"{1e3 * min(pre[k]):.2f} ({1e3 * statistics.median(pre[k]):.2f}) |")


if __name__ == "__main__":
    run(parse_args())
