"""Mamba2Block.backward: gradients vs PyTorch autograd of transformers'
Mamba2Block run in verified float64 (with and without dt_limit, and the
clamp's gradient at its bounds), a central-difference check of that
reference, and conv1d.weight's gradient in the caller's shape. The intake
of x and grad_output and the bit properties every block shares (each with
its control) are in tests/contract/test_backward.py.
"""
import math

import numpy as np
import pytest
import torch

import mojolearn
from tests import backward_checks as checks
from tests import tolerance
from tests.reference import hf_mamba as _hf
from tests.reference.hf_mamba import mamba2_reference
from mojolearn.reference.weights import mamba2_weights, random_input

REL = 1e-4  # test_single_token_single_head: D and dt_bias within REL or 2x PyTorch float32
NAMES = ("x", "block_norm.weight", "in_proj.weight", "conv1d.weight", "conv1d.bias",
         "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")
INF = math.inf


# --------------------------------------------------------------------------- reference
def grad_reference(weights, x, grad_output, dt_limit=(0.0, INF), n_groups=1):
    """PyTorch autograd of transformers' Mamba2Block in verified float64.

    Same block, weights (float64 leaf parameters), torch path and casts
    neutralised as hf_mamba.mamba2_reference, with gradients enabled: the
    loss is sum(y * grad_output). The dispatch guard also sees the backward
    ops, so the whole VJP is checked to be float64. Returns {name: float64
    array} (our names; conv1d.weight as (CD, 1, 4)).
    """
    lo, hi = _hf._check_dt_limit(dt_limit)
    block, _cfg, _d, _di, _h = _hf._mamba2_block(weights, (lo, hi), residual_in_fp32=False,
                                                 n_groups=n_groups)
    out = checks.hf_float64_grads(block, _hf._hf_m2, x, grad_output, _our_name)
    assert set(out) == set(NAMES)
    return out


def _our_name(name):
    """Our name of a parameter of transformers' Mamba2Block."""
    return "block_norm.weight" if name == "norm.weight" else name[len("mixer."):]


def reference_and_scale(w, x, g, dt_limit=(0.0, INF), **kw):
    """The float64 gradients and each element's error scale (tests/tolerance.py).
    dL/dD_h, one number summed over every token, may cancel to ~1e-3 of its
    terms: the scale sees that (the former per-array bound needed a special
    term that allowed D 1.85% off at d = 32, B = 1, L = 530)."""
    return tolerance.sensitivity(lambda w_, x_, g_: grad_reference(w_, x_, g_, dt_limit),
                                 w, (x, g), **kw)


CHECK = tolerance.GradientCheck(NAMES, "Mamba-2 backward")
_compare = CHECK.compare


@pytest.fixture(scope="module", autouse=True)
def _report_worst():
    yield from CHECK.report()


# --------------------------------------------------------------------------- accuracy
@pytest.mark.parametrize("d,B,L", [
    (32, 3, 1), (64, 3, 1), (32, 3, 5), (64, 1, 5), (64, 1, 255), (32, 3, 255),
    (32, 3, 256), (64, 1, 256), (64, 3, 257), (32, 1, 257), (32, 1, 530),
])
def test_gradients_match_float64_autograd(d, B, L):
    w = mamba2_weights(d, seed=d + L)
    got, x, g = checks.backward_with_shapes(mojolearn.Mamba2Block(w), w, B, L, NAMES)
    # L = 1: a head's y is c x (one scalar c), so the gated norm's scale
    # invariance makes sum_p x_p dy_p cancel exactly (tolerance.py, cancels)
    _compare(got, *reference_and_scale(w, x, g, cancels=L == 1), f"d={d} L={L} B={B}",
             control=L > 1)


def _torch_float32_grads(weights, x, grad_output, dt_limit=(0.0, INF)):
    """The same autograd run in float32 (transformers' own precision): how
    far plain float32 arithmetic lands from the float64 reference."""
    block, _cfg, _d, _di, _h = _hf._mamba2_block(weights, dt_limit, residual_in_fp32=False)
    block = block.to(torch.float32)
    xt = torch.from_numpy(np.array(x, dtype=np.float32)).requires_grad_(True)
    with _hf.torch_path(_hf._hf_m2), torch.enable_grad():
        (block(xt) * torch.from_numpy(np.array(grad_output, np.float32))).sum().backward()
    out = {"x": xt.grad.double().numpy()}
    for name, p in block.named_parameters():
        out[_our_name(name)] = p.grad.double().numpy()
    return out


