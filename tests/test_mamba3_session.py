"""Mamba3DecodeSession from input states (set_input_states: pending):
byte for byte what Mamba3Block.step gives. Sessions across chunk folds,
after a reload, and their refusals: the block contract,
tests/contract/test_sessions.py."""
import numpy as np

import mojolearn
from tests.bits import assert_bits_differ, assert_same_bits
from tests.contract.cases import snapshot, steps
from mojolearn.reference.weights import mamba3_weights, random_input

D = 64
BLOCK = mojolearn.Mamba3Block(mamba3_weights(D, seed=11))


def session_steps(sess, x, t0, t1):
    return np.concatenate([np.asarray(sess.step(x[:, t])) for t in range(t0, t1)], 1)


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
    ys = steps(BLOCK, x, s1, 0, 70)
    with BLOCK.decode_session(s2) as sess:
        yd = session_steps(sess, x, 0, 70)
    assert_same_bits(yd, ys, "session from input states")
    assert snapshot(s2) == snapshot(s1)
    # control: a session that ignored the pending k (zero) differs
    s3 = BLOCK.allocate_state(2).set_input_states(theta, h, k * 0, v)
    with BLOCK.decode_session(s3) as sess:
        assert_bits_differ(session_steps(sess, x, 0, 70), ys, "pending k dropped")
