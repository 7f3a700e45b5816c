"""Bit-equality properties of Mamba-3 in identical mode (docs/numerics.md,
"The contract of identical mode").

Each property is checked with exact byte equality and has a negative control
showing that the same check fails on a one-ulp (or otherwise small) change.
"""
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import mojolearn
from mojolearn.mamba import Mamba3BlockInference
from tests.bits import (
    assert_bits_differ, assert_only_rounding_differs, assert_same_bits, nudge, reordered_reduction,
)
from mojolearn.reference.weights import mamba3_weights, random_input

D = 32
W = mamba3_weights(D, seed=21)
_BLOCK = []


def block():
    if not _BLOCK:
        _BLOCK.append(mojolearn.Mamba3Block(W))
    return _BLOCK[0]


STATE_NAMES = ("theta", "h", "buffer_qrot", "buffer_krot", "buffer_v", "buffer_dt",
               "buffer_sig", "buffer_adt", "pending_k", "pending_v")


def valid_state(state):
    """The bytes that define a state: every array, but only the valid buffer rows."""
    n = state.buffered_tokens
    out = [state.buffered_tokens, state.pending]
    for name in STATE_NAMES:
        a = np.asarray(getattr(state, name))
        if name.startswith("buffer_"):
            a = a[:, :n]
        out.append(a.tobytes())
    return out


def reports(b):
    return [np.asarray(a).copy() for a in (b.h_last_, b.k_last_, b.v_last_, b.theta_last_)]


def steps(b, x, state, t0, t1):
    return [np.asarray(b.step(x[:, t], state)) for t in range(t0, t1)]


@pytest.mark.parametrize("B", [2, 9])
def test_decode_equals_prefill_across_chunk_boundary(B):
    """prefill 60 then step to 70 == prefill 70 (crosses the 64 boundary).
    B = 9: a step's input norms run 8 rows side by side, then one alone."""
    x = random_input(B, 70, D, seed=1)
    s_pre = block().allocate_state(B)
    y = np.asarray(block().forward(x, s_pre))
    rep = reports(block())
    s = block().allocate_state(B)
    parts = [np.asarray(block().forward(x[:, :60], s))] + steps(block(), x, s, 60, 70)
    assert_same_bits(np.concatenate(parts, 1), y, "prefill 60 + 10 steps vs prefill 70")
    assert valid_state(s) == valid_state(s_pre), "state after decode vs after prefill"
    for a, b_, n in zip(reports(block()), rep, ("h_last_", "k_last_", "v_last_", "theta_last_")):
        assert_same_bits(a, b_, n)
    # negative control: one ulp in one decoded token changes the outputs
    s2 = block().allocate_state(B)
    xn = nudge(x, index=(70 + 64) * D + D - 1)   # row 1, token 64
    parts2 = [np.asarray(block().forward(xn[:, :60], s2))] + steps(block(), xn, s2, 60, 70)
    assert_bits_differ(np.concatenate(parts2, 1), y, "decode with a nudged token")


def test_200_steps_from_zero_equal_prefill():
    x = random_input(1, 200, D, seed=2)
    y = np.asarray(block().forward(x))
    h_pre = np.asarray(block().h_last_).copy()
    s = block().allocate_state(1)
    ys = steps(block(), x, s, 0, 200)
    assert_same_bits(np.concatenate(ys, 1), y, "200 steps vs prefill 200")
    assert_same_bits(np.asarray(block().h_last_), h_pre, "h_last_ after steps vs prefill")
    assert s.buffered_tokens == 200 - 192
    # negative control: a state nudged half way gives other bits afterwards
    s2 = block().allocate_state(1)
    ys2 = steps(block(), x, s2, 0, 100)
    np.asarray(s2.h).reshape(-1)[17] += np.float32(1e-3)
    ys2 += steps(block(), x, s2, 100, 200)
    assert_bits_differ(np.concatenate(ys2, 1), y, "steps from a nudged state")


L_SPLIT = 140
X_SPLIT = random_input(2, L_SPLIT, D, seed=3)
_Y_SPLIT = []


def y_split():
    if not _Y_SPLIT:
        _Y_SPLIT.append(np.asarray(block().forward(X_SPLIT)))
    return _Y_SPLIT[0]


