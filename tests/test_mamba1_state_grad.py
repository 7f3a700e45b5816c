"""Mamba1Block.backward through the state: a start state, cotangents of the
final state (grad_state) and ragged lengths.

Gradients against float64 autograd of tests/reference/torch_mamba1.py
(itself checked against mojolearn.reference.mamba1 and against autograd of
transformers' MambaBlock), bounded per element by tests/tolerance.py; the
bit properties of the new paths; the chunked-training identity (pieces run
backward last to first, passing the state gradients, give the one-shot
gradients), also with ragged rows; forward(x, state, lengths) leaving each
row's state at its length; the intake's errors. Each check has a negative
control; hand mutations of the kernel (cotangent of h or of the window
ignored, the ragged skip or the start state's loads removed, the window
gradient's dpre terms dropped, padded grad_output read) each fail tests here.
"""
import numpy as np
import pytest
import torch

import mojolearn
from mojolearn.reference.mamba1 import mamba1_numpy
from mojolearn.reference.weights import mamba1_weights, random_input
from tests import backward_checks as checks
from tests import tolerance
from tests.bits import assert_bits_differ, assert_same_bits
from tests.contract.cases import fails, snapshot
from tests.reference import torch_mamba1
from tests.test_mamba1_backward import NAMES as WEIGHT_NAMES, grad_reference

NAMES = WEIGHT_NAMES + ("state.conv_window", "state.h")
CHECK = tolerance.GradientCheck(NAMES, "Mamba-1 backward through the state")
CHECK_RAGGED = tolerance.GradientCheck(WEIGHT_NAMES, "Mamba-1 ragged backward, no state")


@pytest.fixture(scope="module", autouse=True)
def _report_worst():
    yield from tolerance.report_all(CHECK, CHECK_RAGGED)


def state_arrays(B, d, seed, scale=1.0):
    """(conv_window, h) float32 of a Mamba1State for B rows, ~N(0, scale)."""
    return (random_input(B, 2 * d, 4, seed=seed, scale=scale),
            random_input(B, 2 * d, 16, seed=seed + 1, scale=scale))


def as_state(block, cw, h):
    st = block.allocate_state(cw.shape[0])
    np.asarray(st.conv_window)[...] = cw
    np.asarray(st.h)[...] = h
    return st


def reference_and_scale(w, x, g, start, cot, lengths=None):
    """Float64 gradients and per-element scales; start / cot: (conv_window,
    h) arrays of the start state and the final state's cotangent."""
    def ref(weights, *arrays):
        return torch_mamba1.grads(weights, *arrays, lengths=lengths)
    return tolerance.sensitivity(ref, w, (x, g) + tuple(start) + tuple(cot))


def run_case(d, B, L, seed, *, state, cot, lengths=None, control=True):
    w = mamba1_weights(d, seed=seed)
    x, g = random_input(B, L, d, seed=seed + 1), random_input(B, L, d, seed=seed + 2)
    zeros = (np.zeros((B, 2 * d, 4), np.float32), np.zeros((B, 2 * d, 16), np.float32))
    start = state_arrays(B, d, seed + 3) if state else zeros
    gs = state_arrays(B, d, seed + 5) if cot else zeros
    block = mojolearn.Mamba1Block(w)
    got = block.backward(x, g, as_state(block, *start) if state else None,
                         grad_state=dict(zip(torch_mamba1.STATE, gs)) if cot else None,
                         lengths=lengths)
    check = CHECK
    ref, scale = reference_and_scale(w, x, g, start, gs, lengths)
    if not state and not cot:  # lengths only: no start-state gradients asked for
        assert not any(k.startswith("state.") for k in got)
        check = CHECK_RAGGED
        ref = {k: ref[k] for k in WEIGHT_NAMES}
    check.compare(got, ref, scale, f"d={d} B={B} L={L} state={state} cot={cot} "
                  f"lengths={lengths}", control=control)
    return got


