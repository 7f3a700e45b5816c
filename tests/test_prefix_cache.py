"""The prefix-state cache: the LRU itself (longest prefix, bytes bound,
eviction order, counts), and in the Batcher: a prompt that extends a cached
prefix, or repeats a cached prompt, starts from a copy of its state and
gives the bits of a cold run."""
from array import array

import pytest

from mojolearn._array import Array
from mojolearn.prefix_cache import PrefixCache, state_nbytes

from .engine_common import alone, logits_bytes, prompt_of, tiny_folder, tiny_lm


class _State:
    """A stand-in layer state: one array of n floats."""
    _ARRAYS = ("a",)

    def __init__(self, n, fill=0.0):
        self.a = Array((n,))
        memoryview(self.a).cast("B")[:] = array("f", [fill] * n).tobytes()

    def copy(self):
        new = _State(len(memoryview(self.a)))
        memoryview(new.a).cast("B")[:] = memoryview(self.a).cast("B")
        return new


def _row():
    return Array((4,))


def test_lookup_finds_the_longest_cached_prefix_and_counts():
    c = PrefixCache(10_000)
    assert c.lookup([1, 2, 3]) is None and c.misses == 1
    c.store([1, 2], [_State(8)], _row())
    c.store([1, 2, 3, 4], [_State(8)], _row())
    c.store([9], [_State(8)], _row())
    assert c.lookup([1, 2, 3, 4, 5]).tokens == (1, 2, 3, 4)
    assert c.lookup([1, 2, 3]).tokens == (1, 2)
    assert c.lookup([1, 2, 3, 4], max_length=3).tokens == (1, 2)
    assert c.lookup([2, 1]) is None
    assert (c.hits, c.misses, len(c)) == (3, 2, 3)
    assert (1, 2) in c and (2,) not in c


def test_the_cache_keeps_copies_and_stays_within_its_bytes():
    one = state_nbytes([_State(8)]) + 16  # 8 floats and a 4-float row
    c = PrefixCache(3 * one)
    src = [_State(8, 1.0)]
    assert c.store([1], src, _row())
    memoryview(src[0].a)[0] = 5.0  # the caller's later change is not seen
    assert memoryview(c.lookup([1]).states[0].a)[0] == 1.0
    c.store([2], [_State(8)], _row())
    c.store([3], [_State(8)], _row())
    assert c.nbytes == 3 * one
    c.lookup([1])  # [1] is now the most recent: [2] goes first
    c.store([4], [_State(8)], _row())
    assert (2,) not in c and (1,) in c and c.nbytes == 3 * one and len(c) == 3
    assert not c.store([5], [_State(100)], _row())  # larger than the whole cache
    assert len(c) == 3 and (5,) not in c
    assert c.store([1], [_State(8)], _row())  # already there: only refreshed
    assert len(c) == 3
    c.clear()
    assert len(c) == 0 and c.nbytes == 0


@pytest.fixture(scope="module", params=["mamba", "mamba2", "mamba3"])
def lm(request, tmp_path_factory):
    return tiny_lm(tiny_folder(tmp_path_factory.mktemp(request.param), request.param))


KW = dict(temperature=0.9, top_k=10, seed=7)


