"""Mamba3Block.backward through the state (issue 18 item 1): the gradient of a
forward that started from a given Mamba3State (its open, partly full chunk
and pending input states included), with cotangents for the final state,
against PyTorch autograd of a float64 recurrence that starts from the same
state (below); ragged rows; the chunked-training identity; the intake.

The float64 model of a forward from a state (docs/mamba3.md): the buffered
rows j < n0 are the state's own (rotated k, v, dt, sg, adt as stored; a
buffered q is never read), entering the recurrence from h, the state
entering the working chunk (which already holds the previous chunk's last
row with its trapezoid beta):

    S = h;  S = exp(adt_j) S [+ exp(adt_j) dt_j (1 - sg_j) v_{j-1} k_{j-1}^T, j > 0]
              + dt_j sg_j v_j k_j^T      for the buffered rows j = 0 .. n0-1,

then the tokens as in tests/reference/torch_mamba3.py (the previous row of
token 0 is the last buffered row, or the pending input states). The final
state: theta, h = the state entering the last working chunk (S after the
previous chunk's last row plus that row's beta term, taken when a token
finds the chunk full; the initial h, plus the pending term, if no chunk
was completed), the working chunk's rows, pending_k/v unchanged.
"""

import functools

import numpy as np
import pytest
import torch

import mojolearn
from mojolearn.mamba.mamba3 import _state_shapes
from mojolearn.reference.mamba3 import TWO_PI32
from mojolearn.reference.weights import mamba3_weights, random_input
from tests import backward_checks as checks
from tests import tolerance
from tests.errors import raises_naming
from tests.reference.state_autograd import state_vjp
from tests.reference.torch_mamba3 import GRAD_NAMES, _silu, mamba3_grads, token_step

STATE = ("theta", "h", "buffer_qrot", "buffer_krot", "buffer_v", "buffer_dt", "buffer_sig",
         "buffer_adt", "pending_k", "pending_v")
NAMES = GRAD_NAMES + tuple(f"state.{n}" for n in STATE)
BUFFERS = ("buffer_qrot", "buffer_krot", "buffer_v", "buffer_dt", "buffer_sig", "buffer_adt")

CHECK = tolerance.GradientCheck(NAMES, "Mamba-3 backward through the state")


# CHECK.compare and (control) its negative control on every array that has
# nonzero elements to change (an all-zero gradient, e.g. buffer_qrot when no
# buffered row reaches the final state, has none)
compare = functools.partial(checks.compare_with_controls, CHECK)


@pytest.fixture(scope="module", autouse=True)
def _report_worst():
    yield from CHECK.report()


# --------------------------------------------------------------------------- reference
def forward_from_state(W, x, st, n0, pending, mod=TWO_PI32):
    """(y, final state dict) of the block from state st (dict of float64
    tensors in the Mamba3State layouts) with n0 buffered rows."""
    Bsz, L, d = x.shape
    di = 2 * d
    H, P, N = di // 64, 64, 128
    theta, h = st["theta"], st["h"]
    S = h
    kp = torch.zeros((Bsz, H, N), dtype=x.dtype)
    vp = torch.zeros((Bsz, H, P), dtype=x.dtype)
    rows = []  # the working chunk: (q, k, v, dt, sg, adt), each (B, H, ...)
    for j in range(n0):
        kj, vj = st["buffer_krot"][:, j], st["buffer_v"][:, j]
        dtj, sgj, adtj = st["buffer_dt"][:, j], st["buffer_sig"][:, j], st["buffer_adt"][:, j]
        alpha = torch.exp(adtj)[:, :, None, None]
        S = alpha * S + (dtj * sgj)[:, :, None, None] * (vj[:, :, :, None] * kj[:, :, None, :])
        if j > 0:
            S = S + alpha * (dtj * (1.0 - sgj))[:, :, None, None] * (
                vp[:, :, :, None] * kp[:, :, None, :])
        rows.append((st["buffer_qrot"][:, j], kj, vj, dtj, sgj, adtj))
        kp, vp = kj, vj
    if pending:
        kp, vp = st["pending_k"], st["pending_v"]
    hchunk = h
    ys = []
    for t in range(L):
        xt = x[:, t]
        z, v, dt, sg, adt, qr, kr, theta = token_step(W, xt, theta, mod)
        beta = (dt * (1.0 - sg))[:, :, None, None]
        term = beta * (vp[:, :, :, None] * kp[:, :, None, :])
        if len(rows) == 64:  # the full chunk is folded: h is S with its last beta term
            hchunk = S + term
            rows = []
        elif t == 0 and pending:
            hchunk = h + term
        alpha = torch.exp(adt)[:, :, None, None]
        S = alpha * S + alpha * term + (dt * sg)[:, :, None, None] * (
            v[:, :, :, None] * kr[:, :, None, :])
        y = torch.einsum("bhpn,bhn->bhp", S, qr) + W["D"][None, :, None] * v
        o = y.reshape(Bsz, di) * _silu(z)
        ys.append(xt + o @ W["out_proj.weight"].T)
        rows.append((qr, kr, v, dt, sg, adt))
        kp, vp = kr, v
    final = {"theta": theta, "h": hchunk, "pending_k": st["pending_k"],
             "pending_v": st["pending_v"]}
    for i, n in enumerate(BUFFERS):
        final[n] = torch.stack([r[i] for r in rows], dim=1)  # (B, rows, H, ...)
    return torch.stack(ys, dim=1), final


