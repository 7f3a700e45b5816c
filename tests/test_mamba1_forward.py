"""Mamba-1 forward vs transformers' MambaBlock run in verified float64."""
import numpy as np
import pytest

import mojolearn
from tests import block_cases, tolerance
from tests.reference.hf_mamba import mamba1_reference
from mojolearn.reference.weights import mamba1_weights, random_input

ATOL, RTOL = 1e-6, 1e-5
WORST = {}  # worst err / bound ratio seen, reported at the end


def _check(y, ref, label):
    return tolerance.assert_mixed_bound(y, ref, label, ATOL, RTOL, WORST)


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("L", [1, 7, 64, 257])
@pytest.mark.parametrize("d", [1, 5, 16, 64, 256])
def test_forward_matches_transformers_float64(d, L, B):
    w = mamba1_weights(d, seed=d)
    x = random_input(B, L, d, seed=100 + L)
    block = mojolearn.Mamba1Block(w)
    ref, ref_conv, ref_h = mamba1_reference(w, x)
    _check(block.forward(x), ref, f"d={d} L={L} B={B}")
    # the carried state after a prefill matches the reference's cache
    state = block.allocate_state(B)
    block.forward(x, state)
    np.testing.assert_allclose(np.asarray(state.conv_window), ref_conv, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.h), ref_h, rtol=1e-4, atol=1e-6)


def test_continuation_from_a_state_matches_transformers():
    w, x, block, state = block_cases.continuation_case(mojolearn.Mamba1Block, mamba1_weights, 12)
    block.forward(x[:, :5], state)
    ref, _, _ = mamba1_reference(w, x[:, 5:], np.asarray(state.conv_window, np.float64),
                                 np.asarray(state.h, np.float64))
    _check(block.forward(x[:, 5:], state), ref, "continuation")


@pytest.mark.parametrize("bias_shift,x_scale", block_cases.SOFTPLUS_SHIFTS)
def test_softplus_near_threshold_and_large_inputs(bias_shift, x_scale):
    """softplus inputs around its threshold 20 (both branches), large gates."""
    w, x = block_cases.mamba1_softplus_case(bias_shift, x_scale)
    block = mojolearn.Mamba1Block(w)
    ref, _, _ = mamba1_reference(w, x)
    _check(block.forward(x), ref, f"bias+{bias_shift} x*{x_scale}")


@pytest.mark.parametrize("a_scale", [150.0, 3000.0])
def test_decays_beyond_exps_fast_range(a_scale):
    """dt * A below -87 on some lanes, where the scan must take exp's checked
    path (its fast path needs the whole token's 16 x 16 exponents in
    [-87, 88]): every third channel's A scaled up."""
    d = 32
    w = mamba1_weights(d, seed=5)
    w["A_log"] = w["A_log"].copy()
    w["A_log"][::3] += np.float32(np.log(a_scale))
    w["dt_proj.bias"] = w["dt_proj.bias"] + np.float32(2.0)
    x = random_input(2, 40, d, seed=6, scale=3.0)
    block = mojolearn.Mamba1Block(w)
    ref, _, _ = mamba1_reference(w, x)
    _check(block.forward(x), ref, f"A x{a_scale}")


def test_reference_mismatch_is_detected():
    """Negative control: a perturbed weight must fail the tolerance."""
    _, x, ref, w2 = block_cases.perturbed_out_proj(mamba1_weights, mamba1_reference, 16)
    y = mojolearn.Mamba1Block(w2).forward(x)
    with pytest.raises(AssertionError):
        _check(y, ref, "perturbed")
