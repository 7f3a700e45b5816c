"""Contract: state buffers (docs/guide/errors.rst), for every block class and
every array of its state (``state._ARRAYS``): a state of another class, a
batch mismatch, read-only, non-contiguous, a wrong shape, not a buffer, a
wrong dtype, non-finite values; and "a failed call changes no byte".

forward, step and decode_session refuse the same state the same way; the
state (every array, including the ones that were not at fault) and x keep
their bytes.
"""
import numpy as np
import pytest

import mojolearn
from mojolearn.reference import weights as reference_weights
from tests.contract.cases import (B, BAD_DTYPES, L, as_bytes, fails, filled_state, numpy_state,
                                  snapshot, state_with, steps, with_value)


def _calls(block, x, st, session=True):
    """The three calls that take a state."""
    out = [(block.forward, (x, st)), (block.step, (np.ascontiguousarray(x[:, 0]), st)),
           (block.step, (x[:, :1], st))]
    return out + [(block.decode_session, (st,))] if session else out


# ------------------------------------------------------- class and batch
def test_state_of_another_class(case, block, x):
    other = 1 + case.kind % 3
    alien = getattr(mojolearn, f"Mamba{other}Block")(
        getattr(reference_weights, f"mamba{other}_weights")(32, seed=0)).allocate_state(B)
    arrays = {n: np.zeros(1, np.float32) for n in case.arrays}
    for bad in (arrays, tuple(arrays.values()), object(), alien):
        for call, args in _calls(block, x, bad):
            fails(TypeError, call, *args, keep=[x],
                  match=["state", case.state_name, type(bad).__name__])


@pytest.mark.parametrize("rows", [1, 3])
def test_batch_mismatch_with_x(case, block, rows):
    x = case.x(seed=2)
    for st in (filled_state(block, rows), numpy_state(filled_state(block, rows))):
        match = ["batch mismatch", "x", f"B={B}", case.batch_words(case.arrays[0], rows)]
        for call, args in _calls(block, x, st, session=False):
            fails(ValueError, call, *args, keep=[st, x], match=match)


def test_batch_mismatch_between_state_arrays(case, block, x):
    good = numpy_state(filled_state(block))
    other = numpy_state(filled_state(block, B + 1))
    for which in case.arrays:
        st = state_with(good, **{which: getattr(other, which)})
        for call, args in _calls(block, x, st, session=False):
            fails(ValueError, call, *args, keep=[good, other, x],
                  match=["batch mismatch", case.batch_words(which, B + 1)])


# ------------------------------------------------------- buffer properties
@pytest.mark.parametrize("kind", ["numpy-readonly", "bytes-memoryview"])
def test_read_only_state(case, block, x, kind):
    good = numpy_state(filled_state(block))
    for which in case.arrays:
        arr = np.array(getattr(good, which))
        if kind == "numpy-readonly":
            arr.flags.writeable = False
            bad = arr
        else:
            bad = memoryview(arr.tobytes()).cast("f", arr.shape)
        st = state_with(good, **{which: bad})
        for call, args in _calls(block, x, st):
            fails(ValueError, call, *args, keep=[st, good, x],
                  match=[f"state.{which}", "read-only"])


def test_non_contiguous_state(case, block, x):
    good = numpy_state(filled_state(block))
    for which in case.arrays:
        arr = getattr(good, which)
        wide = np.zeros(arr.shape[:-1] + (2 * arr.shape[-1],), np.float32)
        wide[..., ::2] = arr
        fortran = np.asfortranarray(arr)
        assert not fortran.flags.c_contiguous, which
        for bad, keep in ((wide[..., ::2], wide), (fortran, fortran)):
            st = state_with(good, **{which: bad})
            for call, args in _calls(block, x, st):
                fails(ValueError, call, *args, keep=[keep, good, x],
                      match=[f"state.{which}", "C-contiguous"])


def _wrong_shapes(shape):
    s = list(shape)
    return [tuple(s[:-1] + [s[-1] + 1]), tuple(s[:-1] + [s[-1] - 1]),
            tuple(s[:1] + [s[1] + 1] + s[2:]), tuple(s[:-2] + [s[-2] * s[-1]]),
            (int(np.prod(s)),)]


def test_wrong_state_shape(case, block, x):
    good = numpy_state(filled_state(block))
    for which in case.arrays:
        for shape in _wrong_shapes(getattr(good, which).shape):
            st = state_with(good, **{which: np.zeros(shape, np.float32)})
            for call, args in _calls(block, x, st, session=False):
                fails(ValueError, call, *args, keep=[st, good, x],
                      match=[f"state.{which}", str(shape)])


@pytest.mark.parametrize("bad", [[0.0] * 10, None, "text"], ids=["list", "None", "str"])
def test_state_array_not_a_buffer(case, block, x, bad):
    good = numpy_state(filled_state(block))
    for which in case.arrays:
        st = state_with(good, **{which: bad})
        for call, args in _calls(block, x, st):
            fails(TypeError, call, *args, keep=[good, x],
                  match=[f"state.{which}", type(bad).__name__])


