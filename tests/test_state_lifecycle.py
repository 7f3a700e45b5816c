"""State lifecycle, for every block class: sessions hold a state exclusively
and weakly, close() writes back all or nothing, buffers of one call may not
share memory, and states copy and pickle bit for bit."""
import gc
import pickle

import numpy as np
import pytest

import mojolearn
from tests.bits import assert_same_bits, assert_bits_differ
from tests.errors import raises_naming
from mojolearn.reference.weights import (mamba1_weights, mamba2_weights, mamba3_weights,
                                         random_input)

MAKERS = {1: mamba1_weights, 2: mamba2_weights, 3: mamba3_weights}
CLASSES = [(k, suffix) for k in (1, 2, 3) for suffix in ("Block", "BlockInference")]
D, B = 32, 2


@pytest.fixture(params=CLASSES, ids=lambda p: f"Mamba{p[0]}{p[1]}")
def block(request):
    kind, suffix = request.param
    return getattr(mojolearn, f"Mamba{kind}{suffix}")(MAKERS[kind](D, seed=kind))


def _x(l=6, seed=2):
    return random_input(B, l, D, seed=seed)


def _state_bytes(state):
    return {n: np.asarray(getattr(state, n)).tobytes() for n in state._ARRAYS}


def _decode(block, state, x, t0, t1):
    return np.concatenate([np.asarray(block.step(np.ascontiguousarray(x[:, t]), state))
                           for t in range(t0, t1)], 1)


def test_second_session_on_a_held_state_is_refused(block):
    state = block.allocate_state(B)
    with block.decode_session(state) as s:
        with raises_naming(ValueError, "state", "held"):
            block.decode_session(state)
        assert s.is_open
    with block.decode_session(state):  # free again after close
        pass


def test_dropped_session_writes_back_and_frees_the_state(block):
    x = _x()
    ref_state = block.allocate_state(B)
    ref = _decode(block, ref_state, x, 0, 6)
    state = block.allocate_state(B)
    s = block.decode_session(state)
    for t in range(3):
        s.step(np.ascontiguousarray(x[:, t]))
    del s
    gc.collect()
    # the state is free and holds the three tokens: the rest continues exactly
    assert_same_bits(_decode(block, state, x, 3, 6), ref[:, 3:], "after a dropped session")
    # control: without the write-back the continuation would differ
    fresh = block.allocate_state(B)
    assert_bits_differ(_decode(block, fresh, x, 3, 6), ref[:, 3:], "from a fresh state")


def test_failed_close_writes_nothing_and_stays_open(block):
    x = _x()
    state = block.allocate_state(B)
    s = block.decode_session(state)
    s.step(np.ascontiguousarray(x[:, 0]))
    before = _state_bytes(state)
    good_h = state.h
    state.h = mojolearn.Array((1, 2, 3))
    with raises_naming(ValueError, "state.h"):
        s.close()
    assert s.is_open
    after = _state_bytes(state)
    assert all(after[n] == before[n] for n in before if n != "h")
    state.h = good_h  # fixed: close goes through and the state has the token
    s.close()
    assert not s.is_open
    assert _state_bytes(state) != before


@pytest.mark.parametrize("call", ["forward", "step"])
def test_x_sharing_memory_with_the_state_is_refused(block, call):
    state = block.allocate_state(B)
    block.forward(_x(3), state)
    before = _state_bytes(state)
    h = np.asarray(state.h).reshape(-1)
    x = h[: B * 3 * D].reshape(B, 3, D) if call == "forward" else h[: B * D].reshape(B, D)
    with raises_naming(ValueError, "x", "state.h", "share memory"):
        getattr(block, call)(x, state)
    assert _state_bytes(state) == before
    # control: the same values in their own buffer are accepted
    getattr(block, call)(x.copy(), state)


def test_state_arrays_sharing_memory_are_refused(block):
    state = block.allocate_state(B)
    other = [n for n in state._ARRAYS if n != "h"][0]
    setattr(state, other, np.asarray(state.h).reshape(-1)[: np.asarray(getattr(state, other)).size]
            .reshape(np.asarray(getattr(state, other)).shape))
    with raises_naming(ValueError, "share memory", f"state.{other}", "state.h"):
        block.step(_x(1)[:, 0], state)


@pytest.mark.parametrize("how", ["copy", "pickle", "numpy buffers"])
def test_state_copies_continue_bit_for_bit(block, how):
    x = _x(9)
    state = block.allocate_state(B)
    block.forward(x[:, :5], state)
    if how == "copy":
        twin = state.copy()
    elif how == "pickle":
        twin = pickle.loads(pickle.dumps(state))
    else:  # a copy of a state whose arrays are NumPy arrays
        numpy_state = type(state)(*[np.array(getattr(state, n)) for n in state._ARRAYS],
                                  **{n: getattr(state, n) for n in state._VALUES})
        twin = numpy_state.copy()
    assert type(twin) is type(state)
    assert _state_bytes(twin) == _state_bytes(state)
    assert all(isinstance(getattr(twin, n), mojolearn.Array) for n in twin._ARRAYS)
    assert all(getattr(twin, n) is not getattr(state, n) for n in twin._ARRAYS)
    a = _decode(block, state, x, 5, 9)
    b = _decode(block, twin, x, 5, 9)
    assert_same_bits(b, a, how)
    # independent buffers: the twin advanced on its own (the original did too)
    assert _state_bytes(twin) == _state_bytes(state)
    # control: a copy taken after one more token differs
    c = state.copy()
    block.step(np.ascontiguousarray(x[:, 0]), c)
    assert _state_bytes(c) != _state_bytes(state)


def test_held_state_cannot_be_copied_or_pickled(block):
    state = block.allocate_state(B)
    with block.decode_session(state):
        with raises_naming(ValueError, "state", "held"):
            state.copy()
        with raises_naming(ValueError, "state", "held"):
            pickle.dumps(state)
    state.copy()


def test_array_pickles_and_copies_bit_for_bit():
    import copy
    a = mojolearn.Array((3, 4))
    np.asarray(a)[:] = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.asarray(a)[0, 0] = -0.0
    for b in (pickle.loads(pickle.dumps(a)), copy.copy(a), copy.deepcopy(a)):
        assert b.shape == a.shape and b.dtype == a.dtype and b.address != a.address
        assert np.asarray(b).tobytes() == np.asarray(a).tobytes()
    for shape, dtype in (((0, 4), "int8"), ((), "float64"), ((5,), "uint16")):
        e = mojolearn.Array(shape, dtype)
        f = pickle.loads(pickle.dumps(e))
        assert f.shape == e.shape and f.dtype == dtype
