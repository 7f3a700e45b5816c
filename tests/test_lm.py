"""MambaLM and generation: logits and greedy tokens against transformers
(Mamba, Mamba-2) and the float64 reference (Mamba-3), the bits of a request
alone == in a batch == joined mid-stream, sampling seeds, lowbit formats,
and refusals by name."""
import math

import numpy as np
import pytest

import mojolearn
from mojolearn import lowbit
from mojolearn.checkpoints import load_checkpoint
from mojolearn.save import save_checkpoint
from tests import engine_common

from .errors import raises_naming

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from .reference.hf_build import build  # noqa: E402

PROMPTS = [[1, 5, 9], [2, 2, 8, 61, 0, 4, 4], [7], [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3]]


def _hf_model(kind):
    if kind == "mamba":
        cfg = transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3)
        model = build(transformers.MambaForCausalLM, cfg, seed=3)
    else:
        cfg = transformers.Mamba2Config(vocab_size=64, hidden_size=64, num_hidden_layers=2,
                                        head_dim=64, num_heads=2, n_groups=1, state_size=128,
                                        expand=2, chunk_size=256, tie_word_embeddings=False)
        model = build(transformers.Mamba2ForCausalLM, cfg, seed=3)
    with torch.no_grad():  # larger mixer outputs: the greedy tokens are not all one token
        for name, p in model.named_parameters():
            if name.endswith("out_proj.weight"):
                p.mul_(16.0)
    return model


@pytest.fixture(scope="module", params=["mamba", "mamba2"])
def hf(request, tmp_path_factory):
    """(folder, float64 transformers model) of a tiny random checkpoint."""
    model = _hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    if request.param == "mamba2":
        # the same model with 8-token chunks: the same function (the chunked
        # form is exact for any chunk size), without padding every short
        # forward to 256 tokens in float64
        small = build(transformers.Mamba2ForCausalLM, model.config.__class__(
            **{**model.config.to_dict(), "chunk_size": 8}), seed=4)
        small.load_state_dict(model.state_dict())
        model = small
    return folder, model.double().eval()


def _mamba3_folder(root, tied=True):
    from mojolearn.reference.weights import mamba3_weights
    rng = np.random.default_rng(5)
    d, v = 32, 48
    layers = [mamba3_weights(d, seed=10 + i, scale=4.0) for i in range(2)]
    emb = rng.standard_normal((v, d)).astype(np.float32)
    head = None if tied else rng.standard_normal((v, d)).astype(np.float32) * 0.5
    norm = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    return save_checkpoint(root, "mamba3", layers, emb, norm, head)


@pytest.fixture(scope="module")
def m3_folder(tmp_path_factory):
    return _mamba3_folder(tmp_path_factory.mktemp("mamba3"))


@pytest.fixture(scope="module")
def m3_lm(m3_folder):
    return mojolearn.MambaLM(m3_folder)


@pytest.fixture(scope="module")
def models(hf):
    """{'hf': MambaLM} of the transformers checkpoint of this module run."""
    return {"hf": mojolearn.MambaLM(hf[0])}


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _m3_reference_logits(folder, tokens):
    """Embedding, the float64 reference blocks, final norm and head."""
    from mojolearn.reference.mamba3 import mamba3_numpy
    from mojolearn.reference.ops import rmsnorm
    ck = load_checkpoint(folder)
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    x = f64(ck.embeddings)[np.asarray(tokens)]
    for w in ck.layers:
        x = mamba3_numpy({k: np.asarray(v) for k, v in w.items()}, x)[0]
    return rmsnorm(x, f64(ck.final_norm)) @ f64(ck.lm_head).T


def _bound(ref):
    """Logits are sums over d of products of O(1) values, after float32
    blocks: 1e-5 of the largest logit is far above float32 rounding (about
    1e-6 measured) and far below any formula slip (controls below)."""
    return 1e-5 * max(1.0, float(np.abs(ref).max()))


