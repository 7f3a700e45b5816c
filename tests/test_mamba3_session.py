"""Mamba3DecodeSession: byte for byte what Mamba3Block.step gives, across
chunk folds, from input states and after a reload; the held state is
refused by the block; closed sessions refuse to step."""
import numpy as np

import mojolearn
from tests.bits import assert_bits_differ, assert_same_bits
from tests.errors import raises_naming
from mojolearn.reference.weights import mamba3_weights, random_input

D = 64
BLOCK = mojolearn.Mamba3Block(mamba3_weights(D, seed=11))
NAMES = ("theta", "h", "buffer_qrot", "buffer_krot", "buffer_v", "buffer_dt",
         "buffer_sig", "buffer_adt", "pending_k", "pending_v")


def steps(state, x, t0, t1):
    return np.concatenate([np.asarray(BLOCK.step(x[:, t], state)) for t in range(t0, t1)], 1)


def session_steps(sess, x, t0, t1):
    return np.concatenate([np.asarray(sess.step(x[:, t])) for t in range(t0, t1)], 1)


def assert_same_state(a, b):
    for n in NAMES:
        assert_same_bits(np.asarray(getattr(a, n)), np.asarray(getattr(b, n)), n)
    assert (a.buffered_tokens, a.pending) == (b.buffered_tokens, b.pending)


def test_session_equals_step_after_prefill_across_folds():
    x = random_input(3, 200, D, seed=1)
    s1, s2 = BLOCK.allocate_state(3), BLOCK.allocate_state(3)
    BLOCK.forward(x[:, :60], s1)
    BLOCK.forward(x[:, :60], s2)
    ys = steps(s1, x, 60, 200)  # folds at tokens 64, 128, 192
    with BLOCK.decode_session(s2) as sess:
        yd = session_steps(sess, x, 60, 200)
    assert_same_bits(yd, ys, "session vs step")
    assert_same_state(s2, s1)
    # negative control: one buffered value nudged before opening
    s3 = BLOCK.allocate_state(3)
    BLOCK.forward(x[:, :60], s3)
    np.asarray(s3.buffer_v)[1, 5, 0] += np.float32(1e-3)
    with BLOCK.decode_session(s3) as sess:
        assert_bits_differ(session_steps(sess, x, 60, 200), ys, "nudged state")


def test_session_from_input_states_equals_step():
    rng = np.random.default_rng(3)
    s1, s2 = BLOCK.allocate_state(2), BLOCK.allocate_state(2)
    theta = rng.random(np.asarray(s1.theta).shape, dtype=np.float32)
    h = rng.standard_normal(np.asarray(s1.h).shape).astype(np.float32)
    k = rng.standard_normal(np.asarray(s1.pending_k).shape).astype(np.float32)
    v = rng.standard_normal(np.asarray(s1.pending_v).shape).astype(np.float32)
    for s in (s1, s2):
        s.set_input_states(theta, h, k, v)
    x = random_input(2, 70, D, seed=4)
    ys = steps(s1, x, 0, 70)
    with BLOCK.decode_session(s2) as sess:
        yd = session_steps(sess, x, 0, 70)
    assert_same_bits(yd, ys, "session from input states")
    assert_same_state(s2, s1)


def test_reload_after_an_edit_and_held_state_refused():
    x = random_input(2, 90, D, seed=5)
    s1, s2 = BLOCK.allocate_state(2), BLOCK.allocate_state(2)
    sess = BLOCK.decode_session(s2)
    y1 = session_steps(sess, x, 0, 40)
    assert_same_bits(y1, steps(s1, x, 0, 40), "first 40")
    with raises_naming(ValueError, "state", "Mamba3DecodeSession"):
        BLOCK.step(x[:, 40], s2)
    sess.sync_state()
    np.asarray(s2.h)[1, 0, 3, 7] += np.float32(0.5)
    np.asarray(s1.h)[1, 0, 3, 7] += np.float32(0.5)
    sess.load_state()
    y2 = session_steps(sess, x, 40, 90)
    sess.close()
    sess.close()  # idempotent
    assert_same_bits(y2, steps(s1, x, 40, 90), "after reload")
    assert_same_state(s2, s1)
    with raises_naming(ValueError, "Mamba3DecodeSession", "closed"):
        sess.step(x[:, 0])
    BLOCK.step(x[:, 0], s2)  # released


def test_bad_x_is_refused_and_nothing_changes():
    st = BLOCK.allocate_state(2)
    with BLOCK.decode_session(st) as sess:
        sess.step(random_input(2, 1, D, seed=6))
        before = {n: np.asarray(a).copy() for n, a in sess._arrays.items()}
        bad = random_input(2, 1, D, seed=7)
        bad[1, 0, 3] = np.nan
        with raises_naming(ValueError, "x", f"flat index {D + 3}"):
            sess.step(bad)
        with raises_naming(ValueError, "x", "B=3", "2 rows"):
            sess.step(random_input(3, 1, D, seed=7))
        for n, a in sess._arrays.items():
            assert_same_bits(np.asarray(a), before[n], n)