def test_single_token_single_head():
    """B = 1, L = 1, one head: D and dt_bias are single numbers, each a sum
    over 64 channels that cancels (here to ~1e-6 of its terms), so float32
    cannot reach 1e-4 of them: PyTorch's own float32 autograd misses them by
    7e-4 on this draw. Those two must be within 2x of PyTorch float32's
    error (or within REL); every other array within the elementwise bound
    (with the exact-cancellation term of L = 1, see test_gradients_match_...)."""
    d, B, L = 32, 1, 1
    w = mamba2_weights(d, seed=d + L)
    x, g = random_input(B, L, d, seed=200 + L), random_input(B, L, d, seed=300 + L)
    got = mojolearn.Mamba2Block(w).backward(x, g)
    ref, scale = reference_and_scale(w, x, g, cancels=True)
    t32 = _torch_float32_grads(w, x, g)
    rel, rel32 = {}, {}
    for name in ("D", "dt_bias"):
        top = float(np.abs(ref[name]).max())
        rel[name] = float(np.abs(np.asarray(got[name], np.float64) - ref[name]).max()) / top
        rel32[name] = float(np.abs(t32[name] - ref[name]).max()) / top
        print(f"\nL=1 {name}: ours {rel[name]:.2e}, torch float32 {rel32[name]:.2e}")
    # both are dy . x (times a positive factor for dt_bias): the same
    # conditioning, so the bound is twice float32 PyTorch's worse one
    bound = max(2 * max(rel32.values()), REL)
    for name in rel:
        assert rel[name] <= bound, (name, rel[name], bound)
    for name in NAMES:
        if name not in rel:
            tolerance.assert_within(got[name], ref[name], scale[name], f"L=1 {name}")


@pytest.mark.parametrize("d,B,L", [(32, 2, 300), (64, 1, 40)])
def test_gradients_with_dt_limit(d, B, L):
    """dt of these weights spans about [0.001, 0.1]: both bounds clamp."""
    lim = (0.01, 0.05)
    w = mamba2_weights(d, seed=7)
    x = random_input(B, L, d, seed=8)
    g = random_input(B, L, d, seed=9)
    got = mojolearn.Mamba2Block(w, dt_limit=lim).backward(x, g)
    _compare(got, *reference_and_scale(w, x, g, lim), f"dt_limit {lim} d={d} L={L} B={B}")


@tolerance.one_torch_thread()
def test_clamp_gradient_is_inclusive_at_the_bounds():
    """PyTorch's clamp passes the gradient where lo <= v <= hi (bounds
    included). Here softplus(dtraw + dt_bias) equals lo == hi exactly on
    every token (dt rows of in_proj zero, dt_bias > 20 where softplus is the
    identity in both), so d dt_bias is nonzero only under that convention."""
    a = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    torch.clamp(a, 1.0, 2.0).sum().backward()
    assert a.grad.tolist() == [0.0, 1.0, 1.0, 0.0]
    d, B, L = 64, 2, 20
    w = mamba2_weights(d, seed=5)
    di, H = 2 * d, 2 * d // 64
    w["in_proj.weight"][2 * di + 256:] = 0.0
    w["dt_bias"][:] = np.float32(20.5)
    w["A_log"][:] = np.float32(math.log(1e-3))  # dA = -0.02: moderate decay
    lim = (20.5, 20.5)
    x, g = random_input(B, L, d, seed=1), random_input(B, L, d, seed=2)
    got = mojolearn.Mamba2Block(w, dt_limit=lim).backward(x, g)
    # dt_bias unperturbed: a perturbation would move dt off the bounds
    ref, scale = reference_and_scale(w, x, g, lim, keep=("dt_bias",))
    assert np.all(np.abs(ref["dt_bias"]) > 0)
    _compare(got, ref, scale, "dt on both bounds")
    assert np.all(np.abs(np.asarray(got["dt_bias"])) > 0)
    # just outside the bounds: no gradient reaches dt_bias
    lim_out = (20.75, 21.0)
    got_out = mojolearn.Mamba2Block(w, dt_limit=lim_out).backward(x, g)
    assert np.all(np.asarray(got_out["dt_bias"]) == 0.0)
    assert np.all(grad_reference(w, x, g, lim_out)["dt_bias"] == 0.0)
    assert H == 2


def test_conv_weight_gradient_in_the_callers_shape():
    d = 32
    w = mamba2_weights(d, seed=9)
    x, g = random_input(2, 20, d, seed=1), random_input(2, 20, d, seed=2)
    checks.check_conv_weight_in_callers_shape(mojolearn.Mamba2Block, w, x, g, NAMES,
                                              cd=2 * d + 256)


@tolerance.one_torch_thread()  # small ops: a second thread only contends
def test_central_differences_confirm_the_reference():
    """The float64 autograd reference against central differences of the
    float64 forward (an independent check of the reference itself)."""
    d, B, L = 32, 1, 4
    lim = (0.0, 0.08)
    w32 = mamba2_weights(d, seed=21)
    w = {k: v.astype(np.float64) for k, v in w32.items()}
    x = random_input(B, L, d, seed=22).astype(np.float64)
    g = random_input(B, L, d, seed=23).astype(np.float64)

    def loss(ww, xx):
        return float((mamba2_reference(ww, xx, dt_limit=lim)[0] * g).sum())

    checks.check_central_differences(grad_reference(w, x, g, lim), loss, w, x, NAMES, picks=2)
