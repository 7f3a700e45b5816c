"""Contract: decode sessions, for every block class. An open session holds
its state (the block refuses it), a closed one refuses to step, a refused
step or load_state changes nothing, and a session gives byte for byte what
block.step gives, across the chunk folds and after a reload; each bit
check with its control. (One session per state, dropped sessions, failed
close, copies: tests/test_state_lifecycle.py.)
"""
import numpy as np

from tests.bits import assert_bits_differ, assert_same_bits
from tests.contract.cases import (B, as_bytes, fails, filled_state, numpy_state, snapshot,
                                  steps)


def _session_steps(sess, x, t0, t1):
    return np.concatenate([np.asarray(sess.step(np.ascontiguousarray(x[:, t])))
                           for t in range(t0, t1)], 1)


# ------------------------------------------------------------ refusals
def test_open_session_holds_the_state(case, block, x):
    st = filled_state(block)
    before = snapshot(st)
    session = block.decode_session(st)
    try:
        held = ["state", case.session_name, "held"]
        other = case.block(case.weights(seed=4))
        for call, args in ((block.forward, (x, st)), (block.step, (x[:, 0].copy(), st)),
                           (block.step, (x[:, :1], st)), (block.decode_session, (st,)),
                           (other.forward, (x, st)), (other.step, (x[:, :1], st))):
            fails(ValueError, call, *args, keep=[st, x], match=held)
        assert session.is_open
    finally:
        session.close()
    assert snapshot(st) == before  # nothing stepped: close writes back the same bytes
    assert not session.is_open
    block.forward(x, st)  # usable again after close
    assert snapshot(st) != before  # control


def test_closed_session_refuses(case, block, x):
    st = filled_state(block)
    with block.decode_session(st) as session:
        session.step(x[:, 0].copy())
    assert not session.is_open
    after = snapshot(st)
    closed = [case.session_name, "closed"]
    fails(ValueError, session.step, x[:, 0].copy(), keep=[st], match=closed)
    fails(ValueError, session.sync_state, keep=[st], match=closed)
    fails(ValueError, session.load_state, keep=[st], match=closed)
    session.close()  # closing again is a no-op
    session.close()
    assert snapshot(st) == after and not session.is_open
    block.step(x[:, 0].copy(), st)  # the state is free


def test_second_close_after_block_use_writes_nothing(block, x):
    """A second close() must not copy stale session bytes over a state that
    the block has used since the first close."""
    st = filled_state(block)
    session = block.decode_session(st)
    session.step(x[:, 0].copy())
    session.close()
    block.step(x[:, 1].copy(), st)
    after = snapshot(st)
    session.close()
    assert snapshot(st) == after


def test_refused_steps_change_nothing(case, block, x):
    d = case.d
    st = filled_state(block)
    tokens = [np.ascontiguousarray(x[:, i]) for i in range(3)]
    ref = numpy_state(st)
    want = [as_bytes(block.step(t, ref)) for t in tokens]
    with block.decode_session(st) as session:
        got = [as_bytes(session.step(tokens[0]))]
        bad = tokens[1].copy()
        bad.reshape(-1)[d + 3] = np.nan
        fails(TypeError, session.step, tokens[1].astype(np.float64), match=["x", "float64"])
        fails(TypeError, session.step, None, match=["x", "NoneType"])
        fails(ValueError, session.step, bad, keep=[bad], match=["x", f"flat index {d + 3}"])
        fails(ValueError, session.step, bad[:, None], keep=[bad],
              match=["x", f"flat index {d + 3}"])
        fails(ValueError, session.step, tokens[1][:1], match=["x", "B=1", f"{B} rows"])
        fails(ValueError, session.step, np.zeros((B + 1, d), np.float32),
              match=["x", f"B={B + 1}", f"{B} rows"])
        fails(ValueError, session.step, x[:, :2], keep=[x],
              match=["x", "one token", f"got {(B, 2, d)}"])
        fails(ValueError, session.step, np.zeros((B, d + 1), np.float32),
              match=["x", f"d_model {d + 1}"])
        fails(ValueError, session.step, np.zeros((B, 1, 1, d), np.float32), match=["x"])
        got += [as_bytes(session.step(t)) for t in tokens[1:]]
    assert got == want
    assert snapshot(st) == snapshot(ref)


