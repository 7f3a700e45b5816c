"""Checks shared by the backward test files (tests/test_mamba{1,2,3}_backward.py
and tests/test_mamba{1,2,3}_state_grad.py): each written once here, with the
block, its names and its reference passed in, so that every block is held to
the same assertions.
"""

import numpy as np
import pytest
import torch

from mojolearn.reference.weights import random_input
from tests import tolerance
from tests.bits import assert_same_bits
from tests.errors import raises_naming
from tests.reference import hf_mamba as _hf


# --------------------------------------------------------------------------- references
def hf_float64_grads(block, hf_module, x, grad_output, key):
    """PyTorch autograd of a transformers block (built in float64 by
    tests/reference/hf_mamba.py) with its kernels replaced by their torch
    functions and its float32 casts neutralised, as the forward references
    are; the dispatch guard sees the backward ops too, so the whole VJP is
    checked to be float64. The loss is sum(y * grad_output). Returns
    {"x": dx, key(parameter name): its gradient} as float64 arrays."""
    x64 = torch.from_numpy(np.array(x, dtype=np.float64)).requires_grad_(True)
    g64 = torch.from_numpy(np.array(grad_output, dtype=np.float64))
    guard = _hf._Float64Guard()
    with _hf.torch_path(hf_module), torch.enable_grad():
        with _hf._CastNeutraliser(), guard:
            y = block(x64)
            (y * g64).sum().backward()
    assert guard.ops > 0
    assert not guard.leaks, f"float32 ops in the reference: {dict(guard.leaks)}"
    out = {"x": x64.grad.numpy().copy()}
    for name, p in block.named_parameters():
        out[key(name)] = p.grad.numpy().copy()
    return out


def check_central_differences(ref, loss, w, x, names, picks, extra=None, eps=1e-6):
    """The float64 autograd gradients ref against central differences of
    loss(weights, x) (float64) at `picks` random elements of each array
    (rng seeded 0) plus the indices extra[name]: each within
    1e-6 max(1, |autograd|)."""
    rng = np.random.default_rng(0)
    for name in names:
        base = x if name == "x" else w[name]
        idx = list(rng.choice(base.size, size=min(picks, base.size), replace=False))
        idx += (extra or {}).get(name, [])
        for i in idx:
            plus, minus = base.copy(), base.copy()
            plus.reshape(-1)[i] += eps
            minus.reshape(-1)[i] -= eps
            if name == "x":
                fd = (loss(w, plus) - loss(w, minus)) / (2 * eps)
            else:
                fd = (loss(dict(w, **{name: plus}), x)
                      - loss(dict(w, **{name: minus}), x)) / (2 * eps)
            an = ref[name].reshape(-1)[i]
            assert abs(fd - an) <= 1e-6 * max(1.0, abs(an)), \
                f"{name}[{i}]: fd {fd} vs autograd {an}"


def assert_reference_equals(ours, theirs, names, rel=1e-10):
    """Two float64 references agree on every array of names within rel of
    the array's largest element."""
    for name in names:
        assert np.abs(ours[name] - theirs[name]).max() <= rel * np.abs(theirs[name]).max(), name


def check_reference_at_zero_state(make_weights, d, zero_shapes, torch_grads, grad_reference,
                                  names):
    """At a zero state and zero cotangents (float64 zeros of zero_shapes(w))
    the torch reference's gradients, torch_grads(w, x, g, *zeros, *zeros),
    equal grad_reference(w, x, g) (transformers' block under autograd) on
    names (assert_reference_equals): weights make_weights(d, seed=7), x
    and g (2, 9, d) (seeds 8, 9)."""
    w = make_weights(d, seed=7)
    x, g = random_input(2, 9, d, seed=8), random_input(2, 9, d, seed=9)
    zeros = [np.zeros(s) for s in zero_shapes(w)]
    assert_reference_equals(torch_grads(w, x, g, *zeros, *zeros), grad_reference(w, x, g), names)


