"""mojolearn.init_weights: shapes the blocks take, determinism, and the
mamba_ssm distributions (bounds, dt range, A_log, ones, the out_proj
rescale), each check with a control that it can fail."""
import math

import pytest

import mojolearn

from .errors import raises_naming

np = pytest.importorskip("numpy")

BLOCKS = {"mamba1": "Mamba1Block", "mamba2": "Mamba2Block", "mamba3": "Mamba3Block"}


def _np(w):
    return {k: np.asarray(v).astype(np.float64) for k, v in w.items()}


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_the_blocks_take_them_and_they_are_deterministic(kind):
    w = mojolearn.init_weights(kind, 64, seed=3)
    block = getattr(mojolearn, BLOCKS[kind])(w)
    assert sorted(block.get_params()["weights"]) == sorted(w)
    again = mojolearn.init_weights(kind, 64, seed=3)
    assert all(bytes(memoryview(w[k])) == bytes(memoryview(again[k])) for k in w)
    other = mojolearn.init_weights(kind, 64, seed=4)
    assert bytes(memoryview(w["in_proj.weight"])) != bytes(memoryview(other["in_proj.weight"]))
    x = np.random.default_rng(0).standard_normal((2, 9, 64)).astype(np.float32)
    assert np.isfinite(np.asarray(block.forward(x))).all()


def _uniform_ok(a, bound):
    """Inside [-bound, bound], spread over it (std of U(-b, b) = b / sqrt 3)."""
    return (np.abs(a).max() <= bound and abs(a.std() - bound / math.sqrt(3)) < 0.05 * bound
            and abs(a.mean()) < 0.05 * bound)


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_the_distributions_are_mamba_ssm_s(kind):
    d = 64
    w = _np(mojolearn.init_weights(kind, d, seed=1))
    di = 2 * d
    assert _uniform_ok(w["in_proj.weight"], 1 / math.sqrt(d))
    assert _uniform_ok(w["out_proj.weight"], 1 / math.sqrt(di))
    assert not _uniform_ok(w["out_proj.weight"], 1 / math.sqrt(d))  # control
    dtb = w["dt_proj.bias"] if kind == "mamba1" else w["dt_bias"]
    dt = np.log1p(np.exp(dtb))  # softplus: the initial time steps
    assert dt.min() >= 0.001 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    logs = np.log(dt)  # log-uniform in [log 0.001, log 0.1]
    if dt.size > 100:
        assert abs(logs.mean() - math.log(0.01)) < 0.3
    norms = [k for k in w if k.endswith("norm.weight")]
    assert norms and all((w[k] == 1).all() for k in norms) and (w["D"] == 1).all()
    if kind == "mamba1":
        r = math.ceil(d / 16)
        assert _uniform_ok(w["x_proj.weight"], 1 / math.sqrt(di))
        assert np.abs(w["dt_proj.weight"]).max() <= r ** -0.5
        assert np.allclose(w["A_log"], np.log(np.arange(1, 17))[None, :], rtol=0, atol=1e-7)
    if kind in ("mamba1", "mamba2"):
        assert _uniform_ok(w["conv1d.weight"], 0.5) and np.abs(w["conv1d.bias"]).max() <= 0.5
    if kind == "mamba2":
        a = np.exp(w["A_log"])
        assert a.min() >= 1 - 1e-6 and a.max() <= 16 + 1e-5
    if kind == "mamba3":
        assert (w["B_bias"] == 1).all() and (w["C_bias"] == 1).all()


def test_n_layers_rescales_out_proj_only():
    a = _np(mojolearn.init_weights("mamba2", 64, seed=2))
    b = _np(mojolearn.init_weights("mamba2", 64, seed=2, n_layers=4))
    assert np.allclose(b["out_proj.weight"], a["out_proj.weight"] / 2, rtol=1e-6, atol=0)
    assert all((a[k] == b[k]).all() for k in a if k != "out_proj.weight")


@pytest.mark.parametrize("args, names", [
    (("mamba0", 64), ["kind", "mamba0"]),
    (("mamba2", 48), ["d_model", "48"]),
    (("mamba1", 0), ["d_model", "0"]),
])
def test_bad_arguments_are_refused_by_name(args, names):
    with raises_naming(ValueError, *names):
        mojolearn.init_weights(*args)
