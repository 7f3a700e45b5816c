"""Checkpoint layouts the other checkpoint tests do not reach:

- Mamba-1 at d = 40, where dt_rank = ceil(40 / 16) = 3 differs from
  floor(40 / 16) = 2 (every other Mamba-1 checkpoint test uses d = 32, where
  they agree): the block and a transformers checkpoint with
  time_step_rank 3 load and match their float64 references.
- A sharded folder (transformers' save_pretrained with a small
  max_shard_size: several model-*.safetensors and model.safetensors.index.json)
  loads every shard: its tensors and logits have the bytes of the unsharded
  folder's, eagerly and lazily.
"""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mojolearn  # noqa: E402
from mojolearn.checkpoints import load_checkpoint  # noqa: E402
from mojolearn.reference.weights import mamba1_weights, random_input  # noqa: E402
from tests.test_checkpoints import make_model  # noqa: E402
from tests.reference.hf_mamba import mamba1_reference  # noqa: E402

TOKENS = [[1, 5, 9, 3, 7, 0, 63], [2, 2, 8, 61, 0, 4, 4]]


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model.double()(torch.tensor(tokens)).logits.numpy()


# ----------------------------------------------------------------- dt_rank at d = 40
def test_a_mamba1_block_at_d40_has_dt_rank_3_and_matches_the_reference():
    w = mamba1_weights(40, seed=40, scale=2.0)  # (scale 2: dt's rank-3 term matters)
    assert w["dt_proj.weight"].shape == (80, 3) and w["x_proj.weight"].shape == (35, 80)
    block = mojolearn.Mamba1Block(w)
    assert block.dt_rank == 3
    x = random_input(2, 9, 40, seed=41)
    ref, _, _ = mamba1_reference(w, x)
    bound = 1e-6 + 1e-5 * np.abs(ref)  # test_mamba1_forward.py's per-element bound
    assert (np.abs(np.asarray(block.forward(x), np.float64) - ref) <= bound).all()
    # control: without the dt projection's third column the output leaves the bound
    w2 = dict(w, **{"dt_proj.weight": w["dt_proj.weight"] * np.float32([1, 1, 0])})
    assert (np.abs(mamba1_reference(w2, x)[0] - ref) > 100 * bound).any()
    # a floor-rank (2) layout is refused by name
    bad = dict(w, **{"dt_proj.weight": w["dt_proj.weight"][:, :2]})
    with pytest.raises(ValueError, match="dt_proj.weight"):
        mojolearn.Mamba1Block(bad)


def test_a_d40_transformers_checkpoint_with_time_step_rank_3_loads(tmp_path):
    model = make_model("mamba", tmp_path, seed=7, layers=2, d=40)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["hidden_size"] == 40 and cfg["time_step_rank"] == 3
    ck = load_checkpoint(tmp_path)
    assert ck.d_model == 40 and tuple(np.asarray(ck.layers[0]["dt_proj.weight"]).shape) == (80, 3)
    lm = mojolearn.MambaLM(tmp_path)
    ref = _hf_logits(model, TOKENS)
    got = np.asarray(lm.logits(TOKENS), np.float64)
    err = np.abs(got - ref).max()
    bound = 1e-5 * max(1.0, float(np.abs(ref).max()))
    assert err <= bound, (err, bound)
    # control: another model's logits are far outside the bound
    other = make_model("mamba", tmp_path / "other", seed=8, layers=2, d=40)
    assert np.abs(_hf_logits(other, TOKENS) - ref).max() > 100 * bound


# ----------------------------------------------------------------- sharded folders
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(unsharded folder, sharded folder) of one model, and another model's folder."""
    whole = tmp_path_factory.mktemp("whole")
    model = make_model("mamba", whole, seed=3, layers=3)
    sharded = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(sharded, max_shard_size="40KB")
    other = tmp_path_factory.mktemp("other")
    make_model("mamba", other, seed=4, layers=3)
    return whole, sharded, other


def test_the_sharded_folder_has_several_shards(folders):
    _, sharded, _ = folders
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert not (sharded / "model.safetensors").exists()
    assert len(shards) >= 3, shards
    assert sorted(set(index["weight_map"].values())) == shards
    # the last shard holds weights the model needs (not only the first does)
    last = [n for n, f in index["weight_map"].items() if f == shards[-1]]
    assert last, index["weight_map"]


@pytest.mark.parametrize("lazy", [False, True])
def test_every_shard_is_read(folders, lazy):
    whole, sharded, _ = folders
    a, b = load_checkpoint(whole), load_checkpoint(sharded, lazy=lazy)
    assert b.n_layers == a.n_layers == 3
    load = lambda v: np.asarray(v.load() if hasattr(v, "load") else v)  # noqa: E731
    for i in range(3):
        la = a.layers[i]
        lb = b.layers[i]
        assert set(lb) == set(la)
        for n in la:
            assert load(lb[n]).tobytes() == np.asarray(la[n]).tobytes(), (i, n)
    for name in ("embeddings", "final_norm", "lm_head"):
        assert load(getattr(b, name)).tobytes() == np.asarray(getattr(a, name)).tobytes(), name


def test_sharded_logits_have_the_bytes_of_the_unsharded_ones(folders):
    whole, sharded, other = folders
    want = np.asarray(mojolearn.MambaLM(whole).logits(TOKENS)).tobytes()
    assert np.asarray(mojolearn.MambaLM(sharded).logits(TOKENS)).tobytes() == want
    assert np.asarray(mojolearn.MambaLM(other).logits(TOKENS)).tobytes() != want  # control
