"""mojolearn.torch: the Mamba1/2/3 torch.nn.Modules over the kernels, and
mojolearn.Array's DLPack export.

Bits: outputs equal the mojolearn block's bytes and gradients equal
block.backward's bytes (each with a one-ulp negative control); accuracy:
the module's gradients against float64 PyTorch autograd of the references
(transformers' blocks for Mamba-1/2, tests/reference/torch_mamba3.py) with
the elementwise bound of tests/tolerance.py and its 1%-off negative control;
SGD steps reach the kernels; the no-grad forward keeps nothing;
torch.compile(fullgraph=True) runs through the custom ops; zero-copy in and
out. State dicts and construction: test_torch_modules.py.
"""
import gc
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mojolearn.torch as mt  # noqa: E402
from mojolearn.torch import _ops, _tensors  # noqa: E402
from mojolearn import Array  # noqa: E402
from mojolearn._loader import native  # noqa: E402
from mojolearn.reference.weights import random_input  # noqa: E402
from tests import tolerance  # noqa: E402
from tests.bits import assert_bits_differ, assert_same_bits, nudge  # noqa: E402
from tests.errors import raises_naming  # noqa: E402
from tests.torch_common import ALL, D, KINDS, _param_grads, _setup, _t  # noqa: E402


# --------------------------------------------------------------------------- import
def test_import_mojolearn_does_not_import_torch():
    code = textwrap.dedent("""
        import sys
        import mojolearn
        from mojolearn import *  # noqa: F401,F403
        assert "torch" not in sys.modules, "import mojolearn imported torch"
        assert "torch" not in dir(mojolearn)  # kept out of __all__ (star import)
        m = mojolearn.torch                   # the lazy name
        assert "torch" in sys.modules and m is sys.modules["mojolearn.torch"]
        assert m.Mamba1 and m.Mamba2 and m.Mamba3
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


# --------------------------------------------------------------------------- DLPack
def test_from_dlpack_shares_memory_both_ways():
    a = Array((3, 4))
    assert a.__dlpack_device__() == (1, 0)
    t = torch.from_dlpack(a)
    assert t.shape == (3, 4) and t.dtype == torch.float32
    assert t.data_ptr() == a.address
    t[1, 2] = 7.5                                    # tensor -> Array
    assert memoryview(a).tolist()[1][2] == 7.5
    memoryview(a).cast("B").cast("f")[0] = -3.0      # Array -> tensor
    assert t[0, 0].item() == -3.0
    # negative control: a requested copy does not share memory
    c = torch.from_dlpack(a, copy=True)
    assert c.data_ptr() != a.address
    c[0, 0] = 1.0
    assert t[0, 0].item() == -3.0
    # NumPy consumes it too, and other dtypes keep their type
    assert np.from_dlpack(a).ctypes.data == a.address
    ti = torch.from_dlpack(Array((5,), "int32"))
    assert ti.dtype == torch.int32 and ti.shape == (5,)


def test_dlpack_capsule_keeps_the_array_alive():
    gc.collect()
    base = native()._live_storages()
    a = Array((1000,))
    memoryview(a).cast("B").cast("f")[999] = 2.5
    t = torch.from_dlpack(a)
    del a
    gc.collect()
    assert native()._live_storages() == base + 1  # held by the tensor
    assert t[999].item() == 2.5
    del t
    gc.collect()
    assert native()._live_storages() == base      # and released with it


def test_dlpack_refusals(monkeypatch):
    a = Array((2,))
    with raises_naming(BufferError, "stream"):
        a.__dlpack__(stream=1)
    with raises_naming(BufferError, "(2, 0)"):
        a.__dlpack__(dl_device=(2, 0))
    monkeypatch.setitem(sys.modules, "numpy", None)  # NumPy not importable
    with raises_naming(ImportError, "NumPy", "torch.frombuffer"):
        a.__dlpack__()


# --------------------------------------------------------------------------- zero copy
def _run_spied(m, blk, spy, x):
    """m(x) without gradients while spy stands in for blk.forward."""
    blk.forward = spy
    try:
        with torch.no_grad():
            return m(x)
    finally:
        del blk.forward


def test_inputs_and_outputs_are_not_copied():
    m, _, _ = _setup("mamba1")
    x = _t(random_input(2, 9, D, seed=2))
    blk = m.kernel_block()
    seen = {}
    fwd = blk.forward

    def spy(xb, *a, **k):
        seen["x"] = np.asarray(xb).ctypes.data
        seen["y"] = y = fwd(xb, *a, **k)
        return y

    y = _run_spied(m, blk, spy, x)
    assert seen["x"] == x.data_ptr()                # the kernel read x in place
    assert y.data_ptr() == seen["y"].address        # y is the kernel's Array
    # negative control: a non-contiguous x is copied (and gives the same bits)
    xt = _t(np.ascontiguousarray(np.asarray(x).transpose(1, 0, 2))).transpose(0, 1)
    assert not xt.is_contiguous()
    y2 = _run_spied(m, blk, spy, xt)
    assert seen["x"] != xt.data_ptr()
    assert_same_bits(y2.numpy(), y.numpy(), "non-contiguous x")


def test_gradients_land_in_torch_memory():
    """The backward kernel writes each gradient into a tensor torch
    allocated (no Array, no copy); block.backward called directly still
    returns mojolearn.Arrays."""
    m, _, w = _setup("mamba2")
    x = _t(random_input(2, 9, D, seed=2)).requires_grad_(True)
    kinds = []
    orig = _ops._grad_tensor

    def spy(g):
        kinds.append(type(g))
        return orig(g)

    _ops._grad_tensor = spy
    try:
        m(x).sum().backward()
    finally:
        _ops._grad_tensor = orig
    assert kinds == [_tensors._TorchOut] * (1 + len(w))
    direct = m.kernel_block().backward(np.asarray(x.detach()), np.ones((2, 9, D), np.float32))
    assert all(isinstance(v, Array) for v in direct.values())


def test_without_numpy_the_buffers_are_ctypes_views(monkeypatch):
    m, block, _ = _setup("mamba1")
    x = _t(random_input(2, 9, D, seed=2))
    buf = _tensors._buffer(x)
    assert isinstance(buf, np.ndarray) and buf.ctypes.data == x.data_ptr()
    monkeypatch.setattr(_tensors, "_np", None)
    buf = _tensors._buffer(x)
    assert isinstance(buf, memoryview) and buf.shape == (2, 9, D) and buf.format == "f"
    assert native().address(buf) == x.data_ptr()
    a = Array((2, 3))
    assert _tensors._tensor(a).data_ptr() == a.address and _tensors._tensor(a).shape == (2, 3)
    with torch.no_grad():
        y = m(x)
    assert_same_bits(y.numpy(), block.forward(np.asarray(x)), "forward without NumPy")


# --------------------------------------------------------------------------- bits
@pytest.mark.parametrize("kind", ALL)
def test_output_equals_the_block_bits(kind):
    m, block, w = _setup(kind)
    x = random_input(3, 37, D, seed=5)
    y = m(_t(x))
    assert y.shape == (3, 37, D) and y.dtype == torch.float32 and y.requires_grad
    want = np.asarray(block.forward(x))
    assert_same_bits(y.detach().numpy(), want, f"{kind} forward")
    # negative controls: one ulp of x, or of one weight, changes the bits
    assert_bits_differ(m(_t(nudge(x, 100))).detach().numpy(), want, "x nudged")
    name = "in_proj.weight"
    m2 = KINDS[kind][0].from_weights(dict(w, **{name: nudge(w[name], 3)}))
    assert_bits_differ(m2(_t(x)).detach().numpy(), want, f"{name} nudged")


@pytest.mark.parametrize("kind", ALL)
def test_gradients_equal_block_backward_bits(kind):
    m, block, w = _setup(kind)
    x, g = random_input(2, 37, D, seed=6), random_input(2, 37, D, seed=7)
    xt = _t(x).requires_grad_(True)
    m(xt).backward(_t(g))
    got = dict(_param_grads(m), x=xt.grad.numpy().copy())
    want = {k: np.asarray(v).copy() for k, v in block.backward(x, g).items()}
    assert set(got) == set(want) == set(w) | {"x"}
    for name, p in m.named_parameters():
        assert p.grad.shape == p.shape == w[name].shape, name
    for name in want:
        assert_same_bits(got[name], want[name], f"{kind} grad {name}")
    # negative control: one ulp of grad_output changes the gradients
    m.zero_grad()
    xt.grad = None
    m(xt).backward(_t(nudge(g, g.size - 1)))
    assert_bits_differ(xt.grad.numpy(), want["x"], "grad_output nudged")


def test_only_requested_gradients():
    m, _, _ = _setup("mamba1")
    x = _t(random_input(1, 5, D, seed=2))
    m.requires_grad_(False)
    m.in_proj.weight.requires_grad_(True)
    m(x).sum().backward()
    assert m.in_proj.weight.grad is not None and x.grad is None
    assert all(p.grad is None for n, p in m.named_parameters() if n != "in_proj.weight")


# --------------------------------------------------------------------------- accuracy
def _reference(kind):
    if kind == "mamba1":
        from tests.test_mamba1_backward import grad_reference
        return grad_reference
    if kind == "mamba2":
        from tests.test_mamba2_backward import grad_reference
        return grad_reference
    from tests.reference.torch_mamba3 import mamba3_grads
    return mamba3_grads


@pytest.mark.parametrize("kind", ALL)
def test_gradients_match_float64_autograd(kind):
    """The module's gradients within tolerance.C of float64 PyTorch
    autograd of the reference, elementwise (the bound of the block backward
    tests); negative control: the smallest 20% of any array 1% off fails."""
    _, _, w = _setup(kind, seed=11)
    x, g = random_input(2, 40, D, seed=12), random_input(2, 40, D, seed=13)
    m = KINDS[kind][0].from_weights(w)
    xt = _t(x).requires_grad_(True)
    m(xt).backward(_t(g))
    got = dict(_param_grads(m), x=xt.grad.numpy().copy())
    ref, scale = tolerance.sensitivity(_reference(kind), w, (x, g))
    assert set(ref) == set(got)
    for name in got:
        tolerance.assert_within(got[name], ref[name], scale[name], f"{kind} {name}")
        with pytest.raises(AssertionError):
            tolerance.assert_within(tolerance.smallest_changed(got[name]), ref[name],
                                    scale[name], f"{kind} {name} 1% off")


# --------------------------------------------------------------------------- training
@pytest.mark.parametrize("kind", ALL)
def test_sgd_steps_reach_the_kernels(kind):
    m, block, w = _setup(kind)
    x, g = random_input(2, 17, D, seed=8), random_input(2, 17, D, seed=9)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    first = m.kernel_block()
    builds = m._kernel.builds
    y1 = m(_t(x))
    (y1 * _t(g)).sum().backward()
    assert m.kernel_block() is first and m._kernel.builds == builds  # nothing rebuilt
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt.step()
    for n, p in m.named_parameters():
        want = before[n].add(p.grad, alpha=-0.05)   # SGD's own update
        assert torch.equal(p.detach(), want) and not torch.equal(want, before[n]), n
    y2 = m(_t(x))
    assert m._kernel.builds == builds + 1 and m.kernel_block() is not first
    new_w = {n: p.detach().numpy().copy() for n, p in m.named_parameters()}
    assert_same_bits(y2.detach().numpy(), KINDS[kind][1](new_w).forward(x), "after a step")
    assert_bits_differ(y2.detach().numpy(), y1.detach().numpy(), "before vs after the step")
    # a second step and in-place edits are seen too
    opt.zero_grad()
    (m(_t(x)) * _t(g)).sum().backward()
    opt.step()
    with torch.no_grad():
        m.D.add_(0.01)
    y3 = m(_t(x))
    new_w = {n: p.detach().numpy().copy() for n, p in m.named_parameters()}
    assert_same_bits(y3.detach().numpy(), KINDS[kind][1](new_w).forward(x), "two steps")


def test_modified_between_forward_and_backward_is_refused():
    m, _, _ = _setup("mamba1")
    y = m(_t(random_input(1, 5, D, seed=1)))
    with torch.no_grad():
        m.D.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# --------------------------------------------------------------------------- no_grad
@pytest.mark.parametrize("kind", ALL)
def test_no_grad_forward_keeps_nothing(kind):
    m, _, _ = _setup(kind)
    x = _t(random_input(2, 9, D, seed=3)).requires_grad_(True)
    ref = weakref.ref(x)
    with torch.no_grad():
        y = m(x)
    assert y.grad_fn is None and not y.requires_grad
    del x
    gc.collect()
    assert ref() is None, "the no-grad forward kept x"
    # negative control: with grad the input is kept for backward while y lives
    x = _t(random_input(2, 9, D, seed=3)).requires_grad_(True)
    ref = weakref.ref(x)
    y = m(x)
    del x
    gc.collect()
    assert ref() is not None
    del y
    gc.collect()
    assert ref() is None


# --------------------------------------------------------------------------- state
@pytest.mark.parametrize("kind", ALL)
def test_state_needs_no_grad(kind):
    m, block, _ = _setup(kind)
    x1, x2 = random_input(2, 7, D, seed=1), random_input(2, 5, D, seed=2)
    st = m.allocate_state(2)
    with raises_naming(NotImplementedError, "state", "torch.no_grad()"):
        m(_t(x1), st)
    with raises_naming(NotImplementedError, "state"):
        m.step(_t(x2[:, 0]), st)
    with torch.no_grad():
        y1, y2 = m(_t(x1), st).numpy(), m(_t(x2), st).numpy()
        s = m.step(_t(x1[:, 0]), st).numpy()
    bst = block.allocate_state(2)
    assert_same_bits(y1, block.forward(x1, bst), "state, first call")
    assert_same_bits(y2, block.forward(x2, bst), "state, continued")
    assert_same_bits(s, block.step(x1[:, 0], bst), "step")
    # negative control: the continuation differs from a fresh prefill
    assert_bits_differ(y2, block.forward(x2), "continued vs fresh")
    # allowed with grad mode on when nothing requires grad
    m.requires_grad_(False)
    st2 = m.allocate_state(2)
    assert_same_bits(m(_t(x1), st2).numpy(), y1, "state without no_grad")


# --------------------------------------------------------------------------- compile
# inductor's own imports warn (torch.utils.mkldnn uses torch.jit.script_method)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_torch_compile_fullgraph_matches_eager():
    """torch.compile(fullgraph=True) traces through the custom ops (a graph
    break would raise); outputs and gradients equal eager bit for bit (the
    only other op, a scaling by 0.5, is exact) and a parameter update
    reaches the compiled model."""
    torch._dynamo.reset()
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = mt.Mamba1(D), mt.Mamba2(D), mt.Mamba3(D)

        def forward(self, x):
            return self.c(self.b(self.a(x)) * 0.5)

    net = Net()
    x = _t(random_input(2, 11, D, seed=4)).requires_grad_(True)
    g = _t(random_input(2, 11, D, seed=5))
    compiled = torch.compile(net, fullgraph=True)
    y_c = compiled(x)
    y_c.backward(g)
    grads_c = dict(x=x.grad.clone(), **{n: p.grad.clone() for n, p in net.named_parameters()})
    net.zero_grad()
    x.grad = None
    y_e = net(x)
    y_e.backward(g)
    assert_same_bits(y_c.detach().numpy(), y_e.detach().numpy(), "compiled forward")
    assert_same_bits(grads_c["x"].numpy(), x.grad.numpy(), "compiled grad x")
    for n, p in net.named_parameters():
        assert_same_bits(grads_c[n].numpy(), p.grad.numpy(), f"compiled grad {n}")
    with torch.no_grad():
        net.b.D.add_(0.25)
        after = compiled(x)
        assert_same_bits(after.numpy(), net(x).numpy(), "after an update")
    assert_bits_differ(after.numpy(), y_e.detach().numpy(), "update seen")
