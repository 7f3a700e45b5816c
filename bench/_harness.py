"""Timing helpers shared by the benchmark scripts.

PyTorch's OpenMP workers keep spinning for a while after a parallel region
(measured: our 2-thread decode step is 1.3-1.7x slower right after a
transformers call, normal after 0.5 s), and after such a pause the cores
have clocked down. So before each timed side a script waits SETTLE_S, then
keeps the cores busy for a moment (busy_warm) before timing.
"""
import time

SETTLE_S = 0.5


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), for the header of every table."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown CPU"


def busy_warm(fn, seconds=0.25):
    """Call fn for `seconds` so the cores are back at full clock."""
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        fn()


# ---- backward benchmark: one fresh child process per (block, side, configuration)

def worker_spec(spec: str):
    """(block, side, d, B, L, threads, reps) of a child's --worker spec; pins
    the thread counts before NumPy or PyTorch are imported (NumPy only moves
    data and gets one OpenBLAS thread; PyTorch uses MKL/OpenMP)."""
    import os
    block, side, d, B, L, threads, reps = spec.split(",")
    d, B, L, threads, reps = int(d), int(B), int(L), int(threads), int(reps)
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    return block, side, d, B, L, threads, reps


def time_with_rss(call, reps):
    """Best-of timing of call() and the process's peak RSS around it: one
    warm-up then `reps` timed calls (reps = 0: one timed call, no warm-up,
    for configurations too slow to run twice)."""
    import gc
    import resource
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    if reps > 0:
        call()  # warm-up
    gc.disable()
    for _ in range(max(reps, 1)):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"times_s": times, "best_s": min(times), "rss_before_kib": base,
            "rss_peak_kib": peak}


def measure_in_child(script, block, side, d, B, L, threads, reps):
    """Run `script --worker block,side,d,B,L,threads,reps` in a fresh process
    and return the JSON dict its last output line holds."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    spec = f"{block},{side},{d},{B},{L},{threads},{reps}"
    env = dict(os.environ, PYTHONPATH=f"{root / 'python'}:{root}")
    res = subprocess.run([sys.executable, os.path.abspath(script), "--worker", spec],
                         capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"{spec} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def add_model_options(parser, *, kind, d, layers, vocab):
    """The options of a random model's shape: --kind, --d, --layers, --vocab
    (with these defaults), as write_random_model takes them."""
    parser.add_argument("--kind", default=kind, choices=["mamba", "mamba2", "mamba3"])
    parser.add_argument("--d", type=int, default=d)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--vocab", type=int, default=vocab)


def write_random_model(folder, kind, d, layers, vocab, emb_scale):
    """Save a MambaLM checkpoint of random weights into folder; return the
    folder. Layer i: mojolearn.init_weights seeded i; embeddings standard
    normal (seed 0) times emb_scale; final norm ones; tied head."""
    import numpy as np
    import mojolearn
    from mojolearn.save import save_checkpoint
    block = {"mamba": "mamba1"}.get(kind, kind)
    ws = [mojolearn.init_weights(block, d, seed=i, n_layers=layers) for i in range(layers)]
    emb = (np.random.default_rng(0).standard_normal((vocab, d)) * emb_scale).astype(np.float32)
    return save_checkpoint(folder, kind, ws, emb, np.ones(d, np.float32))
