"""Mamba2Block.backward through the state (issue 18 item 1): the gradient of a
forward that started from a given Mamba2State (conv window, h and the open
chunk's buffered rows), with cotangents for every array of the final state,
against PyTorch autograd of a float64 recurrence that starts from the same
state (tests/reference/torch_mamba2.py, itself checked against
mojolearn.reference.mamba2 and transformers' Mamba2Block here); ragged
rows; the chunked-training identity; the intake.

Hand mutations of the kernel that these tests caught (each reverted): the
final h's cotangent ignored in a full last chunk and in an open one, the
final buffer_xbc / buffer_dtraw / conv_window cotangents dropped, the start
h, conv window or buffered rows not loaded (zeros instead), the state rows
left out of the dB sums, dt_bias given the buffer_dtraw cotangent, ragged
padding's grad_output read (docs/backward.md, "Mamba-2", lists them).
"""
import functools

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
from tests.reference.torch_mamba2 import STATE, state_grads
from tests.test_mamba2_backward import NAMES as GRAD_NAMES, grad_reference

NAMES = GRAD_NAMES + tuple(f"state.{n}" for n in STATE)
BUFFERS = ("buffer_xbc", "buffer_dtraw")
CHUNK = 256

CHECK = tolerance.GradientCheck(NAMES, "Mamba-2 backward through the state")


@pytest.fixture(scope="module", autouse=True)
def _report_worst():
    yield from CHECK.report()


def resolved_changed(a, frac=0.2, factor=1.01):
    """tolerance.smallest_changed over the elements of a at or above one
    float32 ulp of its largest element: a buffered row far from the chunk
    end has state gradients decayed to 1e-20 of the array's largest (the
    decay of ~256 rows), below what float32 resolves in that array, and
    their scale (tolerance.py) rightly allows them any error."""
    out = np.array(a, dtype=np.float64, copy=True)
    flat = out.reshape(-1)
    top = np.abs(flat).max()
    ok = np.flatnonzero(np.abs(flat) >= tolerance.ULP * top)
    idx = ok[np.argsort(np.abs(flat[ok]), kind="stable")[:max(1, int(frac * ok.size))]]
    flat[idx] *= factor
    return out


# CHECK.compare and (control) its negative control on every nonzero array
compare = functools.partial(checks.compare_with_controls, CHECK, mutate=resolved_changed)


# --------------------------------------------------------------------------- the reference
def test_reference_forward_equals_numpy_reference():
    """From a state with no buffered rows and a zero window (what
    mamba2_numpy takes: an initial h), the torch block equals mamba2_numpy,
    output and final h (after two chunk ends); and a state left by a real
    forward continues it: prefix + rest equals one mamba2_numpy run."""
    d, b, L = 32, 2, 600
    w = mamba2_weights(d, seed=1)
    x = random_input(b, L, d, seed=2).astype(np.float64)
    h0 = 0.3 * np.random.default_rng(3).standard_normal((b, 1, 64, 128))
    W = {k: torch.tensor(np.asarray(v, dtype=np.float64)) for k, v in w.items()}
    st = {"conv_window": torch.zeros(b, 320, 4), "h": torch.tensor(h0),
          "buffer_xbc": torch.zeros(b, CHUNK, 320), "buffer_dtraw": torch.zeros(b, CHUNK, 1)}
    st = {k: v.double() for k, v in st.items()}
    y, fin = torch_mamba2.forward(W, torch.tensor(x), st, 0)
    y_np, h_np = mamba2_numpy(w, x, h0)
    assert np.abs(y.numpy() - y_np).max() <= 1e-12 * np.abs(y_np).max()
    # the final h is the h at the last chunk end (512), not after token 599
    y512, h512 = mamba2_numpy(w, x[:, :512], h0)
    assert np.abs(fin["h"].numpy() - h512).max() <= 1e-12 * np.abs(h512).max()
    assert fin["buffer_xbc"].shape == (b, L - 512, 320)
    # a real state (one chunk folded, 44 rows buffered) continued
    block = mojolearn.Mamba2Block(w)
    state = block.allocate_state(b)
    block.forward(x[:, :300].astype(np.float32), state)
    arrays = {n: torch.tensor(np.asarray(getattr(state, n), dtype=np.float64)) for n in STATE}
    x32 = x.astype(np.float32).astype(np.float64)
    y2, _ = torch_mamba2.forward(W, torch.tensor(x32[:, 300:]), arrays, state.buffered_tokens)
    y_all, _ = mamba2_numpy(w, x32)
    assert np.abs(y2.numpy() - y_all[:, 300:]).max() <= 1e-4 * np.abs(y_all).max()