@pytest.mark.parametrize("make,words", BAD_DTYPES)
def test_state_bad_dtype(case, block, x, make, words):
    good = numpy_state(filled_state(block))
    for which in case.arrays:
        bad = make(getattr(good, which).shape)
        st = state_with(good, **{which: bad})
        for call, args in _calls(block, x, st):
            fails(TypeError, call, *args, keep=[good, bad, x],
                  match=[f"state.{which}"] + words)


# -------------------------------------------------------------- non-finite
@pytest.mark.parametrize("value", [np.nan, -np.inf])
@pytest.mark.parametrize("kind", ["Array", "numpy"])
def test_nonfinite_state_named_with_its_index(case, block, x, value, kind):
    """Every array a call reads, at its first, a middle and its last read
    position (buffers: the valid rows only)."""
    for which in case.read_arrays:
        st = filled_state(block, tokens=3)
        if kind == "numpy":
            st = numpy_state(st)
        arr = np.asarray(getattr(st, which))  # zero-copy for mojolearn.Array
        for pos in case.read_positions(which, arr.shape, 3):
            old = arr[pos]
            arr[pos] = value
            match = [f"state.{which}", f"flat index {np.ravel_multi_index(pos, arr.shape)}"]
            for call, args in _calls(block, x, st):
                fails(ValueError, call, *args, keep=[st, x], match=match)
            arr[pos] = old
        # the refused decode_session did not leave the state held
        block.forward(x, st)


# ------------------------------------------------- a failed call changes no byte
def _refusals(case, block, st, x):
    """One refused call of each kind on state st, or on a state that shares
    all but one of st's arrays (the one at fault)."""
    d = case.d
    h = np.asarray(st.h).reshape(-1)
    calls = [
        lambda: block.forward(x.astype(np.float64), st),
        lambda: block.forward(with_value(x, 7), st),
        lambda: block.forward(np.zeros((B, L, d + 1), np.float32), st),
        lambda: block.forward(x[:1].copy(), st),
        *([] if case.kind == 1 else [lambda: block.forward(x, st, lengths=[L, L])]),
        lambda: block.step(x[:, :2].copy(), st),
        lambda: block.step(with_value(x[:, 0], 3), st),
        lambda: block.step(x[:1, 0].copy(), st),
        lambda: block.step(h[:B * d].reshape(B, d), st),  # x shares memory with state.h
        lambda: block.forward(x, {"h": None}),
    ]
    for which in case.arrays:
        a = np.array(getattr(st, which))
        ro = a.copy()
        ro.flags.writeable = False
        bad = [ro, np.asfortranarray(a), a.astype(np.float64),
               np.zeros(a.shape[:-1] + (a.shape[-1] + 1,), np.float32)]
        if which in case.read_arrays:
            bad.append(with_value(a, 0))
        for o in (state_with(st, **{which: v}) for v in bad):
            calls += [lambda o=o: block.forward(x, o), lambda o=o: block.step(x[:, :1], o),
                      lambda o=o: block.decode_session(o)]
    return calls


def test_a_refused_call_changes_no_byte(case):
    """After a good call: every kind of refused call, then the state (every
    array and value), x, the block's reports and what the next calls give
    are those of a block that never saw the refused calls."""
    block, ref = case.block(), case.block()
    x = case.x(l=7, seed=3)
    st, st_ref = block.allocate_state(B), ref.allocate_state(B)
    assert as_bytes(block.forward(x, st)) == as_bytes(ref.forward(x, st_ref))
    reports = case.reports_of(block)
    before = snapshot(st, x)
    n = 0
    for call in _refusals(case, block, st, x):
        with pytest.raises((TypeError, ValueError)):
            call()
        n += 1
        assert snapshot(st, x) == before, f"refusal {n} changed a byte"
    assert n >= 10 + 3 * 4 * len(case.arrays)
    for name, a, b in zip(case.reports, case.reports_of(block), reports):
        assert a.tobytes() == b.tobytes(), name
    # the state continues as if nothing happened (forward, steps, a session)
    assert as_bytes(block.forward(x, st)) == as_bytes(ref.forward(x, st_ref))
    assert steps(block, x, st, 0, 3).tobytes() == steps(ref, x, st_ref, 0, 3).tobytes()
    with block.decode_session(st) as s, ref.decode_session(st_ref) as r:
        assert as_bytes(s.step(x[:, 3].copy())) == as_bytes(r.step(x[:, 3].copy()))
    assert snapshot(st) == snapshot(st_ref)
    # control: a call that is not refused does change the state
    block.step(x[:, 4].copy(), st)
    assert snapshot(st) != snapshot(st_ref)