def test_logits_match_transformers(hf, models):
    folder, model = hf
    tokens = [[1, 5, 9, 3, 7, 0, 63], [2, 2, 8, 61, 0, 4, 4]]
    ours = np.asarray(models["hf"].logits(tokens))
    ref = _hf_logits(model, tokens)
    assert ours.shape == ref.shape == (2, 7, 64)
    assert np.abs(ours - ref).max() <= _bound(ref)
    # control: one prompt token changed is far outside the bound
    other = _hf_logits(model, [[4] + tokens[0][1:], tokens[1]])
    assert np.abs(other - ours).max() > 100 * _bound(ref)


def test_ragged_logits_equal_each_row_alone(models):
    lm = models["hf"]
    tokens = [[1, 5, 9, 3, 7], [2, 2, 8, 0, 0]]
    both = np.asarray(lm.logits(tokens, lengths=[5, 3]))
    alone = np.asarray(lm.logits([tokens[1][:3]]))
    assert both[1, :3].tobytes() == alone[0].tobytes()
    assert both[0].tobytes() == np.asarray(lm.logits([tokens[0]]))[0].tobytes()
    assert both[1, :3].tobytes() != both[0, :3].tobytes()  # control


def test_mamba3_logits_match_the_reference(m3_folder, m3_lm):
    tokens = [[1, 5, 9, 3, 7, 0, 47, 12], [2, 2, 8, 40, 0, 4, 4, 4]]
    ours = np.asarray(m3_lm.logits(tokens))
    ref = _m3_reference_logits(m3_folder, tokens)
    assert np.abs(ours - ref).max() <= 10 * _bound(ref)
    assert np.abs(ours[:, ::-1] - ref).max() > 100 * _bound(ref)  # control


def _greedy_reference(logits_of, prompt, n):
    """Greedy tokens by repeated uncached float64 forwards; also the
    smallest gap between the best and second-best logit seen."""
    seq, gap = list(prompt), math.inf
    for _ in range(n):
        last = logits_of([seq])[0, -1]
        top2 = np.sort(last)[-2:]
        gap = min(gap, top2[1] - top2[0])
        seq.append(int(last.argmax()))
    return seq[len(prompt):], gap


def test_greedy_tokens_match_transformers_for_a_ragged_batch(hf, models):
    _, model = hf
    ours = models["hf"].generate(PROMPTS[:3], max_new_tokens=6)
    for p, got in zip(PROMPTS[:3], ours):
        want, gap = _greedy_reference(lambda t: _hf_logits(model, t), p, 6)
        assert gap > 1e-4  # no near-tie: the comparison means something
        assert got == want


def test_mamba3_greedy_tokens_match_the_reference(m3_folder, m3_lm):
    prompts = [[1, 5, 9], [2, 40, 8, 33, 0, 4, 4], [7]]
    ours = m3_lm.generate(prompts, max_new_tokens=6)
    for p, got in zip(prompts, ours):
        want, gap = _greedy_reference(lambda t: _m3_reference_logits(m3_folder, t), p, 6)
        assert gap > 1e-4
        assert got == want


def _bytes(logits_lists):
    return [b"".join(np.asarray(a).tobytes() for a in lst) for lst in logits_lists]


def test_a_request_has_the_same_bits_alone_batched_and_joined_mid_stream(models):
    _check_bits(models["hf"])


def test_a_mamba3_request_has_the_same_bits_alone_batched_and_joined_mid_stream(m3_lm):
    _check_bits(m3_lm)