@tolerance.one_torch_thread()
def test_reference_gradients_equal_transformers_autograd():
    """At a zero state and zero cotangents the torch block's gradients are
    those of transformers' Mamba2Block in float64 (test_mamba2_backward)."""
    checks.check_reference_at_zero_state(
        mamba2_weights, 32, lambda w: mojolearn.Mamba2Block(w)._state_shapes(2).values(),
        functools.partial(state_grads, s=0), grad_reference, GRAD_NAMES)


# --------------------------------------------------------------------------- cases
def make_state(block, b, n0, seed):
    """A realistic state with n0 buffered rows (the state a forward of a
    prefix leaves: one chunk folded into h, then n0 rows); n0 = 0 with a
    fold as well (nonzero h and window)."""
    state = block.allocate_state(b)
    block.forward(random_input(b, CHUNK + n0, block.d_model, seed=seed), state)
    assert state.buffered_tokens == n0
    return state


def state_arrays(state):
    return checks.state_arrays(state, STATE)


def make_cotangents(block, b, seed):
    return checks.random_cotangents(block._state_shapes(b), seed, STATE)


def run_case(d, b, l, n0, seed, cot=True, dt_limit=(0.0, float("inf")), n_groups=1):
    w = mamba2_weights(d, seed=seed, n_groups=n_groups)
    block = mojolearn.Mamba2Block(w, dt_limit=dt_limit, n_groups=n_groups)
    state = make_state(block, b, n0, seed + 1)
    got, ref, scale, x, g, cots = checks.backward_from_state(
        block, w, state, l, seed, cot, block._state_shapes(b), STATE,
        lambda ww, xx, gg, *rest: state_grads(ww, xx, gg, *rest, s=n0, dt_limit=dt_limit,
                                              n_groups=n_groups))
    assert state.buffered_tokens == n0
    return got, ref, with_underflow_floor(scale), (w, block, state, x, g, cots)


def with_underflow_floor(scale):
    """Every element's scale gets FLT_MIN = 2^-126 added: a gradient through
    the decay of a whole chunk can be far below float32's range (state.h
    at n0 = 255, one head with A = -15: about 1e-99), where the kernels
    give +0.0 (docs/numerics.md: results below 2^-126 are flushed)."""
    return {k: v + 2.0 ** -126 for k, v in scale.items()}


CASES = [  # d, B, L, n0
    (32, 2, 5, 0),          # nothing buffered: nonzero h and window
    (32, 2, 3, 1),          # one buffered row; L < 4: the final window holds start entries
    (32, 1, 40, 100),       # inside the open chunk
    (32, 2, 156, 100),      # exactly completes it: the final h is its fold, no buffers
    (32, 1, 300, 100),      # crosses its end: 156 + 144
    (32, 2, 1, 255),        # one token completes a chunk of 255 buffered rows
    (32, 2, 3, 255),        # ... and two more open the next (look-back into the window)
    (64, 1, 530, 255),      # three chunks, d = 64 (two heads)
]


@pytest.mark.parametrize("d,B,L,n0", CASES)
def test_gradients_through_the_state_match_float64_autograd(d, B, L, n0):
    got, ref, scale, _ = run_case(d, B, L, n0, seed=n0 + L + d)
    assert set(got) == set(NAMES)
    compare(got, ref, scale, f"d={d} B={B} L={L} n0={n0}", control=L > 1)
    for n in BUFFERS:  # the rows past n0 are +0.0 exactly
        tail = np.asarray(got[f"state.{n}"])[:, n0:]
        assert not tail.any() and not np.signbit(tail).any(), n
    cw0 = np.asarray(got["state.conv_window"])[:, :, 0]  # read by no convolution
    assert not cw0.any() and not np.signbit(cw0).any()


