"""Mamba-2 only bit properties (docs/numerics.md, "The contract of identical
mode"): buffered_tokens and h_last_ at the 256-token chunk boundary, a
nonzero initial h, the two conv1d.weight layouts, dt_limit on the
inference class, large batches grouped by rows. What every block promises
(decode == prefill, any split, ragged rows, thread counts, batch
composition, sessions, ...): the block contract, tests/contract/.

Each property is checked with exact byte equality and has a negative
control showing the same check fails on a small change.
"""
import numpy as np
import pytest

import mojolearn
from tests.bits import (
    assert_bits_differ, assert_only_rounding_differs, assert_same_bits, nudge, reordered_reduction,
)
from tests.contract.cases import snapshot, steps
from mojolearn.reference.weights import mamba2_weights, random_input

D = 64  # two heads
W = mamba2_weights(D, seed=21)
BLOCK = None


def block():
    global BLOCK
    if BLOCK is None:
        BLOCK = mojolearn.Mamba2Block(W)
    return BLOCK


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
    # steps through the boundary: 250 -> 255 -> 0 -> 6, the buffers emptied at 0
    state = block().allocate_state(1)
    block().forward(x[:, :250], state)
    seen = []
    for t in range(250, 262):
        block().step(x[:, t], state)
        seen.append(state.buffered_tokens)
        if t == 255:
            assert not np.asarray(state.buffer_xbc).any()
            assert_same_bits(np.asarray(block().h_last_), np.asarray(state.h), "after step 256")
    assert seen == [251, 252, 253, 254, 255, 0, 1, 2, 3, 4, 5, 6]


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
    assert snapshot(s1) == snapshot(s2)
    s3 = block().allocate_state(2)
    assert_bits_differ(np.asarray(block().forward(x, s3)), y, "zero vs nonzero initial h")


def test_conv_weight_2d_and_3d_identical():
    w2 = dict(W)
    w2["conv1d.weight"] = np.ascontiguousarray(W["conv1d.weight"].reshape(-1, 4))
    x = random_input(2, 40, D, seed=11)
    y = np.asarray(block().forward(x))
    assert_same_bits(np.asarray(mojolearn.Mamba2Block(w2).forward(x)), y, "(CD, 4) conv weight")
    w3 = dict(w2)
    w3["conv1d.weight"] = nudge(w2["conv1d.weight"], index=3)
    assert_bits_differ(np.asarray(mojolearn.Mamba2Block(w3).forward(x)), y, "nudged conv weight")


def test_inference_class_takes_dt_limit():
    x = random_input(2, 260, D, seed=8)
    inf = mojolearn.Mamba2BlockInference(W, dt_limit=(0.0, 0.05))
    ref = mojolearn.Mamba2Block(W, dt_limit=(0.0, 0.05))
    assert_same_bits(np.asarray(inf.forward(x)), np.asarray(ref.forward(x)), "dt_limit")
    assert_bits_differ(np.asarray(inf.forward(x)), np.asarray(block().forward(x)), "default")


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