def state_grads(weights, x, g, *state_and_cot, n0, pending):
    """float64 autograd of sum(y g) + <cot, final state> (rows of the final
    buffers past its buffered_tokens carry no cotangent): {name: ndarray}
    for x, every weight and 'state.<name>'."""
    return state_vjp(lambda W, xt, st: forward_from_state(W, xt, st, n0, pending), weights, x, g,
                     STATE, state_and_cot[:len(STATE)], state_and_cot[len(STATE):])


# --------------------------------------------------------------------------- cases
def make_state(block, b, n0, seed, pending=False):
    """A realistic state with n0 buffered rows (the state a forward of a
    prefix leaves: its rows are consistent), nonzero theta and h; n0 = 0:
    a fresh state with random theta and h (pending: set_input_states)."""
    rng = np.random.default_rng(seed)
    d, h = block.d_model, block.nheads
    state = block.allocate_state(b)
    if n0 == 0:
        theta = rng.uniform(0, 2 * np.pi, (b, h, 32)).astype(np.float32)
        hh = (0.3 * rng.standard_normal((b, h, 64, 128))).astype(np.float32)
        if pending:
            k = (1 + 0.3 * rng.standard_normal((b, h, 128))).astype(np.float32)
            v = rng.standard_normal((b, h, 64)).astype(np.float32)
            state.set_input_states(theta, hh, k, v)
        else:
            np.asarray(state.theta)[:] = theta
            np.asarray(state.h)[:] = hh
        return state
    block.forward(random_input(b, 64 + n0, d, seed=seed), state)  # one fold, then n0 rows
    assert state.buffered_tokens == n0
    return state


def state_arrays(state):
    return checks.state_arrays(state, STATE)


def make_cotangents(block, b, seed):
    return checks.random_cotangents(_state_shapes(b, block.nheads), seed, STATE)


def run_case(d, b, l, n0, seed, pending=False, cot=True):
    w = mamba3_weights(d, seed=seed)
    block = mojolearn.Mamba3Block(w)
    state = make_state(block, b, n0, seed + 1, pending)
    got, ref, scale, x, g, cots = checks.backward_from_state(
        block, w, state, l, seed, cot, _state_shapes(b, block.nheads), STATE,
        lambda ww, xx, gg, *rest: state_grads(ww, xx, gg, *rest, n0=n0, pending=pending))
    assert state.buffered_tokens == n0 and state.pending == pending
    return got, ref, with_cumsum_scale(ref, scale), (w, block, state, x, g, cots)


