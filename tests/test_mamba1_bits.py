"""Bit-equality properties of Mamba-1 in identical mode (docs/numerics.md,
"The contract of identical mode").

Each property is checked with exact byte equality and has a negative
control showing the same check fails on a one-ulp change.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mojolearn
from tests.bits import (
    assert_bits_differ, assert_only_rounding_differs, assert_same_bits, nudge, reordered_reduction,
)
from mojolearn.reference.weights import mamba1_weights, random_input

D = 24  # not a multiple of 16: exercises the vector tails too
W = mamba1_weights(D, seed=11)
BLOCK = None


def block():
    global BLOCK
    if BLOCK is None:
        BLOCK = mojolearn.Mamba1Block(W)
    return BLOCK


def state_arrays(state):
    return np.asarray(state.conv_window).copy(), np.asarray(state.h).copy()


def test_decode_equals_prefill():
    x = random_input(2, 40, D, seed=1)
    y = block().forward(x)
    state = block().allocate_state(2)
    steps = np.concatenate([np.asarray(block().step(x[:, t], state)) for t in range(40)], 1)
    assert_same_bits(steps, y, "token-by-token decode vs prefill")
    # the final state equals the state a prefill leaves
    s2 = block().allocate_state(2)
    block().forward(x, s2)
    assert_same_bits(np.asarray(state.h), np.asarray(s2.h), "state h")
    assert_same_bits(np.asarray(state.conv_window), np.asarray(s2.conv_window), "conv window")
    # negative control: one ulp in one input token changes later outputs
    s3 = block().allocate_state(2)
    xn = nudge(x, index=5)
    steps3 = np.concatenate([np.asarray(block().step(xn[:, t], s3)) for t in range(40)], 1)
    assert_bits_differ(steps3, y, "decode with a nudged token")


@settings(max_examples=25, deadline=None)
@given(splits=st.lists(st.integers(min_value=1, max_value=69), min_size=1, max_size=4,
                       unique=True))
def test_continuation_at_any_split_equals_one_call(splits):
    L = 70
    x = random_input(2, L, D, seed=2)
    y = np.asarray(block().forward(x))
    state = block().allocate_state(2)
    cuts = [0] + sorted(splits) + [L]
    parts = [np.asarray(block().forward(x[:, a:b], state)) for a, b in zip(cuts, cuts[1:]) if b > a]
    assert_same_bits(np.concatenate(parts, 1), y, f"split at {cuts[1:-1]}")


def test_continuation_negative_control():
    x = random_input(1, 30, D, seed=3)
    y = np.asarray(block().forward(x))
    state = block().allocate_state(1)
    a = np.asarray(block().forward(x[:, :13], state))
    # continuing from a slightly moved state must change the bits
    np.asarray(state.h).reshape(-1)[0] += np.float32(1e-3)
    b = np.asarray(block().forward(x[:, 13:], state))
    assert_bits_differ(np.concatenate([a, b], 1), y, "continuation from a nudged state")


def test_decode_session_equals_block_step():
    x = random_input(3, 20, D, seed=4)
    s1 = block().allocate_state(3)
    s2 = block().allocate_state(3)
    block().forward(x[:, :5], s1)
    block().forward(x[:, :5], s2)
    ys = [np.asarray(block().step(x[:, t], s1)) for t in range(5, 20)]
    with block().decode_session(s2) as sess:
        yd = [np.asarray(sess.step(x[:, t])) for t in range(5, 20)]
    assert_same_bits(np.concatenate(yd, 1), np.concatenate(ys, 1), "session vs step")
    assert_same_bits(np.asarray(s2.h), np.asarray(s1.h), "state after session close")
    # negative control: a session started from a nudged state differs
    s3 = block().allocate_state(3)
    block().forward(x[:, :5], s3)
    np.asarray(s3.h).reshape(-1)[3] += np.float32(1e-3)
    with block().decode_session(s3) as sess:
        y3 = [np.asarray(sess.step(x[:, t])) for t in range(5, 20)]
    assert_bits_differ(np.concatenate(y3, 1), np.concatenate(ys, 1), "session from nudged state")


def test_row_alone_equals_row_in_batch():
    x = random_input(5, 33, D, seed=5)
    y = np.asarray(block().forward(x))
    for i in range(5):
        alone = np.asarray(block().forward(x[i:i + 1]))
        assert_same_bits(alone[0], y[i], f"row {i} alone vs in batch")
    # a different batch around the same row: the row's bits do not move
    other = random_input(4, 33, D, seed=55)
    mixed = np.concatenate([other[:2], x[2:3], other[2:]], 0)
    assert_same_bits(np.asarray(block().forward(mixed))[2], y[2], "row 2 in another batch")
    # negative control: nudging the row's own input changes it
    assert_bits_differ(np.asarray(block().forward(nudge(x[2:3])))[0], y[2], "nudged row")


@pytest.mark.parametrize("shape", [(1, 1), (3, 50), (8, 300)])
def test_thread_count_does_not_change_bits(threads, shape):
    B, L = shape
    x = random_input(B, L, D, seed=6)
    threads(1)
    y1 = np.asarray(block().forward(x))
    s1 = block().allocate_state(B)
    d1 = np.asarray(block().step(x[:, 0], s1))
    outs = []
    for n in (2, 3, 4):
        threads(n)
        s = block().allocate_state(B)
        outs.append((n, np.asarray(block().forward(x)), np.asarray(block().step(x[:, 0], s))))
    for n, y, d in outs:
        assert_same_bits(y, y1, f"forward with {n} threads vs 1")
        assert_same_bits(d, d1, f"step with {n} threads vs 1")
    # negative control: the same function summed over d_model in another
    # order (what a thread-dependent reduction would do) changes the bits
    r = reordered_reduction(W, x, "mamba1")
    other = mojolearn.Mamba1Block(r.weights)
    assert_only_rounding_differs(r.output(other.forward(r.x)), y1, "reordered forward")
    s2 = other.allocate_state(B)
    assert_only_rounding_differs(r.output(other.step(r.x[:, 0], s2)), d1, "reordered step")


@pytest.mark.parametrize("garbage", [1e30, np.nan, -np.inf, 0.5])
def test_ragged_rows_equal_rows_alone_with_exact_zero_padding(garbage):
    B, L = 4, 37
    lengths = [37, 1, 20, 36]
    clean = random_input(B, L, D, seed=7)
    x = clean.copy()
    for i, n in enumerate(lengths):
        x[i, n:] = garbage
    y = np.asarray(block().forward(x, lengths=lengths))
    for i, n in enumerate(lengths):
        alone = np.asarray(block().forward(np.ascontiguousarray(x[i:i + 1, :n])))
        assert_same_bits(y[i, :n], alone[0], f"ragged row {i}")
        pad = y[i, n:]
        assert (pad.view(np.uint32) == 0).all(), f"row {i}: padding is not exactly +0.0"
    # negative control: padding that leaked into the rows, here run as real
    # tokens (lengths all L), makes each short row differ from its row alone
    # + zero padding, while (causal) its real positions keep their bits
    leaked = np.asarray(block().forward(clean))
    for i, n in enumerate(lengths):
        if n < L:
            assert_same_bits(leaked[i, :n], y[i, :n], f"row {i} real positions")
            assert_bits_differ(leaked[i], y[i], f"row {i} with its padding run as tokens")


def test_state_bytes_copied_to_fresh_buffers_continue_identically():
    x = random_input(2, 30, D, seed=8)
    state = block().allocate_state(2)
    block().forward(x[:, :11], state)
    cw, h = state_arrays(state)
    # plain NumPy buffers, restored from bytes
    fresh = mojolearn.Mamba1State(np.frombuffer(cw.tobytes(), np.float32).reshape(cw.shape).copy(),
                                  np.frombuffer(h.tobytes(), np.float32).reshape(h.shape).copy())
    a = np.asarray(block().forward(x[:, 11:], state))
    b = np.asarray(block().forward(x[:, 11:], fresh))
    assert_same_bits(b, a, "continuation from copied state bytes")
    # negative control: a copy with one value of h moved continues
    # differently (one ulp of one h value rounds away in y = C h + ...)
    h2 = h.copy()
    h2.reshape(-1)[7] += np.float32(1e-3)
    nudged = mojolearn.Mamba1State(cw.copy(), h2)
    c = np.asarray(block().forward(x[:, 11:], nudged))
    assert_bits_differ(c, a, "continuation from nudged state bytes")


def test_repeated_calls_identical_and_input_layout_irrelevant():
    x = random_input(2, 19, D, seed=9)
    y = np.asarray(block().forward(x))
    assert_same_bits(np.asarray(block().forward(x)), y, "repeat")
    # a non-contiguous view of the same values gives the same bits
    big = np.zeros((2, 19, 2 * D), np.float32)
    big[:, :, ::2] = x
    assert_same_bits(np.asarray(block().forward(big[:, :, ::2])), y, "strided input")
