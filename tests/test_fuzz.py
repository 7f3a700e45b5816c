"""Fuzz the public surface (Hypothesis): random dtypes, shapes (zero, wrong,
huge), strides, aliasing, lengths, thread counts, state shapes and session
lifecycles, for all three blocks.

Invariants, for every call:
- it raises TypeError, ValueError, OverflowError or MemoryError with a
  message, and then no byte of any caller buffer or state has changed; or
- it returns exactly what the plain call gives: x as a fresh C-contiguous
  float32 array and a fresh copy of the state (output bytes and every
  state byte after the call).
Calls that could kill the interpreter (thread variables, thread counts,
overflowing sizes) run in a child process, which must exit normally.

Default budget: MOJOLEARN_FUZZ_EXAMPLES examples per test (default 25);
set it higher for a long run, e.g. MOJOLEARN_FUZZ_EXAMPLES=2000.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import mojolearn
from mojolearn.reference.weights import (mamba1_weights, mamba2_weights, mamba3_weights,
                                         random_input)

EXAMPLES = int(os.environ.get("MOJOLEARN_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
D = 32
ALLOWED = (TypeError, ValueError, OverflowError, MemoryError)
_BLOCKS = {}


def block_of(kind):
    if kind not in _BLOCKS:
        make = {1: mamba1_weights, 2: mamba2_weights, 3: mamba3_weights}[kind]
        cls = {1: mojolearn.Mamba1Block, 2: mojolearn.Mamba2Block, 3: mojolearn.Mamba3Block}[kind]
        _BLOCKS[kind] = cls(make(D, seed=kind))
    return _BLOCKS[kind]


def snapshot(*objs):
    """Bytes of every buffer reachable from objs (arrays and state arrays)."""
    out = []
    for o in objs:
        if o is None:
            continue
        if hasattr(o, "_ARRAYS"):
            out += [np.asarray(getattr(o, n)).tobytes() for n in o._ARRAYS]
            out += [repr(getattr(o, n)) for n in o._VALUES]
        else:
            try:
                out.append(bytes(memoryview(o).cast("B")) if memoryview(o).nbytes else b"")
            except TypeError:
                out.append(repr(o))
    return out


def plain_copy_of_state(state):
    return type(state)(*[np.array(getattr(state, n), dtype=np.float32, copy=True)
                         for n in state._ARRAYS],
                       **{n: getattr(state, n) for n in state._VALUES})


@st.composite
def an_x(draw, b, l):
    """x of nominal shape (b, l, D): usually fine, sometimes not."""
    kind = draw(st.sampled_from(["plain", "plain", "plain", "strided", "transposed",
                                 "dtype", "shape", "zero", "nonfinite", "list", "fortran"]))
    x = random_input(b, l, D, seed=draw(st.integers(0, 3)))
    if kind == "strided":
        big = np.zeros((b, l, 2 * D), np.float32)
        big[:, :, ::2] = x
        return big[:, :, ::2]
    if kind == "transposed":
        return np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2)
    if kind == "fortran":
        return np.asfortranarray(x)
    if kind == "dtype":
        return x.astype(draw(st.sampled_from([np.float64, np.float16, np.int32, np.uint16])))
    if kind == "shape":
        return np.zeros(draw(st.sampled_from([(b, l, D + 1), (b, l), (b, l, D, 1), (b, 0, D),
                                              (0, l, D), (b + 1, l, D)])), np.float32)
    if kind == "zero":
        return np.zeros((b, l, D), np.float32)
    if kind == "nonfinite":
        x[draw(st.integers(0, b - 1)), draw(st.integers(0, l - 1)), 0] = \
            draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        return x
    return x.tolist() if kind == "list" else x


@st.composite
def lengths_for(draw, b, l):
    kind = draw(st.sampled_from(["none", "none", "good", "bad"]))
    if kind == "none":
        return None
    if kind == "good":
        return [draw(st.integers(1, l)) for _ in range(b)]
    return draw(st.sampled_from([[0] * b, [l + 1] * b, [1] * (b + 1), [1.5] * b, [True] * b,
                                 "abc", 3, [-1] * b, [2**63] * b]))


def names_one_of(msg, names):
    """The message names at least one of the call's arguments as a word."""
    import re
    from tests.errors import name_pattern
    assert any(re.search(name_pattern(n), msg) for n in names), \
        f"{msg!r} names none of {names}"


