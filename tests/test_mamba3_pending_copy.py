"""A Mamba3State with input states pending (set_input_states) copies and
pickles as it is: pending stays True, every array keeps its bytes, and a
continuation from the copy has the bits of one from the original. Control:
the same state with pending cleared continues to other bits (the flag is
what the copy must carry)."""
import copy
import pickle

import numpy as np
import pytest

import mojolearn
from mojolearn.reference.weights import mamba3_weights, random_input
from tests.bits import assert_bits_differ, assert_same_bits

D, B = 32, 2
BLOCK = []


def _block():
    if not BLOCK:
        BLOCK.append(mojolearn.Mamba3Block(mamba3_weights(D, seed=31)))
    return BLOCK[0]


def _pending_state():
    blk = _block()
    rng = np.random.default_rng(4)
    h = blk.nheads
    return blk.allocate_state(B).set_input_states(
        rng.uniform(0, 6.28, (B, h, 32)).astype(np.float32),
        (0.1 * rng.standard_normal((B, h, 64, 128))).astype(np.float32),
        rng.standard_normal((B, h, 128)).astype(np.float32),
        rng.standard_normal((B, h, 64)).astype(np.float32))


def _state_bytes(s):
    return {n: np.asarray(getattr(s, n)).tobytes() for n in s._ARRAYS}


HOW = {
    "copy()": lambda s: s.copy(),
    "copy.copy": copy.copy,
    "copy.deepcopy": copy.deepcopy,
    "pickle": lambda s: pickle.loads(pickle.dumps(s)),
}


@pytest.mark.parametrize("how", list(HOW))
def test_a_pending_state_copies_with_its_flag_and_bytes(how):
    state = _pending_state()
    assert state.pending
    twin = HOW[how](state)
    assert type(twin) is type(state)
    assert twin.pending is True and twin.buffered_tokens == state.buffered_tokens == 0
    assert _state_bytes(twin) == _state_bytes(state)
    assert all(getattr(twin, n) is not getattr(state, n) for n in state._ARRAYS)
    # the continuations agree bit for bit (a prefill, then steps)
    x = random_input(B, 9, D, seed=12)
    blk = _block()
    ya = np.asarray(blk.forward(x[:, :6], state))
    yb = np.asarray(blk.forward(x[:, :6], twin))
    assert_same_bits(yb, ya, f"{how}: forward from the copy")
    assert not state.pending and not twin.pending  # consumed by the first call
    for t in range(6, 9):
        xt = np.ascontiguousarray(x[:, t])
        assert_same_bits(np.asarray(blk.step(xt, twin)), np.asarray(blk.step(xt, state)),
                         f"{how}: step {t}")
    assert _state_bytes(twin) == _state_bytes(state)


def test_the_pending_flag_changes_the_continuation():
    """Negative control of the test above: a copy that lost the flag (the
    same bytes, pending False) continues to other bits."""
    x = random_input(B, 6, D, seed=12)
    state = _pending_state()
    lost = state.copy()
    lost.pending = False
    assert _state_bytes(lost) == _state_bytes(state)
    assert_bits_differ(np.asarray(_block().forward(x, lost)),
                       np.asarray(_block().forward(x, state)), "pending cleared")
