"""The Batcher as an engine: EOS by default, cancel, starting from a state,
checked parameters, the counters, thread-safe submission, and failure
safety (a fault in one request's own work leaves the others' bits as if it
had never joined)."""
import threading

import pytest

import mojolearn

from .engine_common import alone, logits_bytes, prompt_of, tiny_folder, tiny_lm
from .errors import raises_naming


@pytest.fixture(scope="module", params=["mamba", "mamba2", "mamba3"])
def folder(request, tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def lm(folder):
    return tiny_lm(folder)


PROMPTS = [prompt_of(5), prompt_of(9, 1), prompt_of(2, 2), prompt_of(13, 3)]
KW = [dict(temperature=0.9, seed=1), dict(temperature=0.0), dict(temperature=1.2, top_k=5,
                                                                  seed=3),
      dict(temperature=0.7, top_p=0.8, seed=4)]


def _check_alone(lm, req, i, n=None):
    toks, lg = alone(lm, PROMPTS[i], n or len(req.tokens), **KW[i])
    assert req.tokens == toks and logits_bytes(req) == lg, i


# -- EOS ----------------------------------------------------------------------

def test_generation_stops_at_the_models_eos_by_default(folder):
    plain = tiny_lm(folder)
    assert plain.eos_token_ids == ()
    first = plain.generate([PROMPTS[1]], max_new_tokens=6)[0]
    assert len(first) == 6  # control: no EOS declared, no stop
    lm = tiny_lm(folder, eos=[first[0]])  # the greedy choice is the EOS
    assert lm.eos_token_ids == (first[0],)
    assert lm.generate([PROMPTS[1]], max_new_tokens=6) == [[first[0]]]
    b = lm.batcher()
    r = b.submit(PROMPTS[1], max_new_tokens=6)
    list(b.run())
    assert r.tokens == [first[0]] and r.finish_reason == "stop"
    # stop_tokens=() turns it off
    assert lm.generate([PROMPTS[1]], max_new_tokens=6, stop_tokens=()) == [first]
    r = b.submit(PROMPTS[1], max_new_tokens=6, stop_tokens=())
    list(b.run())
    assert r.tokens == first and r.finish_reason == "length"


def test_a_folders_eos_token_id_stops_generation(folder, tmp_path):
    """End to end: generation_config.json's eos_token_id becomes the default
    stop set (the folder read as a user would)."""
    import json
    import shutil
    first = tiny_lm(folder).generate([PROMPTS[0]], max_new_tokens=4)[0]
    copy = tmp_path / "with_eos"
    shutil.copytree(folder, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [first[1], 47]}))
    lm = mojolearn.MambaLM(copy)
    assert lm.eos_token_ids == (first[1], 47)
    assert lm.generate([PROMPTS[0]], max_new_tokens=4) == [first[:first.index(first[1]) + 1]]
    assert lm.generate([PROMPTS[0]], max_new_tokens=4, stop_tokens=()) == [first]


# -- cancel -------------------------------------------------------------------

def test_cancel_retires_a_request_and_leaves_the_others_bits(lm):
    b = lm.batcher(keep_logits=True, prefill_chunk=4)
    reqs = [b.submit(p, max_new_tokens=7, **kw) for p, kw in zip(PROMPTS, KW)]
    for _ in range(4):
        b.step()
    assert reqs[0].tokens and not reqs[3].tokens  # 0 decoding, 3 still prefilling
    reqs[0].cancel()
    reqs[3].cancel()
    assert not reqs[0].done  # retired at the next step, not before
    out = b.step()
    for r in (reqs[0], reqs[3]):
        assert r.done and r.finish_reason == "cancelled" and r.error is None
        assert r in b.dropped and r not in b.active
        assert all(q is not r for q, _ in out)
    list(b.run())
    for i in (1, 2):
        assert reqs[i].finish_reason == "length"
        _check_alone(lm, reqs[i], i)
    n0 = len(reqs[0].tokens)
    reqs[0].cancel()  # a done request: nothing happens
    assert reqs[0].finish_reason == "cancelled" and len(reqs[0].tokens) == n0
    s = b.stats
    assert (s.requests_submitted, s.requests_finished, s.requests_cancelled) == (4, 4, 2)
    assert s.active_rows == 0 and s.prefilling_requests == 0 and s.pending_requests == 0


def test_a_request_cancelled_before_its_first_step_gets_no_token(lm):
    b = lm.batcher()
    r = b.submit(PROMPTS[0], max_new_tokens=3)
    r.cancel()
    assert b.step() == [] and r.done and r.tokens == [] and not b.busy


# -- starting from a state ------------------------------------------------------

