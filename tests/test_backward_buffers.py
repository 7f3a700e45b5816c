"""The memory a backward hands its kernel: what fresh, uninitialised memory
holds never reaches a gradient.

No public call hands the backward op caller-owned gradient buffers: every
call (``Block.backward``, and the torch bridge through it) allocates its
gradient arrays afresh. The arrays the kernel writes in full (the runner
spec's ``written_grads``: Mamba-2's and Mamba-3's projection weight
gradients, dx, the start state's gradients) are allocated without zeroing;
the others are zeroed and accumulated into. A kernel that accumulated into
a "written" array (say, dW added to what the buffer holds in the first chunk
pass B runs, instead of written from +0.0) would still pass every other
test, since fresh memory usually is zero. Here every unzeroed allocation is
filled with NaN bytes first, and each gradient must keep the bytes of the
ordinary call. Control: dirtying the zeroed arrays as well changes the
accumulated gradients' bytes (the fill reaches the gradient buffers)."""
import numpy as np
import pytest

import mojolearn
from mojolearn import _array
from mojolearn.mamba import _base
from mojolearn.reference.weights import (mamba1_weights, mamba2_weights, mamba3_weights,
                                         random_input)
from tests.bits import assert_bits_differ, assert_same_bits

D = 32
# (block, weights, B, L): every case crosses at least two of its chunks.
# Mamba-3's first case keeps all its rows and runs the weight gradients once
# at the end; its second is past the 32 MiB budget of docs/backward.md
# (B L = 16384 rows of 547 floats at d_model 32), so they run chunk by chunk,
# from +0.0 in the first chunk pass B runs.
CASES = {
    "mamba1": (mojolearn.Mamba1Block, mamba1_weights, 2, 150),
    "mamba2": (mojolearn.Mamba2Block, mamba2_weights, 2, 300),
    "mamba3": (mojolearn.Mamba3Block, mamba3_weights, 2, 150),
    "mamba3-per-chunk": (mojolearn.Mamba3Block, mamba3_weights, 8, 2048),
}
FILL = 0xFF  # every float32 a NaN: any use of the old contents shows


def dirty_arrays(zeroed_too=False):
    """An Array class whose unzeroed allocations (and with zeroed_too, the
    zeroed ones) come filled with FILL bytes."""
    class Dirty(_array.Array):
        def __init__(self, shape, dtype="float32", *, zero=True, _base=None):
            super().__init__(shape, dtype, zero=zero, _base=_base)
            if _base is None and self.nbytes and (zeroed_too or not zero):
                np.asarray(memoryview(self).cast("B")).fill(FILL)
    return Dirty


def _grads(cls, w, x, g, state=None, grad_state=None):
    """{name: bytes} of a fresh block's backward (its transposed panels and
    float32 weights are made in this call's memory)."""
    blk = cls(w)
    got = blk.backward(x, g, state, grad_state=grad_state)
    return {k: np.asarray(v).copy() for k, v in got.items()}


def _dirty_run(monkeypatch, run, zeroed_too=False):
    with monkeypatch.context() as m:
        m.setattr(_array, "Array", dirty_arrays(zeroed_too))
        m.setattr(_base._THREAD_WORK, "array", None)  # a fresh (dirty) workspace too
        return run()


def _assert_same(got, want, what):
    assert set(got) == set(want), what
    for name in want:
        assert_same_bits(got[name], want[name], f"{what}: {name}")


@pytest.mark.parametrize("case", list(CASES))
def test_unzeroed_gradient_memory_never_reaches_a_gradient(case, monkeypatch):
    cls, make, b, l = CASES[case]
    w = make(D, seed=7)
    x, g = random_input(b, l, D, seed=8), random_input(b, l, D, seed=9)
    want = _grads(cls, w, x, g)
    _assert_same(_dirty_run(monkeypatch, lambda: _grads(cls, w, x, g)), want, case)
    # control: the zeroed (accumulated) gradients dirtied as well
    other = _dirty_run(monkeypatch, lambda: _grads(cls, w, x, g), zeroed_too=True)
    accumulated = [n for n in w if n not in cls._runner.spec.written_grads]
    assert accumulated, case
    for name in accumulated:
        assert_bits_differ(other[name], want[name], f"{case}: {name} from dirty memory")


@pytest.mark.parametrize("case", ["mamba1", "mamba2", "mamba3"])
def test_unzeroed_memory_of_a_backward_through_a_state(case, monkeypatch):
    """The same from a used state with final-state cotangents (the start
    state's gradients are written in full too)."""
    cls, make, b, l = CASES[case]
    w = make(D, seed=7)
    x0, x, g = (random_input(b, n, D, seed=s) for s, n in ((10, 37), (11, l), (12, l)))
    blk = cls(w)
    state = blk.allocate_state(b)
    blk.forward(x0, state)
    cot = blk.allocate_state(b)
    blk.forward(random_input(b, 45, D, seed=13), cot)
    want = _grads(cls, w, x, g, state, cot)
    assert any(k.startswith("state.") for k in want)
    got = _dirty_run(monkeypatch, lambda: _grads(cls, w, x, g, state, cot))
    _assert_same(got, want, f"{case} from a state")
