"""MambaLM on a transformers FalconMambaForCausalLM folder (save_pretrained):
the blocks get bcdt_rms_eps = mixer_rms_eps; logits and greedy tokens
against transformers' uncached float64 forward; a bad mixer_rms_eps is
refused by name. Controls: the same folder read as plain Mamba (its
model_type changed) misses the bound; a changed prompt token too."""
import json
import shutil

import numpy as np
import pytest

import mojolearn
from mojolearn.checkpoints import load_checkpoint

from .errors import raises_naming
from .test_lm import PROMPTS, _bound, _greedy_reference, _hf_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
EPS = 1e-3  # larger than the 1e-6 default, so a wrong eps shows in the logits


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    """(folder, float64 transformers model) of a tiny random Falcon-Mamba."""
    torch.manual_seed(4)
    cfg = transformers.FalconMambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3,
                                         mixer_rms_eps=EPS)
    model = transformers.FalconMambaForCausalLM(cfg)
    with torch.no_grad():  # every parameter set here, larger mixer outputs
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.5 if p.ndim > 1 else 0.1)
                    + (1.0 if name.endswith("norm.weight") or name.endswith("norm_f.weight")
                       else 0.0))
            if name.endswith("out_proj.weight"):
                p.mul_(4.0)
    folder = tmp_path_factory.mktemp("falcon")
    model.save_pretrained(folder)
    return folder, model.double().eval()


def test_checkpoint_reads_the_eps(falcon):
    ck = load_checkpoint(falcon[0])
    assert ck.kind == "mamba" and ck.bcdt_rms_eps == EPS
    assert ck.block(0).bcdt_rms_eps == EPS


def test_logits_and_greedy_tokens_match_transformers(falcon, tmp_path):
    folder, model = falcon
    lm = mojolearn.MambaLM(folder)
    tokens = [[1, 5, 9, 3, 7, 0, 63], [2, 2, 8, 61, 0, 4, 4]]
    ours = np.asarray(lm.logits(tokens))
    ref = _hf_logits(model, tokens)
    assert np.abs(ours - ref).max() <= _bound(ref)
    for p, got in zip(PROMPTS[:3], lm.generate(PROMPTS[:3], max_new_tokens=6)):
        want, gap = _greedy_reference(lambda t: _hf_logits(model, t), p, 6)
        assert gap > 1e-4 and got == want
    # controls: a changed prompt token; the folder read as plain Mamba
    other = _hf_logits(model, [[4] + tokens[0][1:], tokens[1]])
    assert np.abs(other - ours).max() > 100 * _bound(ref)
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (plain / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(plain).bcdt_rms_eps is None
    assert np.abs(np.asarray(mojolearn.MambaLM(plain).logits(tokens)) - ref).max() > \
        10 * _bound(ref)


@pytest.mark.parametrize("bad", [0, -1.0, "small", None])
def test_bad_mixer_rms_eps_is_refused_by_name(falcon, tmp_path, bad):
    folder = tmp_path / "bad"
    shutil.copytree(falcon[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["mixer_rms_eps"] = bad
    (folder / "config.json").write_text(json.dumps(cfg))
    with raises_naming(ValueError, "mixer_rms_eps"):
        load_checkpoint(folder)


def test_save_checkpoint_keeps_the_model_a_falcon(falcon, tmp_path):
    """save_checkpoint with the documented config fields writes a folder
    that loads as the same Falcon-Mamba model (same logits bits); control:
    saved without them, the eps is lost and the logits change."""
    from mojolearn.save import save_checkpoint
    ck = load_checkpoint(falcon[0])
    tokens = [[1, 5, 9, 3, 7]]
    want = np.asarray(mojolearn.MambaLM(falcon[0]).logits(tokens))
    head = None if ck.tie_word_embeddings else ck.lm_head
    args = ("mamba", ck.layers, ck.embeddings, ck.final_norm, head)
    kept = save_checkpoint(tmp_path / "kept", *args,
                           config={"model_type": "falcon_mamba", "mixer_rms_eps": EPS})
    assert load_checkpoint(kept).bcdt_rms_eps == EPS
    got = np.asarray(mojolearn.MambaLM(kept).logits(tokens))
    assert got.tobytes() == want.tobytes()
    lost = save_checkpoint(tmp_path / "lost", *args)
    assert load_checkpoint(lost).bcdt_rms_eps is None
    assert np.asarray(mojolearn.MambaLM(lost).logits(tokens)).tobytes() != want.tobytes()
