"""PrefillPacer (Batcher(prefill_chunk='auto')): the chunk it chooses from
measured step times, with fake timings (the bits of any chunking are the
chunked-prefill tests' business: tests/test_engine_chunked.py)."""
import pytest

from mojolearn.prefill_pacer import PrefillPacer
from tests.errors import raises_naming


def test_no_stream_waits_so_the_chunk_is_the_largest():
    p = PrefillPacer(low=8, high=256)
    assert p.budget(decoding=False) == 256
    assert p.budget(decoding=True) == 8  # streams run: start small


@pytest.mark.parametrize("fixed,per_token", [(0.0, 1e-3), (0.02, 1e-3), (0.01, 5e-4), (0.05, 5e-4)])
def test_the_chunk_settles_where_a_step_prefill_costs_the_target(fixed, per_token):
    """A prefill of n tokens costs fixed + per_token * n; decode costs 20 ms.
    The chunk settles (within 2 tokens) at the n whose cost is 1.5x the
    decode, whatever the split between the per-call and per-token cost."""
    decode = 0.02
    p = PrefillPacer(low=1, high=10_000, ratio=1.5)
    for _ in range(60):
        n = p.budget(decoding=True)
        p.observe(n, fixed + per_token * n, decode)
    want = max(1.0, (1.5 * decode - fixed) / per_token)  # 1: a call alone costs more
    assert abs(p.chunk - want) <= 2 + 0.02 * want, (p.chunk, want)


def test_the_chunk_stays_within_its_bounds_and_ignores_empty_steps():
    p = PrefillPacer(low=8, high=256)
    p.observe(8, 10.0, 0.01)  # a very slow prefill: down to low
    assert p.chunk == 8
    for _ in range(20):
        p.observe(p.chunk, 1e-6, 1.0)  # a very fast prefill: up to high
    assert p.chunk == 256
    p.observe(0, 1.0, 1.0)  # nothing prefilled, or no decode: nothing to learn
    p.observe(5, 1.0, 0.0)
    assert p.chunk == 256


def test_bad_bounds_and_bad_chunk_names_are_refused(tmp_path):
    with raises_naming(ValueError, "low"):
        PrefillPacer(low=0)
    from tests.engine_common import tiny_folder, tiny_lm
    lm = tiny_lm(tiny_folder(tmp_path, "mamba"))
    with raises_naming(ValueError, "prefill_chunk"):
        lm.batcher(prefill_chunk="fast")
    assert lm.batcher(prefill_chunk="auto").prefill_chunk == "auto"


def test_the_batcher_reports_each_step_to_its_pacer(tmp_path):
    """While a request decodes, every step that prefills tells the pacer
    the tokens it prefilled and both times; its chunk bounds the next step."""
    from tests.engine_common import prompt_of, tiny_folder, tiny_lm
    lm = tiny_lm(tiny_folder(tmp_path, "mamba2"))
    b = lm.batcher(prefill_chunk="auto")
    seen = []
    observe = b._pacer.observe
    b._pacer.observe = lambda n, tp, td: (seen.append((n, tp, td)), observe(n, tp, td))
    first = b.submit(prompt_of(90), max_new_tokens=40)
    b.step()  # alone: no stream waits (the whole 90 tokens), nothing to learn
    assert first.prompt_tokens_done == 90 and not seen
    long = b.submit(prompt_of(100, 1), max_new_tokens=1)
    before = long.prompt_tokens_done
    b.step()
    assert long.prompt_tokens_done - before == 8  # the first chunk while a stream runs
    assert seen and seen[-1][0] == 8 and seen[-1][1] > 0 and seen[-1][2] > 0
    while not long.done:
        chunk = b._pacer.chunk
        before = long.prompt_tokens_done
        b.step()
        assert long.done or long.prompt_tokens_done - before == min(chunk, 100 - before)