# --------------------------------------------------------------------------- backward
def backward_with_shapes(block, w, B, L, names):
    """block.backward(x, g) on x (seed 200 + L) and g (seed 300 + L) of
    shape (B, L, d_model), dx checked to have x's shape and every weight
    gradient its weight's (names[0] is x): (got, x, g)."""
    x = random_input(B, L, block.d_model, seed=200 + L)
    g = random_input(B, L, block.d_model, seed=300 + L)
    got = block.backward(x, g)
    for name in names[1:]:
        assert got[name].shape == w[name].shape, name
    assert got["x"].shape == (B, L, block.d_model)
    return got, x, g


def check_conv_weight_in_callers_shape(block_cls, w, x, g, names, cd):
    """conv1d.weight given as (cd, 4) instead of (cd, 1, 4): its gradient
    comes back in the caller's shape and every gradient keeps its bytes."""
    w2 = dict(w, **{"conv1d.weight": np.ascontiguousarray(w["conv1d.weight"].reshape(cd, 4))})
    a = block_cls(w).backward(x, g)
    b = block_cls(w2).backward(x, g)
    assert a["conv1d.weight"].shape == (cd, 1, 4)
    assert b["conv1d.weight"].shape == (cd, 4)
    for name in names:
        assert_same_bits(np.asarray(a[name]).reshape(-1), np.asarray(b[name]).reshape(-1), name)


# --------------------------------------------------------------------------- through the state
def state_arrays(state, names):
    """float32 copies of the state's arrays, in the order of names."""
    return [np.array(np.asarray(getattr(state, n)), dtype=np.float32) for n in names]


def random_cotangents(shapes, seed, names, scale=1.0):
    """{name: float32 ~ N(0, scale) of shapes[name]} for the state arrays names."""
    rng = np.random.default_rng(seed)
    return {n: (scale * rng.standard_normal(shapes[n])).astype(np.float32) for n in names}


def backward_from_state(block, w, state, l, seed, cot, shapes, names, reference):
    """backward(x, g, state, grad_state) on l tokens drawn from seed (x
    seed+2, g seed+3, cotangents seed+4 when cot), checking that the state
    is not changed; and the float64 reference's gradients and scales
    (reference(w, x, g, *state arrays, *cotangents), a missing cotangent as
    zeros; shapes: the state arrays' shapes). Returns (got, ref, scale, x,
    g, cots)."""
    b, d = state_arrays(state, names[:1])[0].shape[0], block.d_model
    x = random_input(b, l, d, seed=seed + 2)
    g = random_input(b, l, d, seed=seed + 3)
    cots = random_cotangents(shapes, seed + 4, names) if cot else {}
    before = [a.tobytes() for a in state_arrays(state, names)]
    got = block.backward(x, g, state, grad_state=cots or None)
    assert [a.tobytes() for a in state_arrays(state, names)] == before, "the state was changed"
    cot_list = [cots.get(n, np.zeros(shapes[n], np.float32)) for n in names]
    ref, scale = tolerance.sensitivity(reference, w,
                                       (x, g, *state_arrays(state, names), *cot_list))
    return got, ref, scale, x, g, cots


def compare_with_controls(check, got, ref, scale, case, control=True,
                          mutate=tolerance.smallest_changed):
    """check.compare, and (control) its negative control on every array that
    has nonzero elements to change (an all-zero gradient has none):
    mutate(array) must fail the same bound."""
    check.compare(got, ref, scale, case)
    if control:
        for name in check.names:
            if np.asarray(got[name]).any():
                with pytest.raises(AssertionError):
                    tolerance.assert_within(mutate(got[name]), ref[name], scale[name],
                                            f"{case} {name} 1% off")


def arrays_failing(got, ref, scale, names):
    """The names whose gradient fails the elementwise bound against ref."""
    failed = []
    for n in names:
        try:
            tolerance.assert_within(got[n], ref[n], scale[n], n)
        except AssertionError:
            failed.append(n)
    return failed