def _check_bits(lm):
    kw = dict(max_new_tokens=[6, 9, 4, 7], temperature=[0.0, 0.8, 0.0, 1.3],
              top_k=[0, 5, 0, 0], top_p=[1.0, 1.0, 1.0, 0.9], seed=[1, 2, 3, 4],
              return_logits=True)
    prompts = [[t % lm.vocab_size for t in p] for p in PROMPTS]
    toks, lg = lm.generate(prompts, **kw)
    assert [len(t) for t in toks] == [6, 9, 4, 7]
    for i, p in enumerate(prompts):
        one = {k: v[i] for k, v in kw.items() if k not in ("return_logits", "max_new_tokens")}
        t1, l1 = engine_common.alone(lm, p, kw["max_new_tokens"][i], **one)
        assert t1 == toks[i] and [b"".join(l1)] == _bytes([lg[i]]), i
    # joined mid-stream: request 3 arrives after two steps, request 0 after four
    b = lm.batcher(keep_logits=True)
    sub = lambda i: b.submit(prompts[i], **{k: v[i] for k, v in kw.items()  # noqa: E731
                                            if k != "return_logits"})
    reqs = {1: sub(1), 2: sub(2)}
    for _ in range(2):
        b.step()
    reqs[3] = sub(3)
    for _ in range(2):
        b.step()
    reqs[0] = sub(0)
    list(b.run())
    for i, r in reqs.items():
        assert r.tokens == toks[i] and _bytes([r.logits]) == _bytes([lg[i]])
        assert r.done and r.finish_reason == "length"
    # control: another prompt's logits differ in their bytes
    assert _bytes([lg[0][:4]]) != _bytes([lg[2][:4]])


def test_sampling_reproduces_with_a_seed_and_top_k_1_is_greedy(models):
    lm = models["hf"]
    kw = dict(max_new_tokens=10, temperature=1.0)
    a = lm.generate(PROMPTS[:2], seed=11, **kw)
    assert a == lm.generate(PROMPTS[:2], seed=11, **kw)
    assert a != lm.generate(PROMPTS[:2], seed=12, **kw)  # control: the seed matters
    assert lm.generate(PROMPTS[:2], top_k=1, seed=5, **kw) == lm.generate(PROMPTS[:2],
                                                                         max_new_tokens=10)


def _rule(logits, t, k, p, u):
    """lm.mojo's next-token rule in float64 (for u away from a boundary)."""
    ids = list(range(len(logits)))
    if (0 < k < len(logits)) or p < 1:
        ids.sort(key=lambda i: (-logits[i], i))
        if 0 < k < len(logits):
            ids = ids[:k]
    m = max(logits[i] for i in ids)
    w = np.exp((np.asarray([logits[i] for i in ids], np.float64) - m) / t)
    if p < 1:
        c = np.cumsum(w)
        ids, w = ids[:int(np.searchsorted(c, p * c[-1]) + 1)], w[:int(np.searchsorted(c, p * c[-1]) + 1)]
    c = np.cumsum(w)
    return ids[min(int(np.searchsorted(c, u * c[-1], side="right")), len(ids) - 1)], c / c[-1]


@pytest.mark.parametrize("t, k, p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.5, 0, 0.8), (1.0, 7, 0.6)])
def test_next_token_rule_against_a_float64_version(models, t, k, p):
    lm = models["hf"]
    v = lm.vocab_size
    rng = np.random.default_rng(2)
    logits = mojolearn.Array((64, v))
    np.asarray(logits)[:] = rng.standard_normal((64, v)).astype(np.float32) * 2
    us = (np.arange(64) + 0.5) / 64
    got = lm.next_tokens(logits, [t] * 64, [k] * 64, [p] * 64, list(us))
    checked = 0
    for r in range(64):
        want, cum = _rule(np.asarray(logits)[r].astype(np.float64), t, k, p, us[r])
        if np.min(np.abs(cum - us[r])) > 1e-5:  # not within rounding of a boundary
            assert got[r] == want
            checked += 1
    assert checked >= 60
    greedy = lm.next_tokens(logits, [0.0] * 64, [0] * 64, [1.0] * 64, list(us))
    assert greedy == list(np.asarray(logits).argmax(axis=1))


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "q4_0", "q8_0"])
def test_packed_formats_give_the_bits_of_the_rounded_float32_model(hf, fmt):
    folder = hf[0]
    packed = mojolearn.MambaLM(folder, weight_format=fmt)
    ck = load_checkpoint(folder)

    def rounded(w):
        return lowbit.pack_one(w, fmt).to_float32()
    for layer in ck.layers:
        for n in list(layer):
            if lowbit.is_projection(n):
                layer[n] = rounded(layer[n])
    ck.lm_head = rounded(ck.lm_head)
    ck.embeddings = rounded(ck.embeddings) if not ck.tie_word_embeddings else ck.lm_head
    expanded = mojolearn.MambaLM(ck)
    tokens = [[1, 5, 9, 3, 7], [2, 2, 8, 61, 0]]
    a = np.asarray(packed.logits(tokens))
    assert a.tobytes() == np.asarray(expanded.logits(tokens)).tobytes()
    assert a.tobytes() != np.asarray(mojolearn.MambaLM(folder).logits(tokens)).tobytes()
    assert packed.generate(PROMPTS[:2], max_new_tokens=5) == \
        expanded.generate(PROMPTS[:2], max_new_tokens=5)


