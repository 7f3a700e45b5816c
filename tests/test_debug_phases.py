"""mojolearn.debug: the phase table names every forward phase of a one-chunk
pass, and timing never changes a bit."""
import numpy as np
import pytest

import mojolearn as ml
from mojolearn import _abi, debug
from mojolearn.reference.weights import mamba1_weights, mamba2_weights, mamba3_weights

CASES = {
    "m1_forward": (ml.Mamba1Block, mamba1_weights, {"bcdt_rms_eps": 1e-6}),
    "m2_forward": (ml.Mamba2Block, mamba2_weights, {}),
    "m3_forward": (ml.Mamba3Block, mamba3_weights, {}),
}


def _block(op):
    cls, weights, kw = CASES[op]
    return cls(weights(32, seed=1), **kw)


def _x(seed=2):
    return np.random.default_rng(seed).standard_normal((1, 3, 32)).astype(np.float32)


def _phases(op, block):
    with debug.timing_phases() as timing:
        block.forward(_x())
    return sorted({r["phase"] for r in timing.result if r["op"] == op})


@pytest.mark.parametrize("op", sorted(CASES))
def test_one_chunk_has_one_named_phase_per_stage(op):
    # Mamba-1/2: phase 0 loads the state, then the stages, then one phase
    # saves it; Mamba-3 runs its stages from phase 0. A stage list shorter or
    # longer than the kernel's shifts every name after the gap.
    names = debug.STAGES[_abi.op_ids()[op]]
    first = 0 if op == "m3_forward" else 1
    last = first + len(names) - (0 if first else 1)
    assert _phases(op, _block(op)) == list(range(last + 1))
    op_id = _abi.op_ids()[op]
    labels = [debug.stage_of(op_id, p) for p in range(first, first + len(names))]
    assert labels == list(names)
    if first:
        assert debug.stage_of(op_id, 0) == "load state"
        assert debug.stage_of(op_id, last) == "save state"


@pytest.mark.parametrize("op", sorted(CASES))
def test_timing_changes_no_bit(op):
    block = _block(op)
    plain = bytes(block.forward(_x()))
    with debug.timing_phases() as timing:
        timed = bytes(block.forward(_x()))
    assert timing.result, "timing recorded nothing"
    assert timed == plain
    assert bytes(block.forward(_x(seed=3))) != plain  # control: other input, other bytes


def test_timing_is_off_after_the_block():
    block = _block("m2_forward")
    with debug.timing_phases():
        block.forward(_x())
    block.forward(_x())
    assert debug.phase_times() == []
