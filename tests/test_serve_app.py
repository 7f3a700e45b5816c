"""mojolearn.serve in this process: the queue limit (503 with Retry-After),
the chat endpoint without a template, the engine's queue and drain, and the
Prometheus text, with Starlette Requests built by hand (no sockets)."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

import mojolearn

from .text_model import tokenizer, write_model

pytest.importorskip("starlette")
from mojolearn.serve.app import Server  # noqa: E402
from mojolearn.serve.engine import Engine, QueueFull  # noqa: E402
from mojolearn.serve.schemas import Limits  # noqa: E402


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return mojolearn.MambaLM(write_model(tmp_path_factory.mktemp("app_lm"), chat=False))


def _call(server, method, path, body=None):
    """server.dispatch on a hand-built Request: (status, headers, decoded body)."""
    from starlette.requests import Request
    raw = json.dumps(body).encode() if body is not None else b""
    sent = []

    async def receive():
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.sleep(3600)  # the client stays

    scope = {"type": "http", "method": method, "path": path, "headers": [],
             "query_string": b"", "root_path": "", "scheme": "http",
             "server": ("127.0.0.1", 80)}

    async def go():
        r = await server.dispatch(Request(scope, receive))
        return r.status_code, dict(r.headers), r.body.decode()
    return asyncio.run(go())


class _Gate:
    """A sink that holds the engine thread at its first call until opened."""

    def __init__(self):
        self.entered, self.opened, self.calls = threading.Event(), threading.Event(), []

    def __call__(self, tokens, reason, error):
        self.entered.set()
        self.opened.wait(30)
        self.calls.append((tokens, reason))


def test_a_full_queue_answers_503_with_retry_after_and_nothing_is_lost(lm):
    server = Server(lm, tokenizer=tokenizer(), limits=Limits(max_rows=1, max_queue=1))
    try:
        gate = _Gate()
        first = server.engine.submit([1, 2, 3], dict(max_new_tokens=2), gate)
        assert gate.entered.wait(30)  # the engine thread is held inside its first step
        waiting = server.engine.submit([4, 5], dict(max_new_tokens=2), gate)
        with pytest.raises(QueueFull):
            server.engine.submit([6], dict(max_new_tokens=2), gate)
        status, headers, body = _call(server, "POST", "/v1/completions",
                                      {"prompt": [7], "max_tokens": 2})
        assert status == 503 and headers["retry-after"] == "1"
        assert json.loads(body)["error"]["code"] == "queue_full"
        assert "mojolearn_queue_length 1" in _call(server, "GET", "/metrics")[2]
        gate.opened.set()
    finally:
        server.close()  # drains: both jobs finish
    assert first.done and waiting.done
    assert [r for _, r in gate.calls if r] == ["length", "length"]
    tokens = [t for toks, _ in gate.calls for t in toks]
    assert tokens == sum(lm.generate([[1, 2, 3], [4, 5]], max_new_tokens=2), [])


def test_chat_without_a_template_is_an_openai_error_saying_so(lm):
    server = Server(lm, tokenizer=tokenizer())
    try:
        status, _, body = _call(server, "POST", "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "hi"}]})
        err = json.loads(body)["error"]
        assert status == 400 and "chat template" in err["message"]
        assert err["code"] == "no_chat_template" and err["type"] == "invalid_request_error"
        status, _, body = _call(server, "GET", "/v1/nothing")
        assert status == 404
    finally:
        server.close()


def test_text_needs_a_tokenizer_and_ids_do_not(lm):
    server = Server(lm, tokenizer=None)
    try:
        status, _, body = _call(server, "POST", "/v1/completions", {"prompt": "hello"})
        assert status == 400 and json.loads(body)["error"]["param"] == "prompt"
        status, _, body = _call(server, "POST", "/v1/completions",
                                {"prompt": [1, 2], "stop": ["x"]})
        assert status == 400 and json.loads(body)["error"]["param"] == "stop"
        status, _, body = _call(server, "POST", "/v1/completions",
                                {"prompt": [1, 2], "max_tokens": 3, "temperature": 0,
                                 "return_token_ids": True})
        choice = json.loads(body)["choices"][0]
        assert status == 200 and choice["token_ids"] == lm.generate([[1, 2]],
                                                                    max_new_tokens=3)[0]
    finally:
        server.close()


def test_stopping_without_drain_cancels_what_is_in_flight(lm):
    engine = Engine(lm, max_rows=2, max_queue=4)
    gate = _Gate()
    engine.submit([1, 2, 3], dict(max_new_tokens=500), gate)
    later = engine.submit([4], dict(max_new_tokens=500), gate)
    assert gate.entered.wait(30)
    threading.Timer(0.2, gate.opened.set).start()
    engine.stop(drain=False)
    assert not engine.alive and later.done
    reasons = [r for _, r in gate.calls if r]
    assert reasons == ["cancelled", "cancelled"]
    with pytest.raises(RuntimeError, match="shutting down"):
        engine.submit([1], {}, gate)


def test_the_engine_keeps_at_most_max_rows_in_the_batch(lm):
    engine = Engine(lm, max_rows=2, max_queue=8)
    seen, got = [], {}
    prompts = [[i + 1, i + 2] for i in range(6)]

    def sink_for(i):
        def sink(tokens, reason, error):
            seen.append(engine.snapshot()["batch_size"])
            got.setdefault(i, []).extend(tokens)
        return sink
    for i, p in enumerate(prompts):
        engine.submit(p, dict(max_new_tokens=3, temperature=0.5, seed=i), sink_for(i))
    engine.stop()
    assert max(seen) == 2
    assert [got[i] for i in range(6)] == [
        lm.generate([p], max_new_tokens=3, temperature=0.5, seed=i)[0]
        for i, p in enumerate(prompts)]


def test_a_parameter_only_the_batcher_refuses_is_a_400(lm, monkeypatch):
    server = Server(lm, tokenizer=tokenizer())
    try:
        real = server.engine.batcher.submit

        def picky(prompt, **kw):
            if kw["seed"] == 13:
                raise ValueError("seed 13 is refused by the Batcher")
            return real(prompt, **kw)
        monkeypatch.setattr(server.engine.batcher, "submit", picky)
        status, _, body = _call(server, "POST", "/v1/completions",
                                {"prompt": [1, 2], "seed": 13, "max_tokens": 2})
        assert status == 400 and "seed 13" in json.loads(body)["error"]["message"]
        status, _, body = _call(server, "POST", "/v1/completions",
                                {"prompt": [1, 2], "seed": 12, "max_tokens": 2})
        assert status == 200
    finally:
        server.close()