def test_a_request_continues_a_given_state_with_the_bits_of_the_whole_prompt(lm):
    head, rest = PROMPTS[3][:6], PROMPTS[3][6:]
    state = lm.allocate_state(1)
    lm.forward_tokens([head], state)
    before = [bytes(memoryview(getattr(st, n)).cast("B")) for st in state
              for n in type(st)._ARRAYS]
    b = lm.batcher(keep_logits=True, prefill_chunk=3)
    r = b.submit(rest, max_new_tokens=5, state=state, **KW[3])
    list(b.run())
    toks, lg = alone(lm, PROMPTS[3], 5, **KW[3])
    assert r.tokens == toks and logits_bytes(r) == lg
    after = [bytes(memoryview(getattr(st, n)).cast("B")) for st in state
             for n in type(st)._ARRAYS]
    assert after == before  # the caller's state is not changed
    # control: from a zero state the same tokens give other logits
    cold = b.submit(rest, max_new_tokens=5, **KW[3])
    list(b.run())
    assert logits_bytes(cold) != lg


def test_a_bad_state_is_refused_by_name_and_changes_nothing(lm, tmp_path):
    b = lm.batcher()
    other_kind = "mamba3" if lm.kind != "mamba3" else "mamba"
    other = tiny_lm(tiny_folder(tmp_path, other_kind))
    two = lm.allocate_state(2)
    held = lm.allocate_state(1)
    session = lm.blocks[0].decode_session(held[0])
    cases = [(ValueError, lm.allocate_state(1)[:1]), (TypeError, "abc"),
             (TypeError, other.allocate_state(1)), (ValueError, two), (ValueError, held)]
    for err, bad in cases:
        with raises_naming(err, "state"):
            b.submit(PROMPTS[0], state=bad)
    session.close()
    if lm.kind == "mamba3":
        pend = lm.allocate_state(1)
        pend[0].pending = True  # as set_input_states leaves it
        with raises_naming(ValueError, "state[0]", "pending"):
            b.submit(PROMPTS[0], state=pend)
    assert not b.busy and b.stats.requests_submitted == 0


# -- checked parameters ----------------------------------------------------------

@pytest.mark.parametrize("kw, err, names", [
    ({"top_k": 2 ** 63}, ValueError, ["top_k"]),
    ({"top_k": 1.5}, TypeError, ["top_k"]),
    ({"stop_tokens": 5}, TypeError, ["stop_tokens"]),
    ({"stop_tokens": "ab"}, TypeError, ["stop_tokens"]),
    ({"stop_tokens": [48]}, ValueError, ["stop_tokens[0]"]),
    ({"temperature": "abc"}, TypeError, ["temperature"]),
    ({"temperature": 1e300}, ValueError, ["temperature"]),
    ({"temperature": 1e-60}, ValueError, ["temperature"]),
    ({"top_p": 1e-60}, ValueError, ["top_p"]),
    ({"max_new_tokens": 2 ** 64}, ValueError, ["max_new_tokens"]),
    ({"seed": "x"}, TypeError, ["seed"]),
    ({"max_new_tokens": True}, TypeError, ["max_new_tokens"]),
])
def test_every_parameter_is_checked_at_submit(lm, kw, err, names):
    b = lm.batcher()
    ok = b.submit(PROMPTS[0], max_new_tokens=2)
    with raises_naming(err, *names):
        b.submit(PROMPTS[0], **kw)
    list(b.run())
    assert ok.finish_reason == "length" and b.stats.requests_submitted == 1


def test_batcher_arguments_are_checked(lm):
    with raises_naming(ValueError, "prefill_chunk"):
        lm.batcher(prefill_chunk=0)
    with raises_naming(TypeError, "prefix_cache_bytes"):
        lm.batcher(prefix_cache_bytes=1.5)


# -- threads ----------------------------------------------------------------------

def test_submit_and_cancel_from_other_threads(lm):
    b = lm.batcher(keep_logits=True)
    got, lock = [], threading.Lock()

    def client(k):
        for j in range(3):
            r = b.submit(PROMPTS[k % 4], max_new_tokens=3, **KW[k % 4])
            with lock:
                got.append((k % 4, r))
            if j == 1 and k == 0:
                r.cancel()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) or b.busy:
        b.step()
    for t in threads:
        t.join()
    assert sorted(r.id for _, r in got) == list(range(12))
    cancelled = [r for _, r in got if r.finish_reason == "cancelled"]
    assert len(cancelled) <= 1
    for i, r in got:
        if r.finish_reason == "length":
            _check_alone(lm, r, i)
    assert b.stats.requests_submitted == b.stats.requests_finished == 12


# -- failure safety -----------------------------------------------------------------

def _fault_after(n, exc=RuntimeError):
    """A replacement for a request's uniform draw that raises at call n."""
    calls = []

    def draw(orig):
        def f():
            calls.append(1)
            if len(calls) == n:
                raise exc("injected fault")
            return orig()
        return f
    return draw


