#!/usr/bin/env python
"""Benchmark: Mamba1Block, Mamba2Block and Mamba3Block backward against PyTorch
autograd (float32, CPU), time and peak memory.

For each block, configuration and side, a fresh child process:
  * builds the block from ``mojolearn.reference.weights.mamba{1,2,3}_weights(d,
    seed=0)`` and the inputs from ``random_input`` (x seed 1, grad_output seed 2);
  * mojolearn: times ``block.backward(x, dy)`` (which recomputes the forward);
    Mamba-2 also reports its backward workspace (``workspace_bytes`` of
    OP_M2_BACKWARD), the dominant allocation;
  * PyTorch: times ``y = f(x); y.backward(dy)`` with x and every parameter
    requiring grad, grads reset to None before each call, where f is

    - Mamba-1: transformers' ``MambaBlock(cfg).eval()`` (bench_mamba1.hf_block),
      its normal CPU torch path: sequential selective scan, ``use_mambapy=False``;
    - Mamba-2: transformers' ``Mamba2Block(cfg).eval()`` (bench_mamba2.hf_block),
      its CPU torch path: chunked SSD, chunk 256;
    - Mamba-3: bench's float32 PyTorch Mamba-3 (bench_mamba3.TorchMamba3.prefill,
      chunked);

  * best of N after one warm-up (``--reps``; Mamba-2 and Mamba-3 take one
    fewer, at least one, where B * L > 1024); ``resource.getrusage(RUSAGE_SELF)
    .ru_maxrss`` before the first call and at the end (native memory included;
    tracemalloc would not see it). "peak over baseline" is what the calls added.
Threads: ``--threads`` (default 2) on both sides (torch.set_num_threads,
mojolearn.set_num_threads, OMP/MKL_NUM_THREADS; NumPy's OpenBLAS gets 1). Nothing here
asserts a speed. One markdown table per block, with the columns of that block.

Usage (repository root)::

    PYTHONPATH=python:. python bench/bench_backward.py [--block mamba1|mamba2|mamba3]
        [--quick] [--config D,B,L ...] [--reps N] [--sides mojolearn,torch]
        [--threads N] [--out FILE.json]

Without ``--block`` all three blocks run, one after the other.
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
# cls: the mojolearn class; quick: the --quick sizes; torch: the PyTorch
# side's name in the raw rows and its column label; fewer_reps_long: one rep
# less where B * L > 1024; workspace_op: the op whose workspace is reported
BLOCKS = {
    "mamba1": dict(title="Mamba-1", cls="Mamba1Block", quick=[(768, 1, 128), (256, 2, 256)],
                   torch=("transformers", "transformers"), fewer_reps_long=False,
                   workspace_op=None),
    "mamba2": dict(title="Mamba-2", cls="Mamba2Block", quick=[(256, 1, 128), (256, 2, 300)],
                   torch=("transformers", "transformers"), fewer_reps_long=True,
                   workspace_op="OP_M2_BACKWARD"),
    "mamba3": dict(title="Mamba-3", cls="Mamba3Block", quick=[(256, 1, 128), (256, 2, 256)],
                   torch=("torch", "PyTorch"), fewer_reps_long=True, workspace_op=None),
}
TORCH_SIDES = ("torch", "transformers")  # either names the PyTorch side in --sides


# --------------------------------------------------------------------------- child
def _mojolearn_call(block_name, w, x, g, B, L, d):
    """(call, extra fields) of the mojolearn side."""
    import mojolearn
    spec = BLOCKS[block_name]
    block = getattr(mojolearn, spec["cls"])(w)
    extra = {}
    if spec["workspace_op"]:
        from mojolearn import _abi
        op = getattr(_abi, spec["workspace_op"])
        extra["workspace_bytes"] = block._lib.workspace_bytes(
            op, _abi.op_spec(block._lib, op).pack(b=B, l=L, d=d))
    return (lambda: block.backward(x, g)), extra


def _torch_call(block_name, w, x, g, d):
    """The PyTorch side's forward + backward, grads reset before each call."""
    import torch
    if block_name == "mamba3":
        from bench_mamba3 import TorchMamba3
        m = TorchMamba3(w)
        params, fwd = list(m.w.values()), m.prefill
        for p in params:
            p.requires_grad_(True)
    else:
        if block_name == "mamba1":
            from bench_mamba1 import hf_block
        else:
            from bench_mamba2 import hf_block
        fwd, _cfg = hf_block(w, d)
        params = list(fwd.parameters())
    xt = torch.from_numpy(x).requires_grad_(True)
    gt = torch.from_numpy(g)

    def call():
        xt.grad = None
        for p in params:
            p.grad = None
        y = fwd(xt)
        y.backward(gt)
        return xt.grad
    return call