def run_split(cuts, x=X_SPLIT):
    state = block().allocate_state(x.shape[0])
    cuts = [0] + sorted(set(cuts)) + [x.shape[1]]
    parts = [np.asarray(block().forward(x[:, a:b], state)) for a, b in zip(cuts, cuts[1:]) if b > a]
    return np.concatenate(parts, 1)


@pytest.mark.parametrize("cut", [1, 63, 64, 65, 128, 129])
def test_continuation_at_chunk_edges(cut):
    assert_same_bits(run_split([cut]), y_split(), f"split at {cut}")


@settings(max_examples=20, deadline=None)
@example(splits=[63, 64, 65])
@example(splits=[128, 129])
@example(splits=[1, 64, 129])
@given(splits=st.lists(st.integers(min_value=1, max_value=L_SPLIT - 1), min_size=1,
                       max_size=4, unique=True))
def test_continuation_at_any_split_equals_one_call(splits):
    assert_same_bits(run_split(splits), y_split(), f"split at {sorted(splits)}")


def test_continuation_negative_control():
    state = block().allocate_state(2)
    a = np.asarray(block().forward(X_SPLIT[:, :70], state))
    np.asarray(state.buffer_krot)[0, 3, 0, 0] += np.float32(1e-3)
    b = np.asarray(block().forward(X_SPLIT[:, 70:], state))
    assert_bits_differ(np.concatenate([a, b], 1), y_split(), "continuation from nudged buffer")


def test_row_alone_equals_row_in_batch():
    x = random_input(4, 70, D, seed=5)
    y = np.asarray(block().forward(x))
    for i in range(4):
        assert_same_bits(np.asarray(block().forward(x[i:i + 1]))[0], y[i], f"row {i} alone")
    other = random_input(3, 70, D, seed=55)
    mixed = np.concatenate([other[:1], x[2:3], other[1:]], 0)
    assert_same_bits(np.asarray(block().forward(mixed))[1], y[2], "row 2 in another batch")
    # decode: a row stepped alone == the row stepped in a batch
    s_all, s_one = block().allocate_state(4), block().allocate_state(1)
    block().forward(x[:, :60], s_all)
    block().forward(x[1:2, :60], s_one)
    a = np.asarray(block().step(x[:, 60], s_all))
    b = np.asarray(block().step(x[1:2, 60], s_one))
    assert_same_bits(b[0], a[1], "row 1 stepped alone vs in batch")
    assert_bits_differ(np.asarray(block().forward(nudge(x[2:3])))[0], y[2], "nudged row")


def test_long_pass_leaves_every_state_byte_of_short_passes():
    """A pass of 256+ tokens per row (B <= 4 here) scans on a contiguous copy
    of each head's chunk rows; shorter passes work in the state itself. The
    outputs and every byte of the state, invalid buffer rows included, are
    the same either way: rows alone (B = 1, one pass of up to 300 tokens)
    vs in a batch of 5 (passes of 204 tokens); and a ragged row of 10
    tokens (no fold) in a 300-token pass vs alone."""
    x = random_input(5, 300, D, seed=13)
    s_all = block().allocate_state(5)
    y = np.asarray(block().forward(x, s_all))
    for i in range(5):
        s = block().allocate_state(1)
        if i == 4:  # a second call: 40 tokens, then a long pass from there
            block().forward(x[i:i + 1, :40], s)
            yi = np.asarray(block().forward(np.ascontiguousarray(x[i:i + 1, 40:]), s))
            assert_same_bits(yi[0], y[i, 40:], f"row {i} continued alone")
        else:
            yi = np.asarray(block().forward(x[i:i + 1], s))
            assert_same_bits(yi[0], y[i], f"row {i} alone")
        for name in STATE_NAMES:
            assert_same_bits(np.asarray(getattr(s, name))[0],
                             np.asarray(getattr(s_all, name))[i], f"row {i} state.{name}")
    y2 = np.asarray(block().forward(x[:2], lengths=[300, 10]))
    rep = reports(block())
    alone = np.asarray(block().forward(x[1:2, :10]))
    assert_same_bits(y2[1, :10], alone[0], "ragged row of 10 in a long pass")
    for a, b_, name in zip(reports(block()), rep, ("h", "k", "v", "theta")):
        assert_same_bits(a[0], b_[1], f"ragged row report {name}")
    # negative controls: the invalid rows (44..63 of a 300-token row) hold
    # the last folded chunk's rows, so a scan that left them as they were
    # (zeros) would fail the state check above; a nudged input is seen
    assert s_all.buffered_tokens == 44
    assert np.asarray(s_all.buffer_krot)[0, 44:].any()
    assert_bits_differ(np.asarray(block().forward(nudge(x[:1], index=299 * D)))[0], y[0],
                       "nudged last token")