# ------------------------------------------------------------------ reference
@tolerance.one_torch_thread()
def test_reference_forward_equals_numpy_reference():
    """The torch block from a nonzero state equals mamba1_numpy (float64),
    outputs and final state; ragged rows equal the row run alone to its
    length."""
    d, B, L = 16, 2, 37
    w = mamba1_weights(d, seed=1)
    x = random_input(B, L, d, seed=2).astype(np.float64)
    cw, h = (a.astype(np.float64) for a in state_arrays(B, d, 3))
    W = {k: torch.tensor(v, dtype=torch.float64) for k, v in w.items()}
    y, cwf, hf = torch_mamba1.forward(W, torch.tensor(x), torch.tensor(cw), torch.tensor(h))
    y_np, cw_np, h_np = mamba1_numpy(w, x, cw, h)
    for a, b in ((y, y_np), (cwf, cw_np), (hf, h_np)):
        assert np.abs(a.numpy() - b).max() <= 1e-12 * np.abs(b).max()
    y, cwf, hf = torch_mamba1.forward(W, torch.tensor(x), torch.tensor(cw), torch.tensor(h),
                                      lengths=[L, 5])
    y_np, cw_np, h_np = mamba1_numpy(w, x[1:, :5], cw[1:], h[1:])
    assert np.abs(y[1, :5].numpy() - y_np[0]).max() <= 1e-12 * np.abs(y_np).max()
    assert not y[1, 5:].any()
    assert np.abs(cwf[1].numpy() - cw_np[0]).max() <= 1e-12 * np.abs(cw_np).max()
    assert np.abs(hf[1].numpy() - h_np[0]).max() <= 1e-12 * np.abs(h_np).max()


@tolerance.one_torch_thread()
def test_reference_gradients_equal_transformers_autograd():
    """At a zero state and zero cotangents the torch block's gradients are
    those of transformers' MambaBlock in float64 (test_mamba1_backward)."""
    checks.check_reference_at_zero_state(mamba1_weights, 16, lambda w: [(2, 32, 4), (2, 32, 16)],
                                         torch_mamba1.grads, grad_reference, WEIGHT_NAMES)


# ------------------------------------------------------------------ accuracy
@pytest.mark.parametrize("L", [3, 40, 100])
@pytest.mark.parametrize("state,cot", [(True, False), (False, True), (True, True)],
                         ids=["state", "grad_state", "both"])
def test_gradients_match_float64_autograd(L, state, cot):
    """L = 3: the final window holds start-window entries (their cotangent
    goes straight to the start state's gradient); 40, 100 cross the 32-token
    chunks of the kernel."""
    run_case(16, 2, L, seed=10 + L, state=state, cot=cot)


@pytest.mark.parametrize("L,lengths", [(100, [100, 37]), (40, [2, 33]), (3, [1, 3]),
                                       (70, [64, 65])])
def test_ragged_gradients_match_float64_autograd(L, lengths):
    run_case(16, 2, L, seed=L, state=True, cot=True, lengths=lengths)


def test_ragged_without_state():
    run_case(16, 2, 50, seed=3, state=False, cot=False, lengths=[50, 20])


def test_channels_not_a_multiple_of_16():
    """d = 5: d_inner 10, so every 16-lane block of channels is partial."""
    run_case(5, 3, 40, seed=5, state=True, cot=True, lengths=[40, 7, 33])


# ------------------------------------------------------------------ bits
def _inputs(d=16, B=2, L=45, seed=0):
    w = mamba1_weights(d, seed=seed)
    x, g = random_input(B, L, d, seed=seed + 1), random_input(B, L, d, seed=seed + 2)
    return mojolearn.Mamba1Block(w), x, g


def _arrays(grads):
    return {k: np.asarray(v).copy() for k, v in grads.items()}


def _same(a, b, what, names=None):
    for k in names or a:
        assert_same_bits(a[k], b[k], f"{what}: {k}")


def test_zero_state_and_zero_cotangents_give_the_stateless_bits():
    """A zero state / zero (or absent) cotangents give backward(x, g)'s bits;
    the start-state gradients are there whenever state or grad_state is."""
    block, x, g = _inputs()
    plain = _arrays(block.backward(x, g))
    assert not any(k.startswith("state.") for k in plain)
    zero = block.allocate_state(2)
    gz = {"h": np.zeros((2, 32, 16), np.float32), "conv_window": np.zeros((2, 32, 4), np.float32)}
    variants = {"zero state": dict(state=zero), "empty grad_state": dict(grad_state={}),
                "zero grad_state": dict(grad_state=gz),
                "state object as grad_state": dict(state=zero, grad_state=zero)}
    for what, kw in variants.items():
        got = _arrays(block.backward(x, g, **kw))
        assert set(got) == set(plain) | {"state.conv_window", "state.h"}, what
        _same(plain, got, what, names=plain)
    cw, h = state_arrays(2, 16, 1)
    assert_bits_differ(block.backward(x, g, as_state(block, cw, h))["x"], plain["x"],
                       "control: a nonzero state")