def _worker(spec: str) -> None:
    block_name, side, d, B, L, threads, reps = worker_spec(spec)
    sys.path[:0] = [str(ROOT / "python"), str(ROOT)]
    from mojolearn.reference import weights as mw
    w = getattr(mw, f"{block_name}_weights")(d, seed=0)
    x = mw.random_input(B, L, d, seed=1)
    g = mw.random_input(B, L, d, seed=2)
    if side == "mojolearn":
        import mojolearn
        mojolearn.set_num_threads(threads)
        call, extra = _mojolearn_call(block_name, w, x, g, B, L, d)
    else:
        import torch
        torch.set_num_threads(threads)
        call, extra = _torch_call(block_name, w, x, g, d), {}
    print(json.dumps({"block": block_name, "side": side, "d": d, "B": B, "L": L,
                      "threads": threads, **time_with_rss(call, reps), **extra}))


# --------------------------------------------------------------------------- parent
def _ms(r):
    return f"{r['best_s'] * 1e3:.1f}" if r else "-"


def _mem(r):
    if not r:
        return "-"
    return (f"{r['rss_peak_kib'] / 1024:.0f} "
            f"(+{(r['rss_peak_kib'] - r['rss_before_kib']) / 1024:.0f})")


def run_block(block_name, configs, args, sides):
    """Measure one block over configs: (raw rows, markdown table, whether
    the load average was above 1 at its start or end)."""
    spec = BLOCKS[block_name]
    torch_side, label = spec["torch"]
    workspace = spec["workspace_op"] is not None
    load0 = os.getloadavg()[0]
    print(f"{spec['title']}: threads={args.threads}, load average {load0:.2f} at start",
          flush=True)
    rows, raw = [], []
    for d, B, L in configs:
        reps = args.reps
        if spec["fewer_reps_long"] and B * L > 1024:
            reps = max(1, reps - 1)
        m = (measure_in_child(__file__, block_name, "mojolearn", d, B, L, args.threads, reps)
             if "mojolearn" in sides else None)
        t = (measure_in_child(__file__, block_name, torch_side, d, B, L, args.threads, reps)
             if "torch" in sides else None)
        raw += [r for r in (m, t) if r]
        speed = f"{t['best_s'] / m['best_s']:.2f}x" if m and t else "-"
        cells = [d, B, L, _ms(m), _ms(t), speed, _mem(m)]
        if workspace:
            cells.append(f"{m['workspace_bytes'] / 2**20:.0f}" if m else "-")
        rows.append("| " + " | ".join(str(c) for c in cells + [_mem(t)]) + " |")
        print(rows[-1], flush=True)
    load1 = os.getloadavg()[0]
    head = (["mojolearn backward ms", f"{label} fwd+bwd ms", "speed-up",
             "mojolearn peak RSS MiB (+ over baseline)"]
            + (["mojolearn workspace MiB"] if workspace else [])
            + [f"{label} peak RSS MiB (+)"])
    table = "\n".join(
        [f"{spec['title']} backward",
         f"threads={args.threads}, load average {load0:.2f} -> {load1:.2f}",
         "| d | B | L | " + " | ".join(head) + " |",
         "|" + "---|" * (3 + len(head))] + rows)
    return raw, table, max(load0, load1) > 1.0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block", choices=sorted(BLOCKS), action="append",
                   help="run this block (repeatable); default: all three")
    p.add_argument("--quick", action="store_true", help="each block's small sizes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3,
                   help="timed calls after one warm-up; 0: one timed call, no warm-up")
    p.add_argument("--config", action="append", metavar="D,B,L",
                   help="run these shapes instead of the default list")
    p.add_argument("--out", metavar="FILE.json")
    p.add_argument("--sides", default="mojolearn,torch",
                   help="comma-separated subset of mojolearn,torch (transformers: "
                        "the same as torch)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return
    sides = {"torch" if s in TORCH_SIDES else s for s in args.sides.split(",")}
    if not sides <= {"mojolearn", "torch"}:
        p.error(f"--sides: unknown side(s) {sorted(sides - {'mojolearn', 'torch'})}")
    load0 = os.getloadavg()[0]
    raw, tables = [], []
    for name in args.block or list(BLOCKS):
        configs = BLOCKS[name]["quick"] if args.quick else FULL
        if args.config:
            configs = [tuple(int(v) for v in c.split(",")) for c in args.config]
        r, table, busy = run_block(name, configs, args, sides)
        raw += r
        tables.append(table)
        print(table, flush=True)
        if busy:
            print("warning: the machine was busy; numbers are unreliable")
    load1 = os.getloadavg()[0]
    if args.out:
        Path(args.out).write_text(json.dumps({"raw": raw, "markdown": "\n\n".join(tables),
                                              "load": [load0, load1]}, indent=1))


if __name__ == "__main__":
    main()