@pytest.mark.parametrize("shape", [(1, 1), (3, 70)])
def test_thread_count_does_not_change_bits(threads, shape):
    B, L = shape
    x = random_input(B, L, 64, seed=6)
    w = mamba3_weights(64, seed=6)
    blk = mojolearn.Mamba3Block(w)
    threads(1)
    y1 = np.asarray(blk.forward(x))
    s1 = blk.allocate_state(B)
    d1 = np.asarray(blk.step(x[:, 0], s1))
    h1 = np.asarray(blk.h_last_).copy()
    for n in (2, 3):
        threads(n)
        assert_same_bits(np.asarray(blk.forward(x)), y1, f"forward with {n} threads")
        s = blk.allocate_state(B)
        assert_same_bits(np.asarray(blk.step(x[:, 0], s)), d1, f"step with {n} threads")
        assert_same_bits(np.asarray(blk.h_last_), h1, f"h_last_ with {n} threads")
    # negative control: the same function summed over d_model in another
    # order (what a thread-dependent reduction would do) changes the bits
    r = reordered_reduction(w, x, "mamba3")
    other = mojolearn.Mamba3Block(r.weights)
    assert_only_rounding_differs(r.output(other.forward(r.x)), y1, "reordered forward")
    s2 = other.allocate_state(B)
    assert_only_rounding_differs(r.output(other.step(r.x[:, 0], s2)), d1, "reordered step")


@pytest.mark.parametrize("garbage", [1e30, np.nan, -np.inf])
def test_ragged_rows_equal_rows_alone_with_exact_zero_padding(garbage):
    B, L = 4, 70
    lengths = [70, 1, 64, 65]
    clean = random_input(B, L, D, seed=7)
    x = clean.copy()
    for i, n in enumerate(lengths):
        x[i, n:] = garbage
    y = np.asarray(block().forward(x, lengths=lengths))
    rep = reports(block())
    for i, n in enumerate(lengths):
        alone = np.asarray(block().forward(np.ascontiguousarray(x[i:i + 1, :n])))
        assert_same_bits(y[i, :n], alone[0], f"ragged row {i}")
        assert (y[i, n:].view(np.uint32) == 0).all(), f"row {i}: padding is not +0.0"
        for a, b_, name in zip(reports(block()), rep, ("h", "k", "v", "theta")):
            assert_same_bits(a[0], b_[i], f"ragged row {i} report {name}")
    # negative control: padding that leaked into the rows, here run as real
    # tokens (lengths all L), makes each short row differ from its row alone:
    # in the reports and in the padded positions; (causal) its real
    # positions keep their bits
    leaked = np.asarray(block().forward(clean))
    rep_leaked = reports(block())
    for i, n in enumerate(lengths):
        if n < L:
            assert_same_bits(leaked[i, :n], y[i, :n], f"row {i} real positions")
            assert_bits_differ(leaked[i], y[i], f"row {i} with its padding run as tokens")
            for a, b_, name in zip(rep_leaked, rep, ("h", "k", "v", "theta")):
                assert_bits_differ(a[i], b_[i], f"row {i} report {name}, padding as tokens")


def test_inference_block_equals_block():
    x = random_input(2, 70, D, seed=8)
    inf = Mamba3BlockInference(W)
    assert_same_bits(np.asarray(inf.forward(x)), np.asarray(block().forward(x)), "forward")
    s1, s2 = inf.allocate_state(2), block().allocate_state(2)
    a = [np.asarray(inf.step(x[:, t], s1)) for t in range(3)]
    b = [np.asarray(block().step(x[:, t], s2)) for t in range(3)]
    assert_same_bits(np.concatenate(a, 1), np.concatenate(b, 1), "step")
    w2 = dict(W)
    w2["D"] = nudge(W["D"])
    assert_bits_differ(np.asarray(Mamba3BlockInference(w2).forward(x)),
                       np.asarray(block().forward(x)), "nudged D")