def test_with_the_dt_clamp():
    """dt_limit clamping on both sides: the clamp's gradient also covers the
    state rows' dt (buffer_dtraw gets +0.0 through a clamped dt, but still
    its cotangent)."""
    got, ref, scale, _ = run_case(32, 2, 60, 20, seed=5, dt_limit=(0.02, 0.05))
    compare(got, ref, scale, "dt_limit (0.02, 0.05)")


def test_without_final_cotangents():
    got, ref, scale, _ = run_case(32, 2, 70, 30, seed=3, cot=False)
    compare(got, ref, scale, "no grad_state")


def test_grad_state_alone_starts_from_a_zero_state():
    """state=None with grad_state: the zero state; its gradients are those of
    a zero Mamba2State; with no cotangents, the weights' gradients have the
    zero-state backward's bytes."""
    d, b, l = 32, 2, 300
    w = mamba2_weights(d, seed=4)
    block = mojolearn.Mamba2Block(w)
    x, g = random_input(b, l, d, seed=5), random_input(b, l, d, seed=6)
    a, zc = checks.check_grad_state_alone(block, x, g, make_cotangents(block, b, 7), NAMES,
                                          GRAD_NAMES)
    assert np.asarray(a["in_proj.weight"]).tobytes() != np.asarray(zc["in_proj.weight"]).tobytes()


@pytest.mark.parametrize("name,n0,L", [("conv_window", 100, 40), ("h", 100, 40),
                                       ("h", 100, 156), ("buffer_xbc", 100, 40),
                                       ("buffer_dtraw", 100, 40)])
def test_each_final_cotangent_is_used(name, n0, L):
    """Negative control: the reference without one cotangent (as a kernel
    that ignored it would compute) fails the check (h: an open last chunk,
    and a full one whose fold is the final h)."""
    got, ref, scale, (w, block, state, x, g, cots) = run_case(32, 1, L, n0, seed=8)
    compare(got, ref, scale, "controls base", control=False)
    dropped = dict(cots)
    dropped[name] = np.zeros_like(cots[name])
    ref2 = state_grads(w, x, g, *state_arrays(state), *[dropped[n] for n in STATE], s=n0)
    assert checks.arrays_failing(got, ref2, scale, NAMES), \
        f"dropping the {name} cotangent changes nothing the check sees"


@pytest.mark.parametrize("name", STATE)
def test_each_start_array_is_used(name):
    """Negative control: the reference from a state with one array zeroed
    (as a kernel that ignored it would compute) fails the check."""
    n0, L = 20, 40
    got, ref, scale, (w, block, state, x, g, cots) = run_case(32, 1, L, n0, seed=9)
    arrays = dict(zip(STATE, state_arrays(state)))
    arrays[name] = np.zeros_like(arrays[name])
    ref2 = state_grads(w, x, g, *[arrays[n] for n in STATE], *[cots[n] for n in STATE], s=n0)
    assert checks.arrays_failing(got, ref2, scale, NAMES), \
        f"ignoring the start {name} changes nothing the check sees"


def test_bits_do_not_depend_on_the_thread_count(threads):
    """From a state (an open chunk crossing its end, two rows) and ragged:
    1, 2, 3 and 5 threads give the same bytes (threads split only
    independent outputs). Control: another cotangent changes them."""
    d, b = 32, 2
    block = mojolearn.Mamba2Block(mamba2_weights(d, seed=80))
    state = make_state(block, b, 200, 81)
    x, g = random_input(b, 100, d, seed=82), random_input(b, 100, d, seed=83)
    cots = make_cotangents(block, b, 84)

    def run():
        a = block.backward(x, g, state, grad_state=cots)
        r = block.backward(x, g, lengths=[100, 37])
        return {k: np.asarray(v).tobytes() for k, v in list(a.items())
                + [(f"ragged {k}", v) for k, v in r.items()]}
    threads(1)
    ref = run()
    for n in (2, 3, 5):
        threads(n)
        got = run()
        for k in ref:
            assert got[k] == ref[k], f"{k}: {n} threads vs 1"
    other = dict(cots, h=cots["h"] * 2)
    assert (np.asarray(block.backward(x, g, state, grad_state=other)["state.h"]).tobytes()
            != ref["state.h"])


