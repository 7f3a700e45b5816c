"""Mamba-1 only: what the block contract (tests/contract/, the same checks
for all six block classes) does not cover: the two conv1d.weight layouts,
d_model >= 1, Mamba1State's reserved arguments, profile_id and
absolute_position, dt_rank.

Every error test checks the exception class and that the message names the
thing at fault (tests/errors.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from mojolearn.mamba import Mamba1Block, Mamba1State
from mojolearn.reference.weights import mamba1_weights, random_input
from tests.contract.cases import as_bytes, fails, snapshot, with_value
from tests.errors import raises_naming

D = 20            # dt_rank 2, d_inner 40
DI = 2 * D
R = 2
B, L = 2, 5


@pytest.fixture(scope="module")
def weights():
    return mamba1_weights(D, seed=3)


@pytest.fixture
def x():
    return random_input(B, L, D, seed=11)


@pytest.mark.parametrize("bad_shape", [(DI, 4, 1), (DI, 1, 3), (DI, 2, 4), (DI, 3), (DI * 4,),
                                       (1, DI, 4)])
def test_wrong_conv_weight_shape(weights, bad_shape):
    w = dict(weights)
    w["conv1d.weight"] = np.zeros(bad_shape, np.float32)
    fails(ValueError, Mamba1Block, w, match=["conv1d.weight", str(bad_shape)])


def test_nonfinite_conv_weight_2d(weights):
    w = dict(weights)
    w["conv1d.weight"] = with_value(weights["conv1d.weight"].reshape(DI, 4), 37)
    fails(ValueError, Mamba1Block, w, keep=[w["conv1d.weight"]],
          match=["conv1d.weight", "flat index 37"])


def test_conv_weight_2d_and_3d_identical(weights, x):
    w2 = dict(weights)
    w2["conv1d.weight"] = np.ascontiguousarray(weights["conv1d.weight"].reshape(DI, 4))
    b3, b2 = Mamba1Block(weights), Mamba1Block(w2)
    assert as_bytes(b3.forward(x)) == as_bytes(b2.forward(x))
    s3, s2 = b3.allocate_state(B), b2.allocate_state(B)
    assert as_bytes(b3.forward(x, s3)) == as_bytes(b2.forward(x, s2))
    assert as_bytes(b3.step(x[:, 0], s3)) == as_bytes(b2.step(x[:, 0], s2))
    assert snapshot(s3) == snapshot(s2)
    assert as_bytes(b3.forward(x, lengths=[2, 5])) == as_bytes(b2.forward(x, lengths=[2, 5]))
    # control: the (d_inner, 4) weight of another layout (transposed) differs
    w2["conv1d.weight"] = np.ascontiguousarray(weights["conv1d.weight"].reshape(4, DI).T)
    assert as_bytes(Mamba1Block(w2).forward(x)) != as_bytes(b3.forward(x))


def test_zero_d_model(weights):
    w = {k: np.zeros((0,) * v.ndim, np.float32) for k, v in weights.items()}
    fails(ValueError, Mamba1Block, w, match=["norm.weight", "d_model >= 1"])


def test_state_reserved_arguments():
    cw, h = np.zeros((1, DI, 4), np.float32), np.zeros((1, DI, 16), np.float32)
    for name in ("affine_boundary", "affine_a", "affine_b"):
        with raises_naming(ValueError, name, "None"):
            Mamba1State(cw, h, **{name: 1})


def test_profile_id_and_absolute_position(weights, x):
    """profile_id is kept, never read; absolute_position counts the tokens
    forward, step and a session consumed; both must be ints."""
    blk = Mamba1Block(weights)
    st = blk.allocate_state(B)
    assert (st.profile_id, st.absolute_position) == (1, 0)
    blk.forward(x, st)
    blk.step(x[:, 0], st)
    with blk.decode_session(st) as s:
        s.step(x[:, 1])
        s.step(x[:, 2])
    assert st.absolute_position == L + 3
    tagged = Mamba1State(np.array(st.conv_window), np.array(st.h), profile_id=7,
                         absolute_position=np.int64(100))
    assert (tagged.profile_id, tagged.absolute_position) == (7, 100)
    assert as_bytes(blk.step(x[:, 3], tagged)) == as_bytes(blk.step(x[:, 3], st))
    assert tagged.absolute_position == 101
    for name, bad in (("profile_id", 1.5), ("absolute_position", "3"), ("profile_id", True)):
        with raises_naming(TypeError, name, "int", type(bad).__name__):
            Mamba1State(np.array(st.conv_window), np.array(st.h), **{name: bad})


def test_dt_rank_and_d_inner(weights):
    blk = Mamba1Block(weights)
    assert (blk.d_model, blk.d_inner, blk.dt_rank) == (D, DI, R)
    blk.set_params(weights=mamba1_weights(8, seed=1))  # another d_model through set_params
    assert (blk.d_model, blk.d_inner, blk.dt_rank) == (8, 16, 1)
    assert Mamba1Block(mamba1_weights(33, seed=1)).dt_rank == 3
