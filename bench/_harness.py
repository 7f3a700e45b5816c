"""Timing helpers shared by the benchmark scripts.

PyTorch's OpenMP workers keep spinning for a while after a parallel region
(measured: our 2-thread decode step is 1.3-1.7x slower right after a
transformers call, normal after 0.5 s), and after such a pause the cores
have clocked down. So before each timed side a script waits SETTLE_S, then
keeps the cores busy for a moment (busy_warm) before timing.
"""
import time

SETTLE_S = 0.5


def busy_warm(fn, seconds=0.25):
    """Call fn for `seconds` so the cores are back at full clock."""
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        fn()
