"""Mamba1Block.backward: gradients vs PyTorch autograd of transformers'
MambaBlock run in verified float64, a central-difference check of that
reference, and conv1d.weight's gradient in the caller's shape. The intake
of x and grad_output and the bit properties every block shares (each with
its control) are in tests/contract/test_backward.py.
"""
import numpy as np
import pytest

import mojolearn
from tests import backward_checks as checks
from tests import block_cases, tolerance
from tests.reference import hf_mamba as _hf
from tests.reference.hf_mamba import mamba1_reference
from mojolearn.reference.weights import mamba1_weights, random_input

NAMES = ("x", "norm.weight", "in_proj.weight", "conv1d.weight", "conv1d.bias",
         "x_proj.weight", "dt_proj.weight", "dt_proj.bias", "A_log", "D",
         "out_proj.weight")


# --------------------------------------------------------------------------- reference
def grad_reference(weights, x, grad_output, bcdt_rms_eps=None):
    """PyTorch autograd of transformers' MambaBlock in verified float64
    (with bcdt_rms_eps: FalconMambaBlock with mixer_rms_eps = bcdt_rms_eps).

    Same block, weights (float64 leaf parameters) and casts neutralised as
    hf_mamba.mamba1_reference, but with gradients enabled: the loss is
    sum(y * grad_output). The dispatch guard also sees the backward ops, so
    the whole VJP is checked to be float64. Returns {name: float64 array}
    (conv1d.weight as (di, 1, 4)).
    """
    block, _cfg, _d, _di = _hf._mamba1_block(weights, residual_in_fp32=False,
                                             bcdt_eps=bcdt_rms_eps)
    module = _hf._hf_m1 if bcdt_rms_eps is None else _hf._hf_fm
    out = checks.hf_float64_grads(
        block, module, x, grad_output,
        lambda name: name[len("mixer."):] if name.startswith("mixer.") else name)
    assert set(out) == set(NAMES)
    return out


def reference_and_scale(w, x, g):
    """The float64 gradients and each element's error scale (tests/tolerance.py)."""
    return tolerance.sensitivity(grad_reference, w, (x, g))


CHECK = tolerance.GradientCheck(NAMES, "Mamba-1 backward")
_compare = CHECK.compare


@pytest.fixture(scope="module", autouse=True)
def _report_worst():
    yield from CHECK.report()


# --------------------------------------------------------------------------- accuracy
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("L", [1, 7, 64, 130])
@pytest.mark.parametrize("d", [5, 16, 64])
def test_gradients_match_float64_autograd(d, L, B):
    w = mamba1_weights(d, seed=d)
    got, x, g = checks.backward_with_shapes(mojolearn.Mamba1Block(w), w, B, L, NAMES)
    # L = 1: A_log has no gradient (h starts at zero), so no control
    _compare(got, *reference_and_scale(w, x, g), f"d={d} L={L} B={B}", control=L > 1)


@pytest.mark.parametrize("L", [2, 33, 34, 66, 96])
def test_gradients_at_chunk_edges(L):
    """Chunks are 32 tokens: a last chunk of 1 or 2 tokens carries the conv
    look-ahead across two chunks; 96 ends exactly on a chunk boundary."""
    d, B = 16, 2
    w = mamba1_weights(d, seed=4)
    x, g = random_input(B, L, d, seed=L), random_input(B, L, d, seed=L + 1)
    _compare(mojolearn.Mamba1Block(w).backward(x, g), *reference_and_scale(w, x, g),
             f"edge L={L}")


@pytest.mark.parametrize("bias_shift,x_scale", block_cases.SOFTPLUS_SHIFTS)
def test_gradients_softplus_threshold_and_large_inputs(bias_shift, x_scale):
    """softplus inputs around 20 (both branches of its gradient), large gates."""
    w, x = block_cases.mamba1_softplus_case(bias_shift, x_scale)
    g = random_input(2, 33, 32, seed=5)
    _compare(mojolearn.Mamba1Block(w).backward(x, g), *reference_and_scale(w, x, g),
             f"bias+{bias_shift} x*{x_scale}")


def test_one_percent_off_in_the_small_elements_fails():
    """Negative control of the elementwise bound: the smallest 20% of the
    nonzero elements of any one array 1% off fails it (the former bound,
    1e-4 max|ref| per array, let A_log's pass)."""
    d, B, L = 16, 2, 40
    w = mamba1_weights(d, seed=5)
    x, g = random_input(B, L, d, seed=6), random_input(B, L, d, seed=7)
    got = {k: np.asarray(v) for k, v in mojolearn.Mamba1Block(w).backward(x, g).items()}
    ref, scale = reference_and_scale(w, x, g)
    for name in NAMES:
        tolerance.assert_within(got[name], ref[name], scale[name], name)
        bad = tolerance.smallest_changed(got[name])
        with pytest.raises(AssertionError):
            tolerance.assert_within(bad, ref[name], scale[name], f"{name} 1% off")
    bad = tolerance.smallest_changed(got["A_log"])
    assert np.abs(bad - ref["A_log"]).max() <= 1e-4 * np.abs(ref["A_log"]).max()


def test_conv_weight_gradient_in_the_callers_shape():
    d = 16
    w = mamba1_weights(d, seed=9)
    x, g = random_input(2, 40, d, seed=1), random_input(2, 40, d, seed=2)
    checks.check_conv_weight_in_callers_shape(mojolearn.Mamba1Block, w, x, g, NAMES, cd=2 * d)


@tolerance.one_torch_thread()  # small ops: a second thread only contends
def test_central_differences_confirm_the_reference():
    """The float64 autograd reference against central differences of the
    float64 forward (an independent check of the reference itself)."""
    d, B, L = 3, 2, 6
    w32 = mamba1_weights(d, seed=21)
    w = {k: v.astype(np.float64) for k, v in w32.items()}
    x = random_input(B, L, d, seed=22).astype(np.float64)
    g = random_input(B, L, d, seed=23).astype(np.float64)

    def loss(ww, xx):
        return float((mamba1_reference(ww, xx)[0] * g).sum())

    checks.check_central_differences(grad_reference(w, x, g), loss, w, x, NAMES, picks=3)