def test_refused_load_state_changes_nothing(case, block, x):
    st = numpy_state(filled_state(block))
    tokens = [np.ascontiguousarray(x[:, i]) for i in range(2)]
    ref = numpy_state(st)
    want = [as_bytes(block.step(t, ref)) for t in tokens]
    with block.decode_session(st) as session:
        got = [as_bytes(session.step(tokens[0]))]
        pos = (1, 1) + (3,) * (st.h.ndim - 2)
        st.h[pos] = np.nan  # edit the (stale) state arrays badly
        fails(ValueError, session.load_state,
              match=["state.h", f"flat index {np.ravel_multi_index(pos, st.h.shape)}"])
        assert session.is_open
        got.append(as_bytes(session.step(tokens[1])))  # the session's own state was kept
    assert got == want
    assert snapshot(st) == snapshot(ref)


def test_open_session_decodes_its_own_batch(case, block):
    st = filled_state(block, 3)
    with block.decode_session(st) as session:
        fails(ValueError, session.step, case.x(B, 1, seed=1), keep=[st],
              match=["x", f"B={B}", "session decodes 3 rows"])


# ------------------------------------------------------------ bits
def test_load_state_sees_edits_and_only_then(case, block, x):
    a, b = filled_state(block), filled_state(block)
    with block.decode_session(a) as sa, block.decode_session(b) as sb:
        np.asarray(a.h).reshape(-1)[0] += np.float32(0.5)
        ya, yb = as_bytes(sa.step(x[:, 0].copy())), as_bytes(sb.step(x[:, 0].copy()))
        assert ya == yb  # the edit is not seen before load_state
        sa.load_state()
        sb.load_state()
        assert as_bytes(sa.step(x[:, 1].copy())) != as_bytes(sb.step(x[:, 1].copy()))


def test_session_equals_block_step_across_folds(case):
    """Prefill 6 tokens into the second chunk, then steps through two folds:
    a session gives the bytes of block.step, and leaves the state block.step
    leaves (every array and value)."""
    blk, c = case.shared, case.chunk
    n0, n1 = c + 6, 3 * c + 2
    x = case.x(3, n1, seed=40)
    s1, s2 = blk.allocate_state(3), blk.allocate_state(3)
    blk.forward(x[:, :n0], s1)
    blk.forward(x[:, :n0], s2)
    base = numpy_state(s1)
    ys = steps(blk, x, s1, n0, n1)
    with blk.decode_session(s2) as sess:
        yd = _session_steps(sess, x, n0, n1)
    assert_same_bits(yd, ys, "session vs step")
    assert snapshot(s2) == snapshot(s1)
    # control: a session from a state with one carried value moved differs
    for which in case.carried:
        nudged = numpy_state(base)
        a = getattr(nudged, which)
        a[case.read_positions(which, a.shape, 6)[1]] += np.float32(1e-3)
        with blk.decode_session(nudged) as sess:
            assert_bits_differ(_session_steps(sess, x, n0, n1), ys, f"nudged state.{which}")


def test_session_reload_after_edits_equals_block_step(case):
    """Steps over two folds, an edit of every read array, load_state, more
    steps: the session rebuilds whatever it keeps from the state (M2: its
    transposed copies) and gives the bytes of block.step on the same edit."""
    blk, c = case.shared, case.chunk
    n0, n1 = 2 * c + 8, 2 * c + 18
    x = case.x(B, n1, seed=41)
    s1, s2 = blk.allocate_state(B), blk.allocate_state(B)
    ys = steps(blk, x, s1, 0, n0)
    unedited = numpy_state(s1)

    def edit(st):
        for which in case.read_arrays:
            a = np.asarray(getattr(st, which))
            a[case.read_positions(which, a.shape, n0 % c or c)[1]] += np.float32(0.25)

    with blk.decode_session(s2) as sess:
        assert_same_bits(_session_steps(sess, x, 0, n0), ys, f"{n0} session steps vs step")
        sess.sync_state()
        edit(s2)
        sess.load_state()
        yd = _session_steps(sess, x, n0, n1)
    edit(s1)
    ys2 = steps(blk, x, s1, n0, n1)
    assert_same_bits(yd, ys2, "session after load_state vs step")
    assert snapshot(s2) == snapshot(s1)
    # control: without the edit the outputs differ
    assert_bits_differ(steps(blk, x, unedited, n0, n1), ys2, "unedited state")
