"""mojolearn.torch.Mamba1 / Mamba2 / Mamba3 with the state as a dict of
tensors (plus the state's plain values: buffered_tokens, Mamba-3's pending):
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
from mojolearn.reference.weights import (  # noqa: E402
    mamba1_weights, mamba2_weights, mamba3_weights, random_input)
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
        _chain_loss(module, NAMES, xs, [_t(g1), _t(g2)], s0,
                    {"conv_window": _t(gcw), "h": _t(gh)}).backward()
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
    compiled = torch.compile(lambda *a: _chain_loss(m, NAMES, *a), fullgraph=True)

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
    m3 = mt.Mamba3.from_weights(mamba3_weights(32, seed=0))
    st = {n: torch.zeros(memoryview(a).shape) for n, a in
          zip(NAMES3, _arrays(m3.allocate_state(1), NAMES3))}
    x3 = _t(random_input(1, 3, 32, seed=1))
    with raises_naming(ValueError, "state", "'h'"):
        m3(x3, {n: v for n, v in st.items() if n != "h"})
    with raises_naming(ValueError, "state", "unknown", "'bogus'"):
        m3(x3, dict(st, bogus=1))
    with raises_naming(TypeError, "state['buffered_tokens']", "int"):
        m3(x3, dict(st, buffered_tokens=1.0))
    with raises_naming(TypeError, "state['pending']", "bool"):
        m3(x3, dict(st, pending=1))


# --------------------------------------------------------------------------- Mamba-2, Mamba-3
# Both states have an open chunk (buffered_tokens rows); Mamba-3's may hold
# pending input states. The pieces start from a state a real forward left.
NAMES2 = mojolearn.Mamba2State._ARRAYS
NAMES3 = mojolearn.Mamba3State._ARRAYS
KINDS = {2: (mt.Mamba2, mojolearn.Mamba2Block, mamba2_weights, NAMES2, 256),
         3: (mt.Mamba3, mojolearn.Mamba3Block, mamba3_weights, NAMES3, 64)}


def _arrays(st, names):
    return [np.array(getattr(st, n), dtype=np.float32, copy=True) for n in names]


def _values(st):
    return {n: getattr(st, n) for n in type(st)._VALUES}


def _open_state(kind, block, b, prefix, seed, pending=False):
    """A block state after `prefix` tokens (an open chunk), or, with
    pending, a fresh state with Mamba-3 input states set."""
    st = block.allocate_state(b)
    if pending:
        theta, h, k, v = (_rand(getattr(st, n), seed + i) * 0.3 for i, n in
                          enumerate(("theta", "h", "pending_k", "pending_v")))
        st.set_input_states(np.abs(theta), h, k, v)
    elif prefix:
        block.forward(random_input(b, prefix, block.d_model, seed=seed), st)
    return st


def _dict_state(st, names, grad=False):
    out = {n: _t(a, grad) for n, a in zip(names, _arrays(st, names))}
    out.update(_values(st))
    return out


def _rand(like, seed):
    """Normal float32 values in the shape of buffer `like`."""
    shape = memoryview(like).shape
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _cotangent(names, st, seed):
    return {n: _rand(getattr(st, n), seed + i) for i, n in enumerate(names)}


@pytest.mark.parametrize("kind,prefix,pending", [(3, 69, False), (3, 0, True), (2, 300, False)])
def test_open_chunk_forward_equals_the_block(kind, prefix, pending):
    """y, every array of the new state and its values equal the block's
    forward from the same state; the given tensors are not changed."""
    mod_cls, blk_cls, wfn, names, chunk = KINDS[kind]
    w = wfn(32, seed=3)
    m, block = mod_cls.from_weights(w), blk_cls(w)
    st = _open_state(kind, block, 2, prefix, seed=20, pending=pending)
    x = random_input(2, 30, 32, seed=1)
    s0 = _dict_state(st, names)
    before = {k: v.clone() for k, v in s0.items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        y, s1 = m(_t(x), s0)
    want = block.forward(x, st)
    assert_same_bits(y.numpy(), want, "y")
    for n in names:
        assert_same_bits(s1[n].numpy(), getattr(st, n), n)
        assert torch.equal(s0[n], before[n]), f"state[{n!r}] changed"
    assert {k: s1[k] for k in type(st)._VALUES} == _values(st)


def _chain_loss(m, names, xs, gs, s0, g_final):
    """The pieces chained by their states; the loss is sum(y_k * g_k) +
    sum(final state * g_final) over the state arrays in names."""
    st, loss = s0, 0.0
    for x, g in zip(xs, gs):
        y, st = m(x, st)
        loss = loss + (y * g).sum()
    for n in names:
        loss = loss + (st[n] * g_final[n]).sum()
    return loss


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("kind,prefix,pending,lens", [
    (3, 69, False, (40, 27)), (3, 0, True, (50, 30)), (2, 300, False, (230, 40))])
def test_open_chunk_gradients_equal_the_block_chain(kind, prefix, pending, lens):
    """Two pieces from an open chunk (the first one crossing a chunk end),
    final-state cotangents on every array: dx of each piece, d state0 and
    the parameter gradients (the pieces' sums, added by torch) equal the
    block API's chained backward bit for bit; torch.compile(fullgraph=True)
    gives eager's bits."""
    mod_cls, blk_cls, wfn, names, chunk = KINDS[kind]
    w = wfn(32, seed=3)
    m, block = mod_cls.from_weights(w), blk_cls(w)
    b, (L1, L2) = 2, lens
    st0 = _open_state(kind, block, b, prefix, seed=20, pending=pending)
    x1, x2 = random_input(b, L1, 32, seed=5), random_input(b, L2, 32, seed=6)
    g1, g2 = random_input(b, L1, 32, seed=7), random_input(b, L2, 32, seed=8)
    gfin = _cotangent(names, st0, seed=40)
    st1 = st0.copy()
    block.forward(x1, st1)
    r2 = block.backward(x2, g2, st1, grad_state=gfin)
    r1 = block.backward(x1, g1, st0, grad_state={n: r2[f"state.{n}"] for n in names})

    def run(fn):
        xs = [_t(x1, True), _t(x2, True)]
        s0 = _dict_state(st0, names, grad=True)
        m.zero_grad()
        fn(xs, [_t(g1), _t(g2)], s0, {n: _t(v) for n, v in gfin.items()}).backward()
        out = {"x1": xs[0].grad, "x2": xs[1].grad}
        out.update({f"state.{n}": s0[n].grad for n in names})
        out.update({n: p.grad.clone() for n, p in m.named_parameters()})
        return {k: v.numpy().copy() for k, v in out.items()}

    eager = run(lambda *a: _chain_loss(m, names, *a))
    assert_same_bits(eager["x1"], r1["x"], "x1")
    assert_same_bits(eager["x2"], r2["x"], "x2")
    for n in names:
        assert_same_bits(eager[f"state.{n}"], r1[f"state.{n}"], n)
    for n, _ in m.named_parameters():
        assert_same_bits(eager[n], np.asarray(r2[n]) + np.asarray(r1[n]), n)
    assert_bits_differ(eager["x1"], block.backward(x1, g1, st0)["x"], "control: no grad_state")
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: _chain_loss(m, names, *a), fullgraph=True)
    comp = run(compiled)
    for k in eager:
        assert_same_bits(comp[k], eager[k], f"compiled {k}")
