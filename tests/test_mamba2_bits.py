"""Bit-equality properties of Mamba-2 in identical mode (docs/numerics.md,
"The contract of identical mode").

Each property is checked with exact byte equality and has a negative
control showing the same check fails on a small change.
"""
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import mojolearn
from tests.bits import (
    assert_bits_differ, assert_only_rounding_differs, assert_same_bits,
    assert_shared_workspace_changes_bits, nudge, reordered_reduction,
)
from mojolearn.reference.weights import mamba2_weights, random_input
from tests.threads import run_in_threads

D = 64  # two heads
W = mamba2_weights(D, seed=21)
BLOCK = None
STATE_NAMES = ("conv_window", "h", "buffer_xbc", "buffer_dtraw")


def block():
    global BLOCK
    if BLOCK is None:
        BLOCK = mojolearn.Mamba2Block(W)
    return BLOCK


def assert_same_state(a, b, what):
    for n in STATE_NAMES:
        assert_same_bits(np.asarray(getattr(a, n)), np.asarray(getattr(b, n)), f"{what}: {n}")
    assert a.buffered_tokens == b.buffered_tokens, what


def steps(blk, x, state, t0, t1):
    return np.concatenate([np.asarray(blk.step(x[:, t], state)) for t in range(t0, t1)], 1)


def test_decode_after_prefill_across_a_chunk_boundary():
    """Prefill 250 tokens, then step to 262 (through the 256th token)."""
    x = random_input(2, 262, D, seed=1)
    y = np.asarray(block().forward(x))
    h_full = np.asarray(block().h_last_).copy()
    state = block().allocate_state(2)
    a = np.asarray(block().forward(x[:, :250], state))
    seen = []
    parts = [a]
    for t in range(250, 262):
        parts.append(np.asarray(block().step(x[:, t], state)))
        seen.append(state.buffered_tokens)
    assert seen == [251, 252, 253, 254, 255, 0, 1, 2, 3, 4, 5, 6]
    assert_same_bits(np.concatenate(parts, 1), y, "prefill 250 + 12 steps vs prefill 262")
    assert_same_bits(np.asarray(block().h_last_), h_full, "h_last_ after decode vs prefill")
    ref_state = block().allocate_state(2)
    block().forward(x, ref_state)
    assert_same_state(state, ref_state, "state after decode vs after prefill")
    # negative control: one ulp in a token before the boundary moves later outputs
    s3 = block().allocate_state(2)
    xn = nudge(x, index=249 * D + 5)
    b = np.concatenate([np.asarray(block().forward(xn[:, :250], s3)),
                        steps(block(), xn, s3, 250, 262)], 1)
    assert_bits_differ(b[:, 256:], y[:, 256:], "decode after a nudged token")


def test_300_steps_from_zero_equal_prefill():
    x = random_input(2, 300, D, seed=2)
    y = np.asarray(block().forward(x))
    h_full = np.asarray(block().h_last_).copy()
    state = block().allocate_state(2)
    d = steps(block(), x, state, 0, 300)
    assert state.buffered_tokens == 44
    assert_same_bits(d, y, "300 decode steps vs prefill 300")
    assert_same_bits(np.asarray(block().h_last_), h_full, "h_last_ (lazy) vs prefill")
    s2 = block().allocate_state(2)
    block().forward(x, s2)
    assert_same_state(state, s2, "state after 300 steps vs prefill")
    # negative control: a nudged dt_bias (another block) gives other bits
    w2 = dict(W)
    w2["dt_bias"] = nudge(W["dt_bias"])
    assert_bits_differ(np.asarray(mojolearn.Mamba2Block(w2).forward(x)), y, "nudged dt_bias")


L_SPLIT = 530
X_SPLIT = random_input(2, L_SPLIT, D, seed=3)
Y_SPLIT = None


def _y_split():
    global Y_SPLIT
    if Y_SPLIT is None:
        Y_SPLIT = (np.asarray(block().forward(X_SPLIT)), np.asarray(block().h_last_).copy())
    return Y_SPLIT


@settings(max_examples=12, deadline=None)
@given(splits=st.lists(st.integers(min_value=1, max_value=L_SPLIT - 1), min_size=1,
                       max_size=4, unique=True))
