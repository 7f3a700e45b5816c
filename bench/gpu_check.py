#!/usr/bin/env python
"""Device check: a GPU binary's output bytes against the CPU binary's, and
its speed against PyTorch on the same GPU. Prints one table.

Runs on a GPU machine with Python, NumPy, PyTorch (+ transformers for the
Mamba-1/2 timings) and no Mojo, from a copy of this repository that carries
the built binaries (bench/README.md, "GPU check", says how to build and
carry them). For every case of bench/gpu_cases.py (the own transcendentals
and the finiteness check first, then forward, reports, ragged rows, prefill,
continuation, decode steps and sessions, batch-8 steps, states and backward
of all three blocks, and blocks on packed bfloat16/int8 weights) it compares:

* the GPU bytes with the CPU binary's bytes computed here, on this machine
  (the CPU binary is deterministic across x86 machines), and
* their SHA-256 with tests/digests.json, the digests every binary must
  reproduce (written by ``python -m bench.gpu_cases --write-digests`` on a
  CPU machine, and checked there for every CPU binary by
  tests/test_cpu_variants.py).

All bytes equal is the bar. Timing rows (--no-timing to skip): prefill and
one decode step of the mojolearn GPU path; prefill of transformers'
MambaBlock/Mamba2Block on the same GPU (torch.cuda.synchronize around each call). The mojolearn
GPU path stages every buffer to the device per call (docs/gpu.md), so its
times include those copies.

Usage (repository root):
    PYTHONPATH=python:. python bench/gpu_check.py [--vendor cuda] [--no-timing]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "python")]
EXPECTED = ROOT / "tests" / "digests.json"

# (block, d_model, B, L) for the timings: a prefill and decode steps.
TIMED = [(1, 768, 1, 1024), (2, 768, 1, 1024), (3, 768, 1, 1024)]


def _use(vendor: str):
    """Makes the next blocks run on `vendor`'s binary (the loader keys its
    cache by MOJOLEARN_VENDOR, and a block keeps the binary it was built on)."""
    os.environ["MOJOLEARN_VENDOR"] = vendor
    import mojolearn
    return mojolearn


def _digest(cases: dict) -> dict:
    return {k: hashlib.sha256(v).hexdigest() for k, v in cases.items()}


def run_bytes(vendor: str) -> dict:
    from bench import gpu_cases
    return gpu_cases.run_cases(_use(vendor))


def _best(fn, sync, reps=5):
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def _torch_block(kind, weights, d):
    if kind == 1:
        from bench.bench_mamba1 import hf_block
    elif kind == 2:
        from bench.bench_mamba2 import hf_block
    else:
        return None
    made = hf_block(weights, d)
    return made[0] if isinstance(made, tuple) else made


def time_rows(vendor: str) -> list:
    import numpy as np
    from bench import gpu_cases
    from mojolearn.reference.weights import random_input
    rows = []
    for kind, d, b, l in TIMED:
        mojolearn = _use(vendor)
        block = gpu_cases.block_for(mojolearn, kind, d)
        x = random_input(b, l, d, seed=3)
        pre = _best(lambda: block.forward(x), lambda: None, reps=3)
        state = block.allocate_state(b)
        block.forward(x, state)
        xt = np.ascontiguousarray(x[:, -1])
        step = _best(lambda: block.step(xt, state), lambda: None, reps=20)
        t_pre = None
        try:
            import torch
            tb = _torch_block(kind, gpu_cases._weights(kind, d), d)
            if tb is not None and torch.cuda.is_available():
                tb = tb.to("cuda")
                xg = torch.from_numpy(x).to("cuda")
                with torch.inference_mode():
                    t_pre = _best(lambda: tb(xg), torch.cuda.synchronize, reps=3)
        except Exception as e:  # timings are informative only
            print(f"torch timing for Mamba-{kind} skipped: {e}", file=sys.stderr)
        rows.append((f"Mamba-{kind} d{d} B{b}", l, pre, step, t_pre))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vendor", default="cuda", help="GPU vendor to check (default cuda)")
    p.add_argument("--no-timing", action="store_true")
    a = p.parse_args(argv)

    cpu = run_bytes("cpu")
    mojolearn = _use(a.vendor)
    try:
        used = mojolearn.vendor_used()
    except mojolearn.BinaryNotFoundError as e:
        print(f"no usable {a.vendor} binary: {e}", file=sys.stderr)
        return 2
    from mojolearn import _loader
    info = _loader.describe(_loader.library())
    print(f"GPU binary: {_loader.library().path} ({info}); device {_loader.library().device_arch}")
    gpu = run_bytes(a.vendor)
    saved = json.loads(EXPECTED.read_text())["digests"] if EXPECTED.is_file() else {}
    gd, cd = _digest(gpu), _digest(cpu)
    print(f"\n| case | bytes | GPU == CPU here | GPU == tests/digests.json |\n|---|---|---|---|")
    ok = used == a.vendor
    for name in cpu:
        here = gpu.get(name) == cpu[name]
        there = saved.get(name) == gd.get(name) if saved else None
        ok = ok and here and there is not False
        print(f"| {name} | {len(cpu[name])} | {'yes' if here else 'NO'} | "
              f"{'-' if there is None else ('yes' if there else 'NO')} |")
    if saved and saved != cd:
        print("note: this machine's CPU bytes differ from the saved ones "
              f"({sum(saved.get(k) != v for k, v in cd.items())} cases)")
    print(f"\nall bytes equal: {'YES' if ok else 'NO'} (vendor used: {used})")
    if not a.no_timing:
        print("\n| block | L | mojolearn GPU prefill ms | mojolearn GPU step ms | "
              "torch GPU prefill ms |\n|---|---|---|---|---|")
        f = lambda v: "-" if v is None else f"{v * 1e3:.2f}"  # noqa: E731
        for name, l, pre, step, tp in time_rows(a.vendor):
            print(f"| {name} | {l} | {f(pre)} | {f(step)} | {f(tp)} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