def test_a_tied_model_keeps_one_vocabulary_copy(m3_folder, tmp_path):
    tied = mojolearn.MambaLM(m3_folder)
    untied = mojolearn.MambaLM(_mamba3_folder(tmp_path, tied=False))
    assert tied.tied and not untied.tied
    v, d = tied.vocab_size, tied.d_model
    assert untied._blob.nbytes - tied._blob.nbytes >= v * d * 4


@pytest.mark.parametrize("bad, names", [
    ([[]], ["prompts[0]", "empty"]),
    ([[1, 2], [3, 64]], ["prompts[1]", "prompt[1]", "64"]),
    ([[1, -1]], ["prompts[0]", "prompt[1]", "-1"]),
    ([[1, 2.5]], ["prompts[0]", "prompt[1]"]),
])
def test_bad_prompts_are_refused_by_name(models, bad, names):
    lm = models["hf"]
    err = TypeError if 2.5 in bad[-1] else ValueError
    with raises_naming(err, *names):
        lm.generate(bad, max_new_tokens=2)


@pytest.mark.parametrize("kw, names", [
    ({"max_new_tokens": 0}, ["max_new_tokens"]),
    ({"temperature": -1.0}, ["temperature"]),
    ({"temperature": float("nan")}, ["temperature"]),
    ({"top_p": 0.0}, ["top_p"]),
    ({"top_p": 1.5}, ["top_p"]),
    ({"top_k": -2}, ["top_k"]),
    ({"stop_tokens": [99]}, ["stop_tokens[0]", "99"]),
])
def test_bad_parameters_are_refused_by_name_and_change_nothing(models, kw, names):
    b = models["hf"].batcher()
    ok = b.submit([1, 2, 3], max_new_tokens=2)
    with raises_naming(ValueError, *names):
        b.submit([1, 2, 3], **kw)
    # the refused submission left nothing behind: only ok runs, and ids go on from 1
    done = list(b.run())
    assert [r for r, _ in done] == [ok, ok] and ok.tokens == [t for _, t in done]
    assert b._next_id == 1 and b.submit([4], max_new_tokens=1).id == 1


def test_stop_tokens_end_a_request(models):
    lm = models["hf"]
    full = lm.generate([PROMPTS[1]], max_new_tokens=8)[0]
    stop = full[3]
    first = full.index(stop)
    got = lm.generate([PROMPTS[1]], max_new_tokens=8, stop_tokens=[stop])[0]
    assert got == full[:first + 1]


def test_streaming_gives_the_tokens_as_they_come(models):
    lm = models["hf"]
    seen = []
    toks = lm.generate(PROMPTS[:3], max_new_tokens=4, stream=lambda i, t: seen.append((i, t)))
    for i, t in enumerate(toks):
        assert [tok for j, tok in seen if j == i] == t


