"""Mamba1Block(weights, bcdt_rms_eps=eps): the Falcon-Mamba block (the
Mamba-1 mixer with weightless RMS norms of x_proj's dt, B and C outputs).

Forward against transformers' FalconMambaBlock run in verified float64
(tests/reference/hf_mamba.py), per element within the condition-scaled
bound of tests/tolerance.py; the float64 NumPy reference
(mojolearn.reference.mamba1_numpy with bcdt_rms_eps) against it; backward
against torch autograd of that FalconMambaBlock, and through the state
(start state, final-state cotangents, ragged rows) against autograd of
tests/reference/torch_mamba1.py with the same norms; the bit properties
(prefill == steps == session == split continuation, ragged row == row
alone, thread count) and packed weights; the option's intake. Each check
has a negative control (the plain Mamba-1 block on the same weights, a
nudged input, or 1% off in the smallest elements).
"""
import numpy as np
import pytest

import mojolearn
from mojolearn import lowbit
from mojolearn.reference.mamba1 import mamba1_numpy
from mojolearn.reference.weights import mamba1_weights, random_input
from tests import tolerance
from tests.bits import assert_bits_differ, assert_same_bits
from tests.contract.cases import fails, snapshot
from tests.reference import hf_mamba as _hf
from tests.reference import torch_mamba1
from tests.test_mamba1_backward import NAMES, grad_reference as mamba1_grad_reference
from tests.test_mamba1_state_grad import NAMES as STATE_NAMES

EPS = 1e-6  # transformers' FalconMambaConfig.mixer_rms_eps default
CHECK = tolerance.GradientCheck(NAMES, "Falcon-Mamba backward")
CHECK_STATE = tolerance.GradientCheck(STATE_NAMES, "Falcon-Mamba backward through the state")


@pytest.fixture(scope="module", autouse=True)
def _report_worst():
    yield from tolerance.report_all(CHECK, CHECK_STATE)


def falcon(w, **kw):
    return mojolearn.Mamba1Block(w, bcdt_rms_eps=EPS, **kw)


def _forward_reference(weights, x, eps=EPS):
    y, cw, h = _hf.mamba1_reference(weights, x, bcdt_rms_eps=eps)
    return {"y": y, "conv_window": cw, "h": h}


# ------------------------------------------------------------------ forward
@pytest.mark.parametrize("d,B,L", [(5, 1, 1), (16, 3, 7), (40, 2, 37), (64, 1, 130)])
def test_forward_matches_transformers_falcon_mamba_float64(d, B, L):
    w = mamba1_weights(d, seed=d)
    x = random_input(B, L, d, seed=100 + L)
    ref, scale = tolerance.sensitivity(_forward_reference, w, (x,))
    block = falcon(w)
    state = block.allocate_state(B)
    y = block.forward(x, state)
    tolerance.assert_within(y, ref["y"], scale["y"], f"d={d} B={B} L={L} y")
    tolerance.assert_within(state.conv_window, ref["conv_window"], scale["conv_window"], "window")
    tolerance.assert_within(state.h, ref["h"], scale["h"], "h")
    # controls: the plain Mamba-1 block on the same weights, and 1% off in
    # the smallest 20% of the outputs, each fail the same bound
    with pytest.raises(AssertionError):
        tolerance.assert_within(mojolearn.Mamba1Block(w).forward(x), ref["y"], scale["y"], "plain")
    with pytest.raises(AssertionError):
        tolerance.assert_within(tolerance.smallest_changed(y), ref["y"], scale["y"], "1% off")


def test_continuation_from_a_state_matches_transformers():
    """transformers' cached decode path (the stepped reference) from the
    state our prefill left."""
    d, B = 32, 2
    w = mamba1_weights(d, seed=7)
    x = random_input(B, 12, d, seed=8)
    block = falcon(w)
    state = block.allocate_state(B)
    block.forward(x[:, :5], state)
    cw, h = np.array(state.conv_window, np.float64), np.array(state.h, np.float64)

    def ref(weights, xx, cw_, h_):
        y, cwf, hf = _hf.mamba1_reference(weights, xx, cw_, h_, bcdt_rms_eps=EPS)
        return {"y": y, "h": hf}
    r, s = tolerance.sensitivity(ref, w, (x[:, 5:], cw, h))
    assert _hf.LAST_RUN["path"] == "stepped" and _hf.LAST_RUN["block"] == "FalconMambaBlock"
    tolerance.assert_within(block.forward(x[:, 5:], state), r["y"], s["y"], "continuation y")
    tolerance.assert_within(state.h, r["h"], s["h"], "continuation h")


