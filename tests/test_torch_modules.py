"""mojolearn.torch modules: transformers mixers' and blocks' state_dicts
load into Mamba1/Mamba2 (same forward); the constructors initialise like
mojolearn.reference.weights and check their arguments; from_weights
variants, deepcopy, save/load and inference mode.
"""
import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mojolearn  # noqa: E402
import mojolearn.torch as mt  # noqa: E402
from mojolearn.reference.weights import (  # noqa: E402
    mamba1_weights, mamba2_weights, random_input,
)
from tests.bits import assert_bits_differ, assert_same_bits  # noqa: E402
from tests.errors import raises_naming  # noqa: E402
from tests.reference.hf_build import build  # noqa: E402
from tests.torch_common import ALL, D, KINDS, _setup, _t  # noqa: E402


# --------------------------------------------------------------------------- state_dict
def _hf_mixer(kind, seed):
    from tests.reference import hf_mamba as hf
    if kind == "mamba1":
        return build(hf._hf_m1.MambaMixer, hf._mamba1_config(D, False), layer_idx=0, seed=seed)
    mixer = build(hf._hf_m2.Mamba2Mixer, hf._mamba2_config(D, (0.0, math.inf), False),
                  layer_idx=0, seed=seed)
    return _init_hf_mamba2(mixer, seed)


def _init_hf_mamba2(mixer, seed):
    """Mamba2Mixer's own initialisation gives A_log = log(1..H) and D = 1
    for every head: give dt_bias, A_log and D the values of
    mojolearn.reference.weights (distinct per head)."""
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
    if kind == "mamba1":  # (build runs the mixer's own initialisation: A_log, D)
        hblock = build(hf._hf_m1.MambaBlock, hf._mamba1_config(D, False), layer_idx=0,
                       seed=6).eval()
        mod = hf._hf_m1
    else:
        hblock = build(hf._hf_m2.Mamba2Block, hf._mamba2_config(D, (0.0, math.inf), False),
                       layer_idx=0, seed=6).eval()
        _init_hf_mamba2(hblock.mixer, seed=6)
        mod = hf._hf_m2
    with torch.no_grad():  # distinct norms, and a mixer term as large as the residual
        for name, p in hblock.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
        hblock.mixer.out_proj.weight.mul_(20.0)
    cls = KINDS[kind][0]
    m = cls(D)
    m.load_state_dict(cls.state_dict_from_transformers(hblock.state_dict()), strict=True)
    x = _t(random_input(2, 21, D, seed=7))
    with hf.torch_path(mod), torch.no_grad():
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
