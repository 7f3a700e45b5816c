"""The machine's limits for one block, and the FLOP / byte model of the blocks.

Measured limits (issue 16, item 2):

* ``sgemm_gflops(shapes, threads)``: NumPy float32 ``(M, K) @ (K, N)`` GFLOP/s
  on the block's projection shapes, in a child process with
  OPENBLAS_NUM_THREADS = threads and OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE
  unset (so OpenBLAS picks its own kernel for this CPU), best of a few reps.
* ``weight_read_seconds(nbytes, threads)``: the time ``threads`` threads take
  to read a warm float32 buffer of ``nbytes`` once (each thread reduces its
  disjoint slice with a NumPy reduction, which releases the GIL; persistent
  threads started by a barrier; best of several reps and of two reductions).

The model (issue 16, item 3; written out in bench/MODEL.md):

``flop_model(kind, d, B, L)`` counts, for a prefill of B sequences of L
tokens from an empty state (T = B*L tokens), with d_inner = di = 2d:

* projections, 2*M*N*K per matmul (M = T rows), from the weight shapes of
  python/mojolearn/mamba/mamba{1,2,3}.py:

  - Mamba-1: in_proj (2di x d), x_proj (R+2*16 x di), dt_proj (di x R),
    out_proj (d x di), R = ceil(d/16):
    ``2T(2di*d + (R+32)*di + di*R + d*di)``
  - Mamba-2: in_proj (2di+256+H x d), out_proj (d x di), H = di/64:
    ``2T((2di+256+H)*d + d*di)``
  - Mamba-3: in_proj (2di+256+3H+32 x d), out_proj (d x di):
    ``2T((2di+256+3H+32)*d + d*di)``

* the scan, roughly (one multiply or add = 1 FLOP, an exp / softplus /
  sigmoid / sin / cos = 1 FLOP; norms, gates, the skip term D*x, the conv are
  counted separately as "other" and are small):

  - Mamba-1 (N = 16): per token and (channel, state): dA = exp(dt*A),
    h = dA*h + (dt*x)*B, y += C*h: ``6*T*di*N``.
  - Mamba-2 (SSD, N = 128, P = 64, chunk Q = 256): per head, a token at
    row i of its chunk costs CB over i+1 rows (2N each), Ydiag over i+1 rows
    (2P each), Yoff = C.h (2NP) and its share of the fold (2NP):
    ``B * H * sum_{t<L} [2(N+P)*((t mod Q)+1) + 4NP]``.
  - Mamba-3 (SISO, N = 128, P = 64, chunk Q = 64): the same shape of count
    (q'.k'_j over the chunk rows, the weighted sum of v rows, q'.h, a fold
    of 2QPN per 64 tokens), with chunk 64:
    ``B * H * sum_{t<L} [2(N+P)*((t mod Q)+1) + 4NP]``.

  - "other": conv (2*4 per channel per token: Mamba-1 di channels, Mamba-2
    di+256; Mamba-3 has none), RMSNorms and gates ~ 10 per element of d and
    di per token. Counted in ``total`` but not in ``proj``.

``weight_bytes(kind, d, fmt)``: the bytes a decode step must read from the
weights: the projection matrices (``lowbit.is_projection``) in ``fmt``
(float32 4 B, bfloat16 2 B, int8 1 B + one int32 exponent per row), every
other weight in float32. ``state_bytes(kind, d, B)`` is the state's float32
bytes (read and written by each step).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KINDS = ("mamba1", "mamba2", "mamba3")
_FMT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}


# --------------------------------------------------------------------------- shapes
def _mojolearn_path():
    p = os.path.join(ROOT, "python")
    if p not in sys.path:
        sys.path.insert(0, p)


def weight_shapes(kind: str, d: int) -> dict:
    """{name: shape} of the block's weights (the package's *_weight_shapes)."""
    _mojolearn_path()
    if kind == "mamba1":
        from mojolearn.mamba.mamba1 import mamba1_weight_shapes as f
    elif kind == "mamba2":
        from mojolearn.mamba.mamba2 import mamba2_weight_shapes as f
    elif kind == "mamba3":
        from mojolearn.mamba.mamba3 import mamba3_weight_shapes as f
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    out = {}
    for name, shape in f(d).items():
        if shape and isinstance(shape[0], tuple):  # accepted alternatives: same size
            shape = shape[0]
        out[name] = tuple(shape)
    return out


def _is_projection(name: str) -> bool:
    _mojolearn_path()
    from mojolearn.lowbit import is_projection
    return is_projection(name)


def proj_shapes(kind: str, d: int, T: int) -> list:
    """[(M, K, N)] of the projection matmuls for T tokens: (T, K) @ (K, N),
    the weight being (N, K)."""
    return [(T, k, n) for name, (n, k) in
            ((nm, s) for nm, s in weight_shapes(kind, d).items()
             if _is_projection(nm) and len(s) == 2)]


def _dims(kind, d):
    di = 2 * d
    if kind == "mamba1":
        return {"di": di, "N": 16, "R": -(-d // 16)}
    h = di // 64
    return {"di": di, "H": h, "N": 128, "P": 64, "Q": 256 if kind == "mamba2" else 64}


# --------------------------------------------------------------------------- model
def flop_model(kind: str, d: int, B: int, L: int) -> dict:
    """FLOPs of a prefill of B sequences of L tokens (empty state); formulas in the
    module docstring. Returns {'proj', 'scan', 'other', 'total'} in FLOPs."""
    T = B * L
    proj = sum(2.0 * m * k * n for m, k, n in proj_shapes(kind, d, T))
    dm = _dims(kind, d)
    di = dm["di"]
    if kind == "mamba1":
        scan = 6.0 * T * di * dm["N"]
        other = T * (2.0 * 4 * di + 10.0 * (d + 2 * di))
    else:
        N, P, Q, H = dm["N"], dm["P"], dm["Q"], dm["H"]
        full, rest = divmod(L, Q)
        rows = full * Q * (Q + 1) / 2 + rest * (rest + 1) / 2   # sum_t ((t mod Q) + 1)
        scan = B * H * (2.0 * (N + P) * rows + 4.0 * N * P * L)
        conv = 2.0 * 4 * (di + 2 * N) if kind == "mamba2" else 0.0
        other = T * (conv + 10.0 * (d + 2 * di))
    return {"proj": proj, "scan": scan, "other": other, "total": proj + scan + other}


def weight_bytes(kind: str, d: int, fmt: str = "float32") -> int:
    """Bytes of the block's weights with the projections in fmt (see docstring)."""
    if fmt not in _FMT_BYTES:
        raise ValueError(f"fmt must be one of {list(_FMT_BYTES)}, got {fmt!r}")
    total = 0
    for name, shape in weight_shapes(kind, d).items():
        n = math.prod(shape)
        if _is_projection(name) and len(shape) == 2:
            total += n * _FMT_BYTES[fmt] + (4 * shape[0] if fmt == "int8" else 0)
        else:
            total += 4 * n
    return total