def check_grad_state_alone(block, x, g, cots, names, grad_names):
    """state=None with grad_state starts from the zero state (a fresh
    allocate_state gives the same bytes); with no cotangents (grad_state={})
    the weights' gradients have the stateless backward's bytes. Returns
    (the call with cots, the call with grad_state={})."""
    b = x.shape[0]
    a = block.backward(x, g, grad_state=cots)
    z = block.backward(x, g, block.allocate_state(b), grad_state=cots)
    assert sorted(a) == sorted(z) == sorted(names)
    for n in names:
        assert np.asarray(a[n]).tobytes() == np.asarray(z[n]).tobytes(), n
    plain = block.backward(x, g)
    zc = block.backward(x, g, grad_state={})
    for n in grad_names:
        assert np.asarray(plain[n]).tobytes() == np.asarray(zc[n]).tobytes(), n
    return a, zc


def chunked_gradients(block, x, g, pieces, weight_names, state_names, state=None, cot=None):
    """Forward piece by piece with the state carried, then backward in
    reverse, each piece from its saved start state with the next piece's
    state gradients as its final-state cotangents: (weight gradients summed
    in float64 over the pieces, x gradients concatenated, the start state's
    gradients {name: array})."""
    b = x.shape[0]
    state = block.allocate_state(b) if state is None else state.copy()
    starts, t = [], 0
    for n in pieces:
        starts.append((state.copy(), t, n))
        block.forward(np.ascontiguousarray(x[:, t:t + n]), state)
        t += n
    total = {n: 0.0 for n in weight_names}
    xs = []
    for st, t, n in reversed(starts):
        gr = block.backward(np.ascontiguousarray(x[:, t:t + n]),
                            np.ascontiguousarray(g[:, t:t + n]), st, grad_state=cot)
        cot = {k: gr[f"state.{k}"] for k in state_names}
        for k in total:
            total[k] = total[k] + np.asarray(gr[k], dtype=np.float64)
        xs.append(np.asarray(gr["x"]))
    total["x"] = np.concatenate(xs[::-1], axis=1)
    return total, cot


def check_ragged_rows(block_cls, make_weights, lens, reference_of, weight_names, nan_padding):
    """On a block of make_weights(32, seed=50) and x, g (len(lens),
    max(lens), 32) (seeds 51, 52): backward(x, g, lengths=lens), no state:
    a row's x gradient equals the row's alone over its own tokens, padding x
    gradients are +0.0 (with nan_padding the padding of x and g is NaN,
    never read); the weight gradients are within the bound of float64
    autograd (reference_of(block)(w, x, g)) of the rows alone, summed.
    Control: without lengths the padding counts."""
    w = make_weights(32, seed=50)
    block, shape = block_cls(w), (len(lens), max(lens), 32)
    x, g = random_input(*shape, seed=51), random_input(*shape, seed=52)
    reference = reference_of(block)
    xp, gp = x.copy(), g.copy()
    if nan_padding:
        for i, n in enumerate(lens):
            xp[i, n:] = np.nan
            gp[i, n:] = np.nan
    got = block.backward(xp, gp, lengths=lens)
    gx = np.asarray(got["x"])
    for i, n in enumerate(lens):
        alone = block.backward(np.ascontiguousarray(x[i:i + 1, :n]),
                               np.ascontiguousarray(g[i:i + 1, :n]))
        assert np.array_equal(gx[i, :n], np.asarray(alone["x"])[0]), i
        tail = gx[i, n:]
        assert not tail.any() and not np.signbit(tail).any()
    ref, scale = tolerance.sensitivity_of_rows(reference, w, x, g, lens, weight_names)
    for k in ref:
        tolerance.assert_within(got[k], ref[k], scale[k], f"ragged {k}")
    full = block.backward(x, g)
    assert not np.array_equal(np.asarray(full["in_proj.weight"]),
                              np.asarray(got["in_proj.weight"]))


# --------------------------------------------------------------------------- intake
def intake_case(block_cls, make_weights, make_state, state_class, foreign_cls, foreign_weights):
    """(block, x, g, state) of a stateful backward's intake test, after the
    errors every one gives (check_state_intake_errors, naming state_class;
    the foreign state: a foreign_cls block's): d 32 (weights seed 60), x and g (2, 6, 32) (seeds
    61, 62), a state with 5 buffered rows, make_state(block, 2, 5, 63)."""
    block = block_cls(make_weights(32, seed=60))
    x, g = random_input(2, 6, 32, seed=61), random_input(2, 6, 32, seed=62)
    state = make_state(block, 2, 5, 63)
    foreign = foreign_cls(foreign_weights(32, 1)).allocate_state(2)
    check_state_intake_errors(block, x, g, state, foreign, state_class)
    return block, x, g, state


