"""MambaLM on Mamba-2 checkpoints with n_groups > 1 (Mamba-Codestral's
layout, G = 8): a transformers Mamba2ForCausalLM folder (save_pretrained)
with n_groups = 2, its state_dict without a config (n_groups read off the
conv1d shape), and mamba_ssm folders with ssm_cfg.ngroups = 8 written in
that layout. Logits and greedy tokens against transformers' uncached
float64 forwards; the folder layouts against save_checkpoint's bytes.
Controls: a changed prompt token; a changed weight in the file."""
import json

import numpy as np
import pytest

import mojolearn
from mojolearn.checkpoints import load_checkpoint
from mojolearn.reference.weights import mamba2_weights
from mojolearn.save import save_checkpoint

from .errors import raises_naming
from .test_lm import PROMPTS, _bound, _greedy_reference, _hf_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from tests.reference.hf_build import build  # noqa: E402
from tests.test_mamba_ssm_format import PAD, VOCAB, write_mamba_ssm_folder  # noqa: E402

G = 2
TOKENS = [[1, 5, 9, 3, 7, 0, 63], [2, 2, 8, 61, 0, 4, 4]]


def _config(chunk):
    return transformers.Mamba2Config(vocab_size=64, hidden_size=128, num_hidden_layers=2,
                                     head_dim=64, num_heads=4, n_groups=G, state_size=128,
                                     expand=2, chunk_size=chunk, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(folder, float64 transformers model, its float32 state_dict) of a
    tiny random Mamba-2 with two groups (two heads per group)."""
    model = build(transformers.Mamba2ForCausalLM, _config(256), seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # every norm weight away from one; larger mixer outputs
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            if name.endswith("out_proj.weight"):
                p.mul_(16.0)
    folder = tmp_path_factory.mktemp("mamba2_groups")
    model.save_pretrained(folder)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    # the same function with 8-token chunks (exact for any chunk size): no
    # padding of every short float64 forward to 256 tokens
    small = build(transformers.Mamba2ForCausalLM, _config(8), seed=4)
    small.load_state_dict(model.state_dict())
    return folder, small.double().eval(), sd


def test_checkpoint_reads_the_groups(hf):
    ck = load_checkpoint(hf[0])
    assert ck.kind == "mamba2" and ck.n_groups == G
    assert ck.block(0).n_groups == G


def test_logits_and_greedy_tokens_match_transformers(hf):
    folder, model, _ = hf
    lm = mojolearn.MambaLM(folder)
    ours = np.asarray(lm.logits(TOKENS))
    ref = _hf_logits(model, TOKENS)
    err = float(np.abs(ours - ref).max())
    print(f"\nn_groups={G} LM logits: max |err| {err:.3g}, bound {_bound(ref):.3g}")
    assert err <= _bound(ref)
    for p, got in zip(PROMPTS[:2], lm.generate(PROMPTS[:2], max_new_tokens=4)):
        want, gap = _greedy_reference(lambda t: _hf_logits(model, t), p, 4)
        assert gap > 1e-4 and got == want
    other = _hf_logits(model, [[4] + TOKENS[0][1:], TOKENS[1]])  # control
    assert np.abs(other - ours).max() > 100 * _bound(ref)


def test_state_dict_without_config_infers_the_groups(hf):
    folder, _, sd = hf
    ck = load_checkpoint(sd)
    assert ck.n_groups == G
    a = mojolearn.MambaLM(ck).logits(TOKENS)
    b = mojolearn.MambaLM(folder).logits(TOKENS)
    assert bytes(memoryview(a).cast("B")) == bytes(memoryview(b).cast("B"))


@pytest.mark.parametrize("bad", [3, 0, 8, "2"])
def test_bad_n_groups_is_refused_by_name(hf, tmp_path, bad):
    folder = tmp_path / "bad"
    folder.mkdir()
    for f in hf[0].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    cfg["n_groups"] = bad
    (folder / "config.json").write_text(json.dumps(cfg))
    with raises_naming(ValueError, "n_groups"):
        load_checkpoint(folder)


# --------------------------------------------------------------------------- mamba_ssm
def _codestral_shaped(d=256, groups=8, n_layers=2, seed=0):
    """(layers, embeddings, final_norm, lm_head) of a Mamba-2 with eight
    groups (one per head at d 256), as float32 NumPy arrays."""
    rng = np.random.default_rng(seed)
    layers = []
    for i in range(n_layers):
        w = mamba2_weights(d, seed=seed + i, n_groups=groups)
        for k in ("block_norm.weight", "norm.weight", "D"):
            w[k] = (w[k] + 0.1 * rng.standard_normal(w[k].shape)).astype(np.float32)
        w["out_proj.weight"] *= 8
        layers.append(w)
    rows = VOCAB + (-VOCAB % PAD)  # mamba_ssm pads the vocabulary
    emb = rng.standard_normal((rows, d)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    head = rng.standard_normal((rows, d)).astype(np.float32)
    return layers, emb, norm, head


def _logits_bytes(folder):
    ids = [[t % VOCAB for t in row] for row in TOKENS]
    return bytes(memoryview(mojolearn.MambaLM(folder).logits(ids)).cast("B"))


def test_mamba_ssm_folder_with_ngroups_loads(tmp_path):
    """ssm_cfg.ngroups = 8 (Mamba-Codestral's) in mamba_ssm's layout gives
    the bytes of the same weights saved by save_checkpoint (which writes
    n_groups to config.json); a changed weight in the file does not."""
    weights = _codestral_shaped()
    layers, emb, norm, head = weights
    ref_folder = save_checkpoint(tmp_path / "ref", "mamba2", layers, emb, norm, head)
    assert json.loads((ref_folder / "config.json").read_text())["n_groups"] == 8
    assert load_checkpoint(ref_folder).n_groups == 8
    ref = _logits_bytes(ref_folder)
    ssm = write_mamba_ssm_folder(tmp_path / "ssm", "Mamba2", weights, ssm_cfg={"ngroups": 8})
    ck = load_checkpoint(ssm)
    assert (ck.format, ck.kind, ck.n_groups) == ("mamba_ssm", "mamba2", 8)
    assert _logits_bytes(ssm) == ref
    layers[-1]["D"][0] += 0.5  # control
    neg = write_mamba_ssm_folder(tmp_path / "neg", "Mamba2", (layers, emb, norm, head),
                                 ssm_cfg={"ngroups": 8})
    assert _logits_bytes(neg) != ref


@pytest.mark.parametrize("ngroups,names", [(3, ("ssm_cfg.ngroups",)),
                                           (4, ("backbone.layers.0.mixer.in_proj.weight",))])
def test_mamba_ssm_ngroups_that_do_not_fit_are_refused_by_name(tmp_path, ngroups, names):
    ssm = write_mamba_ssm_folder(tmp_path / "ssm", "Mamba2", _codestral_shaped(n_layers=1),
                                 ssm_cfg={"ngroups": ngroups})
    with raises_naming(ValueError, *names):
        load_checkpoint(ssm)
