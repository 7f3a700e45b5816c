"""Chunked prefill: a step prefills at most prefill_chunk prompt tokens (all
joining requests together, first come first served) besides the decode
step of the running rows, and every request keeps the bits of its
unchunked, alone run (a sequence split between calls gives the same bits).
Prompts cross the blocks' chunk ends (Mamba-2: 256 tokens, Mamba-3: 64)."""
import pytest

from .engine_common import alone, logits_bytes, prompt_of, tiny_folder, tiny_lm

LENGTHS = {"mamba": [40, 11, 3], "mamba2": [300, 70, 3], "mamba3": [130, 65, 3]}
KW = [dict(temperature=0.9, seed=1), dict(temperature=0.0), dict(temperature=1.1, top_k=6,
                                                                  seed=2)]


@pytest.fixture(scope="module", params=["mamba", "mamba2", "mamba3"])
def lm(request, tmp_path_factory):
    return tiny_lm(tiny_folder(tmp_path_factory.mktemp(request.param), request.param))


@pytest.fixture(scope="module")
def reference(lm):
    prompts = [prompt_of(n, i) for i, n in enumerate(LENGTHS[lm.kind])]
    return prompts, [alone(lm, p, 5, **kw) for p, kw in zip(prompts, KW)]


@pytest.mark.parametrize("chunk", [1, 7, 64, 100, 256, None, "auto"])
def test_chunked_prefill_keeps_the_bits_and_bounds_each_step(lm, reference, chunk):
    prompts, ref = reference
    bound = 256 if chunk == "auto" else chunk  # 'auto': PrefillPacer's high
    b = lm.batcher(keep_logits=True, prefill_chunk=chunk)
    early = b.submit(prompts[2], max_new_tokens=12, **KW[2])  # decoding while the rest join
    b.step()
    reqs = [b.submit(p, max_new_tokens=5, **kw) for p, kw in zip(prompts, KW)]
    done = b.stats.prompt_tokens
    while b.busy:
        decoding = len(b.active)
        out = b.step()
        s = b.stats
        assert bound is None or s.prompt_tokens - done <= bound
        done = s.prompt_tokens
        assert len(out) >= min(decoding, 1)  # the running rows are never stalled
    for r, (toks, lg) in zip(reqs, ref):
        assert r.tokens == toks and logits_bytes(r) == lg
    assert early.finish_reason == "length"
    if isinstance(chunk, int) and chunk < len(prompts[0]):  # the long prompt was split
        assert b.stats.steps > len(prompts[0]) // chunk
    if chunk == "auto":  # it starts at 8 tokens a step while a request decodes
        assert b.stats.steps > len(prompts[0]) // 256 + 1
    # control: one prompt token changed gives other logits bytes
    other = list(prompts[0])
    other[len(other) // 2] = (other[len(other) // 2] + 1) % lm.vocab_size
    assert alone(lm, other, 5, **KW[0])[1] != ref[0][1]


def test_prefill_is_first_come_first_served(lm):
    b = lm.batcher(prefill_chunk=8)
    long = b.submit(prompt_of(20), max_new_tokens=1)
    short = b.submit(prompt_of(2, 1), max_new_tokens=1)
    b.step()  # 8 tokens of the long prompt
    assert long.prompt_tokens_done == 8 and short.prompt_tokens_done == 0
    b.step()
    assert long.prompt_tokens_done == 16 and not long.tokens
    b.step()  # the long prompt's last 4, then the short one's 2
    assert long.done and short.done and short.prompt_tokens_done == 2