def test_each_cotangent_array_is_used():
    """grad_state['h'] and grad_state['conv_window'] each change the
    gradients; a missing name reads as zeros."""
    block, x, g = _inputs(L=40)
    cw, h = state_arrays(2, 16, 4)
    base = _arrays(block.backward(x, g, grad_state={}))
    only_h = _arrays(block.backward(x, g, grad_state={"h": h}))
    only_w = _arrays(block.backward(x, g, grad_state={"conv_window": cw}))
    both = _arrays(block.backward(x, g, grad_state={"h": h, "conv_window": cw}))
    for a, what in ((only_h, "h"), (only_w, "conv_window"), (both, "both")):
        assert_bits_differ(a["x"], base["x"], what)
    # the window's cotangent reaches only the last four conv inputs (and
    # through them x at those tokens): earlier tokens keep their bits
    assert_same_bits(only_w["x"][:, :36], base["x"][:, :36], "tokens before the window")
    assert_bits_differ(only_w["x"][:, 36:], base["x"][:, 36:], "the window's tokens")


def test_state_and_cotangents_are_not_changed(threads):
    block, x, g = _inputs()
    st = as_state(block, *state_arrays(2, 16, 6))
    gs = as_state(block, *state_arrays(2, 16, 8))
    before = snapshot(st, gs, x, g)
    ref = _arrays(block.backward(x, g, st, grad_state=gs, lengths=[45, 12]))
    assert snapshot(st, gs, x, g) == before
    for n in (2, 3):
        threads(n)
        _same(ref, _arrays(block.backward(x, g, st, grad_state=gs, lengths=[45, 12])),
              f"{n} threads vs 1")


def test_padding_contributes_nothing():
    """Changing a ragged row's padding (x and grad_output, NaN included)
    changes no gradient byte; dx there is +0.0. Control: a real token's
    grad_output changes them."""
    block, x, g = _inputs(L=70)
    st = as_state(block, *state_arrays(2, 16, 2))
    gs = dict(zip(torch_mamba1.STATE, state_arrays(2, 16, 3)))
    lengths = [70, 33]
    ref = _arrays(block.backward(x, g, st, grad_state=gs, lengths=lengths))
    assert not np.asarray(ref["x"])[1, 33:].view(np.uint32).any(), "padding dx is +0.0"
    x2, g2 = x.copy(), g.copy()
    x2[1, 33:] = np.nan
    g2[1, 33:] = 1e30
    g2[1, 40] = np.inf
    _same(ref, _arrays(block.backward(x2, g2, st, grad_state=gs, lengths=lengths)), "padding")
    g3 = g.copy()
    g3[1, 32] += 1.0
    assert_bits_differ(block.backward(x, g3, st, grad_state=gs, lengths=lengths)["x"], ref["x"],
                       "control: the last real token")


@pytest.mark.parametrize("length", [37, 64, 2])
def test_ragged_row_equals_the_row_alone(length):
    """A ragged row's x and start-state gradients are those of the row run
    alone at its length; a one-row batch padded to L gives every gradient
    of the row alone (padding adds exact zeros to the weight sums)."""
    block, x, g = _inputs(L=100, seed=length)
    cw, h = state_arrays(2, 16, 9)
    gcw, gh = state_arrays(2, 16, 11)

    def run(rows, n, lengths=None):
        return _arrays(block.backward(
            x[rows, :n], g[rows, :n], as_state(block, cw[rows], h[rows]),
            grad_state={"conv_window": gcw[rows], "h": gh[rows]}, lengths=lengths))

    alone = run(slice(1, 2), length)
    batch = run(slice(0, 2), 100, [100, length])
    for k in ("state.conv_window", "state.h"):
        assert_same_bits(batch[k][1:], alone[k], k)
    assert_same_bits(batch["x"][1:, :length], alone["x"], "x")
    padded = run(slice(1, 2), 100, [length])
    padded["x"] = padded["x"][:, :length]
    _same(alone, padded, f"one row padded from {length} to 100")


# ------------------------------------------------------------ chunked training
PIECES = (40, 33, 27)


