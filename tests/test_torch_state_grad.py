"""mojolearn.torch.Mamba1 with the state as a dict of tensors:
forward(x, state) -> (y, new_state), differentiable with respect to the
state tensors (ops mojolearn::mamba_forward_state / mamba_backward_state).

Bits: outputs and the new state equal Mamba1Block.forward(x, state)'s;
torch autograd through pieces chained by their states gives the bits of the
block API's chained backward (tests/test_mamba1_state_grad.py checks those
against float64 autograd); torch.compile(fullgraph=True) gives eager's bits.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mojolearn  # noqa: E402
import mojolearn.torch as mt  # noqa: E402
from mojolearn.reference.weights import mamba1_weights, mamba2_weights, random_input  # noqa: E402
from tests.bits import assert_bits_differ, assert_same_bits  # noqa: E402
from tests.errors import raises_naming  # noqa: E402

D = 16
NAMES = ("conv_window", "h")


def _t(a, grad=False):
    return torch.from_numpy(np.array(a, dtype=np.float32, copy=True)).requires_grad_(grad)


def _setup():
    w = mamba1_weights(D, seed=3)
    return mt.Mamba1.from_weights(w), mojolearn.Mamba1Block(w)


def _state(seed, b=2):
    return (random_input(b, 2 * D, 4, seed=seed), random_input(b, 2 * D, 16, seed=seed + 1))


def _block_state(block, cw, h):
    st = block.allocate_state(cw.shape[0])
    np.asarray(st.conv_window)[...] = cw
    np.asarray(st.h)[...] = h
    return st


def test_forward_equals_the_block_and_changes_no_input():
    m, block = _setup()
    x = random_input(2, 37, D, seed=1)
    cw, h = _state(2)
    s0 = {"conv_window": _t(cw), "h": _t(h)}
    before = {k: v.clone() for k, v in s0.items()}
    with torch.no_grad():
        y, s1 = m(_t(x), s0)
    st = _block_state(block, cw, h)
    assert_same_bits(y.numpy(), block.forward(x, st), "y")
    for n in NAMES:
        assert_same_bits(s1[n].numpy(), getattr(st, n), n)
        assert torch.equal(s0[n], before[n]), f"state[{n!r}] changed"
    assert_bits_differ(y.numpy(), block.forward(x), "control: a zero state")


def _loss(m, xs, gs, s0, g_final):
    """The pieces chained by their states; the loss is sum(y_k * g_k) +
    sum(final state * g_final)."""
    st, loss = s0, 0.0
    for x, g in zip(xs, gs):
        y, st = m(x, st)
        loss = loss + (y * g).sum()
    for n in NAMES:
        loss = loss + (st[n] * g_final[n]).sum()
    return loss


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_gradients_through_the_state_equal_the_block_chain():
    """Two pieces: dx of each, d state0 and the parameter gradients (the two
    pieces' sums, added by torch in float32) equal the block API's chained
    backward bit for bit; torch.compile(fullgraph=True) gives the same."""
    m, block = _setup()
    L1, L2 = 40, 27
    x1, x2 = random_input(2, L1, D, seed=5), random_input(2, L2, D, seed=6)
    g1, g2 = random_input(2, L1, D, seed=7), random_input(2, L2, D, seed=8)
    cw, h = _state(9)
    gcw, gh = _state(11)
    # the block API: forward with the state carried, backward last to first
    st0 = _block_state(block, cw, h)
    st1 = st0.copy()
    block.forward(x1, st1)
    r2 = block.backward(x2, g2, st1, grad_state={"conv_window": gcw, "h": gh})
    r1 = block.backward(x1, g1, st0, grad_state={n: r2[f"state.{n}"] for n in NAMES})

    def run(module):
        xs = [_t(x1, True), _t(x2, True)]
        s0 = {"conv_window": _t(cw, True), "h": _t(h, True)}
        module.zero_grad()
        _loss(module, xs, [_t(g1), _t(g2)], s0, {"conv_window": _t(gcw), "h": _t(gh)}).backward()
        out = {"x1": xs[0].grad, "x2": xs[1].grad}
        out.update({f"state.{n}": s0[n].grad for n in NAMES})
        out.update({n: p.grad.clone() for n, p in m.named_parameters()})
        return {k: v.numpy().copy() for k, v in out.items()}

    eager = run(m)
    assert_same_bits(eager["x1"], r1["x"], "x1")
    assert_same_bits(eager["x2"], r2["x"], "x2")
    for n in NAMES:
        assert_same_bits(eager[f"state.{n}"], r1[f"state.{n}"], n)
    for n, _ in m.named_parameters():
        want = np.asarray(r2[n]) + np.asarray(r1[n])
        assert_same_bits(eager[n], want, n)
    assert_bits_differ(eager["x1"], block.backward(x1, g1, st0)["x"], "control: no grad_state")
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: _loss(m, *a), fullgraph=True)

    def run_compiled():
        xs = [_t(x1, True), _t(x2, True)]
        s0 = {"conv_window": _t(cw, True), "h": _t(h, True)}
        m.zero_grad()
        compiled(xs, [_t(g1), _t(g2)], s0, {"conv_window": _t(gcw), "h": _t(gh)}).backward()
        out = {"x1": xs[0].grad, "x2": xs[1].grad}
        out.update({f"state.{n}": s0[n].grad for n in NAMES})
        out.update({n: p.grad.clone() for n, p in m.named_parameters()})
        return {k: v.numpy().copy() for k, v in out.items()}

    comp = run_compiled()
    for k in eager:
        assert_same_bits(comp[k], eager[k], f"compiled {k}")


def test_only_the_requested_gradients():
    """A state tensor not requiring grad gets none; x and parameters still do."""
    m, _ = _setup()
    x = _t(random_input(2, 9, D, seed=1), True)
    cw, h = _state(2)
    s0 = {"conv_window": _t(cw), "h": _t(h, True)}
    y, s1 = m(x, s0)
    (y.sum() + s1["conv_window"].sum()).backward()
    assert s0["conv_window"].grad is None
    assert s0["h"].grad is not None and x.grad is not None
    assert m.norm.weight.grad is not None


def test_state_dict_refusals():
    m, _ = _setup()
    x = _t(random_input(2, 5, D, seed=1))
    cw, h = _state(2)
    with raises_naming(ValueError, "state", "'h'"):
        m(x, {"conv_window": _t(cw)})
    with raises_naming(TypeError, "state['h']", "float32"):
        m(x, {"conv_window": _t(cw), "h": _t(h).double()})
    m2 = mt.Mamba2.from_weights(mamba2_weights(32, seed=0))
    with raises_naming(NotImplementedError, "Mamba1", "state"):
        m2(_t(random_input(1, 3, 32, seed=1)), {"h": torch.zeros(1)})