def _cli(*args):
    import os
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(__import__("pathlib").Path(mojolearn.__file__).parents[1])]
        + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    r = subprocess.run([sys.executable, "-m", "mojolearn", "generate", *map(str, args)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_the_generate_command_prints_the_tokens_and_the_speed(hf, models):
    out = _cli(hf[0], "--prompt-ids", "1,5,9", "--max-new-tokens", 6).splitlines()
    assert out[0].split() == [str(t) for t in models["hf"].generate([[1, 5, 9]],
                                                                     max_new_tokens=6)[0]]
    assert out[1].startswith("prefill 3 tokens in") and "decode 5 tokens in" in out[1]
    sampled = _cli(hf[0], "--prompt-ids", "1,5,9", "--max-new-tokens", 6, "--temperature",
                   0.9, "--top-k", 7, "--seed", 3).splitlines()[0].split()
    assert sampled == [str(t) for t in models["hf"].generate(
        [[1, 5, 9]], max_new_tokens=6, temperature=0.9, top_k=7, seed=3)[0]]


def test_the_generate_command_reads_text_with_a_tokenizer(hf, models, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    import shutil
    folder = tmp_path / "with_tokenizer"
    shutil.copytree(hf[0], folder)
    words = [f"w{i}" for i in range(64)]
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)},
                                                          unk_token="w0"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    tk.save(str(folder / "tokenizer.json"))
    out = _cli(folder, "--prompt", "w1 w5 w9", "--max-new-tokens", 4).splitlines()
    want = models["hf"].generate([[1, 5, 9]], max_new_tokens=4)[0]
    assert out[0].split() == [words[t] for t in want]


@pytest.mark.parametrize("fmt", ["float32", "int8", "q4_0"])
def test_a_folder_is_read_lazily_in_row_ranges_with_the_same_bits(hf, fmt, monkeypatch):
    """MambaLM(folder) reads layer by layer and packs the vocabulary in row
    ranges (lm.PREPARE_ROWS; 16 here: four ranges of the 64 rows); the
    bits are those of the model built from the checkpoint in memory."""
    from mojolearn import lm as lm_module
    monkeypatch.setattr(lm_module, "PREPARE_ROWS", 16)
    lazy = mojolearn.MambaLM(hf[0], weight_format=fmt)
    whole = mojolearn.MambaLM(load_checkpoint(hf[0]), weight_format=fmt)
    assert bytes(memoryview(lazy._blob)) == bytes(memoryview(whole._blob))
    tokens = [[1, 5, 9, 3, 7], [2, 2, 8, 61, 0]]
    assert bytes(memoryview(lazy.logits(tokens))) == bytes(memoryview(whole.logits(tokens)))


def _crossing(lm, prompts, n):
    """Tokens and logits bytes of prompts generated together and alone."""
    kw = dict(max_new_tokens=n, temperature=0.7, top_k=8, seed=[5 + i for i in range(len(prompts))],
              return_logits=True)
    toks, lg = lm.generate(prompts, **kw)
    for i, p in enumerate(prompts):
        t1, l1 = engine_common.alone(lm, p, n, temperature=0.7, top_k=8, seed=5 + i)
        assert t1 == toks[i] and [b"".join(l1)] == _bytes([lg[i]]), i


@pytest.fixture(scope="module")
def m2_lm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mamba2_lm")
    _hf_model("mamba2").save_pretrained(folder)
    return mojolearn.MambaLM(folder)


def test_mamba2_rows_crossing_their_chunk_ends_at_different_steps(m2_lm):
    """Rows at their own chunk positions fold (256th token) at different
    decode steps: each row still has the bits it has alone."""
    lm = m2_lm
    prompts = [[(7 * j + i) % 64 for j in range(length)] for i, length in
               enumerate([250, 253, 5, 256])]
    _crossing(lm, prompts, 9)


def test_mamba3_rows_crossing_their_chunk_ends_at_different_steps(m3_lm):
    prompts = [[(5 * j + i) % 48 for j in range(length)] for i, length in
               enumerate([60, 63, 2, 64, 127])]
    _crossing(m3_lm, prompts, 8)