ARG_NAMES = ["x", "lengths", "state", "batch_size", "number of threads"] + [
    f"state.{n}" for n in ("h", "conv_window", "buffer_xbc", "buffer_dtraw", "theta",
                           "buffer_qrot", "buffer_krot", "buffer_v", "buffer_dt",
                           "buffer_sig", "buffer_adt", "pending_k", "pending_v")] + [
    f"lengths[{i}]" for i in range(4)]


def check_call(fn, plain, inputs, states):
    """fn() either raises an allowed error leaving every buffer unchanged,
    or gives the bytes of plain(), which is prepared (its copies taken)
    before fn runs and returns a thunk running the plain call."""
    before = snapshot(*inputs, *states)
    try:
        plain = plain()
    except ALLOWED:  # (the copies themselves may be refused: fn must be too)
        plain = None
    try:
        got = fn()
    except ALLOWED as e:
        names_one_of(str(e), ARG_NAMES)
        assert snapshot(*inputs, *states) == before, f"a failed call changed a buffer: {e!r}"
        return None
    assert plain is not None, "accepted a call whose plain form was refused"
    want, want_states = plain()
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    for s, w in zip(states, want_states):
        assert snapshot(s) == snapshot(w)
    return got


@FUZZ
@given(data=st.data(), kind=st.sampled_from([1, 2, 3]), b=st.integers(1, 3),
       l=st.integers(1, 5), threads=st.integers(1, 3))
def test_forward_any_input(data, kind, b, l, threads):
    block = block_of(kind)
    mojolearn.set_num_threads(threads)
    x = data.draw(an_x(b, l))
    with_state = data.draw(st.booleans())
    lengths = data.draw(lengths_for(b, l))
    state = block.allocate_state(b) if with_state else None
    if state is not None and data.draw(st.booleans()):
        block.forward(random_input(b, 2, D, seed=9), state)  # a used state
    if state is not None and data.draw(st.booleans()):  # x aliasing the state
        h = np.asarray(state.h).reshape(-1)
        if h.size >= b * l * D:
            x = h[: b * l * D].reshape(b, l, D)

    def plain():
        s2 = plain_copy_of_state(state) if state is not None else None
        xc = np.array(x, dtype=np.float32, copy=True)
        return lambda: (block.forward(xc, s2, lengths=lengths), [s2] if s2 is not None else [])

    check_call(lambda: block.forward(x, state, lengths=lengths), plain,
               [x], [state] if state is not None else [])


@FUZZ
@given(data=st.data(), kind=st.sampled_from([1, 2, 3]), b=st.integers(1, 3))
def test_step_any_input_and_state(data, kind, b):
    block = block_of(kind)
    x = data.draw(an_x(b, 1))
    if isinstance(x, np.ndarray) and x.ndim == 3 and x.shape[1] == 1 and data.draw(st.booleans()):
        x = x[:, 0]
    sb = data.draw(st.sampled_from([b, b, b, b + 1]))
    state = block.allocate_state(sb)
    block.forward(random_input(sb, 3, D, seed=4), state)
    if data.draw(st.booleans()):  # one state array replaced by a wrong one
        name = data.draw(st.sampled_from(state._ARRAYS))
        shape = np.asarray(getattr(state, name)).shape
        setattr(state, name, data.draw(st.sampled_from([
            np.zeros(shape, np.float64), np.zeros(shape[:-1], np.float32),
            np.zeros(shape, np.float32)[..., ::1], np.zeros(shape, np.float32).T,
            np.full(shape, np.nan, np.float32)])))

    def plain():
        s2 = plain_copy_of_state(state)
        xc = np.array(x, dtype=np.float32, copy=True)
        return lambda: (block.step(xc, s2), [s2])

    check_call(lambda: block.step(x, state), plain, [x], [state])