@example(splits=[255])
@example(splits=[256])
@example(splits=[257])
@example(splits=[255, 256, 257])
@example(splits=[1, 511, 512, 513])
def test_continuation_at_any_split_equals_one_call(splits):
    y, h_full = _y_split()
    state = block().allocate_state(2)
    cuts = [0] + sorted(splits) + [L_SPLIT]
    parts = [np.asarray(block().forward(X_SPLIT[:, a:b], state)) for a, b in zip(cuts, cuts[1:])]
    assert state.buffered_tokens == L_SPLIT % 256
    assert_same_bits(np.concatenate(parts, 1), y, f"split at {cuts[1:-1]}")
    assert_same_bits(np.asarray(block().h_last_), h_full, f"h_last_ split at {cuts[1:-1]}")


def test_continuation_negative_control():
    y, _ = _y_split()
    state = block().allocate_state(2)
    a = np.asarray(block().forward(X_SPLIT[:, :200], state))
    # a moved buffered row (the open chunk is re-run from it) changes the bits
    np.asarray(state.buffer_xbc)[0, 199, 7] += np.float32(1e-3)
    b = np.asarray(block().forward(X_SPLIT[:, 200:], state))
    assert_bits_differ(np.concatenate([a, b], 1)[:1], y[:1], "continuation from a nudged buffer")
    assert_same_bits(np.concatenate([a, b], 1)[1:], y[1:], "the other row is untouched")


def test_buffered_tokens_transitions_and_boundary_state():
    x = random_input(1, 600, D, seed=4)
    for L, expect in ((256, 0), (300, 44), (255, 255), (512, 0), (1, 1)):
        state = block().allocate_state(1)
        block().forward(x[:, :L], state)
        assert state.buffered_tokens == expect, L
        buf = np.asarray(state.buffer_xbc)
        assert (buf[0, expect:].view(np.uint32) == 0).all(), "rows past the open chunk are +0.0"
        assert (np.asarray(state.buffer_dtraw)[0, expect:].view(np.uint32) == 0).all()
        if expect == 0:
            # on a chunk boundary h_last_ is state.h, bit for bit
            assert_same_bits(np.asarray(block().h_last_), np.asarray(state.h), f"L={L}")
        else:
            assert_bits_differ(np.asarray(block().h_last_), np.asarray(state.h), f"L={L}")
    state = block().allocate_state(1)
    block().forward(x[:, :254], state)
    block().step(x[:, 254], state)
    assert state.buffered_tokens == 255
    block().step(x[:, 255], state)
    assert state.buffered_tokens == 0
    assert not np.asarray(state.buffer_xbc).any()
    assert_same_bits(np.asarray(block().h_last_), np.asarray(state.h), "h_last_ after step 256")


def test_row_alone_equals_row_in_batch():
    x = random_input(4, 270, D, seed=5)
    y = np.asarray(block().forward(x))
    for i in range(4):
        assert_same_bits(np.asarray(block().forward(x[i:i + 1]))[0], y[i], f"row {i} alone")
    other = random_input(3, 270, D, seed=55)
    mixed = np.concatenate([other[:2], x[2:3], other[2:]], 0)
    assert_same_bits(np.asarray(block().forward(mixed))[2], y[2], "row 2 in another batch")
    # step: a row stepped alone equals the row stepped in a batch
    s_all = block().allocate_state(4)
    s_one = block().allocate_state(1)
    ya = steps(block(), x[:, :5], s_all, 0, 5)
    yo = steps(block(), x[1:2, :5], s_one, 0, 5)
    assert_same_bits(yo[0], ya[1], "row 1 stepped alone vs in batch")
    assert_bits_differ(np.asarray(block().forward(nudge(x[2:3])))[0], y[2], "nudged row")