def chunked(block, x, g, state, grad_state, pieces=PIECES, chain=True, last_lengths=None):
    """Forward piece by piece with the state carried, then backward piece by
    piece in reverse, each piece's start-state gradient as the previous
    piece's grad_state (chain=False: the negative control, each piece with
    zero cotangents). Returns the gradients as one-shot backward would: x
    concatenated, weight gradients summed (float64), the first piece's
    start-state gradients. last_lengths: ragged lengths of the last piece."""
    starts, st, t = [], state.copy(), 0
    lens = [None] * (len(pieces) - 1) + [last_lengths]
    for n, ln in zip(pieces, lens):
        starts.append(st.copy())
        block.forward(x[:, t:t + n], st, lengths=ln)
        t += n
    out, gs, t = {}, grad_state, sum(pieces)
    xs = []
    for n, s0, ln in zip(reversed(pieces), reversed(starts), reversed(lens)):
        r = _arrays(block.backward(x[:, t - n:t], g[:, t - n:t], s0, grad_state=gs,
                                   lengths=ln))
        t -= n
        xs.insert(0, r.pop("x"))
        gs = {k[len("state."):]: r[k] for k in ("state.conv_window", "state.h")} if chain else {}
        for k, v in r.items():
            if not k.startswith("state."):
                out[k] = out.get(k, 0.0) + v.astype(np.float64)
    out["x"] = np.concatenate(xs, axis=1)
    out["state.conv_window"], out["state.h"] = gs.get("conv_window"), gs.get("h")
    if not chain:
        out["state.conv_window"], out["state.h"] = r["state.conv_window"], r["state.h"]
    return out


def test_chunked_training_gives_the_one_shot_gradients():
    """Pieces 40 + 33 + 27 vs one backward over the 100 tokens, from a
    nonzero state with final-state cotangents.

    Bit-identical: dx at every token except the three before each piece
    boundary, and both start-state gradients: the dh carry and the conv
    look-ahead are the same operations whether a boundary is a piece or
    not. At those three tokens the conv input's gradient is the same four
    terms in another association (in pieces, the later terms arrive summed
    as the later piece's conv_window gradient); the weight gradients sum
    the same terms in another order (the pieces' 32-token chunks sit at
    other positions, and the pieces add up in float64 here). Those are held
    to the float64 reference's elementwise bound (tolerance.C x scale) and
    their max relative difference to the one-shot result is printed.
    Control: the same pieces without passing grad_state fail that bound."""
    d, B, L = 16, 2, sum(PIECES)
    w = mamba1_weights(d, seed=31)
    block = mojolearn.Mamba1Block(w)
    x, g = random_input(B, L, d, seed=32), random_input(B, L, d, seed=33)
    start, cot = state_arrays(B, d, 34), state_arrays(B, d, 36)
    st = as_state(block, *start)
    gs = dict(zip(torch_mamba1.STATE, cot))
    one = _arrays(block.backward(x, g, st, grad_state=gs))
    pieces = chunked(block, x, g, st, gs)
    bounds = np.cumsum(PIECES)[:-1]
    near = np.zeros(L, bool)
    for e in bounds:
        near[e - 3:e] = True
    assert_same_bits(pieces["x"][:, ~near], one["x"][:, ~near], "dx away from the boundaries")
    for k in ("state.conv_window", "state.h"):
        assert_same_bits(pieces[k], one[k], k)
    ref, scale = reference_and_scale(w, x, g, start, cot)
    rel = {}
    for k in NAMES:
        tolerance.assert_within(pieces[k], ref[k], scale[k], f"chunked {k}")
        den = np.abs(one[k]).max()
        rel[k] = float(np.abs(pieces[k] - one[k].astype(np.float64)).max() / den)
    print("\nchunked vs one-shot, max |diff| / max |one-shot| per array:")
    for k, v in rel.items():
        print(f"  {k:18s} {v:.2e}")
    assert max(rel.values()) <= 1e-5
    bad = chunked(block, x, g, st, gs, chain=False)
    with pytest.raises(AssertionError):
        for k in NAMES:
            tolerance.assert_within(bad[k], ref[k], scale[k], f"unchained {k}")


def test_chunked_training_with_ragged_rows():
    """Row 1 ends at 90, inside the last piece (ragged forward and backward
    of that piece): the same bits as the one-shot ragged backward where the
    unragged case has them (start-state gradients; dx away from the three
    tokens before each boundary; dx +0.0 in the padding)."""
    d, B, L = 16, 2, sum(PIECES)
    block = mojolearn.Mamba1Block(mamba1_weights(d, seed=41))
    x, g = random_input(B, L, d, seed=42), random_input(B, L, d, seed=43)
    st = as_state(block, *state_arrays(B, d, 44))
    gs = dict(zip(torch_mamba1.STATE, state_arrays(B, d, 46)))
    one = _arrays(block.backward(x, g, st, grad_state=gs, lengths=[L, 90]))
    pieces = chunked(block, x, g, st, gs, last_lengths=[PIECES[-1], 90 - L + PIECES[-1]])
    near = np.zeros(L, bool)
    for e in np.cumsum(PIECES)[:-1]:
        near[e - 3:e] = True
    assert_same_bits(pieces["x"][:, ~near], one["x"][:, ~near], "dx away from the boundaries")
    assert not pieces["x"][1, 90:].view(np.uint32).any()
    for k in ("state.conv_window", "state.h"):
        assert_same_bits(pieces[k], one[k], k)
    for k in WEIGHT_NAMES[1:]:
        rel = np.abs(pieces[k] - one[k]).max() / np.abs(one[k]).max()
        assert rel <= 1e-5, (k, rel)
    unragged = chunked(block, x, g, st, gs)  # control: the last piece not ragged
    assert_bits_differ(unragged["state.h"], one["state.h"], "control")


