"""Limits of the host layer that a caller can reach: thread counts, the
thread-count variable, and sizes whose byte count would wrap around. Each
is refused by name; none may crash the interpreter (run in a subprocess
where a crash is the failure being guarded)."""
import os
import subprocess
import sys

import pytest

import mojolearn
from tests.errors import raises_naming


def _child(code, **env):
    e = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=e)


@pytest.mark.parametrize("n", [0, -1, 1025, 10**6, 2**31, 2**63, 2**70])
def test_thread_counts_out_of_range_are_refused(n, threads):
    before = mojolearn.get_num_threads()
    with raises_naming(ValueError, "threads"):
        threads(n)
    assert mojolearn.get_num_threads() == before


def test_largest_thread_count_runs_and_gives_the_same_bits():
    # 1024 threads on a small machine: slow to start, never a crash
    r = _child("import numpy as np, mojolearn\n"
               "from mojolearn.reference.weights import mamba1_weights, random_input\n"
               "b = mojolearn.Mamba1Block(mamba1_weights(16, 0)); x = random_input(2, 9, 16, 1)\n"
               "mojolearn.set_num_threads(1); a = np.asarray(b.forward(x)).tobytes()\n"
               "mojolearn.set_num_threads(1024); c = np.asarray(b.forward(x)).tobytes()\n"
               "print('same' if a == c else 'differ')")
    assert r.returncode == 0 and r.stdout.strip() == "same", r.stderr


@pytest.mark.parametrize("value", ["abc", "0", "-3", "2abc", "1e3", "1025", "99999999999", "3.5"])
def test_bad_thread_variable_is_refused_by_name(value):
    r = _child("import mojolearn\nfrom mojolearn.reference.weights import mamba1_weights\n"
               "try:\n    mojolearn.Mamba1Block(mamba1_weights(16, 0)).forward"
               "(__import__('numpy').zeros((1, 2, 16), 'float32'))\n"
               "except ValueError as e:\n    print('refused:', e)\n",
               MOJOLEARN_NUM_THREADS=value)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("refused:") and "MOJOLEARN_NUM_THREADS" in r.stdout
    assert repr(value) in r.stdout


@pytest.mark.parametrize("value,n", [("3", 3), (" 2 ", 2), ("", None)])
def test_good_thread_variable_is_used(value, n):
    r = _child("import mojolearn; print(mojolearn.get_num_threads())", MOJOLEARN_NUM_THREADS=value)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == (n if n is not None else (os.cpu_count() or 1))


@pytest.mark.parametrize("shape", [(2**31, 2**31), (2**62,), (2**40, 2**40, 2**40), (2**61, 1)])
def test_shapes_whose_bytes_overflow_are_refused(shape):
    with pytest.raises(OverflowError, match=r"\bbytes\b|\bitems\b"):
        mojolearn.Array(shape)


def test_huge_but_countable_array_is_a_memory_error_in_a_child():
    # 2**50 bytes: countable, never allocatable here; must not crash
    r = _child("import mojolearn\ntry:\n    mojolearn.Array((2**48,))\n"
               "except MemoryError:\n    print('MemoryError')\n")
    assert r.returncode == 0 and r.stdout.strip() == "MemoryError", r.stderr


@pytest.mark.parametrize("cls", ["Mamba1Block", "Mamba2Block", "Mamba3Block"])
def test_state_for_an_overflowing_batch_is_refused(cls):
    from mojolearn.reference.weights import mamba1_weights, mamba2_weights, mamba3_weights
    make = {"Mamba1Block": mamba1_weights, "Mamba2Block": mamba2_weights,
            "Mamba3Block": mamba3_weights}[cls]
    block = getattr(mojolearn, cls)(make(32, seed=0))
    with pytest.raises((OverflowError, MemoryError, ValueError)):
        block.allocate_state(2**57)


def test_arrays_states_and_sessions_leave_nothing_behind():
    import gc
    from mojolearn import _loader
    from mojolearn.reference.weights import mamba2_weights, random_input
    block = mojolearn.Mamba2Block(mamba2_weights(32, seed=0))
    x = random_input(2, 3, 32, seed=1)

    def churn():
        for _ in range(50):
            a = mojolearn.Array((7, 5))
            a.reshape(35).copy()
            state = block.allocate_state(2)
            block.forward(x, state)
            with block.decode_session(state.copy()) as s:
                s.step(x[:, 0])
            block.decode_session(state)  # dropped open
    churn()
    gc.collect()
    before = _loader.native()._live_storages()
    churn()
    gc.collect()
    assert _loader.native()._live_storages() == before
