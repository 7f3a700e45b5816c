"""Mamba-2 only: what the block contract (tests/contract/, the same checks
for all six block classes) does not cover: d_model a multiple of 32,
buffered_tokens, unread buffer rows, dt_limit, h_last_ after a call, a
session's buffered_tokens.

Every error test checks the exception class and that the message names the
thing at fault (tests/errors.py); a refused call given a state checks that
the state and x kept their bytes.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from mojolearn.mamba import Mamba2Block, Mamba2BlockInference, Mamba2State
from mojolearn.reference.weights import mamba2_weights
from tests.contract.cases import (as_bytes, fails, family_fixtures, filled_state,
                                  numpy_state, snapshot)
from tests.errors import raises_naming

D = 64
DI, H, CD = 128, 2, 384
B, L = 2, 5
NAMES = ("conv_window", "h", "buffer_xbc", "buffer_dtraw")
SHAPES = {"conv_window": (B, CD, 4), "h": (B, H, 64, 128), "buffer_xbc": (B, 256, CD),
          "buffer_dtraw": (B, 256, H)}


weights, block, x = family_fixtures(mamba2_weights, Mamba2Block, D, B, L)


@pytest.mark.parametrize("d", [16, 48, 100])
def test_d_model_not_a_multiple_of_32(d):
    w = mamba2_weights(64, seed=1)
    w["block_norm.weight"] = np.ones(d, np.float32)
    fails(ValueError, Mamba2Block, w, match=["multiple of 32", f"block_norm.weight has {d} entries"])


# ------------------------------------------------------------ buffered_tokens
@pytest.mark.parametrize("bad", [-1, 256, 300, 10**9])
def test_buffered_tokens_out_of_range(block, x, bad):
    with raises_naming(ValueError, f"buffered_tokens = {bad}", "[0, 256)"):
        Mamba2State(*[np.zeros(SHAPES[n], np.float32) for n in NAMES], buffered_tokens=bad)
    st = numpy_state(filled_state(block))
    before = snapshot(st)[0][:4]
    st.buffered_tokens = bad  # set after construction: checked at the call
    for call, args in ((block.forward, (x, st)), (block.step, (x[:, 0], st)),
                       (block.decode_session, (st,))):
        fails(ValueError, call, *args, keep=[x],
              match=[f"state.buffered_tokens = {bad}", "[0, 256)"])
        assert snapshot(st)[0][:4] == before and st.buffered_tokens == bad


@pytest.mark.parametrize("bad", [2.0, True, "3", None])
def test_buffered_tokens_bad_type(bad):
    with raises_naming(TypeError, "buffered_tokens", type(bad).__name__):
        Mamba2State(*[np.zeros(SHAPES[n], np.float32) for n in NAMES], buffered_tokens=bad)


def test_buffered_tokens_numpy_int_accepted(block, x):
    st = numpy_state(filled_state(block))
    ref = numpy_state(filled_state(block))
    st.buffered_tokens = np.int64(st.buffered_tokens)
    assert as_bytes(block.forward(x, st)) == as_bytes(block.forward(x, ref))
    assert st.buffered_tokens == ref.buffered_tokens and type(st.buffered_tokens) is int


def test_unread_buffer_rows_are_not_checked(block, x):
    """Rows at and past buffered_tokens are never read, so they may hold anything."""
    st = filled_state(block)
    np.asarray(st.buffer_xbc)[:, 3:] = np.nan
    np.asarray(st.buffer_dtraw)[:, 200] = np.inf
    ref = filled_state(block)
    assert as_bytes(block.forward(x, st)) == as_bytes(block.forward(x, ref))
    # control: the same NaN in a read row is refused
    np.asarray(st.buffer_xbc)[0, 2, 0] = np.nan
    fails(ValueError, block.forward, x, st, match=["state.buffer_xbc", "flat index"])


# ------------------------------------------------------------ dt_limit
@pytest.mark.parametrize("bad", [(float("nan"), 1.0), (0.0, float("nan")), (0.2, 0.1),
                                 (1.0,), (0.0, 1.0, 2.0), 0.5, None, "ab", (0.0, "1"),
                                 (True, 1.0), (0.0, 1j)],
                         ids=["nan-lo", "nan-hi", "lo>hi", "one", "three", "scalar", "None",
                              "str", "str-item", "bool", "complex"])
def test_bad_dt_limit(weights, bad):
    fails(ValueError, Mamba2Block, weights, dt_limit=bad, match=["dt_limit"])
    fails(ValueError, Mamba2BlockInference, weights, dt_limit=bad, match=["dt_limit"])


def test_good_dt_limits_accepted(weights):
    for lim in ((0, 1), (0.5, 0.5), [0.0, math.inf], (np.float32(0.01), np.float64(0.2)),
                (-1.0, 1e300)):
        blk = Mamba2Block(weights, dt_limit=lim)
        assert blk.dt_limit == (float(lim[0]), float(lim[1]))


def test_dt_limit_in_params(weights, x):
    blk = Mamba2Block(weights, dt_limit=(0.0, 0.05))
    p = blk.get_params()
    assert p["dt_limit"] == (0.0, 0.05)
    y = as_bytes(blk.forward(x))
    assert as_bytes(Mamba2Block(**p).forward(x)) == y
    assert as_bytes(Mamba2BlockInference(**p).forward(x)) == y
    blk.set_params(dt_limit=(0.0, math.inf))
    assert blk.dt_limit == (0.0, math.inf)
    assert as_bytes(blk.forward(x)) == as_bytes(Mamba2Block(weights).forward(x)) != y
    with raises_naming(ValueError, "dt_limit", "(1.0, 0.0)"):
        blk.set_params(dt_limit=(1.0, 0.0))
    assert blk.dt_limit == (0.0, math.inf)  # a refused set_params changes nothing


def test_attributes(block):
    assert (block.d_model, block.d_inner, block.nheads, block.conv_dim) == (D, DI, H, CD)
    assert block.dt_limit == (0.0, math.inf)


# ------------------------------------------------------------ h_last_
def test_h_last_uses_the_position_the_call_left(block, x):
    """Editing buffered_tokens after a call does not change the lazy report."""
    st = filled_state(block)
    ref = filled_state(block)
    block.forward(x, ref)
    h_ref = np.asarray(block.h_last_).copy()
    block.forward(x, st)
    st.buffered_tokens = 0
    assert np.asarray(block.h_last_).tobytes() == h_ref.tobytes()


# ------------------------------------------------------------ decode session
def test_session_buffered_tokens_stale_until_sync(block, x):
    st = filled_state(block)
    with block.decode_session(st) as sess:
        sess.step(x[:, 0])
        assert st.buffered_tokens == 3  # stale until sync_state
        sess.sync_state()
        assert st.buffered_tokens == 4
    block.step(x[:, 1], st)  # usable again after close
    assert st.buffered_tokens == 5