def test_ragged_forward_with_a_state_ends_each_row_at_its_length():
    """forward(x, state, lengths): row b's outputs and the state it leaves
    are those of the row alone over its first lengths[b] tokens (bits);
    padding outputs +0.0. Control: without lengths row 1's state differs."""
    block, x, _ = _inputs(L=70)
    cw, h = state_arrays(2, 16, 3)
    st = as_state(block, cw, h)
    y = np.asarray(block.forward(x, st, lengths=[70, 33])).copy()
    assert not y[1, 33:].view(np.uint32).any()
    for b, n in ((0, 70), (1, 33)):
        alone = as_state(block, cw[b:b + 1], h[b:b + 1])
        assert_same_bits(y[b:b + 1, :n], block.forward(x[b:b + 1, :n], alone), f"y row {b}")
        for k in torch_mamba1.STATE:
            assert_same_bits(np.asarray(getattr(st, k))[b:b + 1], getattr(alone, k), f"{k} {b}")
    full = as_state(block, cw, h)
    block.forward(x, full)
    assert_bits_differ(np.asarray(full.h)[1], np.asarray(st.h)[1], "control")


# ------------------------------------------------------------------ errors
def test_grad_state_errors():
    block, x, g = _inputs(L=5)
    st = as_state(block, *state_arrays(2, 16, 1))
    h = np.zeros((2, 32, 16), np.float32)
    keep = [x, g, st, h]
    fails(TypeError, block.backward, x, g, grad_state=[h], keep=keep, match=["grad_state", "list"])
    fails(ValueError, block.backward, x, g, grad_state={"hh": h}, keep=keep,
          match=["grad_state", "'hh'"])
    fails(TypeError, block.backward, x, g, grad_state={"h": h.astype(np.float64)}, keep=keep,
          match=["grad_state['h']", "float32"])
    fails(ValueError, block.backward, x, g, grad_state={"h": h[:1]}, keep=keep,
          match=["grad_state['h']", "(2, 32, 16)"])
    bad = np.zeros((2, 32, 4), np.float32)
    bad[1, 3, 2] = np.nan
    fails(ValueError, block.backward, x, g, st, grad_state={"conv_window": bad}, keep=keep + [bad],
          match=["grad_state['conv_window']", "NaN"])
    other = as_state(block, *state_arrays(1, 16, 2))
    fails(ValueError, block.backward, x, g, grad_state=other, keep=keep,
          match=["grad_state.conv_window"])


def test_state_and_lengths_errors():
    block, x, g = _inputs(L=5)
    keep = [x, g]
    fails(TypeError, block.backward, x, g, {"h": 1}, keep=keep, match=["state", "Mamba1State"])
    from mojolearn.reference.weights import mamba2_weights
    m2 = mojolearn.Mamba2Block(mamba2_weights(32, seed=0))
    fails(TypeError, block.backward, x, g, m2.allocate_state(2), keep=keep,
          match=["state", "Mamba2State"])
    fails(ValueError, block.backward, x, g, block.allocate_state(3), keep=keep,
          match=["state.conv_window"])
    st = as_state(block, *state_arrays(2, 16, 1))
    np.asarray(st.h)[0, 0, 0] = np.inf
    fails(ValueError, block.backward, x, g, st, keep=keep + [st], match=["state.h"])
    fails(ValueError, block.backward, x, g, lengths=[5, 6], keep=keep, match=["lengths[1]"])
    fails(ValueError, block.backward, x, g, lengths=[5], keep=keep, match=["lengths"])
    g2 = g.copy()
    g2[0, 4, 0] = np.nan
    fails(ValueError, block.backward, x, g2, lengths=[5, 2], keep=keep, match=["grad_output"])
    block.backward(x, g2, lengths=[4, 2])  # NaN in padding: fine