@FUZZ
@given(kind=st.sampled_from([1, 2, 3]), ops=st.lists(
    st.sampled_from(["open", "step", "close", "drop", "block_step", "copy", "sync"]),
    min_size=1, max_size=12))
def test_session_lifecycles(kind, ops):
    """Any order of session operations: the tokens decoded by whichever
    path reaches the state are never lost, a held state is never used
    behind the session's back, and the state ends as token-by-token steps
    of the same tokens leave it."""
    import gc
    block = block_of(kind)
    b = 2
    xs = random_input(b, len(ops), D, seed=11)
    state, ref = block.allocate_state(b), block.allocate_state(b)
    session, t = None, 0
    for op in ops:
        x_t = np.ascontiguousarray(xs[:, t])
        if op == "open":
            try:
                session = block.decode_session(state)
            except ValueError as e:
                assert session is not None and session.is_open and "held" in str(e)
        elif op == "step" and session is not None and session.is_open:
            session.step(x_t)
            block.step(x_t, ref)
            t += 1
        elif op == "block_step":
            try:
                block.step(x_t, state)
            except ValueError as e:
                assert session is not None and session.is_open and "held" in str(e)
            else:
                block.step(x_t, ref)
                t += 1
        elif op == "copy":
            try:
                state.copy()
            except ValueError as e:
                assert session is not None and session.is_open and "held" in str(e)
        elif op == "sync" and session is not None and session.is_open:
            session.sync_state()
        elif op == "close" and session is not None:
            session.close()
        elif op == "drop":
            session = None
            gc.collect()
    if session is not None:
        session.close()
    assert snapshot(state) == snapshot(ref)


CRASHY = r"""
import os, random, sys
import mojolearn
from mojolearn.reference.weights import mamba1_weights, random_input
rng = random.Random(int(sys.argv[1]))
try:
    blk = mojolearn.Mamba1Block(mamba1_weights(16, 0))
except ValueError as e:  # a bad MOJOLEARN_NUM_THREADS, refused by name
    assert "MOJOLEARN_NUM_THREADS" in str(e), e
    mojolearn.set_num_threads(2)  # an explicit count overrides the variable
    blk = mojolearn.Mamba1Block(mamba1_weights(16, 0))
for _ in range(int(sys.argv[2])):
    what = rng.choice(["threads", "array", "state", "view"])
    try:
        if what == "threads":
            mojolearn.set_num_threads(rng.choice([0, -1, 1, 2, 3, 1024, 1025, 10**6, 2**31, 2**64]))
            blk.forward(random_input(1, 3, 16, 1))
        elif what == "array":
            # (sizes a machine could really allocate are left out: zeroing
            # gigabytes is slow, not a crash)
            mojolearn.Array(tuple(rng.choice([0, 1, 2**40, 2**62, 2**63 - 1])
                                  for _ in range(rng.randint(1, 3))))
        elif what == "state":
            blk.allocate_state(rng.choice([1, 2**40, 2**57, 2**63 - 1]))
        else:
            a = mojolearn.Array((rng.randint(0, 3), rng.randint(0, 3)))
            memoryview(a).tolist()
    except (ValueError, TypeError, OverflowError, MemoryError):
        pass
print("alive")
"""


@pytest.mark.parametrize("env", [{}, {"MOJOLEARN_NUM_THREADS": "abc"},
                                 {"MOJOLEARN_NUM_THREADS": "0"},
                                 {"MOJOLEARN_NUM_THREADS": "99999999"},
                                 {"MOJOLEARN_NUM_THREADS": "3"}])
def test_crash_prone_calls_never_kill_the_interpreter(env):
    e = dict(os.environ, **env)
    r = subprocess.run([sys.executable, "-c", CRASHY, "7", str(max(EXAMPLES, 10))],
                       capture_output=True, text=True, timeout=300, env=e)
    assert r.returncode == 0 and r.stdout.strip() == "alive", r.stderr[-2000:]


@pytest.fixture(autouse=True)
def _restore_threads():
    before = mojolearn.get_num_threads()
    yield
    mojolearn.set_num_threads(before)