@pytest.mark.parametrize("shape", [(1, 1), (3, 300)])
def test_thread_count_does_not_change_bits(threads, shape):
    B, L = shape
    x = random_input(B, L, D, seed=6)
    xs = random_input(B, 3, D, seed=66)
    threads(1)
    y1 = np.asarray(block().forward(x))
    s1 = block().allocate_state(B)
    d1 = steps(block(), xs, s1, 0, 3)
    h1 = np.asarray(block().h_last_).copy()
    outs = []
    for n in (2, 3, 4):
        threads(n)
        s = block().allocate_state(B)
        outs.append((n, np.asarray(block().forward(x)), steps(block(), xs, s, 0, 3),
                     np.asarray(block().h_last_).copy()))
    for n, y, d, h in outs:
        assert_same_bits(y, y1, f"forward with {n} threads vs 1")
        assert_same_bits(d, d1, f"steps with {n} threads vs 1")
        assert_same_bits(h, h1, f"h_last_ with {n} threads vs 1")
    # negative control: the same function summed over d_model in another
    # order (what a thread-dependent reduction would do) changes the bits
    r = reordered_reduction(W, x, "mamba2")
    other = mojolearn.Mamba2Block(r.weights)
    assert_only_rounding_differs(r.output(other.forward(r.x)), y1, "reordered forward")
    s2 = other.allocate_state(B)
    assert_only_rounding_differs(r.output(steps(other, r.inputs(xs), s2, 0, 3)), d1,
                                 "reordered steps")


@pytest.mark.parametrize("garbage", [1e30, np.nan, -np.inf, 0.5])
def test_ragged_rows_equal_rows_alone_with_exact_zero_padding(garbage):
    B, L = 4, 300
    lengths = [300, 1, 256, 257]
    clean = random_input(B, L, D, seed=7)
    x = clean.copy()
    for i, n in enumerate(lengths):
        x[i, n:] = garbage
    y = np.asarray(block().forward(x, lengths=lengths))
    h = np.asarray(block().h_last_).copy()
    for i, n in enumerate(lengths):
        alone = np.asarray(block().forward(np.ascontiguousarray(x[i:i + 1, :n])))
        assert_same_bits(y[i, :n], alone[0], f"ragged row {i}")
        assert_same_bits(h[i], np.asarray(block().h_last_)[0], f"ragged row {i} h_last_")
        assert (y[i, n:].view(np.uint32) == 0).all(), f"row {i}: padding is not exactly +0.0"
    # negative control: padding that leaked into the rows, here run as real
    # tokens (lengths all L), makes each short row differ from its row alone:
    # in h_last_ and in the padded positions; (causal) its real positions
    # keep their bits
    leaked = np.asarray(block().forward(clean))
    h_leaked = np.asarray(block().h_last_).copy()
    for i, n in enumerate(lengths):
        if n < L:
            assert_same_bits(leaked[i, :n], y[i, :n], f"row {i} real positions")
            assert_bits_differ(leaked[i], y[i], f"row {i} with its padding run as tokens")
            assert_bits_differ(h_leaked[i], h[i], f"row {i} h_last_ with its padding as tokens")


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.integers(min_value=1, max_value=280), min_size=1, max_size=4))
@example(lengths=[256, 255, 257, 1])
def test_ragged_lengths_any(lengths):
    B, L = len(lengths), max(lengths)
    x = random_input(B, L, D, seed=12)
    for i, n in enumerate(lengths):
        x[i, n:] = np.float32(7.0)
    y = np.asarray(block().forward(x, lengths=lengths))
    h = np.asarray(block().h_last_).copy()
    for i, n in enumerate(lengths):
        alone = np.asarray(block().forward(np.ascontiguousarray(x[i:i + 1, :n])))
        assert_same_bits(y[i, :n], alone[0], f"ragged row {i} (length {n})")
        assert_same_bits(h[i], np.asarray(block().h_last_)[0], f"ragged row {i} h_last_")
        assert (y[i, n:].view(np.uint32) == 0).all()


def test_inference_class_gives_the_same_bits():
    inf = mojolearn.Mamba2BlockInference(W)
    x = random_input(2, 260, D, seed=8)
    assert_same_bits(np.asarray(inf.forward(x)), np.asarray(block().forward(x)), "forward")
    s1, s2 = inf.allocate_state(2), block().allocate_state(2)
    inf.forward(x[:, :255], s1)
    block().forward(x[:, :255], s2)
    assert_same_bits(steps(inf, x, s1, 255, 260), steps(block(), x, s2, 255, 260), "steps")
    assert_same_state(s1, s2, "states")
    with pytest.raises(NotImplementedError):
        inf.backward(x, x)
    other = mojolearn.Mamba2BlockInference(W, dt_limit=(0.0, 0.05))
    assert_bits_differ(np.asarray(other.forward(x)), np.asarray(inf.forward(x)), "dt_limit")