# --------------------------------------------------------------------------- chunked training
def chunked_gradients(block, x, g, pieces, state=None, cot=None):
    """checks.chunked_gradients with this block's names."""
    return checks.chunked_gradients(block, x, g, pieces, GRAD_NAMES[1:], STATE, state, cot)


def test_chunked_training_identity():
    """A sequence split into pieces (300 + 200 + 100 tokens), run forward
    with the state carried, then backward piece by piece in reverse passing
    the state cotangents, gives the one-shot gradient. Not bit for bit (see
    docs/backward.md): the pieces reorder sums, so the values agree to
    float32 rounding, measured against the float64 reference's scale; the
    first piece without the later pieces' cotangents does not."""
    d, b = 32, 2
    w = mamba2_weights(d, seed=40)
    block = mojolearn.Mamba2Block(w)
    x = random_input(b, 600, d, seed=41)
    g = random_input(b, 600, d, seed=42)
    one = block.backward(x, g)
    got, _ = chunked_gradients(block, x, g, (300, 200, 100))
    zeros = [np.zeros(s, np.float32) for s in block._state_shapes(b).values()]
    ref, scale = tolerance.sensitivity(
        lambda ww, xx, gg: state_grads(ww, xx, gg, *zeros, *zeros, s=0), w, (x, g))
    same = []
    for n in GRAD_NAMES:
        o = np.asarray(one[n], dtype=np.float64)
        r1 = tolerance.assert_within(o, ref[n], scale[n], f"one-shot {n}")
        r2 = tolerance.assert_within(got[n], ref[n], scale[n], f"pieces {n}")
        diff = np.abs(got[n] - o).max() / max(np.abs(o).max(), 1e-30)
        if n == "x" and np.array_equal(got[n], np.asarray(one[n])):
            same.append(n)
        print(f"chunked {n:18s} one-shot {r1:.2f} pieces {r2:.2f} max|diff|/max {diff:.2e}")
    print(f"chunked: bit-identical arrays: {same or 'none'}")
    lonely = block.backward(np.ascontiguousarray(x[:, :300]), np.ascontiguousarray(g[:, :300]))
    with pytest.raises(AssertionError):
        tolerance.assert_within(np.asarray(lonely["x"]), ref["x"][:, :300],
                                scale["x"][:, :300], "first piece without the cotangents")


def test_chunked_training_from_an_open_chunk():
    """The same from a state with an open chunk and with final cotangents:
    pieces 60 + 100 + 10 from n0 = 200 cross the chunk end inside the
    second piece; the start state's gradients agree with the one-shot
    call's to float32 rounding (against the float64 reference's scale)."""
    d, b = 32, 1
    w = mamba2_weights(d, seed=43)
    block = mojolearn.Mamba2Block(w)
    state = make_state(block, b, 200, 44)
    x = random_input(b, 170, d, seed=45)
    g = random_input(b, 170, d, seed=46)
    cots = make_cotangents(block, b, 47)
    one = block.backward(x, g, state, grad_state=cots)
    got, sgrad = chunked_gradients(block, x, g, (60, 100, 10), state=state, cot=cots)
    ref, scale = tolerance.sensitivity(
        lambda ww, xx, gg, *rest: state_grads(ww, xx, gg, *rest, s=200), w,
        (x, g, *state_arrays(state), *[cots[n] for n in STATE]))
    for n in GRAD_NAMES:
        tolerance.assert_within(got[n], ref[n], scale[n], f"pieces {n}")
    for n in STATE:
        o = np.asarray(one[f"state.{n}"], dtype=np.float64)
        p = np.asarray(sgrad[n], dtype=np.float64)
        tolerance.assert_within(p, ref[f"state.{n}"], scale[f"state.{n}"], f"pieces state.{n}")
        diff = np.abs(p - o).max() / max(np.abs(o).max(), 1e-30)
        print(f"chunked from n0=200 state.{n:13s} max|diff|/max {diff:.2e} "
              f"bit-identical {np.array_equal(p, o)}")


