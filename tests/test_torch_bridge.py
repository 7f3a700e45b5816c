"""mojolearn.torch: the Mamba1/2/3 torch.nn.Modules over the kernels, and
mojolearn.Array's DLPack export.

Bits: outputs equal the mojolearn block's bytes and gradients equal
block.backward's bytes (each with a one-ulp negative control); accuracy:
the module's gradients against float64 PyTorch autograd of the references
(transformers' blocks for Mamba-1/2, tests/reference/torch_mamba3.py) with
the elementwise bound of tests/tolerance.py and its 1%-off negative control;
transformers mixers' state_dicts load; SGD steps reach the kernels; the
no-grad forward keeps nothing; torch.compile(fullgraph=True) runs through
the custom ops; zero-copy in and out.
"""
import copy
import gc
import math
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mojolearn  # noqa: E402
import mojolearn.torch as mt  # noqa: E402
from mojolearn.torch import _ops, _tensors  # noqa: E402
from mojolearn import Array  # noqa: E402
from mojolearn._loader import native  # noqa: E402
from mojolearn.reference.weights import (  # noqa: E402
    mamba1_weights, mamba2_weights, mamba3_weights, random_input,
)
from tests import tolerance  # noqa: E402
from tests.bits import assert_bits_differ, assert_same_bits, nudge  # noqa: E402
from tests.errors import raises_naming  # noqa: E402

D = 32
KINDS = {
    "mamba1": (mt.Mamba1, mojolearn.Mamba1Block, mamba1_weights),
    "mamba2": (mt.Mamba2, mojolearn.Mamba2Block, mamba2_weights),
    "mamba3": (mt.Mamba3, mojolearn.Mamba3Block, mamba3_weights),
}
ALL = list(KINDS)


def _setup(kind, seed=1, **kw):
    cls, block_cls, wf = KINDS[kind]
    w = wf(D, seed=seed)
    return cls.from_weights(w, **kw), block_cls(w, **kw), w


def _t(a):
    """A float32 tensor over a copy of a."""
    return torch.from_numpy(np.array(a, dtype=np.float32, copy=True))


def _param_grads(module):
    return {n: p.grad.numpy().copy() for n, p in module.named_parameters()}


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

    blk.forward = spy
    try:
        with torch.no_grad():
            y = m(x)
    finally:
        del blk.forward
    assert seen["x"] == x.data_ptr()                # the kernel read x in place
    assert y.data_ptr() == seen["y"].address        # y is the kernel's Array
    # negative control: a non-contiguous x is copied (and gives the same bits)
    xt = _t(np.ascontiguousarray(np.asarray(x).transpose(1, 0, 2))).transpose(0, 1)
    assert not xt.is_contiguous()
    blk.forward = spy
    try:
        with torch.no_grad():
            y2 = m(xt)
    finally:
        del blk.forward
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


# --------------------------------------------------------------------------- state_dict
def _hf_mixer(kind, seed):
    from tests.reference import hf_mamba as hf
    torch.manual_seed(seed)
    if kind == "mamba1":
        return hf._hf_m1.MambaMixer(hf._mamba1_config(D, False), layer_idx=0)
    mixer = hf._hf_m2.Mamba2Mixer(hf._mamba2_config(D, (0.0, math.inf), False), layer_idx=0)
    return _init_hf_mamba2(mixer, seed)


def _init_hf_mamba2(mixer, seed):
    """Mamba2Mixer leaves dt_bias, A_log and D uninitialised (torch.empty;
    its PreTrainedModel's _init_weights sets them): give them the values of
    mojolearn.reference.weights."""
    w = mamba2_weights(D, seed=seed)
    with torch.no_grad():
        for name in ("dt_bias", "A_log", "D"):
            getattr(mixer, name).copy_(torch.from_numpy(w[name]))
    return mixer