def test_state_bytes_in_numpy_buffers_continue_identically():
    x = random_input(2, 280, D, seed=9)
    state = block().allocate_state(2)
    block().forward(x[:, :200], state)
    saved = [np.frombuffer(np.asarray(getattr(state, n)).tobytes(), np.float32)
             .reshape(np.asarray(getattr(state, n)).shape) for n in STATE_NAMES]

    def restored(bt=200):
        # the state updates its arrays in place: each use gets its own copies
        return mojolearn.Mamba2State(*[a_.copy() for a_ in saved], buffered_tokens=bt)

    fresh = restored()
    a = np.asarray(block().forward(x[:, 200:], state))
    b = np.asarray(block().forward(x[:, 200:], fresh))
    assert_same_bits(b, a, "continuation from copied state bytes")
    assert_same_state(fresh, state, "states after the continuation")
    # negative control from the same saved bytes: untouched they continue
    # identically (the bytes are the pre-continuation state), and only the
    # deliberate change of buffered_tokens moves the bits
    assert_same_bits(np.asarray(block().forward(x[:, 200:], restored())), a, "copy again")
    assert_bits_differ(np.asarray(block().forward(x[:, 200:], restored(bt=199))), a,
                       "buffered_tokens 199")


def test_initial_h_decode_equals_prefill():
    x = random_input(2, 270, D, seed=10)
    h0 = (0.3 * np.random.default_rng(3).standard_normal((2, 2, 64, 128))).astype(np.float32)
    s1, s2 = block().allocate_state(2), block().allocate_state(2)
    np.asarray(s1.h)[...] = h0
    np.asarray(s2.h)[...] = h0
    y = np.asarray(block().forward(x, s1))
    d = np.concatenate([np.asarray(block().forward(x[:, :100], s2)),
                        steps(block(), x, s2, 100, 270)], 1)
    assert_same_bits(d, y, "decode vs prefill from an initial h")
    assert_same_state(s1, s2, "states")
    s3 = block().allocate_state(2)
    assert_bits_differ(np.asarray(block().forward(x, s3)), y, "zero vs nonzero initial h")


def test_conv_weight_2d_and_3d_identical_and_repeat():
    w2 = dict(W)
    w2["conv1d.weight"] = np.ascontiguousarray(W["conv1d.weight"].reshape(-1, 4))
    x = random_input(2, 40, D, seed=11)
    y = np.asarray(block().forward(x))
    assert_same_bits(np.asarray(mojolearn.Mamba2Block(w2).forward(x)), y, "(CD, 4) conv weight")
    assert_same_bits(np.asarray(block().forward(x)), y, "repeat")
    big = np.zeros((2, 40, 2 * D), np.float32)
    big[:, :, ::2] = x
    assert_same_bits(np.asarray(block().forward(big[:, :, ::2])), y, "strided input")
    w3 = dict(w2)
    w3["conv1d.weight"] = nudge(w2["conv1d.weight"], index=3)
    assert_bits_differ(np.asarray(mojolearn.Mamba2Block(w3).forward(x)), y, "nudged conv weight")


def test_concurrent_calls_on_one_block_give_the_same_bits(monkeypatch):
    """Eight Python threads on one block at once (each thread has its own
    workspace): every result keeps its bits."""
    xs = [random_input(2, 270, D, seed=30 + k) for k in range(4)]
    want = [np.asarray(block().forward(x)) for x in xs]
    got = run_in_threads(lambda k: np.asarray(block().forward(xs[k % 4])), 8)
    for k in range(8):
        assert_same_bits(got[k], want[k % 4], f"thread {k}")
    # negative control: the same run with one workspace shared by the
    # threads changes some result's bits
    assert_shared_workspace_changes_bits(
        monkeypatch, lambda k: [np.asarray(block().forward(xs[k % 4]))],
        [[want[k % 4]] for k in range(8)], 8)


