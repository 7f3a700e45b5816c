#!/usr/bin/env python
"""Paired A/B of the projection kernel alone (linear.mojo) between two source
trees, on one thread: the kernel-level ratios of bench/RESULTS.md
("Batched decode projections").

Builds this checkout's bench/linear_micro.mojo against each tree's kernels,
loads both into one process and times y = x @ W^T for the d = 768
projection shapes, alternating A and B call by call (A first on even
pairs, B first on odd ones). Each timing runs the product over --copies
different weight matrices in turn, so with a few copies the panels come
from memory as in a whole-model step, not from L3. Timed in thread CPU
seconds (a call the scheduler pauses is not charged for the pause). Prints
the best GFLOP/s of each side, whether both give the same bytes, and the
median of the per-pair ratios B/A with its quartiles.

Usage (repository root; OLD_ROOT holds an older checkout's mojo/ and bench/)::

    python bench/linear_ab.py OLD_ROOT . [--rows 8,16,32] [--copies 6] [--pairs 30]
        [--format float32|int8] [--shapes m2.in_proj,out_proj]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linear_micro import SHAPES  # (bench/: the d = 768 projection shapes)

MOJO = Path(sys.executable).with_name("mojo")


def build(root: Path, out: Path, target: str) -> ctypes.CDLL:
    """This checkout's bench/linear_micro.mojo (its exports) on root's kernels."""
    subprocess.run([str(MOJO), "build", "--emit", "shared-lib", "--fp-mode", "contract=off",
                    "--target-cpu", target, "-D", f"ML_ARCH={target}",
                    "-I", str(root / "mojo"), "-o", str(out),
                    str(Path(__file__).resolve().with_name("linear_micro.mojo"))], check=True)
    lib = ctypes.CDLL(str(out))
    lib.lm_pack.argtypes = [ctypes.c_int64] * 4
    lib.lm_run.argtypes = [ctypes.c_int64] * 6
    lib.lm_run_wf.argtypes = [ctypes.c_int64] * 7
    return lib


WF_INT8 = 2  # linear.mojo's id of the int8 panel format


def pack_int8(rng, m: int, k: int) -> np.ndarray:
    """Random int8 panels in linear.mojo's layout: per 16-row panel, 16
    float32 scales 2^e (one per row), then the codes k-major [k, 16]."""
    npan = (m + 15) // 16
    out = np.zeros(npan * (16 + k * 4) + 64, np.float32)
    for p in range(npan):
        o = p * (16 + k * 4)
        out[o:o + 16] = 2.0 ** rng.integers(-9, -5, 16)
        codes = rng.integers(-127, 128, (k, 16)).astype(np.int8)
        out[o + 16:o + 16 + k * 4] = codes.reshape(-1).view(np.float32)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root_a", type=Path)
    p.add_argument("root_b", type=Path)
    p.add_argument("--rows", default="8,16,32")
    p.add_argument("--copies", type=int, default=6)
    p.add_argument("--pairs", type=int, default=30)
    p.add_argument("--target", default="x86-64-v3")
    p.add_argument("--format", choices=("float32", "int8"), default="float32",
                   help="the weights' panel format (int8: random codes and scales)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="names from linear_micro.SHAPES")
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(a.root_a.resolve(), Path(tmp) / "liba.so", a.target),
                build(a.root_b.resolve(), Path(tmp) / "libb.so", a.target)]
        print(f"target {a.target}, one thread, thread CPU clock, {a.copies} weight copies, "
              f"{a.pairs} pairs")
        for rows in (int(r) for r in a.rows.split(",")):
            for name in a.shapes.split(","):
                k, m = SHAPES[name]
                x = rng.standard_normal((rows, k), dtype=np.float32)
                panels = []
                for _ in range(a.copies):
                    if a.format == "int8":
                        panels.append(pack_int8(rng, m, k))
                        continue
                    w = rng.standard_normal((m, k), dtype=np.float32)
                    wp = np.zeros(((m + 15) // 16) * 16 * k + 64, np.float32)
                    libs[0].lm_pack(w.ctypes.data, m, k, wp.ctypes.data)
                    panels.append(wp)
                ys = [np.zeros((rows, m), np.float32) for _ in libs]
                wf = WF_INT8 if a.format == "int8" else 0

                def run(i):
                    t0 = time.thread_time()
                    for wp in panels:
                        libs[i].lm_run_wf(wf, x.ctypes.data, rows, wp.ctypes.data, k, m,
                                          ys[i].ctypes.data)
                    return (time.thread_time() - t0) / len(panels)

                times = ([], [])
                for pair in range(a.pairs):
                    for i in ((0, 1) if pair % 2 == 0 else (1, 0)):
                        times[i].append(run(i))
                same = ys[0].tobytes() == ys[1].tobytes()
                ratios = [tb / ta for ta, tb in zip(*times)]
                q = statistics.quantiles(ratios, n=4)
                fl = 2.0 * rows * k * m / 1e9
                print(f"{name:<12}{rows:>5} rows  A {fl / min(times[0]):6.1f}  "
                      f"B {fl / min(times[1]):6.1f} GFLOP/s  same bytes {same}  "
                      f"B/A {statistics.median(ratios):.3f} ({q[0]:.3f}-{q[2]:.3f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