# --------------------------------------------------------------------------- ragged
def test_ragged_rows_match_each_row_alone():
    """lengths (no state): a row's x gradient is that of the row alone over
    its own tokens (values equal; padding x gradients +0.0, NaN padding
    never read); weight gradients are the sum over rows, checked against
    float64 autograd of the rows alone."""
    def reference_of(block):
        zeros = [np.zeros(s, np.float32) for s in block._state_shapes(1).values()]
        return lambda w, x, g: state_grads(w, x, g, *zeros, *zeros, s=0)
    checks.check_ragged_rows(mojolearn.Mamba2Block, mamba2_weights, [300, 5, 258], reference_of,
                             GRAD_NAMES[1:], nan_padding=True)


# --------------------------------------------------------------------------- intake
def test_clear_errors_and_nothing_changed():
    from mojolearn.reference.weights import mamba3_weights
    block, x, g, state = checks.intake_case(mojolearn.Mamba2Block, mamba2_weights, make_state,
                                            "Mamba2State", mojolearn.Mamba3Block, mamba3_weights)
    b = x.shape[0]
    before = [a.tobytes() for a in state_arrays(state)]
    # row 10 < the final buffered_tokens (11): read; the rows past it are not
    checks.check_buffer_cotangent_rows(block, x, g, state, "buffer_xbc", (b, CHUNK, 320),
                                       nan_at=(1, 10, 5), rows_read=11)
    st3 = state.copy()
    np.asarray(st3.buffer_dtraw)[1, 4, 0] = np.nan
    with raises_naming(ValueError, "state.buffer_dtraw"):
        block.backward(x, g, st3)
    np.asarray(st3.buffer_dtraw)[1, 4, 0] = 0.0
    np.asarray(st3.buffer_dtraw)[1, 5:, 0] = np.nan  # past buffered_tokens: not read
    block.backward(x, g, st3)
    assert [a.tobytes() for a in state_arrays(state)] == before
    with pytest.raises(NotImplementedError):
        mojolearn.Mamba2BlockInference(mamba2_weights(32, seed=60)).backward(x, g, state)


def test_read_only_state_is_accepted():
    """The state is only read: read-only and non-contiguous buffers work and
    give the same bytes."""
    d, b, l = 32, 2, 6
    block = mojolearn.Mamba2Block(mamba2_weights(d, seed=64))
    x, g = random_input(b, l, d, seed=65), random_input(b, l, d, seed=66)
    state = make_state(block, b, 5, 67)
    want = block.backward(x, g, state)
    arrays = state_arrays(state)
    ro = []
    for a in arrays:
        a = a.copy()
        a.setflags(write=False)
        ro.append(a)
    nc = [np.asfortranarray(a) for a in arrays]
    for bufs in (ro, nc):
        st = mojolearn.Mamba2State(*bufs, buffered_tokens=5)
        got = block.backward(x, g, st)
        for n in NAMES:
            assert np.asarray(got[n]).tobytes() == np.asarray(want[n]).tobytes(), n


def test_staged_run_gives_the_direct_bytes():
    """A device binary stages every buffer (outputs start as NaN bytes,
    tests/test_device_staging.py): the state gradients' every byte is
    written, so the emulated staging gives the direct run's bytes."""
    checks.check_staged_gives_direct_bytes(
        mojolearn.Mamba2Block, mamba2_weights, lambda block, b: [make_state(block, b, 200, 73)],
        make_cotangents, NAMES)