@pytest.mark.parametrize("kind", ["mamba1", "mamba2"])
def test_transformers_mixer_state_dict_loads(kind):
    mixer = _hf_mixer(kind, seed=3)
    norm_name = "norm.weight" if kind == "mamba1" else "block_norm.weight"
    sd = dict(mixer.state_dict())
    sd[norm_name] = 1.0 + 0.05 * torch.randn(D, generator=torch.Generator().manual_seed(4))
    m = KINDS[kind][0](D)
    m.load_state_dict(sd, strict=True)
    weights = {k: v.detach().numpy().copy() for k, v in sd.items()}
    block = KINDS[kind][1](weights)
    x = random_input(2, 21, D, seed=5)
    with torch.no_grad():
        y = m(_t(x)).numpy()
    assert_same_bits(y, block.forward(x), f"{kind} from a transformers state_dict")
    # negative control: one ulp up of every out_proj weight changes the bits
    # (one ulp of a single weight may round away behind the residual add)
    w_out = sd["out_proj.weight"].numpy()
    bad = dict(sd, **{"out_proj.weight": _t(np.nextafter(w_out, np.float32(np.inf)))})
    m.load_state_dict(bad)
    with torch.no_grad():
        assert_bits_differ(m(_t(x)).numpy(), y, "out_proj.weight nudged")


@pytest.mark.parametrize("kind", ["mamba1", "mamba2"])
def test_transformers_block_state_dict_and_its_forward(kind):
    """A whole transformers block's state_dict (norm.weight, mixer.*) maps
    with state_dict_from_transformers; the module then agrees with that
    block's own float32 forward (torch path) to float32 accuracy, which a
    swapped norm (Mamba-2: block norm vs gated norm) would not."""
    from tests.reference import hf_mamba as hf
    torch.manual_seed(6)
    if kind == "mamba1":
        hblock = hf._hf_m1.MambaBlock(hf._mamba1_config(D, False), layer_idx=0).eval()
        mod, names = hf._hf_m1, hf._M1_KERNEL_NAMES
    else:
        hblock = hf._hf_m2.Mamba2Block(hf._mamba2_config(D, (0.0, math.inf), False),
                                       layer_idx=0).eval()
        _init_hf_mamba2(hblock.mixer, seed=6)
        mod, names = hf._hf_m2, hf._M2_KERNEL_NAMES
    with torch.no_grad():  # distinct norms, and a mixer term as large as the residual
        for name, p in hblock.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
        hblock.mixer.out_proj.weight.mul_(20.0)
    cls = KINDS[kind][0]
    m = cls(D)
    m.load_state_dict(cls.state_dict_from_transformers(hblock.state_dict()), strict=True)
    x = _t(random_input(2, 21, D, seed=7))
    import inspect
    with hf._patched(mod, {n: inspect.unwrap(getattr(mod, n)) for n in names}), \
            torch.no_grad():
        want = hblock(x).numpy()
        got = m(x).numpy()
    mix = np.abs(want - x.numpy()).max()  # the mixer's term
    assert mix > 0.1 * np.abs(want).max()
    err = np.abs(got.astype(np.float64) - want).max()
    assert err <= 1e-4 * mix, (err, mix)
    # negative control: the block norm replaced by (part of) the gated norm
    sd = cls.state_dict_from_transformers(hblock.state_dict())
    other = dict(sd, **{"norm.weight" if kind == "mamba1" else "block_norm.weight":
                        hblock.mixer.D.new_ones(D) if kind == "mamba1"
                        else sd["norm.weight"][:D]})
    m.load_state_dict(other)
    with torch.no_grad():
        err2 = np.abs(m(x).numpy().astype(np.float64) - want).max()
    assert err2 > 1e-2 * mix, (err2, mix)


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


# --------------------------------------------------------------------------- construction
@pytest.mark.parametrize("kind", ALL)
def test_constructor_initialises_like_the_reference(kind):
    """Same names, shapes and distributions as mojolearn.reference.weights
    (within the range of 20 reference draws, and a close spread for the
    large arrays), decided by torch's generator."""
    cls, _, wf = KINDS[kind]
    torch.manual_seed(0)
    a = cls(64)
    torch.manual_seed(0)
    b = cls(64)
    c = cls(64, generator=torch.Generator().manual_seed(1))
    refs = [wf(64, seed=s) for s in range(20)]
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert set(sa) == set(refs[0])
    for n, v in sa.items():
        assert v.shape == refs[0][n].shape and v.dtype == torch.float32, n
        assert torch.equal(v, sb[n]), n                       # torch.manual_seed decides
        pool = np.stack([r[n] for r in refs]).astype(np.float64)
        margin = 0.02 * (pool.max() - pool.min()) + 1e-6
        assert pool.min() - margin <= float(v.min()) and float(v.max()) <= pool.max() + margin, n
        if v.numel() >= 256:
            assert abs(float(v.double().std()) - pool.std()) <= 0.1 * pool.std() + 1e-7, n
            assert abs(float(v.double().mean()) - pool.mean()) <= 0.1 * pool.std() + 1e-7, n
    assert any(not torch.equal(sa[n], sc[n]) for n in sa)     # the generator is used
    if kind == "mamba1":
        assert torch.equal(sa["A_log"], torch.from_numpy(refs[0]["A_log"]))  # S4D-real
    with torch.no_grad():
        assert torch.isfinite(a(torch.randn(1, 4, 64))).all()


