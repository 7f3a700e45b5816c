"""Mamba-3 only: what the block contract (tests/contract/, the same checks
for all six block classes) does not cover: d_model a multiple of 32, the
state rules of docs/mamba3.md, "State" (buffered_tokens, unread buffer
rows, set_input_states, pending), session_info, no dt_limit.

Every error test checks the exception class and that the message names the
thing at fault (tests/errors.py); a refused call given a state checks that
the state and x kept their bytes.
"""
from __future__ import annotations

import numpy as np
import pytest

from mojolearn.mamba import Mamba3Block, Mamba3State
from mojolearn.reference.weights import mamba3_weights
from tests.contract.cases import (as_bytes, fails, family_fixtures, filled_state,
                                  numpy_state)
from tests.errors import raises_naming

D = 64            # H = 2 heads
H = 2
B, L = 2, 5


weights, block, x = family_fixtures(mamba3_weights, Mamba3Block, D, B, L)


def _input_states(k_value=0.0, v_value=0.0):
    return [np.zeros((B, H, 32), np.float32), np.zeros((B, H, 64, 128), np.float32),
            np.full((B, H, 128), k_value, np.float32), np.full((B, H, 64), v_value, np.float32)]


@pytest.mark.parametrize("d", [16, 48, 33, 0])
def test_d_model_not_multiple_of_32(d):
    w = mamba3_weights(32, seed=1)
    w["block_norm.weight"] = np.ones(d, np.float32)
    fails(ValueError, Mamba3Block, w, match=["multiple of 32", f"block_norm.weight has {d} entries"])


# ------------------------------------------------------------ buffered_tokens
@pytest.mark.parametrize("n", [-1, 65, 1000])
def test_buffered_tokens_out_of_range(block, x, n):
    st = filled_state(block)
    st.buffered_tokens = n
    for call, args in ((block.forward, (x, st)), (block.step, (x[:, 0], st)),
                       (block.decode_session, (st,))):
        fails(ValueError, call, *args, keep=[st, x],
              match=[f"state.buffered_tokens = {n}", "[0, 64]"])


def test_buffered_tokens_and_pending_types():
    with raises_naming(TypeError, "buffered_tokens", "int", "float"):
        Mamba3State(*[None] * 10, buffered_tokens=1.5)
    with raises_naming(TypeError, "pending", "bool", "int"):
        Mamba3State(*[None] * 10, pending=1)


def test_nonfinite_in_unread_buffer_rows_is_ignored(block, x):
    """Rows at or past buffered_tokens are never read (documented)."""
    good = filled_state(block)
    st = numpy_state(good)
    st.buffer_krot[:, 10] = np.nan
    assert as_bytes(block.forward(x, st)) == as_bytes(block.forward(x, good))
    # control: the same NaN in a read row is refused
    st.buffer_krot[0, 2, 0, 0] = np.nan
    fails(ValueError, block.forward, x, st, match=["state.buffer_krot", "flat index"])


# ------------------------------------------------------------ input states
def test_set_input_states_on_used_state_fails_at_next_call(block, x):
    st = filled_state(block)
    st.set_input_states(*_input_states())
    assert st.pending
    for call, args in ((block.forward, (x, st)), (block.step, (x[:, 0], st)),
                       (block.decode_session, (st,))):
        fails(ValueError, call, *args, keep=[st, x], match=["state.pending", "fresh"])


def test_set_input_states_bad_arguments(block):
    st = block.allocate_state(B)
    good = _input_states()
    for i, n in enumerate(["theta", "h", "k", "v"]):
        bad = list(good)
        bad[i] = good[i].astype(np.float64)
        fails(TypeError, st.set_input_states, *bad, keep=[st], match=[n, "float64"])
        bad[i] = np.zeros(good[i].shape[:-1] + (3,), np.float32)
        fails(ValueError, st.set_input_states, *bad, keep=[st],
              match=[n, f"got {bad[i].shape}"])
    assert not st.pending


def test_pending_consumed_and_nonfinite_pending(block, x):
    """pending_k/v are read (and checked) only while pending."""
    st = block.allocate_state(B)
    ins = _input_states(1.0, 1.0)
    ins[2][1, 1, 5] = np.nan
    st.set_input_states(*ins)
    idx = int(np.ravel_multi_index((1, 1, 5), ins[2].shape))
    for call, args in ((block.forward, (x, st)), (block.step, (x[:, 0], st)),
                       (block.decode_session, (st,))):
        fails(ValueError, call, *args, keep=[st, x],
              match=["state.pending_k", f"flat index {idx}"])
    ins[2][1, 1, 5] = 0.0
    st.set_input_states(*ins)
    block.forward(x, st)
    assert not st.pending and st.buffered_tokens == L
    np.asarray(st.pending_k)[1, 1, 5] = np.nan  # no longer pending: not read
    block.forward(x, st)


# ------------------------------------------------------------ block
def test_attributes_session_info_and_no_dt_limit(weights, x):
    blk = Mamba3Block(weights)
    assert (blk.d_model, blk.d_inner, blk.nheads) == (D, 2 * D, H)
    assert blk.d_in_proj == 2 * 2 * D + 256 + 3 * H + 32
    assert blk.session_info() is None
    blk.forward(x)
    info = blk.session_info()
    assert isinstance(info, dict) and info["forward_calls"] == 1
    with raises_naming(ValueError, "unknown parameters", "dt_limit"):
        blk.set_params(weights=mamba3_weights(D, seed=8), dt_limit=(0, 1))
    assert blk.session_info()["forward_calls"] == 1  # the refused set_params changed nothing