def with_cumsum_scale(ref, scale):
    """state.buffer_adt: each row's gradient is the canonical reverse
    cumulative sum of the chunk's decay cotangents (step 5 of the scan VJP,
    docs/backward.md), terms of the size of the array's largest element that
    cancel down to the early rows' small values (1e-3 against 20 in the
    d=64 n0=63 case), so its float32 error is relative to that running sum,
    not to the element: one ulp of the array's largest element joins each
    element's scale (as tolerance.py's cancels=True, for this array only).
    Measured: 1.2e-7 of max|ref| there; without it ratio 1.3e3 at 1e-3."""
    name = "state.buffer_adt"
    scale = dict(scale)
    scale[name] = scale[name] + tolerance.ULP * np.abs(ref[name]).max()
    return scale


CASES = [  # d, B, L, n0, pending
    (32, 2, 5, 5, False),        # inside the open chunk
    (32, 1, 70, 5, False),       # past its end: 59 tokens complete it, 11 start the next
    (32, 2, 1, 63, False),       # one token completes it
    (32, 2, 3, 63, False),       # ... and two more start the next
    (64, 1, 130, 63, False),     # three chunks
    (32, 2, 20, 64, False),      # a full buffered chunk: folded by the first token
    (32, 2, 70, 0, False),       # nonzero theta and h, nothing buffered
    (32, 2, 70, 0, True),        # pending input states
    (32, 1, 10, 0, True),        # ... with no fold: the final h holds the pending term
    (64, 3, 65, 40, False),
]


@pytest.mark.parametrize("d,B,L,n0,pending", CASES)
def test_gradients_through_the_state_match_float64_autograd(d, B, L, n0, pending):
    got, ref, scale, _ = run_case(d, B, L, n0, seed=10 * n0 + L + d, pending=pending)
    assert set(got) == set(NAMES)
    # L = 1: the angle rows of in_proj have no gradient (q and k of the one
    # token turn together); as in test_mamba3_backward, no control there.
    # The rows past n0 are +0.0 exactly.
    compare(got, ref, scale, f"d={d} B={B} L={L} n0={n0} pending={pending}", control=L > 1)
    for n in BUFFERS:
        tail = np.asarray(got[f"state.{n}"])[:, n0:]
        assert not tail.any() and not np.signbit(tail).any(), n


def test_without_final_cotangents():
    got, ref, scale, _ = run_case(32, 2, 70, 5, seed=3, cot=False)
    compare(got, ref, scale, "no grad_state")


def test_grad_state_alone_starts_from_a_zero_state():
    """state=None with grad_state: the zero state; its gradients are those of
    a zero Mamba3State (a fresh allocate_state gives the same bytes)."""
    d, b, l = 32, 2, 70
    w = mamba3_weights(d, seed=4)
    block = mojolearn.Mamba3Block(w)
    x, g = random_input(b, l, d, seed=5), random_input(b, l, d, seed=6)
    # and the weights' gradients are the zero-state backward's plus the
    # final state's terms: with zero cotangents, the very same bytes
    checks.check_grad_state_alone(block, x, g, make_cotangents(block, b, 7), NAMES, GRAD_NAMES)


@pytest.mark.parametrize("name", ["theta", "h", "buffer_qrot", "buffer_krot", "buffer_v",
                                  "buffer_dt", "buffer_sig", "buffer_adt"])
def test_each_final_cotangent_is_used(name):
    """Negative control: the reference without one cotangent (as a kernel
    that ignored it would compute) fails the check."""
    got, ref, scale, (w, block, state, x, g, cots) = run_case(32, 1, 8, 5, seed=8)
    compare(got, ref, scale, "controls base", control=False)
    dropped = dict(cots)
    dropped[name] = np.zeros_like(cots[name])
    ref2 = state_grads(w, x, g, *state_arrays(state),
                       *[dropped[n] for n in STATE], n0=5, pending=False)
    assert checks.arrays_failing(got, ref2, scale, NAMES), \
        f"dropping the {name} cotangent changes nothing the check sees"


