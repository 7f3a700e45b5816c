"""Contract: the bit properties of identical mode (docs/numerics.md, "The
contract of identical mode"), for every block class: decode == prefill,
continuation at any split, a ragged row == the row alone with padding
exactly +0.0, thread counts, batch composition, Block == BlockInference,
repeated and concurrent calls, state bytes in new buffers. The state after
a call is compared in every byte of every array and every value, and the
block's reports (h_last_, ...) with it.

Each property is checked with exact byte equality and has a negative
control: the same comparison fails on a small change (a nudged token,
state value or weight, padding run as tokens, the same function with its
sums over d_model in another order). Lengths are spelled in chunks (c):
every property crosses a fold.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.bits import (assert_bits_differ, assert_only_rounding_differs, assert_same_bits,
                        assert_shared_workspace_changes_bits, nudge, reordered_reduction)
from tests.contract.cases import at, numpy_state, snapshot, steps
from tests.threads import run_in_threads


def assert_same_reports(case, got, want, what):
    for name, a, b in zip(case.reports, got, want):
        assert_same_bits(a, b, f"{what}: {name}")


def assert_same_state(a, b, what):
    assert snapshot(a) == snapshot(b), f"{what}: the states differ"


# ------------------------------------------------------------ decode == prefill
@pytest.mark.parametrize("B", [2, 9])
def test_decode_equals_prefill(case, B):
    """3c + 8 tokens: all steps from zero, and a prefill to 4 tokens before
    the first fold then steps (B = 9: a step's input norms run 8 rows side
    by side, then one alone): the outputs, the state and the reports of
    one prefill."""
    blk, c = case.shared, case.chunk
    n = 3 * c + 8
    x = case.x(B, n, seed=1)
    s_pre = blk.allocate_state(B)
    y = np.asarray(blk.forward(x, s_pre))
    rep = case.reports_of(blk)
    for n0 in (0, c - 4):
        s = blk.allocate_state(B)
        parts = [np.asarray(blk.forward(x[:, :n0], s))] if n0 else []
        got = np.concatenate(parts + [steps(blk, x, s, n0, n)], 1)
        assert_same_bits(got, y, f"prefill {n0} + {n - n0} steps vs prefill {n}")
        assert_same_state(s, s_pre, f"state after prefill {n0} + steps")
        assert_same_reports(case, case.reports_of(blk), rep, f"prefill {n0} + steps")
    # control: one ulp in one decoded token (row 1, token c) moves the outputs
    # from that token on, and (causal) not before it
    s = blk.allocate_state(B)
    xn = nudge(x, index=(n + c) * case.d + case.d - 1)
    got = np.concatenate([np.asarray(blk.forward(xn[:, :c - 4], s)),
                          steps(blk, xn, s, c - 4, n)], 1)
    assert_same_bits(got[:, :c], y[:, :c], "before the nudged token")
    assert_bits_differ(got[:, c:], y[:, c:], "decode after a nudged token")


# ------------------------------------------------------------ continuation
def _split_run(case, x, cuts):
    blk = case.shared
    state = blk.allocate_state(x.shape[0])
    cuts = [0] + sorted(set(cuts)) + [x.shape[1]]
    parts = [np.asarray(blk.forward(x[:, a:b], state)) for a, b in zip(cuts, cuts[1:]) if b > a]
    return np.concatenate(parts, 1), state, case.reports_of(blk)


def _one_call(case, x):
    state = case.shared.allocate_state(x.shape[0])
    return np.asarray(case.shared.forward(x, state)), state, case.reports_of(case.shared)


def _check_split(case, cuts):
    x = case.x(2, 2 * case.chunk + 12, seed=3)
    y, s_one, rep = _one_call(case, x)
    got, s, rep_split = _split_run(case, x, cuts)
    assert_same_bits(got, y, f"split at {sorted(cuts)}")
    assert_same_state(s, s_one, f"state, split at {sorted(cuts)}")
    assert_same_reports(case, rep_split, rep, f"split at {sorted(cuts)}")


@pytest.mark.parametrize("cuts", [[1], ["c-1"], ["c"], ["c+1"], ["2c"], ["2c+1"],
                                  ["c-1", "c", "c+1"], [1, "2c-1", "2c", "2c+1"]],
                         ids=lambda cuts: ",".join(map(str, cuts)))
def test_continuation_at_chunk_edges_equals_one_call(case, cuts):
    c = case.chunk
    _check_split(case, [at(k, c) for k in cuts])


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_continuation_at_any_split_equals_one_call(case, data):
    n = 2 * case.chunk + 12
    cuts = data.draw(st.lists(st.integers(1, n - 1), min_size=1, max_size=4, unique=True))
    _check_split(case, cuts)


def test_continuation_control(case):
    """One carried state value moved in row 0 after c + 6 tokens: row 0
    continues with other bits, row 1 with the same."""
    blk, c = case.shared, case.chunk
    x = case.x(2, 2 * c + 12, seed=3)
    y, _, _ = _one_call(case, x)
    state = blk.allocate_state(2)
    a = np.asarray(blk.forward(x[:, :c + 6], state))
    for which in case.carried:
        moved = numpy_state(state)
        arr = getattr(moved, which)
        arr[(0,) + case.read_positions(which, arr.shape, 6)[1][1:]] += np.float32(1e-3)
        got = np.concatenate([a, np.asarray(blk.forward(x[:, c + 6:], moved))], 1)
        assert_bits_differ(got[:1], y[:1], f"row 0 from a moved state.{which}")
        assert_same_bits(got[1:], y[1:], f"row 1 (untouched) with a moved state.{which}")


def test_state_bytes_in_new_buffers_continue_identically(case):
    """The state's bytes, restored into new NumPy buffers, continue bit for
    bit; from the same saved bytes, one carried value moved, or the
    position value moved, gives other bits."""
    blk, c = case.shared, case.chunk
    x = case.x(2, c + 30, seed=8)
    state = blk.allocate_state(2)
    blk.forward(x[:, :c + 6], state)
    saved = {n: np.frombuffer(np.asarray(getattr(state, n)).tobytes(), np.float32)
             .reshape(np.asarray(getattr(state, n)).shape) for n in state._ARRAYS}
    values = {n: getattr(state, n) for n in state._VALUES}

    def restored(**changes):  # a state updates its arrays in place: new copies each time
        arrays = {n: a.copy() for n, a in saved.items()}
        vals = dict(values)
        for n, v in changes.items():
            (vals if n in vals else arrays)[n] = v
        return type(state)(*[arrays[n] for n in state._ARRAYS], **vals)

    fresh = restored()
    a = np.asarray(blk.forward(x[:, c + 6:], state))
    assert_same_bits(np.asarray(blk.forward(x[:, c + 6:], fresh)), a, "from copied bytes")
    assert_same_state(fresh, state, "states after the continuation")
    assert_same_bits(np.asarray(blk.forward(x[:, c + 6:], restored())), a, "copy again")
    for which in case.carried:
        moved = saved[which].copy()
        moved[case.read_positions(which, moved.shape, 6)[1]] += np.float32(1e-3)
        got = np.asarray(blk.forward(x[:, c + 6:], restored(**{which: moved})))
        assert_bits_differ(got, a, f"moved state.{which}")
    for which, k in case.ulp_moves:  # one ulp, where one ulp shows
        moved = saved[which].copy()
        pos = case.read_positions(which, moved.shape, 6)[k]
        moved[pos] = np.nextafter(moved[pos], np.float32(np.inf))
        got = np.asarray(blk.forward(x[:, c + 6:], restored(**{which: moved})))
        assert_bits_differ(got, a, f"one ulp in state.{which}")
    if case.position:
        got = blk.forward(x[:, c + 6:], restored(**{case.position: values[case.position] - 1}))
        assert_bits_differ(np.asarray(got), a, f"{case.position} - 1")


# ------------------------------------------------------------ batch composition
def test_row_alone_equals_row_in_batch(case):
    blk, c = case.shared, case.chunk
    x = case.x(4, c + 6, seed=5)
    y = np.asarray(blk.forward(x))
    rep = case.reports_of(blk)
    for i in range(4):
        assert_same_bits(np.asarray(blk.forward(x[i:i + 1]))[0], y[i], f"row {i} alone")
        assert_same_reports(case, [r[0] for r in case.reports_of(blk)], [r[i] for r in rep],
                            f"row {i} alone")
    other = case.x(3, c + 6, seed=55)
    mixed = np.concatenate([other[:1], x[2:3], other[1:]], 0)
    assert_same_bits(np.asarray(blk.forward(mixed))[1], y[2], "row 2 in another batch")
    # decode: a row stepped alone (across the fold) == the row stepped in a batch
    s_all, s_one = blk.allocate_state(4), blk.allocate_state(1)
    blk.forward(x[:, :c - 2], s_all)
    blk.forward(x[1:2, :c - 2], s_one)
    a, b = steps(blk, x, s_all, c - 2, c + 2), steps(blk, x[1:2], s_one, c - 2, c + 2)
    assert_same_bits(b[0], a[1], "row 1 stepped alone vs in batch")
    for n in s_all._ARRAYS:
        assert_same_bits(np.asarray(getattr(s_one, n))[0], np.asarray(getattr(s_all, n))[1],
                         f"row 1 state.{n}")
    # control: one ulp in each value of the row's first token changes the row
    xn = x[2:3].copy()
    xn[0, 0] = np.nextafter(xn[0, 0], np.float32(np.inf))
    assert_bits_differ(np.asarray(blk.forward(xn))[0], y[2], "nudged row")


@pytest.mark.parametrize("garbage", [1e30, np.nan, -np.inf, 0.5])
def test_ragged_rows_equal_rows_alone_with_exact_zero_padding(case, garbage):
    blk, c = case.shared, case.chunk
    n = c + 6
    lengths = [n, 1, c, c + 1]
    clean = case.x(4, n, seed=7)
    x = clean.copy()
    for i, k in enumerate(lengths):
        x[i, k:] = garbage
    y, rep = _ragged_run_equals_rows_alone(case, x, lengths)
    # control: padding that leaked into the rows, here run as real tokens
    # (lengths all n), makes each short row differ from its row alone, in the
    # padded positions and the reports; (causal) its real positions keep
    # their bits
    leaked = np.asarray(blk.forward(clean))
    rep_leaked = case.reports_of(blk)
    for i, k in enumerate(lengths):
        if k < n:
            assert_same_bits(leaked[i, :k], y[i, :k], f"row {i} real positions")
            assert_bits_differ(leaked[i], y[i], f"row {i} with its padding run as tokens")
            for name, a, b in zip(case.reports, rep_leaked, rep):
                assert_bits_differ(a[i], b[i], f"row {i} {name}, padding as tokens")


def _ragged_run_equals_rows_alone(case, x, lengths):
    """Run x with lengths on the shared block; check each row's real
    positions (output and reports) against the row alone over its own
    tokens and its padding outputs exactly +0.0. Returns (y, reports)."""
    blk = case.shared
    y = np.asarray(blk.forward(x, lengths=lengths))
    rep = case.reports_of(blk)
    for i, k in enumerate(lengths):
        alone = np.asarray(blk.forward(np.ascontiguousarray(x[i:i + 1, :k])))
        assert_same_bits(y[i, :k], alone[0], f"ragged row {i} (length {k})")
        assert_same_reports(case, [r[0] for r in case.reports_of(blk)], [r[i] for r in rep],
                            f"ragged row {i}")
        assert (y[i, k:].view(np.uint32) == 0).all(), f"row {i}: padding is not exactly +0.0"
    return y, rep


def _check_ragged(case, lengths):
    x = case.x(len(lengths), max(lengths), seed=12)
    for i, k in enumerate(lengths):
        x[i, k:] = np.float32(7.0)
    _ragged_run_equals_rows_alone(case, x, lengths)


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_ragged_lengths_any(case, data):
    _check_ragged(case, data.draw(st.lists(st.integers(1, case.chunk + 24), min_size=1,
                                           max_size=4)))


def test_ragged_lengths_at_chunk_edges(case):
    c = case.chunk
    _check_ragged(case, [c, c - 1, c + 1, 1])


# ------------------------------------------------------------ threads
@pytest.mark.parametrize("shape", [(1, 1), (3, "c+6"), (8, 300)], ids=str)
def test_thread_count_does_not_change_bits(case, threads, shape):
    blk, c = case.shared, case.chunk
    b, n = shape[0], at(shape[1], c)
    x = case.x(b, n, seed=6)
    threads(1)
    y1 = np.asarray(blk.forward(x))
    r1 = case.reports_of(blk)
    d1 = steps(blk, x, blk.allocate_state(b), 0, min(n, 3))
    for k in (2, 3, 4):
        threads(k)
        assert_same_bits(np.asarray(blk.forward(x)), y1, f"forward with {k} threads vs 1")
        assert_same_reports(case, case.reports_of(blk), r1, f"forward with {k} threads")
        assert_same_bits(steps(blk, x, blk.allocate_state(b), 0, min(n, 3)), d1,
                         f"steps with {k} threads vs 1")
    # control: the same function summed over d_model in another order (what a
    # thread-dependent reduction would do) changes the bits
    threads(1)
    r = reordered_reduction(case.weights(seed=21), x, case.block_kind)
    other = case.cls(r.weights)
    assert_only_rounding_differs(r.output(other.forward(r.x)), y1, "reordered forward")
    assert_only_rounding_differs(r.output(steps(other, r.x, other.allocate_state(b), 0,
                                                min(n, 3))), d1, "reordered steps")


# ------------------------------------------------------------ same function
def test_block_and_inference_class_give_the_same_bits(case):
    c = case.chunk
    mine, theirs = case.shared, case.sibling(case.weights(seed=21))
    x = case.x(2, c + 6, seed=8)
    assert_same_bits(np.asarray(mine.forward(x)), np.asarray(theirs.forward(x)), "forward")
    assert_same_reports(case, case.reports_of(mine), case.reports_of(theirs), "forward")
    s1, s2 = mine.allocate_state(2), theirs.allocate_state(2)
    mine.forward(x[:, :c - 1], s1)
    theirs.forward(x[:, :c - 1], s2)
    assert_same_bits(steps(mine, x, s1, c - 1, c + 6), steps(theirs, x, s2, c - 1, c + 6),
                     "steps")
    assert_same_state(s1, s2, "states")
    w = case.weights(seed=21)
    w["D"] = nudge(w["D"])
    assert_bits_differ(np.asarray(case.sibling(w).forward(x)), np.asarray(mine.forward(x)),
                       "nudged D")


def test_repeated_calls_give_the_same_bits(case):
    blk = case.shared
    x = case.x(2, 19, seed=9)
    y = np.asarray(blk.forward(x))
    assert_same_bits(np.asarray(blk.forward(x)), y, "repeat")
    d = steps(blk, x, blk.allocate_state(2), 0, 3)
    assert_same_bits(steps(blk, x, blk.allocate_state(2), 0, 3), d, "repeated steps")
    assert_bits_differ(np.asarray(blk.forward(nudge(x, index=3))), y, "nudged x")


def test_concurrent_calls_on_one_block_give_the_same_bits(case, monkeypatch):
    """Eight Python threads on one block at once (each thread has its own
    workspace): every result keeps its bits."""
    blk = case.shared
    xs = [case.x(2, 270, seed=30 + k) for k in range(4)]
    want = [np.asarray(blk.forward(x)) for x in xs]
    got = run_in_threads(lambda k: np.asarray(blk.forward(xs[k % 4])), 8)
    for k in range(8):
        assert_same_bits(got[k], want[k % 4], f"thread {k}")
    # control: the same run with one workspace shared by the threads
    # changes some result's bits
    assert_shared_workspace_changes_bits(
        monkeypatch, lambda k: [np.asarray(blk.forward(xs[k % 4]))],
        [[want[k % 4]] for k in range(8)], 8)