@tolerance.one_torch_thread()
def test_numpy_reference_equals_transformers():
    d, B, L = 24, 2, 19
    w = mamba1_weights(d, seed=3)
    x = random_input(B, L, d, seed=4)
    for eps in (EPS, 0.5):  # a large eps makes the norm's eps term visible
        y_hf, cw_hf, h_hf = _hf.mamba1_reference(w, x, bcdt_rms_eps=eps)
        y, cw, h = mamba1_numpy(w, x, bcdt_rms_eps=eps)
        for a, b in ((y, y_hf), (cw, cw_hf), (h, h_hf)):
            assert np.abs(a - b).max() <= 1e-10 * np.abs(b).max()
    # control: without the norms the references differ
    y0, _, _ = mamba1_numpy(w, x)
    assert np.abs(y0 - y_hf).max() > 1e-5 * np.abs(y_hf).max()
    y1, _, _ = mamba1_numpy(w, x, bcdt_rms_eps=EPS)
    assert np.abs(y1 - y_hf).max() > 1e-10 * np.abs(y_hf).max()  # eps 1e-6 vs 0.5


def test_eps_reaches_the_kernel():
    """A large eps (where it changes the values) against the reference; the
    float32 eps is what the kernel uses."""
    d, B, L = 16, 2, 9
    w = mamba1_weights(d, seed=11)
    x = random_input(B, L, d, seed=12)
    eps = 2.0
    ref, scale = tolerance.sensitivity(lambda ww, xx: _forward_reference(ww, xx, eps), w, (x,))
    y = mojolearn.Mamba1Block(w, bcdt_rms_eps=eps).forward(x)
    tolerance.assert_within(y, ref["y"], scale["y"], "eps 2")
    with pytest.raises(AssertionError):
        tolerance.assert_within(falcon(w).forward(x), ref["y"], scale["y"], "eps 1e-6")


# ------------------------------------------------------------------ bits
def _steps(block, x, state, t0, t1):
    return np.concatenate([np.asarray(block.step(x[:, t], state)) for t in range(t0, t1)], 1)