# --------------------------------------------------------------------------- chunked training
def test_chunked_training_identity():
    """A sequence split into pieces (40 + 50 + 30 tokens), run forward with
    the state carried, then backward piece by piece in reverse passing the
    state cotangents, gives the one-shot gradient. Not bit for bit (see
    docs/backward.md): the values agree to float32 rounding, which this
    measures against the float64 reference's scale."""
    d, b = 32, 2
    w = mamba3_weights(d, seed=40)
    block = mojolearn.Mamba3Block(w)
    x = random_input(b, 120, d, seed=41)
    g = random_input(b, 120, d, seed=42)
    one = {k: np.asarray(v, dtype=np.float64) for k, v in block.backward(x, g).items()}
    got, _ = checks.chunked_gradients(block, x, g, (40, 50, 30), GRAD_NAMES[1:], STATE)
    ref, scale = tolerance.sensitivity(
        lambda ww, xx, gg: state_grads(ww, xx, gg, *zero_state_and_cot(block, b), n0=0,
                                       pending=False), w, (x, g))
    scale = with_cumsum_scale(ref, scale)
    for n in GRAD_NAMES:
        r1 = tolerance.assert_within(one[n], ref[n], scale[n], f"one-shot {n}")
        r2 = tolerance.assert_within(got[n], ref[n], scale[n], f"pieces {n}")
        diff = np.abs(got[n] - one[n]).max() / max(np.abs(one[n]).max(), 1e-30)
        print(f"chunked {n:18s} one-shot {r1:.2f} pieces {r2:.2f} max|diff|/max {diff:.2e}")
    # the x gradient of the first piece is the one-shot's up to rounding; a
    # piece run without the later pieces' state cotangents is not
    lonely = block.backward(np.ascontiguousarray(x[:, :40]), np.ascontiguousarray(g[:, :40]))
    with pytest.raises(AssertionError):
        tolerance.assert_within(np.asarray(lonely["x"]), ref["x"][:, :40], scale["x"][:, :40],
                                "first piece without the cotangents")


def zero_state_and_cot(block, b):
    zeros = {n: np.zeros(s, np.float32) for n, s in _state_shapes(b, block.nheads).items()}
    return [zeros[n] for n in STATE] * 2


# --------------------------------------------------------------------------- ragged
def test_ragged_rows_match_each_row_alone():
    """lengths (no state): a row's gradient is that of the row alone over its
    own tokens (values equal; padding x gradients +0.0); weight gradients are
    the sum over rows, checked against float64 autograd of the rows alone."""
    checks.check_ragged_rows(mojolearn.Mamba3Block, mamba3_weights, [70, 5, 66],
                             lambda block: mamba3_grads, GRAD_NAMES[1:], nan_padding=False)


# --------------------------------------------------------------------------- intake
def test_clear_errors_and_nothing_changed():
    from mojolearn.reference.weights import mamba2_weights
    block, x, g, state = checks.intake_case(mojolearn.Mamba3Block, mamba3_weights, make_state,
                                            "Mamba3State", mojolearn.Mamba2Block, mamba2_weights)
    b = x.shape[0]
    before = [a.tobytes() for a in state_arrays(state)]
    nh = block.nheads
    # rows past the final buffered_tokens (11) are not read
    checks.check_buffer_cotangent_rows(block, x, g, state, "buffer_v", (b, 64, nh, 64),
                                       nan_at=(1, 3, nh - 1, 5), rows_read=11)
    st3 = state.copy()
    st3.buffered_tokens = 65
    with raises_naming(ValueError, "state.buffered_tokens"):
        block.backward(x, g, st3)
    assert [a.tobytes() for a in state_arrays(state)] == before
    with pytest.raises(NotImplementedError):
        mojolearn.Mamba3BlockInference(mamba3_weights(32, seed=60)).backward(x, g, state)


def test_staged_run_gives_the_direct_bytes():
    """A device binary stages every buffer (outputs start as NaN bytes,
    tests/test_device_staging.py): the state gradients' every byte is
    written, so the emulated staging gives the direct run's bytes."""
    checks.check_staged_gives_direct_bytes(
        mojolearn.Mamba3Block, mamba3_weights,
        lambda block, b: [make_state(block, b, n0, 73, pending)
                          for n0, pending in ((5, False), (0, True))],
        make_cotangents, NAMES)