def _input_states(seed, B=2):
    rng = np.random.default_rng(seed)
    H = block().nheads
    return (rng.uniform(0, 6.28, (B, H, 32)).astype(np.float32),
            (0.1 * rng.standard_normal((B, H, 64, 128))).astype(np.float32),
            rng.standard_normal((B, H, 128)).astype(np.float32),
            rng.standard_normal((B, H, 64)).astype(np.float32))


def test_steps_after_set_input_states_equal_forward():
    x = random_input(2, 70, D, seed=9)
    ins = _input_states(1)
    y = np.asarray(block().forward(x, block().allocate_state(2).set_input_states(*ins)))
    s = block().allocate_state(2).set_input_states(*ins)
    ys = steps(block(), x, s, 0, 70)
    assert not s.pending
    assert_same_bits(np.concatenate(ys, 1), y, "steps vs forward after set_input_states")
    ins2 = list(ins)
    ins2[2] = nudge(ins[2])
    y2 = np.asarray(block().forward(x, block().allocate_state(2).set_input_states(*ins2)))
    assert_bits_differ(y2, y, "nudged input-state k")


def test_input_states_continuation_close_to_unbroken_run():
    """Continuing from the reports (h_last_, k_last_, v_last_, theta_last_) of a
    prefix equals the unbroken run up to rounding (a different formula: the
    prefix's chunk is folded with gamma only)."""
    x = random_input(2, 150, D, seed=10)
    y = np.asarray(block().forward(x), np.float64)
    for cut in (30, 64, 100):
        block().forward(x[:, :cut])
        ins = [np.asarray(a).copy() for a in (block().theta_last_, block().h_last_,
                                              block().k_last_, block().v_last_)]
        s = block().allocate_state(2).set_input_states(*ins)
        y2 = np.asarray(block().forward(x[:, cut:], s), np.float64)
        ref = y[:, cut:]
        np.testing.assert_allclose(y2, ref, rtol=1e-5, atol=2e-5)
        # negative control: dropping the pending k v term is visible
        s0 = block().allocate_state(2).set_input_states(ins[0], ins[1], ins[2] * 0, ins[3])
        y0 = np.asarray(block().forward(x[:, cut:], s0), np.float64)
        assert np.abs(y0 - ref).max() > 1e-3


def test_state_bytes_copied_to_numpy_buffers_continue_identically():
    x = random_input(2, 100, D, seed=11)
    s = block().allocate_state(2)
    block().forward(x[:, :67], s)
    saved = [np.array(getattr(s, n)) for n in STATE_NAMES]
    bt, pending = s.buffered_tokens, s.pending

    def restored(changed=None):
        # the state updates its arrays in place: each use gets its own copies
        arrays = [a_.copy() for a_ in saved]
        for i, v in (changed or {}).items():
            arrays[i] = v
        return mojolearn.Mamba3State(*arrays, buffered_tokens=bt, pending=pending)

    fresh = restored()
    a = np.asarray(block().forward(x[:, 67:], s))
    b = np.asarray(block().forward(x[:, 67:], fresh))
    assert_same_bits(b, a, "continuation from copied state bytes")
    # negative controls from the same saved bytes: untouched they continue
    # identically (the bytes are the pre-continuation state), and one ulp in
    # an angle, or in a valid buffered k row, moves the bits
    assert_same_bits(np.asarray(block().forward(x[:, 67:], restored())), a, "copy again")
    c = np.asarray(block().forward(x[:, 67:], restored({0: nudge(saved[0], index=0)})))
    assert_bits_differ(c, a, "one ulp in theta")
    c = np.asarray(block().forward(x[:, 67:], restored({3: nudge(saved[3], index=0)})))
    assert_bits_differ(c, a, "one ulp in buffer_krot row 0")


def test_repeated_calls_and_input_layout():
    x = random_input(2, 19, D, seed=12)
    y = np.asarray(block().forward(x))
    assert_same_bits(np.asarray(block().forward(x)), y, "repeat")
    big = np.zeros((2, 19, 2 * D), np.float32)
    big[:, :, ::2] = x
    assert_same_bits(np.asarray(block().forward(big[:, :, ::2])), y, "strided input")