def state_bytes(block, B: int) -> int:
    """float32 bytes of the block's state for batch B (allocate_state's arrays)."""
    import numpy as np
    st = block.allocate_state(B)
    return int(sum(np.asarray(getattr(st, n)).nbytes for n in type(st)._ARRAYS))


# --------------------------------------------------------------------------- sgemm
def _sgemm_child(spec: str) -> None:
    cfg = json.loads(spec)
    import numpy as np
    rng = np.random.default_rng(0)
    out = {"env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                                   "OPENBLAS_NUM_THREADS")}, "shapes": []}
    sys.path.insert(0, HERE)
    from bench_mamba1 import _openblas_info  # the kernel OpenBLAS chose (and its threads)
    out["blas"] = _openblas_info(np, int(os.environ["OPENBLAS_NUM_THREADS"]))
    tot_f = tot_s = 0.0
    for m, k, n in cfg["shapes"]:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        c = np.empty((m, n), dtype=np.float32)
        np.matmul(a, b, out=c)
        best, t_end, reps = math.inf, time.perf_counter() + cfg["budget_s"], 0
        while reps < cfg["reps"] or (time.perf_counter() < t_end and reps < 50):
            t0 = time.perf_counter()
            np.matmul(a, b, out=c)
            best = min(best, time.perf_counter() - t0)
            reps += 1
        f = 2.0 * m * k * n
        tot_f, tot_s = tot_f + f, tot_s + best
        out["shapes"].append({"M": m, "K": k, "N": n, "best_s": best, "reps": reps,
                              "gflops": f / best / 1e9})
    out["gflops"] = tot_f / tot_s / 1e9  # all shapes together: sum FLOPs / sum times
    print(json.dumps(out))


def sgemm_gflops(shapes, threads: int, reps: int = 3, budget_s: float = 0.5,
                 coretype: str | None = None) -> dict:
    """NumPy float32 sgemm on shapes [(M, K, N)] in a child process with
    OPENBLAS_NUM_THREADS=threads and OPENBLAS_L2_SIZE unset; OPENBLAS_CORETYPE
    unset (the CPU's own kernel) or `coretype` ("Haswell": OpenBLAS's AVX2
    kernel, the limit an AVX2 build is measured against on an AVX-512 CPU).
    Returns {'gflops' (sum FLOPs / sum best times), 'shapes': [...], 'env', 'blas'}."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    env.pop("OPENBLAS_CORETYPE", None)
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    env.pop("OPENBLAS_L2_SIZE", None)
    spec = json.dumps({"shapes": [list(s) for s in shapes], "reps": reps,
                       "budget_s": budget_s})
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--sgemm-child", spec],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- read probe
def weight_read_seconds(nbytes: int, threads: int, reps: int = 30) -> dict:
    """Seconds `threads` threads take to read a warm float32 buffer of nbytes once
    (disjoint slices, one per thread, each reduced with np.maximum.reduce or
    np.add.reduce over rows; best of reps and of the two). Returns
    {'seconds', 'gbps', 'nbytes', 'threads', 'kernel', 'repeat', 'sync_s'}:
    seconds = best round / repeat (reads per round); sync_s is one barrier round
    trip with no work (its share in seconds is sync_s / repeat)."""
    import numpy as np
    n = max(1024, (int(nbytes) // 4 + 1023) // 1024 * 1024)
    buf = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    parts = [p.reshape(-1, 1024) if p.size % 1024 == 0 else p.reshape(1, -1)
             for p in np.array_split(buf, threads)]
    kernels = {"maximum.reduce": lambda p: np.maximum.reduce(p, axis=None),
               "add.reduce(axis=0)": lambda p: np.add.reduce(p, axis=0),
               "noop": lambda p: None}
    best, sync = (math.inf, None), math.inf
    # Each round reads the buffer `repeat` times (>= ~2 ms of work at 30 GB/s) so the
    # barrier round trip (~50 us in Python) is amortized; time per read = round / repeat.
    # Repeated reads of a warm buffer are what a decode loop does with its weights.
    repeat = max(1, math.ceil(60e6 / (4 * n)))
    for kname, fn in kernels.items():
        start, done = threading.Barrier(threads + 1), threading.Barrier(threads + 1)
        stop = []

        def work(p, fn=fn, start=start, done=done):
            while True:
                start.wait()
                if stop:
                    return
                for _ in range(repeat):
                    fn(p)
                done.wait()

        pool = [threading.Thread(target=work, args=(p,), daemon=True) for p in parts]
        for t in pool:
            t.start()
        try:
            for r in range(reps + 3):  # 3 warm-ups (buffer into cache, clocks up)
                t0 = time.perf_counter()
                start.wait()
                done.wait()
                dt = (time.perf_counter() - t0) / repeat
                if r >= 3 and kname == "noop":
                    sync = min(sync, dt)
                elif r >= 3 and dt < best[0]:
                    best = (dt, kname)
        finally:
            stop.append(1)
            start.wait()
            for t in pool:
                t.join()
    return {"seconds": best[0], "gbps": 4 * n / best[0] / 1e9, "nbytes": 4 * n,
            "threads": threads, "kernel": best[1], "repeat": repeat,
            "sync_s": sync * repeat}


# The library's elementwise functions a Mamba-1 prefill must evaluate: per
# token di*N exps (the scan's decays), di softplus (dt), di SiLU after the
# conv and di for the gate. Their bits are fixed (numerics.mojo), so this
# much work is in any identical-mode prefill whatever the kernels around it.
_MATH_FN = {"exp": 0, "softplus": 3, "silu": 5}


def transcendental_counts(kind: str, d: int, T: int) -> dict:
    """Evaluations per prefill of T tokens (Mamba-1 only; the others' are a
    few per head and token, small next to their scans)."""
    if kind != "mamba1":
        return {}
    di = 2 * d
    return {"exp": T * di * 16, "softplus": T * di, "silu": 2 * T * di}


def transcendental_seconds(counts: dict, threads: int, reps: int = 15) -> dict:
    """Seconds `threads` threads need for `counts` evaluations at the rate the
    library's own functions reach on one thread (ml_math_eval, width 16, an
    L2-resident array of in-range inputs like dt and gates, best of reps),
    assuming perfect scaling over threads. Returns {'seconds', 'ns': {fn:
    ns per evaluation}}."""
    import ctypes
    import numpy as np
    from mojolearn import _loader
    lib = ctypes.CDLL(str(_loader.library_path("cpu")))
    lib.ml_math_eval.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_int64]
    lib.ml_math_eval.restype = ctypes.c_int64
    x = np.random.default_rng(0).uniform(-7.0, 3.0, 1 << 15).astype(np.float32)
    out = np.empty_like(x)
    ns, total = {}, 0.0
    for fn, count in counts.items():
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(8):
                lib.ml_math_eval(_MATH_FN[fn], x.ctypes.data, out.ctypes.data, x.size, 16)
            best = min(best, (time.perf_counter() - t0) / (8 * x.size))
        ns[fn] = best * 1e9
        total += count * best / threads
    return {"seconds": total, "ns": ns}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--sgemm-child":
        _sgemm_child(sys.argv[2])
    else:
        for kind in KINDS:
            print(kind, "d=768", {k: f"{v / 1e9:.2f} GFLOP" for k, v in
                                  flop_model(kind, 768, 8, 1024).items()},
                  f"weights {weight_bytes(kind, 768) / 1e6:.2f} MB")
