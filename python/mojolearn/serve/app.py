"""The OpenAI-compatible HTTP API on Starlette: /v1/completions,
/v1/chat/completions, /v1/models, /health and /metrics.

``Server`` holds the model, its tokenizer, the limits and the one Engine
thread; its handlers take a Starlette Request and return a Response, so the
same object serves the Starlette app (``Server.app()``) and a Ray Serve
deployment (``Server.dispatch``). Each request's tokens are those of
generating its prompt alone (the Batcher's promise); text is streamed whole
characters at a time and cut at stop strings (mojolearn.textstream).

Thread safety: the handlers run on one event loop; the Engine is the only
other thread.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..textstream import IncrementalDecoder, StopText
from . import metrics, schemas
from .engine import Engine, QueueFull
from .schemas import APIError, Limits

log = logging.getLogger("mojolearn.serve")
_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


class Server:
    """The serving state of one model.

    Parameters
    ----------
    model : MambaLM
    tokenizer : tokenizers.Tokenizer or None
        Needed for text prompts, text output and stop strings.
    chat_template : mojolearn.serve.chat.ChatTemplate or None
        Needed for /v1/chat/completions.
    model_name : str
        The id /v1/models lists and requests name.
    limits : Limits
    batcher_options : dict
        For ``model.batcher`` (prefill_chunk, prefix_cache_bytes).
    """

    def __init__(self, model, *, tokenizer=None, chat_template=None, model_name="mojolearn",
                 limits: Limits | None = None, batcher_options: dict | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.model_name = model_name
        self.limits = limits or Limits()
        self.eos_ids = tuple(getattr(model, "eos_token_ids", ()) or ())
        self.engine = Engine(model, max_rows=self.limits.max_rows,
                             max_queue=self.limits.max_queue, batcher_options=batcher_options)
        self.rejected = 0
        self.created = int(time.time())

    # -- the app --------------------------------------------------------------
    def app(self) -> Starlette:
        """A Starlette app serving this Server; its shutdown drains the engine."""
        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def lifespan(app):
            yield
            await asyncio.get_running_loop().run_in_executor(None, self.close)

        return Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], lifespan=lifespan)

    async def dispatch(self, request: Request) -> Response:
        """Route one request by method and path (for hosts that hand over
        Starlette Requests, such as Ray Serve)."""
        routes = {("POST", "/v1/completions"): self.completions,
                  ("POST", "/v1/chat/completions"): self.chat_completions,
                  ("GET", "/v1/models"): self.models, ("GET", "/health"): self.health,
                  ("GET", "/metrics"): self.metrics}
        path = request.url.path.rstrip("/")  # under a host's route prefix: match the end
        handler = next((h for (m, p), h in routes.items()
                        if m == request.method and path.endswith(p)), None)
        if handler is None:
            return _error(APIError(f"no route {request.method} {path}", status=404,
                                   code="not_found"))
        return await handler(request)

    def close(self, *, drain: bool = True):
        """Stop the engine: finish (``drain``) or cancel what is in flight."""
        self.engine.stop(drain=drain)

    # -- plain endpoints ------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "mojolearn"}]})

    async def health(self, request: Request) -> Response:
        ok = self.engine.alive
        return JSONResponse({"status": "ok" if ok else "engine stopped"},
                            status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        values = self.engine.snapshot()
        values["rejected"] = self.rejected
        return Response(metrics.render(values), media_type=metrics.CONTENT_TYPE)

    # -- generation -----------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generation(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generation(request, chat=True)

    async def _generation(self, request, *, chat):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        t0 = time.monotonic()
        try:
            body = await _json_body(request)
            prompt, s = self._parse(body, chat)
            job, queue = self._submit(prompt, s)
        except APIError as e:
            self.rejected += 1
            log.info("%s %s status=%d error=%r", rid, request.url.path, e.status, e.message)
            return _error(e)
        run = _Run(self, rid, chat, prompt, s, job, queue, t0, request.url.path)
        if s.stream:
            return StreamingResponse(run.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await run.whole(request)

    def _parse(self, body, chat):
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        name = body.get("model")
        if name is not None and name != self.model_name:
            raise APIError(f"model: this server serves {self.model_name!r}, not {name!r}",
                           param="model", status=404, code="model_not_found")
        v = self.model.vocab_size
        s = schemas.sampling(body, self.limits, v, chat=chat)
        if chat:
            if self.chat_template is None:
                raise APIError("this model has no chat template (tokenizer_config.json's "
                               "chat_template, chat_template.jinja, or a .gguf file's "
                               "tokenizer.chat_template); use /v1/completions",
                               param="messages", code="no_chat_template")
            if self.tokenizer is None:
                raise APIError(f"messages: chat {schemas.NEEDS_TOKENIZER}; use "
                               "/v1/completions with token ids", param="messages")
            messages = schemas.chat_messages(body)
            try:
                text = self.chat_template.render(messages)
            except Exception as e:  # the template's own checks (raise_exception)
                raise APIError(f"messages: the chat template refused them: {e}",
                               param="messages") from None
            prompt = schemas.check_prompt_length(self.tokenizer.encode(text).ids, "messages",
                                                 self.limits)
        else:
            prompt = schemas.completion_prompt(body, self.tokenizer, v, self.limits)
        if s.stop and self.tokenizer is None:
            raise APIError(f"stop: a stop string {schemas.NEEDS_TOKENIZER}", param="stop")
        return prompt, s

    def _submit(self, prompt, s):
        loop = asyncio.get_running_loop()
        queue = asyncio.Queue()

        def sink(tokens, reason, error):  # on the engine thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (tokens, reason, error))
            except RuntimeError:  # the loop is closed: nobody is listening
                pass

        stop = self.eos_ids if s.stop_token_ids is None else tuple(s.stop_token_ids)
        params = dict(max_new_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k,
                      top_p=s.top_p, seed=s.seed, stop_tokens=stop)
        try:
            job = self.engine.submit(prompt, params, sink)
        except QueueFull as e:
            raise APIError(f"the server is busy ({e}); retry later", status=503,
                           type="server_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except RuntimeError as e:
            raise APIError(str(e), status=503, type="server_error",
                           code="shutting_down") from None
        job.stop_set = frozenset(stop)
        return job, queue


class _Run:
    """One generation request in flight: turns the engine's tokens into
    text (stream or whole), usage and the request's log line."""

    def __init__(self, server, rid, chat, prompt, s, job, queue, t0, path):
        self.server, self.rid, self.chat, self.prompt, self.s = server, rid, chat, prompt, s
        self.job, self.queue, self.t0, self.path = job, queue, t0, path
        tok = server.tokenizer
        self.decoder = IncrementalDecoder(tok) if tok is not None else None
        self.stops = StopText(s.stop)
        self.tokens = []
        self.finish = None
        self.error = None
        self.first_token_s = None

    def _take(self, tokens, reason, error):
        """The text of one engine message; sets finish when the run ends."""
        text = []
        if tokens and self.first_token_s is None:
            self.first_token_s = time.monotonic() - self.t0
        shown = tokens[:-1] if reason == "stop" and tokens and (
            tokens[-1] in self.job.stop_set) else tokens
        for i, t in enumerate(tokens):
            self.tokens.append(t)
            if self.decoder is None or i >= len(shown):
                continue
            text.append(self.stops.feed(self.decoder.add(t)))
            if self.stops.stopped:  # a stop string: end here, like OpenAI
                self.job.cancel()
                self.server.engine.wake()
                self.finish = "stop"
                return "".join(text)
        if reason is not None:
            if self.decoder is not None:
                text.append(self.stops.feed(self.decoder.finish()))
                text.append(self.stops.finish())
            self.finish, self.error = reason, error
        return "".join(text)

    def _error_reply(self) -> APIError:
        """The Batcher refused the request (a parameter the checks here let
        through: 400) or failed while running it (500)."""
        if self.job.request is None and isinstance(self.error, (ValueError, TypeError)):
            return APIError(str(self.error))
        return APIError(f"generation failed: {self.error}", status=500, type="server_error")

    def usage(self) -> dict:
        u = {"prompt_tokens": len(self.prompt), "completion_tokens": len(self.tokens),
             "total_tokens": len(self.prompt) + len(self.tokens)}
        u["prompt_tokens_details"] = {"cached_tokens": self.job.cached_tokens}
        return u

    def _choice(self, text, finish, *, delta):
        c = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            c["delta" if delta else "message"] = (
                {"content": text} if delta else {"role": "assistant", "content": text})
        else:
            c["text"] = text
        return c

    def _envelope(self, choices, *, chunk):
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else "")
        return {"id": self.rid, "object": kind, "created": int(time.time()),
                "model": self.server.model_name, "choices": choices}

    def _log(self, status):
        ttft = "-" if self.first_token_s is None else f"{self.first_token_s:.3f}s"
        log.info("%s %s status=%d prompt_tokens=%d completion_tokens=%d cached_tokens=%d "
                 "finish=%s ttft=%s total=%.3fs", self.rid, self.path, status, len(self.prompt),
                 len(self.tokens), self.job.cached_tokens, self.finish, ttft,
                 time.monotonic() - self.t0)

    async def whole(self, request) -> Response:
        parts = []
        getter = None
        checked = time.monotonic()
        try:
            while self.finish is None:
                # one get() kept across polls: wait_for(get()) could lose an item
                # that arrives just as it times out
                getter = getter or asyncio.ensure_future(self.queue.get())
                done, _ = await asyncio.wait({getter}, timeout=_POLL_S)
                if done:
                    parts.append(self._take(*getter.result()))
                    getter = None
                if time.monotonic() - checked >= _POLL_S:  # tokens may never pause
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        self.finish = "cancelled"
        finally:
            if getter is not None:
                getter.cancel()
            if self.finish in (None, "cancelled"):
                self.job.cancel()
                self.server.engine.wake()
        if self.finish == "cancelled":
            self._log(499)
            return Response(status_code=499)
        if self.finish == "error":
            e = self._error_reply()
            self._log(e.status)
            return _error(e)
        choice = self._choice("".join(parts), self.finish, delta=False)
        if self.s.return_token_ids:
            choice["token_ids"] = list(self.tokens)
        body = self._envelope([choice], chunk=False)
        body["usage"] = self.usage()
        self._log(200)
        return JSONResponse(body)

    async def sse(self):
        def event(obj):
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
        status = 200
        try:
            if self.chat:
                yield event(self._envelope([{"index": 0, "delta": {"role": "assistant",
                            "content": ""}, "logprobs": None, "finish_reason": None}],
                                           chunk=True))
            while self.finish is None:
                tokens, reason, error = await self.queue.get()
                n = len(self.tokens)
                text = self._take(tokens, reason, error)
                if self.finish == "error":
                    e = self._error_reply()
                    status = e.status
                    yield event(e.body())
                    break
                if text or self.s.return_token_ids and len(self.tokens) > n:
                    choice = self._choice(text, None, delta=True)
                    if self.s.return_token_ids:
                        choice["token_ids"] = self.tokens[n:]
                    yield event(self._envelope([choice], chunk=True))
            if self.finish != "error":
                yield event(self._envelope([self._choice("", self.finish, delta=True)],
                                           chunk=True))
                if self.s.include_usage:
                    body = self._envelope([], chunk=True)
                    body["usage"] = self.usage()
                    yield event(body)
            yield "data: [DONE]\n\n"
        except BaseException:  # the client went away (cancelled) or the loop is closing
            status = 499
            self.finish = self.finish or "cancelled"
            raise
        finally:
            if self.finish in (None, "cancelled"):
                self.job.cancel()
                self.server.engine.wake()
            self._log(status)


async def _json_body(request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON ({e})") from None


def _error(e: APIError) -> Response:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