@pytest.mark.parametrize("where", ["uniform", "stop_check", "top_k_overflow"])
def test_a_fault_in_one_row_retires_it_and_leaves_the_others_bits(lm, where):
    b = lm.batcher(keep_logits=True, prefill_chunk=None)
    reqs = [b.submit(p, max_new_tokens=6, **kw) for p, kw in zip(PROMPTS, KW)]
    bad = reqs[1]
    for _ in range(2):
        b.step()
    assert len(bad.tokens) == 2
    if where == "uniform":
        bad._uniform = _fault_after(1)(bad._uniform)
    elif where == "stop_check":
        class Boom:
            def __contains__(self, tok):
                raise RuntimeError("injected fault")
        bad.stop_tokens = Boom()
    else:  # a parameter that got past the checks: the batched call overflows
        bad.top_k = 2 ** 63
    out = b.step()
    assert bad.done and bad.finish_reason == "error" and bad in b.dropped
    assert isinstance(bad.error, (RuntimeError, OverflowError))
    assert len(bad.tokens) == len(bad.logits) == 2 and all(r is not bad for r, _ in out)
    list(b.run())
    for i in (0, 2, 3):
        assert reqs[i].finish_reason == "length"
        _check_alone(lm, reqs[i], i)
    assert b.stats.requests_failed == 1


def test_a_failing_batched_head_falls_back_to_rows_one_by_one(lm, monkeypatch):
    """The head fails for every call of more than one row (a fault the
    batched call cannot place): each row is then run alone, with the same
    bits, and a row whose own draw fails is the only one retired."""
    b = lm.batcher(keep_logits=True, prefill_chunk=None)
    reqs = [b.submit(p, max_new_tokens=5, **kw) for p, kw in zip(PROMPTS, KW)]
    b.step()
    real = type(lm).head_logits
    calls = []

    def head(self, hidden):
        calls.append(len(memoryview(hidden).cast("B")) // (4 * self.d_model))
        if calls[-1] > 1:
            raise MemoryError("injected fault")
        return real(self, hidden)
    monkeypatch.setattr(type(lm), "head_logits", head)
    reqs[2]._uniform = _fault_after(2)(reqs[2]._uniform)
    list(b.run())
    assert max(calls) > 1 and calls.count(1) >= 3  # the fallback ran
    assert reqs[2].finish_reason == "error" and len(reqs[2].tokens) == 2
    for i in (0, 1, 3):
        assert reqs[i].finish_reason == "length"
        _check_alone(lm, reqs[i], i)


def test_a_fault_in_the_batched_layer_step_retires_the_decoding_rows_only(lm, monkeypatch):
    from mojolearn.row_decode import RowDecoder
    b = lm.batcher(keep_logits=True, prefill_chunk=4)
    running = [b.submit(PROMPTS[i], max_new_tokens=5, **KW[i]) for i in (0, 2)]
    b.step()
    b.step()
    joining = b.submit(PROMPTS[3], max_new_tokens=4, **KW[3])  # 13 tokens: 4 steps
    monkeypatch.setattr(RowDecoder, "step", lambda self, x: 1 / 0)
    assert b.step() == []
    for r in running:
        assert r.finish_reason == "error" and isinstance(r.error, ZeroDivisionError)
        assert r in b.dropped
    monkeypatch.undo()
    list(b.run())
    assert joining.finish_reason == "length"
    _check_alone(lm, joining, 3)


def test_generate_raises_the_error_of_a_failed_request(lm, monkeypatch):
    from mojolearn import request
    monkeypatch.setattr(request.Request, "_uniform", lambda self: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        lm.generate([PROMPTS[0]], max_new_tokens=2)


def test_max_rows_bounds_the_decoding_rows_first_come_first_served(lm):
    b = lm.batcher(keep_logits=True, prefill_chunk=None, max_rows=2)
    reqs = [b.submit(p, max_new_tokens=3 + i, **kw) for i, (p, kw) in enumerate(zip(PROMPTS, KW))]
    started = []
    while b.busy:
        b.step()
        assert len(b.active) <= 2
        started.append([r.id for r in reqs if r.tokens])
    assert started[0] == [0, 1]  # the first two, then each as a row frees
    assert max(len(s) for s in started) == 4 and len(started) > 7
    for i, r in enumerate(reqs):
        _check_alone(lm, r, i)
    with raises_naming(ValueError, "max_rows"):
        lm.batcher(max_rows=0)


def test_stats_count_the_work(lm):
    b = lm.batcher(prefill_chunk=4)
    b.submit(PROMPTS[3], max_new_tokens=3)  # 13 tokens: 4 steps of prefill
    b.submit(PROMPTS[2], max_new_tokens=2)
    seen = []
    while b.busy:
        b.step()
        seen.append(b.stats)
    s = seen[-1]
    assert s.prompt_tokens == 15 and s.tokens_generated == 5 and s.steps == len(seen)
    assert max(b.prompt_tokens - a.prompt_tokens for a, b in zip(seen, seen[1:])) <= 4
    assert s.requests_finished == 2 and s.last_step_seconds > 0
    assert isinstance(s, mojolearn.generate.BatcherStats)
