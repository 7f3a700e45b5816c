#!/usr/bin/env python
"""Single-thread speed of the projection kernel (linear.mojo) alone, next to
NumPy's one-thread sgemm on the same shapes: the microbenchmark behind the
AVX2 tile and task-grid choices in bench/RESULTS.md.

Builds bench/linear_micro.mojo for the chosen target into a temporary
folder (seconds), then times y = x @ W^T for the d = 768 projection shapes
at the given row counts (best of --reps, GFLOP/s = 2 rows k m / time).

Usage (repository root)::

    python bench/linear_micro.py [--target x86-64-v3|x86-64-v4] [--rows 8,256,1024] [--reps 12]

For an A/B of a kernel change, run it from two checkouts in turn.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# (k, m) of the d = 768 projections: in_proj of Mamba-1 / Mamba-2 / Mamba-3,
# out_proj, Mamba-1's x_proj and dt_proj.
SHAPES = {"m1.in_proj": (768, 3072), "m2.in_proj": (768, 3352), "m3.in_proj": (768, 3432),
          "out_proj": (1536, 768), "m1.x_proj": (1536, 80), "m1.dt_proj": (48, 1536)}


def build(target: str, out: Path) -> Path:
    mojo = Path(sys.executable).with_name("mojo")
    lib = out / f"liblinear_micro_{target}.so"
    subprocess.run([str(mojo), "build", "--emit", "shared-lib", "--fp-mode", "contract=off",
                    "--target-cpu", target, "-D", f"ML_ARCH={target}",
                    "-I", str(ROOT / "mojo"), "-o", str(lib),
                    str(ROOT / "bench" / "linear_micro.mojo")], check=True)
    return lib


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="x86-64-v3")
    p.add_argument("--rows", default="8,256,1024")
    p.add_argument("--reps", type=int, default=12)
    a = p.parse_args(argv)
    if os.environ.get("OPENBLAS_NUM_THREADS") != "1":
        # NumPy's thread count is fixed when it loads: rerun with one thread
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        return subprocess.call([sys.executable, __file__, *(argv or sys.argv[1:])], env=env)
    with tempfile.TemporaryDirectory() as tmp:
        lib = ctypes.CDLL(str(build(a.target, Path(tmp))))
        lib.lm_pack.argtypes = [ctypes.c_int64] * 4
        lib.lm_run.argtypes = [ctypes.c_int64] * 6
        rng = np.random.default_rng(0)
        print(f"target {a.target}, one thread; GFLOP/s best of {a.reps}")
        print(f"{'shape':<12}{'rows':>6}{'k':>6}{'m':>6}{'ours':>8}{'numpy':>8}")
        for rows in (int(r) for r in a.rows.split(",")):
            for name, (k, m) in SHAPES.items():
                x = rng.standard_normal((rows, k), dtype=np.float32)
                w = rng.standard_normal((m, k), dtype=np.float32)
                wp = np.zeros(((m + 15) // 16) * 16 * k + 64, np.float32)
                lib.lm_pack(w.ctypes.data, m, k, wp.ctypes.data)
                y = np.zeros((rows, m), np.float32)
                ours = ref = float("inf")
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    lib.lm_run(x.ctypes.data, rows, wp.ctypes.data, k, m, y.ctypes.data)
                    ours = min(ours, time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    x @ w.T
                    ref = min(ref, time.perf_counter() - t0)
                fl = 2.0 * rows * k * m / 1e9
                print(f"{name:<12}{rows:>6}{k:>6}{m:>6}{fl / ours:>8.1f}{fl / ref:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
