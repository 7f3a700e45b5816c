"""Checks of the float64 references themselves.

(a) transformers-in-float64 (hf_mamba) == independent NumPy recurrence
    (mojolearn.reference.mamba1 / mamba2) to 1e-10 relative; (b) Mamba-1 continuation
    == one-shot run to 1e-12; (c) the float64 guard fires when neutralisation is off
    (negative control); (d) the references run transformers' torch functions, never
    a kernel installed at an entry point. Plus weight-dict checks and a loose check
    against transformers' own float32 run.
"""

from __future__ import annotations

import functools
import inspect
import math

import numpy as np
import pytest
import torch
import transformers

from . import hf_mamba
from .hf_mamba import Float32LeakError, mamba1_reference, mamba2_reference
from mojolearn.reference.mamba1 import mamba1_numpy
from mojolearn.reference.mamba2 import mamba2_numpy
from mojolearn.reference.ops import rmsnorm, silu, softplus
from mojolearn.reference.weights import mamba1_weights, mamba2_weights, random_input
from tests.errors import raises_naming

TOL_REF = 1e-10
TOL_CONT = 1e-12


def rel(a, b, base=None):
    """max |a - b| / max |b - base| (base=None: / max |b|)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    den = np.max(np.abs(b if base is None else b - base))
    assert den > 0
    return float(np.max(np.abs(a - b)) / den)


def x64(x):
    return np.asarray(x, np.float64)


# ----------------------------------------------------------------------------- weights
M1_SHAPES = lambda d, R: {  # noqa: E731
    "norm.weight": (d,), "in_proj.weight": (4 * d, d), "conv1d.weight": (2 * d, 1, 4),
    "conv1d.bias": (2 * d,), "x_proj.weight": (R + 32, 2 * d), "dt_proj.weight": (2 * d, R),
    "dt_proj.bias": (2 * d,), "A_log": (2 * d, 16), "D": (2 * d,), "out_proj.weight": (d, 2 * d)}
M2_SHAPES = lambda d, H: {  # noqa: E731
    "block_norm.weight": (d,), "in_proj.weight": (4 * d + 256 + H, d),
    "conv1d.weight": (2 * d + 256, 1, 4), "conv1d.bias": (2 * d + 256,), "dt_bias": (H,),
    "A_log": (H,), "D": (H,), "norm.weight": (2 * d,), "out_proj.weight": (d, 2 * d)}


@pytest.mark.parametrize("d", [1, 17, 32, 40, 64])
def test_mamba1_weight_dict(d):
    w = mamba1_weights(d, 3)
    want = M1_SHAPES(d, math.ceil(d / 16))
    assert {k: v.shape for k, v in w.items()} == want
    assert all(v.dtype == np.float32 and v.flags.c_contiguous for v in w.values())
    w2 = mamba1_weights(d, 3)
    assert all(np.array_equal(w[k], w2[k]) for k in w)
    assert not np.array_equal(w["in_proj.weight"], mamba1_weights(d, 4)["in_proj.weight"])
    np.testing.assert_allclose(np.exp(w["A_log"][0]), np.arange(1, 17), rtol=1e-6)
    dt = softplus(x64(w["dt_proj.bias"]))
    assert dt.min() >= 0.001 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)


@pytest.mark.parametrize("d", [32, 64, 96])
def test_mamba2_weight_dict(d):
    w = mamba2_weights(d, 3)
    assert {k: v.shape for k, v in w.items()} == M2_SHAPES(d, d // 32)
    assert all(v.dtype == np.float32 for v in w.values())
    assert all(np.array_equal(w[k], mamba2_weights(d, 3)[k]) for k in w)
    assert np.all((np.exp(w["A_log"]) >= 1 - 1e-6) & (np.exp(w["A_log"]) <= 16 + 1e-5))
    with pytest.raises(ValueError):
        mamba2_weights(48, 0)


def test_random_input():
    x = random_input(2, 3, 5, seed=1, scale=2.0)
    assert x.shape == (2, 3, 5) and x.dtype == np.float32
    assert np.array_equal(x, random_input(2, 3, 5, seed=1, scale=2.0))


# ------------------------------------------------------------- (a) Mamba-1 vs NumPy
@pytest.mark.parametrize("d,B,L", [(32, 1, 1), (32, 2, 5), (64, 2, 300), (40, 1, 5), (17, 2, 3)])
def test_mamba1_reference_matches_numpy(d, B, L):
    w = mamba1_weights(d, seed=d + L)
    x = random_input(B, L, d, seed=100 + L)
    y, cs, ss = mamba1_reference(w, x)
    assert hf_mamba.LAST_RUN["path"] == "prefill"
    yn, csn, ssn = mamba1_numpy(w, x)
    assert y.dtype == cs.dtype == ss.dtype == np.float64
    assert rel(y, yn, base=x64(x)) < TOL_REF   # relative to the mixer's contribution
    assert rel(cs, csn) < TOL_REF
    assert rel(ss, ssn) < TOL_REF
    # the conv window is the last four pre-conv rows, oldest first (zeros before t = 0)
    if L < 4:
        assert np.all(cs[:, :, : 4 - L] == 0)


def test_mamba1_reference_with_states_matches_numpy():
    d, B, L = 32, 2, 5
    w = mamba1_weights(d, seed=11)
    x = random_input(B, L, d, seed=12)
    rng = np.random.default_rng(13)
    cs0 = rng.standard_normal((B, 2 * d, 4))
    ss0 = rng.standard_normal((B, 2 * d, 16))
    y, cs, ss = mamba1_reference(w, x, cs0, ss0)
    assert hf_mamba.LAST_RUN["path"] == "stepped"
    yn, csn, ssn = mamba1_numpy(w, x, cs0, ss0)
    assert rel(y, yn, base=x64(x)) < TOL_REF
    assert rel(cs, csn) < TOL_REF and rel(ss, ssn) < TOL_REF
    # the carried state matters
    y0, _, _ = mamba1_reference(w, x)
    assert rel(y0, y, base=x64(x)) > 1e-3


# ------------------------------------------------------------- (a) Mamba-2 vs NumPy
M2_CASES = [
    # d, B, L, dt_limit, nonzero initial_h
    (64, 1, 1, (0.0, math.inf), False),
    (64, 2, 5, (0.0, math.inf), False),
    (64, 2, 300, (0.0, math.inf), False),
    (32, 1, 300, (0.0, math.inf), False),
    (64, 2, 300, (0.001, 0.1), False),
    (64, 2, 5, (0.0, math.inf), True),
    (64, 1, 1, (0.001, 0.1), True),
    (64, 2, 300, (0.0, math.inf), True),
]


@pytest.mark.parametrize("d,B,L,dt_limit,with_h", M2_CASES)
def test_mamba2_reference_matches_numpy(d, B, L, dt_limit, with_h):
    w = mamba2_weights(d, seed=d + L)
    x = random_input(B, L, d, seed=200 + L)
    h0 = np.random.default_rng(7).standard_normal((B, d // 32, 64, 128)) if with_h else None
    y, h = mamba2_reference(w, x, initial_h=h0, dt_limit=dt_limit)
    assert hf_mamba.LAST_RUN["path"] == "chunk_scan"
    yn, hn = mamba2_numpy(w, x, h0=h0, dt_limit=dt_limit)
    assert y.dtype == h.dtype == np.float64 and h.shape == (B, d // 32, 64, 128)
    assert rel(y, yn, base=x64(x)) < TOL_REF
    assert rel(h, hn) < TOL_REF


def _mamba2_dt(w, x):
    """dt before the clamp: in_proj of the normed x, then softplus(dtraw + dt_bias)."""
    W = {k: x64(v) for k, v in w.items()}
    d = x.shape[-1]
    proj = rmsnorm(x64(x), W["block_norm.weight"]) @ W["in_proj.weight"].T
    return softplus(proj[..., 4 * d + 256:] + W["dt_bias"])


def test_mamba2_dt_limit_is_active():
    d, B, L = 64, 2, 300
    w = mamba2_weights(d, seed=d + L)
    x = random_input(B, L, d, seed=200 + L)
    dt = _mamba2_dt(w, x)
    assert (dt < 0.001).mean() > 0.01 and (dt > 0.1).mean() > 0.01   # both bounds bite
    y_lim, _ = mamba2_reference(w, x, dt_limit=(0.001, 0.1))
    y_free, _ = mamba2_reference(w, x)
    assert rel(y_lim, y_free, base=x64(x)) > 1e-4


def test_mamba2_initial_h_matters_and_zero_h_is_default():
    d, B, L = 64, 1, 5
    w = mamba2_weights(d, seed=5)
    x = random_input(B, L, d, seed=6)
    y0, h0 = mamba2_reference(w, x)
    yz, hz = mamba2_reference(w, x, initial_h=np.zeros((B, 2, 64, 128)))
    assert np.array_equal(y0, yz) and np.array_equal(h0, hz)
    yh, _ = mamba2_reference(w, x, initial_h=np.ones((B, 2, 64, 128)))
    assert rel(yh, y0, base=x64(x)) > 1e-3


@pytest.mark.parametrize("bad", [(0.1, 0.01), (math.nan, 1.0), (0.0,), "ab", (True, 1.0)])
def test_mamba2_bad_dt_limit(bad):
    w = mamba2_weights(32, 0)
    with pytest.raises(ValueError):
        mamba2_reference(w, random_input(1, 2, 32, 0), dt_limit=bad)


# ------------------------------------------------------------ (b) Mamba-1 continuation
@pytest.mark.parametrize("first", [5, 2, 1])
def test_mamba1_continuation_equals_one_shot(first):
    d, B, L = 32, 2, 8
    w = mamba1_weights(d, seed=21)
    x = random_input(B, L, d, seed=22)
    y_all, cs_all, ss_all = mamba1_reference(w, x)
    y1, cs1, ss1 = mamba1_reference(w, x[:, :first])
    y2, cs2, ss2 = mamba1_reference(w, x[:, first:], conv_state=cs1, ssm_state=ss1)
    assert rel(np.concatenate([y1, y2], axis=1), y_all, base=x64(x)) < TOL_CONT
    assert rel(cs2, cs_all) < TOL_CONT
    assert rel(ss2, ss_all) < TOL_CONT
    # carried zero states == fresh prefill (stepped path vs prefill path)
    yz, csz, ssz = mamba1_reference(w, x, np.zeros_like(cs1), np.zeros_like(ss1))
    assert rel(yz, y_all, base=x64(x)) < TOL_CONT and rel(ssz, ss_all) < TOL_CONT


# ------------------------------------------------------------- (c) negative control
@pytest.mark.parametrize("eps", [None, 1e-6])  # MambaBlock, FalconMambaBlock
def test_guard_fires_without_neutralisation_mamba1(eps):
    w = mamba1_weights(32, 1)
    x = random_input(1, 3, 32, 2)
    with raises_naming(Float32LeakError, "torch.float32"):
        mamba1_reference(w, x, bcdt_rms_eps=eps, _neutralise=False)
    with raises_naming(Float32LeakError, "torch.float32"):   # decode path too
        mamba1_reference(w, x, np.zeros((1, 64, 4)), np.zeros((1, 64, 16)), bcdt_rms_eps=eps,
                         _neutralise=False)
    mamba1_reference(w, x, bcdt_rms_eps=eps)
    run = hf_mamba.LAST_RUN
    assert run["ops_checked"] > 50
    assert run["neutralised"]["Tensor.float()"] > 0          # .float() calls were rewritten
    assert run["neutralised"]["Tensor.to(float32)"] > 0      # the RMSNorm float32 cast


def test_guard_fires_without_neutralisation_mamba2():
    w = mamba2_weights(32, 1)
    x = random_input(1, 3, 32, 2)
    with raises_naming(Float32LeakError, "torch.float32"):
        mamba2_reference(w, x, _neutralise=False)
    mamba2_reference(w, x)
    run = hf_mamba.LAST_RUN
    assert run["ops_checked"] > 50
    assert run["neutralised"]["Tensor.float()"] > 0
    assert run["neutralised"]["Tensor.to(float32)"] >= 3     # block norm + gated norm (x, gate)


def test_guard_catches_float32_parameters():
    """A float32 tensor entering any op is caught, not only casts."""
    w = mamba1_weights(32, 1)
    block, cfg, d, di = hf_mamba._mamba1_block(w, residual_in_fp32=False)
    block.mixer.D.data = block.mixer.D.data.float()
    x = torch.from_numpy(x64(random_input(1, 2, 32, 2)))
    with raises_naming(Float32LeakError, "torch.float32"):
        with hf_mamba._float64_run("MambaBlock", hf_mamba._hf_m1, True):
            block(x)


# ------------------------------------------- sanity: same computation as transformers fp32
def test_references_track_transformers_float32():
    w1, x1 = mamba1_weights(32, 31), random_input(2, 20, 32, 32)
    blk1, *_ = hf_mamba._mamba1_block(w1, residual_in_fp32=True)
    blk2, *_ = hf_mamba._mamba2_block(mamba2_weights(64, 33), (0.0, math.inf), True)
    x2 = random_input(2, 20, 64, 34)
    with torch.no_grad():
        y1_32 = blk1.float()(torch.from_numpy(x1)).numpy()
        y2_32 = blk2.float()(torch.from_numpy(x2)).numpy()
    assert y1_32.dtype == np.float32
    y1, _, _ = mamba1_reference(w1, x1)
    y2, _ = mamba2_reference(mamba2_weights(64, 33), x2)
    assert 1e-9 < rel(y1_32, y1, base=x64(x1)) < 1e-4
    assert 1e-9 < rel(y2_32, y2, base=x64(x2)) < 1e-4


def test_references_are_deterministic():
    w, x = mamba2_weights(64, 41), random_input(2, 40, 64, 42)
    a, ha = mamba2_reference(w, x)
    b, hb = mamba2_reference(w, x)
    assert np.array_equal(a, b) and np.array_equal(ha, hb)
    w1, x1 = mamba1_weights(32, 43), random_input(2, 40, 32, 44)
    assert all(np.array_equal(p, q) for p, q in zip(mamba1_reference(w1, x1), mamba1_reference(w1, x1)))


# ----------------------------------------------- (d) the torch path, whatever is installed
MODULES = {"mamba": hf_mamba._hf_m1, "falcon_mamba": hf_mamba._hf_fm, "mamba2": hf_mamba._hf_m2}
BLOCKS = {"mamba": "MambaBlock", "falcon_mamba": "FalconMambaBlock", "mamba2": "Mamba2Block"}
BCDT_EPS = {"falcon_mamba": 1e-6}


def _install_failing_kernels(monkeypatch, module, names):
    """Each named function of module becomes a wrapper of it (the way transformers wraps
    its kernel fallbacks) that fails when called: a kernel package installed there."""
    def failing(name, fn):
        @functools.wraps(fn)
        def kernel(*args, **kwargs):
            raise AssertionError(f"the kernel at {name} ran")
        return kernel
    for name in names:
        monkeypatch.setattr(module, name, failing(name, getattr(module, name)))


def _run_references(kind):
    """The references of one modeling module: prefill and cached decode (Mamba-1,
    Falcon-Mamba), the chunk scan (Mamba-2)."""
    if kind == "mamba2":
        mamba2_reference(mamba2_weights(32, 5), random_input(1, 3, 32, 6))
        return
    w, x, eps = mamba1_weights(16, 5), random_input(1, 3, 16, 6), BCDT_EPS.get(kind)
    mamba1_reference(w, x, bcdt_rms_eps=eps)
    mamba1_reference(w, x, np.zeros((1, 32, 4)), np.zeros((1, 32, 16)), bcdt_rms_eps=eps)


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_every_kernel_entry_point_runs_as_torch(kind, monkeypatch):
    """A failing kernel at every entry point: the references still run (on
    transformers' torch functions). Control: one left out of the entry-point list
    is refused by name, with the transformers version."""
    module = MODULES[kind]
    names = hf_mamba.kernel_names(module)
    _install_failing_kernels(monkeypatch, module, names)
    with hf_mamba.torch_path(module):  # plain functions of the module, no wrapper or kernel
        for fn in (getattr(module, n) for n in names):
            assert inspect.isfunction(fn) and not hasattr(fn, "__wrapped__"), fn
            assert fn.__module__ == module.__name__, fn
    with pytest.raises(AssertionError, match="the kernel at"):
        getattr(module, names[0])()
    _run_references(kind)
    assert hf_mamba.LAST_RUN["block"] == BLOCKS[kind] and hf_mamba.LAST_RUN["ops_checked"] > 50
    left_out = names[-1]
    monkeypatch.setitem(hf_mamba._KERNEL_NAMES, module.__name__,
                        {(5, 0): tuple(n for n in names if n != left_out)})
    with raises_naming(RuntimeError, f"transformers {transformers.__version__}", left_out):
        _run_references(kind)


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_a_missing_entry_point_is_named_with_the_version(kind, monkeypatch):
    module = MODULES[kind]
    for name in hf_mamba.kernel_names(module):
        with monkeypatch.context() as patch:
            patch.delattr(module, name)
            with raises_naming(RuntimeError, f"transformers {transformers.__version__}", name):
                _run_references(kind)
