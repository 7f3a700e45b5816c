"""Reading and checking the JSON bodies of the OpenAI-compatible endpoints.

Every field is checked before anything runs; a bad one is an ``APIError``
(HTTP 400) that names it, in the shape of OpenAI's errors:
``{"error": {"message", "type", "param", "code"}}``. Fields of OpenAI's API
that the server does not implement (``n`` > 1, ``logprobs``, ``echo``,
``best_of``, penalties, ``logit_bias``, ...) are refused by name rather
than ignored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16
_INT64 = 1 << 63


class APIError(Exception):
    """An error answered as OpenAI-shaped JSON with an HTTP status."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass
class Limits:
    """The server's limits (``python -m mojolearn serve --help`` lists them)."""
    max_rows: int = 16          # requests decoded at once
    max_queue: int = 64         # requests waiting for a row; more get 503
    max_prompt_tokens: int = 8192
    max_tokens: int = 1024      # tokens generated per request, at most


@dataclass
class Sampling:
    """The generation parameters of one request, checked."""
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: list = field(default_factory=list)          # strings
    stop_token_ids: list | None = None                # None: the model's end-of-text ids
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


# what text needs when the server has no tokenizer (the server's messages)
NEEDS_TOKENIZER = ("needs the model's tokenizer (the folder's tokenizer.json; for a .gguf "
                   "file the one beside it, else the one the file carries)")


def _bad(field_name, message):
    return APIError(f"{field_name}: {message}", param=field_name)


def _int(body, name, default, lo=None, hi=None):
    v = body.get(name, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int) and not (
            isinstance(v, float) and v.is_integer()):
        raise _bad(name, f"must be an integer, got {v!r}")
    v = int(v)
    if lo is not None and v < lo or hi is not None and v > hi:
        span = f"from {lo} to {hi}" if hi is not None else f">= {lo}"
        raise _bad(name, f"must be {span}, got {v}")
    return v


def _float(body, name, default, lo, hi, lo_open=False):
    v = body.get(name, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(name, f"must be a number, got {v!r}")
    v = float(v)
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        span = f"in ({lo}, {hi}]" if lo_open else f"from {lo} to {hi}"
        raise _bad(name, f"must be {span}, got {v!r}")
    return v


def _nonzero_in_float32(v, name, what):
    """v > 0 must stay > 0 when the kernels round it to float32."""
    from .._intake import float32_round
    if v > 0 and float32_round(v) == 0:
        raise _bad(name, f"{v!r} is 0 in float32 ({what})")
    return v


def _bool(body, name, default=False):
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"must be true or false, got {v!r}")
    return v


def token_ids(value, name: str, vocab_size: int) -> list:
    """A list of token ids in [0, vocab_size), or an APIError naming ``name``."""
    if not isinstance(value, list):
        raise _bad(name, f"must be a list of token ids, got {type(value).__name__}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise APIError(f"{name}[{i}] must be an integer token id, got {t!r}", param=name)
        if not 0 <= t < vocab_size:
            raise APIError(f"{name}[{i}] = {t} is not a token id of this model "
                           f"(vocab_size {vocab_size})", param=name)
    return value


_REFUSED = {  # field: the value that means "off", which is the only one taken
    "n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None,
    "suffix": None, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
    "tools": None, "functions": None, "response_format": None,
}


def _refuse_unsupported(body):
    for name, off in _REFUSED.items():
        v = body.get(name)
        if v is None or v == off or (name == "logit_bias" and v == {}) or (
                name == "logprobs" and v is False) or (name == "response_format" and v == {
                    "type": "text"}):
            continue
        raise _bad(name, f"is not supported by this server (only {off!r})")


def sampling(body: dict, limits: Limits, vocab_size: int, *, chat: bool) -> Sampling:
    """The checked generation parameters of a completions or chat body."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    _refuse_unsupported(body)
    name = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        name = "max_completion_tokens"
    default = 16 if not chat else limits.max_tokens
    max_tokens = _int(body, name, default, 1)
    if max_tokens > limits.max_tokens:
        raise _bad(name, f"must be at most {limits.max_tokens} (the server's limit), "
                         f"got {max_tokens}")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", "must be a non-empty string or a list of them")
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        stop_ids = token_ids(stop_ids, "stop_token_ids", vocab_size)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("stream_options", "must be an object")
    include_usage = _bool(opts or {}, "include_usage")
    seed = body.get("seed")
    if seed is None:
        import secrets
        seed = secrets.randbits(63)  # OpenAI: no seed, no promise of repeatability
    seed = _int({"seed": seed}, "seed", 0, -_INT64, _INT64 - 1)
    return Sampling(
        max_tokens=max_tokens,
        temperature=_nonzero_in_float32(_float(body, "temperature", 1.0, 0.0, 2.0),
                                        "temperature", "give 0 for greedy"),
        top_p=_nonzero_in_float32(_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                                  "top_p", "it must be > 0"),
        top_k=_int(body, "top_k", 0, 0, 1 << 31),
        seed=seed, stop=stop, stop_token_ids=stop_ids,
        stream=_bool(body, "stream"), include_usage=include_usage,
        return_token_ids=_bool(body, "return_token_ids"))


def completion_prompt(body: dict, tokenizer, vocab_size: int, limits: Limits) -> list:
    """The prompt of a /v1/completions body as token ids (text needs the tokenizer)."""
    if "prompt" not in body:
        raise _bad("prompt", "is required")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if tokenizer is None:
            raise _bad("prompt", f"text {NEEDS_TOKENIZER} (or give token ids)")
        ids = tokenizer.encode(p).ids
        if not ids:
            raise _bad("prompt", "is empty (it encodes to no tokens)")
    elif isinstance(p, list) and p and all(isinstance(t, list) for t in p):
        raise _bad("prompt", "one prompt per request (a batch of several is not supported)")
    elif isinstance(p, list) and p and all(isinstance(t, str) for t in p):
        raise _bad("prompt", "one prompt per request (a batch of several is not supported)")
    else:
        if isinstance(p, list) and not p:
            raise _bad("prompt", "is empty")
        ids = token_ids(p, "prompt", vocab_size)
    return check_prompt_length(ids, "prompt", limits)


def check_prompt_length(ids, name, limits: Limits) -> list:
    if len(ids) > limits.max_prompt_tokens:
        raise _bad(name, f"has {len(ids)} tokens, more than the server's limit of "
                         f"{limits.max_prompt_tokens}")
    return ids


def chat_messages(body: dict) -> list:
    """The messages of a chat body: a non-empty list of {role, content} with
    string content (or a list of text parts)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(where, "must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):  # text parts: [{"type": "text", "text": ...}]
            try:
                content = "".join(part["text"] for part in content if part["type"] == "text")
            except (TypeError, KeyError):
                raise _bad(f"{where}.content", "parts must be {type: text, text}") from None
        if not isinstance(content, str):
            raise _bad(f"{where}.content", "must be a string")
        out.append({"role": m["role"], "content": content})
    return out
