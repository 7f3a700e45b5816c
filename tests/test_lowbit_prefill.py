"""Prefill-sized products on packed weights (mojolearn.lowbit): a row block
of more than 64 rows widens each panel's k steps once into a float32 slab
and runs the float32 tiles on it (linear.mojo's prefill pass). The bytes
must be those of the same block on the exactly expanded float32 weights,
whatever the slabs (k above one slab's 768 steps), the row blocks (a
256-row group: two blocks and leftover rows) and a partial last panel."""
import pytest

import mojolearn
from mojolearn import lowbit
from tests.bits import assert_same_bits
from mojolearn.reference.weights import mamba1_weights, mamba2_weights, random_input

# d = 416: Mamba-2's out_proj has k = 832 (two slabs: 768 + 64) and its
# in_proj 1933 outputs (a last panel of 13 rows); 263 tokens: a full
# 256-row chunk (row blocks of 132 and 124 rows), then 7 rows.
# Mamba-1 at d = 400: out_proj k = 800, 150 rows in one block.
CASES = [("Mamba2Block", mamba2_weights, 416, 263), ("Mamba1Block", mamba1_weights, 400, 150)]


@pytest.mark.parametrize("cls, make, d, length", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "q4_0", "q8_0"])
def test_prefill_on_packed_weights_gives_the_bytes_of_the_expanded_weights(
        cls, make, d, length, fmt):
    Block = getattr(mojolearn, cls)
    w = make(d, seed=11)
    packed = lowbit.pack(w, fmt)
    expanded, _ = lowbit.unpack(packed)
    x = random_input(1, length, d, seed=12)
    got = Block(packed).forward(x)
    assert_same_bits(got, Block(expanded).forward(x))
    # control: the packed values differ from the float32 originals, and the
    # comparison sees it
    assert bytes(memoryview(got)) != bytes(memoryview(Block(w).forward(x)))