def test_constructor_and_input_checks():
    with raises_naming(ValueError, "d_model", "32"):
        mt.Mamba2(48)
    with raises_naming(ValueError, "d_model", "32"):
        mt.Mamba3(16)
    with pytest.raises(TypeError):
        mt.Mamba1(32.0)
    with raises_naming(ValueError, "numeric_mode"):
        mt.Mamba1(16, numeric_mode="exact")
    m = mt.Mamba1(16)
    with raises_naming(TypeError, "x", "float32", "torch.float64"):
        m(torch.zeros(1, 2, 16, dtype=torch.float64))
    with raises_naming(ValueError, "d_model"):
        m(torch.zeros(1, 2, 8))
    with raises_naming(ValueError, "x", "non-finite"):
        m(torch.full((1, 2, 16), math.nan))
    with raises_naming(ValueError, "D", "non-finite"):
        with torch.no_grad():
            m.D[3] = math.inf
        m(torch.zeros(1, 2, 16))


def test_from_weights_variants_and_dt_limit():
    w = mamba1_weights(D, seed=2)
    w2 = dict(w, **{"conv1d.weight": np.ascontiguousarray(w["conv1d.weight"].reshape(2 * D, 4))})
    a, b = mt.Mamba1.from_weights(w), mt.Mamba1.from_weights(w2)
    assert b.conv1d.weight.shape == (2 * D, 1, 4)
    c = mt.Mamba1.from_weights({k: torch.from_numpy(v) for k, v in w.items()})
    d = mt.Mamba1.from_weights(mojolearn.Mamba1Block(w).get_params()["weights"])
    x = _t(random_input(1, 6, D, seed=3))
    with torch.no_grad():
        ys = [mod(x).numpy() for mod in (a, b, c, d)]
    for y in ys[1:]:
        assert_same_bits(y, ys[0], "from_weights variant")
    with raises_naming(ValueError, "missing"):
        mt.Mamba1.from_weights({k: v for k, v in w.items() if k != "D"})
    # Mamba-2's dt_limit reaches the block
    w2 = mamba2_weights(D, seed=2)
    lim = (0.02, 0.05)
    m = mt.Mamba2.from_weights(w2, dt_limit=lim)
    xx = random_input(1, 6, D, seed=3)
    with torch.no_grad():
        y = m(_t(xx)).numpy()
    assert_same_bits(y, mojolearn.Mamba2Block(w2, dt_limit=lim).forward(xx), "dt_limit")
    assert_bits_differ(y, mojolearn.Mamba2Block(w2).forward(xx), "dt_limit vs none")
    assert "dt_limit=(0.02, 0.05)" in repr(m)


def test_deepcopy_is_independent():
    m, _, _ = _setup("mamba1")
    x = _t(random_input(1, 6, D, seed=3))
    with torch.no_grad():
        y = m(x).numpy().copy()
        m2 = copy.deepcopy(m)
        assert m2._kernel.handle != m._kernel.handle
        m2.D.add_(1.0)
        assert_bits_differ(m2(x).numpy(), y, "the copy's own weights")
        assert_same_bits(m(x).numpy(), y, "the original unchanged")


def test_save_load_and_inference_mode(tmp_path):
    m, block, _ = _setup("mamba3")
    x = random_input(1, 6, D, seed=3)
    want = np.asarray(block.forward(x))
    with torch.inference_mode():
        assert_same_bits(m(_t(x)).numpy(), want, "inference_mode")
    torch.save(m.state_dict(), tmp_path / "sd.pt")
    fresh = mt.Mamba3(D)
    fresh.load_state_dict(torch.load(tmp_path / "sd.pt"))
    torch.save(m, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert whole._kernel.handle != m._kernel.handle
    with torch.no_grad():
        for mod in (fresh, whole):
            assert_same_bits(mod(_t(x)).numpy(), want, "reloaded")