@pytest.mark.parametrize("chunk", [None, 16])
def test_a_cached_prefix_gives_the_bits_of_a_cold_run(lm, chunk):
    first = prompt_of(70, 1)
    turn = first + prompt_of(9, 2)  # the next turn extends the first prompt
    b = lm.batcher(keep_logits=True, prefill_chunk=chunk, prefix_cache_bytes=1 << 24)
    r1 = b.submit(first, max_new_tokens=4, **KW)
    list(b.run())
    assert r1.cached_tokens == 0
    r2 = b.submit(turn, max_new_tokens=4, **KW)
    r3 = b.submit(first, max_new_tokens=4, **KW)  # the same prompt again
    before = b.stats.prompt_tokens
    list(b.run())
    assert r2.cached_tokens == len(first) and r3.cached_tokens == len(first)
    assert b.stats.prompt_tokens - before == len(turn) - len(first)  # r3: no prefill at all
    for r, p in ((r1, first), (r2, turn), (r3, first)):
        toks, lg = alone(lm, p, 4, **KW)
        assert r.tokens == toks and logits_bytes(r) == lg
    s = b.stats
    assert s.prefix_cache_hits == 2 and s.prefix_cache_misses == 1
    assert s.prefix_cache_entries >= 2 and 0 < s.prefix_cache_bytes <= 1 << 24
    if chunk:  # chunk ends are kept too: a prompt sharing the first 40 tokens hits at 32
        r4 = b.submit(first[:40] + [5, 6], max_new_tokens=2, **KW)
        list(b.run())
        assert r4.cached_tokens == 32
        toks, lg = alone(lm, first[:40] + [5, 6], 2, **KW)
        assert r4.tokens == toks and logits_bytes(r4) == lg


@pytest.mark.parametrize("stop", [False, True])
def test_the_next_turn_of_a_conversation_starts_after_the_reply(lm, stop):
    """A finished request's state (its prompt and reply but the last token)
    is cached: the next turn, prompt + reply + new text, prefills only the
    new part (and the reply's last token), with the bits of a cold run."""
    first = prompt_of(40, 4)
    b = lm.batcher(keep_logits=True, prefill_chunk=None, prefix_cache_bytes=1 << 24)
    b.submit(prompt_of(3, 9), max_new_tokens=8, **KW)  # row 0: the reply is row 1
    r1 = b.submit(first, max_new_tokens=5, **KW)
    list(b.run())
    if stop:  # ended by a stop token, at its third token
        b = lm.batcher(keep_logits=True, prefill_chunk=None, prefix_cache_bytes=1 << 24)
        b.submit(prompt_of(3, 9), max_new_tokens=8, **KW)
        r1 = b.submit(first, max_new_tokens=5, stop_tokens=[r1.tokens[2]], **KW)
        list(b.run())
        assert r1.finish_reason == "stop"
    turn = first + r1.tokens + [7, 8]
    r2 = b.submit(turn, max_new_tokens=3, **KW)
    same = b.submit(first + r1.tokens[:-1], max_new_tokens=3, **KW)
    list(b.run())
    assert r2.cached_tokens == len(first) + len(r1.tokens) - 1
    assert same.cached_tokens == len(same.prompt)
    for r in (r2, same):
        toks, lg = alone(lm, list(r.prompt), 3, **KW)
        assert r.tokens == toks and logits_bytes(r) == lg


def test_the_cached_state_is_what_a_hit_runs_on(lm):
    """Control: spoil the cached state and a hit's logits change (the cache
    is really used), while a cache-less batcher still gives the cold bits."""
    first = prompt_of(30, 3)
    b = lm.batcher(keep_logits=True, prefix_cache_bytes=1 << 24)
    b.submit(first, max_new_tokens=1)
    list(b.run())
    entry = b.prefix_cache.lookup(first + [1])
    st = entry.states[0]
    view = memoryview(st.h).cast("B").cast("f")
    for i in range(len(view)):
        view[i] += 0.25
    r = b.submit(first + [1, 2], max_new_tokens=3, **KW)
    list(b.run())
    toks, lg = alone(lm, first + [1, 2], 3, **KW)
    assert r.cached_tokens == len(first) and logits_bytes(r) != lg
    off = lm.batcher(keep_logits=True)
    r = off.submit(first + [1, 2], max_new_tokens=3, **KW)
    list(off.run())
    assert r.cached_tokens == 0 and logits_bytes(r) == lg


def test_a_request_from_a_given_state_is_not_cached(lm):
    b = lm.batcher(prefix_cache_bytes=1 << 24)
    state = lm.allocate_state(1)
    lm.forward_tokens([[1, 2, 3]], state)
    b.submit([4, 5], max_new_tokens=1, state=state)
    list(b.run())
    assert len(b.prefix_cache) == 0 and b.stats.prefix_cache_misses == 0