def test_decode_session_equals_block_step():
    x = random_input(3, 280, D, seed=40)
    s1, s2 = block().allocate_state(3), block().allocate_state(3)
    block().forward(x[:, :250], s1)
    block().forward(x[:, :250], s2)
    ys = steps(block(), x, s1, 250, 280)  # crosses the chunk boundary at 256
    with block().decode_session(s2) as sess:
        yd = np.concatenate([np.asarray(sess.step(x[:, t])) for t in range(250, 280)], 1)
    assert_same_bits(yd, ys, "session vs step")
    assert_same_state(s2, s1, "state after session close")
    # negative control: a session from a nudged buffered row differs
    s3 = block().allocate_state(3)
    block().forward(x[:, :250], s3)
    np.asarray(s3.buffer_xbc)[1, 249, 3] += np.float32(1e-3)
    with block().decode_session(s3) as sess:
        y3 = np.concatenate([np.asarray(sess.step(x[:, t])) for t in range(250, 280)], 1)
    assert_bits_differ(y3, ys, "session from a nudged state")


def test_decode_session_over_two_folds_and_a_reload():
    """The session keeps transposed copies of h and of the open chunk's B
    rows; they must be rebuilt after each fold and after load_state()."""
    x = random_input(2, 530, D, seed=41)
    s1, s2 = block().allocate_state(2), block().allocate_state(2)
    ys = steps(block(), x, s1, 0, 520)  # folds at tokens 256 and 512
    with block().decode_session(s2) as sess:
        yd = np.concatenate([np.asarray(sess.step(x[:, t])) for t in range(520)], 1)
        assert_same_bits(yd, ys, "520 session steps vs step")
        # edit h and a buffered B row of the session's state, then reload
        sess.sync_state()
        np.asarray(s2.h)[0, 1, 5, 7] += np.float32(0.25)
        np.asarray(s2.buffer_xbc)[1, 3, block().d_inner + 2] -= np.float32(0.5)
        sess.load_state()
        yd2 = np.concatenate([np.asarray(sess.step(x[:, t])) for t in range(520, 530)], 1)
    np.asarray(s1.h)[0, 1, 5, 7] += np.float32(0.25)
    np.asarray(s1.buffer_xbc)[1, 3, block().d_inner + 2] -= np.float32(0.5)
    ys2 = steps(block(), x, s1, 520, 530)
    assert_same_bits(yd2, ys2, "session after load_state vs step")
    assert_same_state(s2, s1, "state after the edited run")
    # negative control: without the edit the outputs differ
    s3 = block().allocate_state(2)
    block().forward(x[:, :520], s3)
    assert_bits_differ(steps(block(), x, s3, 520, 530), ys2, "unedited state")


@pytest.mark.parametrize("B,L", [(40, 300), (260, 20)])
def test_large_batches_grouped_rows_equal_rows_alone(B, L):
    """Large batches process a chunk's rows in groups of 256 // B tokens
    (6 and 1 here): the grouping never changes a bit."""
    x = random_input(B, L, D, seed=50)
    y = np.asarray(block().forward(x))
    h = np.asarray(block().h_last_).copy()
    for i in (0, B // 2, B - 1):
        assert_same_bits(np.asarray(block().forward(x[i:i + 1]))[0], y[i], f"row {i} alone")
        assert_same_bits(np.asarray(block().h_last_)[0], h[i], f"row {i} h_last_")
    st = block().allocate_state(B)
    a = np.asarray(block().forward(x[:, :L - 3], st))
    b = steps(block(), x, st, L - 3, L)
    assert_same_bits(np.concatenate([a, b], 1), y, "grouped prefill + steps")
    # negative control: the row alone with its d_model sums in another order
    # (what a grouping-dependent reduction would do) has other bits
    r = reordered_reduction(W, x[1:2], "mamba2")
    assert_only_rounding_differs(r.output(mojolearn.Mamba2Block(r.weights).forward(r.x))[0],
                                 y[1], "row 1 alone, reordered sums")