@pytest.mark.parametrize("B,L", [(1, 9), (3, 300)])
def test_prefill_steps_session_and_split_give_the_same_bits(B, L):
    """L 300 at B 3 crosses the forward's 256-row workspace chunks."""
    d = 40
    w = mamba1_weights(d, seed=21)
    x = random_input(B, L, d, seed=22)
    block = falcon(w)
    whole = block.allocate_state(B)
    y = np.asarray(block.forward(x, whole))
    k = L - 4
    st = block.allocate_state(B)
    a = max(1, k // 3)
    ys = [np.asarray(block.forward(x[:, :a], st)), np.asarray(block.forward(x[:, a:k], st)),
          _steps(block, x, st, k, k + 2)]
    with block.decode_session(st) as s:
        ys += [np.asarray(s.step(np.ascontiguousarray(x[:, t]))) for t in range(k + 2, L)]
    assert_same_bits(np.concatenate(ys, 1), y, "split + steps + session vs one prefill")
    for n in ("conv_window", "h"):
        assert_same_bits(getattr(st, n), getattr(whole, n), f"state.{n}")
    # controls: the plain block, and the stepped inputs each one ulp away
    assert_bits_differ(mojolearn.Mamba1Block(w).forward(x), y, "plain block")
    st2 = block.allocate_state(B)
    block.forward(x[:, :k], st2)
    moved = np.nextafter(x[:, k:], np.float32(np.inf))
    assert_bits_differ(_steps(block, moved, st2, 0, L - k), y[:, k:], "nudged steps")


def test_ragged_rows_equal_rows_alone():
    d, L = 16, 40
    w = mamba1_weights(d, seed=23)
    lengths = [40, 7, 1, 33]
    x = random_input(len(lengths), L, d, seed=24)
    x[1, 7:] = 1e30  # padding is never read
    block = falcon(w)
    st = block.allocate_state(len(lengths))
    y = np.asarray(block.forward(x, st, lengths=lengths))
    for i, n in enumerate(lengths):
        alone = block.allocate_state(1)
        assert_same_bits(y[i:i + 1, :n], block.forward(x[i:i + 1, :n], alone), f"row {i}")
        assert not y[i, n:].view(np.uint32).any(), f"row {i} padding is not +0.0"
        assert_same_bits(np.asarray(st.h)[i:i + 1], alone.h, f"row {i} state")
    # control: the row alone at a length one longer differs in its state
    longer = block.allocate_state(1)
    block.forward(x[1:2, :8], longer)
    assert_bits_differ(np.asarray(st.h)[1:2], longer.h, "row 1 at length 8")


def test_thread_count_does_not_change_bits(threads):
    d, B, L = 40, 3, 70
    w = mamba1_weights(d, seed=25)
    x, g = random_input(B, L, d, seed=26), random_input(B, L, d, seed=27)
    block = falcon(w)
    threads(1)
    y1 = np.asarray(block.forward(x))
    g1 = {k: np.asarray(v) for k, v in block.backward(x, g).items()}
    for k in (2, 3):
        threads(k)
        assert_same_bits(block.forward(x), y1, f"forward at {k} threads")
        got = block.backward(x, g)
        for n in NAMES:
            assert_same_bits(got[n], g1[n], f"{n} at {k} threads")
    # control: the plain block's gradients differ
    threads(1)
    plain = mojolearn.Mamba1Block(w).backward(x, g)
    assert_bits_differ(plain["x_proj.weight"], g1["x_proj.weight"], "plain block's dW_x")


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_packed_weights_give_the_bits_of_their_expansion(fmt):
    d, B, L = 32, 2, 20
    w = mamba1_weights(d, seed=28)
    packed = lowbit.pack(w, fmt)
    block, ref = falcon(packed), falcon(lowbit.unpack(packed)[0])
    assert block.weight_format == fmt and block.bcdt_rms_eps == EPS
    x, g = random_input(B, L, d, seed=29), random_input(B, L, d, seed=30)
    assert_same_bits(block.forward(x), ref.forward(x), "forward")
    sa, sb = block.allocate_state(B), ref.allocate_state(B)
    block.forward(x[:, :L - 2], sa)
    ref.forward(x[:, :L - 2], sb)
    assert_same_bits(_steps(block, x, sa, L - 2, L), _steps(ref, x, sb, L - 2, L), "steps")
    ga, gb = block.backward(x, g), ref.backward(x, g)
    for n in NAMES:
        assert_same_bits(np.asarray(ga[n]), np.asarray(gb[n]), f"backward {n}")
    # control: packed without the option
    assert_bits_differ(mojolearn.Mamba1Block(packed).forward(x), ref.forward(x), "no norms")


# ------------------------------------------------------------------ backward
def grad_reference(weights, x, grad_output):
    """Torch autograd of transformers' FalconMambaBlock in verified float64."""
    return mamba1_grad_reference(weights, x, grad_output, bcdt_rms_eps=EPS)


@pytest.mark.parametrize("d,B,L", [(5, 1, 1), (40, 2, 33), (64, 3, 70)])
def test_gradients_match_transformers_autograd(d, B, L):
    """L 33 and 70 cross the backward's 32-token chunks. d 5 has dt_rank 1:
    the norm of one dt value is sign(v) up to eps, so its gradient is an
    exact cancellation of terms as large as the array (tests/tolerance.py,
    "Exact cancellation": measured x_proj.weight at 98 x the plain scale,
    1.1 with cancels); L 1 has no A_log gradient, so no control there."""
    w = mamba1_weights(d, seed=d + 1)
    x, g = random_input(B, L, d, seed=L), random_input(B, L, d, seed=L + 1)
    got = falcon(w).backward(x, g)
    ref, scale = tolerance.sensitivity(grad_reference, w, (x, g), cancels=d < 17)
    CHECK.compare(got, ref, scale, f"d={d} B={B} L={L}", control=L > 1)
    # control: the plain block's x_proj gradient fails the bound
    plain = mojolearn.Mamba1Block(w).backward(x, g)
    with pytest.raises(AssertionError):
        tolerance.assert_within(plain["x_proj.weight"], ref["x_proj.weight"],
                                scale["x_proj.weight"], "plain block")


@tolerance.one_torch_thread()
def test_state_reference_gradients_equal_transformers_autograd():
    d, B, L = 16, 2, 9
    w = mamba1_weights(d, seed=31)
    x, g = random_input(B, L, d, seed=32), random_input(B, L, d, seed=33)
    z = np.zeros((B, 2 * d, 4)), np.zeros((B, 2 * d, 16))
    ours = torch_mamba1.grads(w, x, g, *z, *z, bcdt_rms_eps=EPS)
    hf = grad_reference(w, x, g)
    for name in NAMES:
        assert np.abs(ours[name] - hf[name]).max() <= 1e-10 * np.abs(hf[name]).max(), name
    plain = torch_mamba1.grads(w, x, g, *z, *z)  # control
    assert np.abs(plain["x_proj.weight"] - hf["x_proj.weight"]).max() > 1e-4


@pytest.mark.parametrize("L,lengths", [(40, None), (70, [70, 33]), (3, [1, 3])])
def test_gradients_through_the_state(L, lengths):
    d, B = 16, 2
    w = mamba1_weights(d, seed=40 + L)
    x, g = random_input(B, L, d, seed=L + 2), random_input(B, L, d, seed=L + 3)
    start = (random_input(B, 2 * d, 4, seed=L + 4), random_input(B, 2 * d, 16, seed=L + 5))
    cot = (random_input(B, 2 * d, 4, seed=L + 6), random_input(B, 2 * d, 16, seed=L + 7))
    block = falcon(w)
    st = block.allocate_state(B)
    np.asarray(st.conv_window)[...] = start[0]
    np.asarray(st.h)[...] = start[1]
    before = snapshot(st)
    got = block.backward(x, g, st, grad_state=dict(zip(torch_mamba1.STATE, cot)),
                         lengths=lengths)
    assert snapshot(st) == before

    def ref(weights, *arrays):
        return torch_mamba1.grads(weights, *arrays, lengths=lengths, bcdt_rms_eps=EPS)
    r, s = tolerance.sensitivity(ref, w, (x, g) + start + cot)
    CHECK_STATE.compare(got, r, s, f"L={L} lengths={lengths}", control=True)


# ------------------------------------------------------------------ the option
def test_option_params_and_default():
    d = 16
    w = mamba1_weights(d, seed=50)
    x = random_input(2, 5, d, seed=51)
    block = falcon(w)
    p = block.get_params()
    assert p["bcdt_rms_eps"] == EPS and set(p) == {"weights", "numeric_mode", "bcdt_rms_eps"}
    y = np.asarray(block.forward(x))
    plain = mojolearn.Mamba1Block(w)
    assert plain.bcdt_rms_eps is None and plain.get_params()["bcdt_rms_eps"] is None
    assert_same_bits(mojolearn.Mamba1Block(w, bcdt_rms_eps=None).forward(x), plain.forward(x),
                     "None is the plain block")
    block.set_params(bcdt_rms_eps=None)
    assert block.bcdt_rms_eps is None
    assert_same_bits(block.forward(x), plain.forward(x), "set_params(bcdt_rms_eps=None)")
    block.set_params(bcdt_rms_eps=np.float32(EPS))
    assert_same_bits(block.forward(x), y, "set_params back (a NumPy float)")
    inf = mojolearn.Mamba1BlockInference(w, bcdt_rms_eps=EPS)
    assert_same_bits(inf.forward(x), y, "Mamba1BlockInference")


@pytest.mark.parametrize("bad,exc", [("1e-6", TypeError), (True, TypeError), ([1e-6], TypeError),
                                     (0, ValueError), (-1e-6, ValueError),
                                     (float("nan"), ValueError), (float("inf"), ValueError),
                                     (1e-50, ValueError), (1e39, ValueError)])
def test_bad_eps_is_refused_by_name(bad, exc):
    w = mamba1_weights(8, seed=52)
    fails(exc, mojolearn.Mamba1Block, w, bcdt_rms_eps=bad, keep=list(w.values()),
          match=["bcdt_rms_eps"])
    block = falcon(w)
    x = random_input(1, 3, 8, seed=53)
    y = np.asarray(block.forward(x))
    fails(exc, block.set_params, bcdt_rms_eps=bad, match=["bcdt_rms_eps"])
    assert block.bcdt_rms_eps == EPS  # a refused set_params keeps the block
    assert_same_bits(block.forward(x), y, "after a refused set_params")


def test_torch_module_takes_the_option():
    """mojolearn.torch.Mamba1(bcdt_rms_eps=...) runs the Falcon block: its
    forward and its autograd gradients are the block's bits; control: the
    module without the option."""
    torch = pytest.importorskip("torch")
    import mojolearn.torch as mt
    d, B, L = 16, 2, 7
    w = mamba1_weights(d, seed=60)
    x, g = random_input(B, L, d, seed=61), random_input(B, L, d, seed=62)
    m = mt.Mamba1.from_weights(w, bcdt_rms_eps=EPS)
    assert f"bcdt_rms_eps={EPS!r}" in repr(m)
    xt = torch.from_numpy(np.array(x)).requires_grad_(True)
    y = m(xt)
    y.backward(torch.from_numpy(np.array(g)))
    assert_same_bits(y.detach().numpy(), falcon(w).forward(x), "torch Falcon forward")
    want = falcon(w).backward(x, g)
    assert_same_bits(xt.grad.numpy(), want["x"], "torch Falcon grad x")
    assert_same_bits(m.x_proj.weight.grad.numpy(), want["x_proj.weight"],
                     "torch Falcon grad x_proj.weight")
    with torch.no_grad():
        plain = mt.Mamba1.from_weights(w)(torch.from_numpy(np.array(x))).numpy()
    assert_bits_differ(plain, y.detach().numpy(), "module without the option")
    fails(ValueError, mt.Mamba1, d, bcdt_rms_eps=-1.0, match=["bcdt_rms_eps"])
