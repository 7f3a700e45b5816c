"""Batched decode steps of 7-64 rows (the projections' segment-major pass,
linear.mojo _rows_many: register groups of 3-6 rows, running sums in a
buffer) give each row the bits of that row stepped alone.

d_model 40 (Mamba-1) leaves a partial 16-column panel in every projection
and two 32-step k segments; d_model 64 (Mamba-2, Mamba-3) gives 2-4
segments. B = 7 makes groups of 3 and 4 rows, 9 of 4 and 5, 13 of 4, 4 and
5, 32 of 5, 5, 5, 5, 6 and 6. Each check is an exact byte comparison with a
negative control (the row alone on an input one ulp away).
"""
import numpy as np
import pytest

import mojolearn
from tests.bits import assert_bits_differ, assert_same_bits, nudge
from mojolearn.reference.weights import (mamba1_weights, mamba2_weights, mamba3_weights,
                                         random_input)

BLOCKS = {
    "mamba1": lambda: mojolearn.Mamba1Block(mamba1_weights(40, seed=4)),
    "mamba2": lambda: mojolearn.Mamba2Block(mamba2_weights(64, seed=4)),
    "mamba3": lambda: mojolearn.Mamba3Block(mamba3_weights(64, seed=4)),
}
STEPS = 2


def _session_steps(block, x):
    """Outputs (B, STEPS, d) of a decode session over x's tokens, from an
    empty state."""
    state = block.allocate_state(x.shape[0])
    with block.decode_session(state) as s:
        return np.stack([np.asarray(s.step(np.ascontiguousarray(x[:, t])))
                         for t in range(x.shape[1])], 1)


@pytest.mark.parametrize("kind", sorted(BLOCKS))
@pytest.mark.parametrize("B", [7, 9, 13, 32])
def test_batched_step_rows_equal_rows_alone(kind, B):
    block = BLOCKS[kind]()
    d = block.d_model
    x = random_input(B, STEPS, d, seed=60 + B)
    y = _session_steps(block, x)
    for i in (0, B // 2, B - 1):
        alone = _session_steps(block, x[i:i + 1])[0]
        assert_same_bits(y[i], alone, f"{kind} B={B} row {i}")
    # negative control: the same comparison fails for an input one ulp away
    off = _session_steps(block, nudge(x[B - 1:B]))[0]
    assert_bits_differ(y[B - 1], off, f"{kind} B={B} nudged row")