def check_state_intake_errors(block, x, g, state, foreign_state, state_class):
    """The errors every stateful backward gives (lengths with a state or
    grad_state, another block's state, an unknown or non-dict grad_state, a
    grad_state['h'] of the wrong shape, a float64 cotangent of the first
    state array), each naming what is wrong; the state keeps its bytes."""
    b, h = x.shape[0], np.asarray(state.h)
    before = [np.asarray(getattr(state, n)).tobytes() for n in state._ARRAYS]
    with raises_naming(ValueError, "lengths"):
        block.backward(x, g, state, lengths=[x.shape[1]] * b)
    with raises_naming(ValueError, "lengths"):
        block.backward(x, g, grad_state={}, lengths=[x.shape[1]] * b)
    with raises_naming(TypeError, "state", state_class):
        block.backward(x, g, foreign_state)
    with raises_naming(ValueError, "grad_state", "'nope'"):
        block.backward(x, g, state, grad_state={"nope": np.zeros(3, np.float32)})
    with raises_naming(TypeError, "grad_state"):
        block.backward(x, g, state, grad_state=[1, 2])
    with raises_naming(ValueError, "grad_state['h']"):
        block.backward(x, g, state, grad_state={"h": np.zeros((b, 3) + h.shape[2:], np.float32)})
    first = state._ARRAYS[0]
    with raises_naming(TypeError, f"grad_state['{first}']"):
        block.backward(x, g, state,
                       grad_state={first: np.zeros(np.asarray(getattr(state, first)).shape)})
    assert [np.asarray(getattr(state, n)).tobytes() for n in state._ARRAYS] == before


def check_buffer_cotangent_rows(block, x, g, state, name, shape, nan_at, rows_read):
    """A NaN in a read row of grad_state[name] (nan_at) is an error naming
    it; NaN in the rows past rows_read (the final buffered_tokens) is never
    read; an inf in the start state's h is an error naming state.h."""
    bad = np.zeros(shape, np.float32)
    bad[nan_at] = np.nan
    with raises_naming(ValueError, f"grad_state['{name}']"):
        block.backward(x, g, state, grad_state={name: bad})
    tail_nan = np.ones(shape, np.float32)
    tail_nan[:, rows_read:] = np.nan
    ok = block.backward(x, g, state, grad_state={name: tail_nan})
    assert all(np.isfinite(np.asarray(v)).all() for v in ok.values())
    st2 = state.copy()
    np.asarray(st2.h)[(0,) * np.asarray(st2.h).ndim] = np.inf
    with raises_naming(ValueError, "state.h"):
        block.backward(x, g, st2)


def check_staged_gives_direct_bytes(block_cls, make_weights, make_states, make_cotangents,
                                    names):
    """On a block of make_weights(32, seed=70), x and g (2, 70, 32) (seeds
    71, 72) and each state of make_states(block, 2), backward with
    grad_state make_cotangents(block, 2, 74) run directly and with the
    device staging emulated (outputs start as NaN bytes,
    tests/test_device_staging.py) gives the same gradients, names, byte for
    byte."""
    from mojolearn import _loader
    lib = _loader.library()
    block = block_cls(make_weights(32, seed=70))
    x, g = random_input(2, 70, 32, seed=71), random_input(2, 70, 32, seed=72)
    for i, state in enumerate(make_states(block, 2)):
        cots = make_cotangents(block, 2, 74)
        before = lib.emulate_device
        try:
            lib.emulate_device = False
            direct = block.backward(x, g, state, grad_state=cots)
            lib.emulate_device = True
            staged = block.backward(x, g, state, grad_state=cots)
        finally:
            lib.emulate_device = before
        assert sorted(direct) == sorted(staged) == sorted(names)
        for n in names:
            assert np.asarray(direct[n]).tobytes() == np.asarray(staged[n]).tobytes(), (i, n)
