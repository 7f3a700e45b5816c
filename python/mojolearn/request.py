"""One generation request of a Batcher, its parameters checked once at
submission (so that a step never fails on them), and the Batcher's
running counters.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from . import _intake

_U_BITS = 24  # a float32 uniform in [0, 1): k / 2^24, exact
INT64_MAX = (1 << 63) - 1
FINISH_REASONS = (None, "stop", "length", "cancelled", "error")


def count(v, name: str, lo: int, hi: int = INT64_MAX) -> int:
    """An int in [lo, hi], TypeError/ValueError naming `name` otherwise."""
    v = _intake.as_int(v, name)
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return v


def real(v, name: str) -> float:
    """A finite real number that float32 can hold, by name otherwise."""
    if isinstance(v, (bool, str, bytes)) or not isinstance(v, (int, float)) \
            and not hasattr(v, "__float__"):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    try:
        v = float(v)
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"{name} must be a real number ({e})") from None
    if not math.isfinite(v) or not math.isfinite(_intake.float32_round(v)):
        raise ValueError(f"{name} must be a finite float32 value, got {v!r}")
    return v


def temperature(t) -> float:
    t = real(t, "temperature")
    if t < 0:
        raise ValueError(f"temperature must be >= 0, got {t}")
    if t > 0 and _intake.float32_round(t) == 0:
        raise ValueError(f"temperature {t!r} is 0 in float32: give 0 for greedy or a "
                         "larger value")
    return t


def top_p(p) -> float:
    p = real(p, "top_p")
    if not 0.0 < p <= 1.0 or _intake.float32_round(p) == 0:
        raise ValueError(f"top_p must be in (0, 1] (and nonzero in float32), got {p}")
    return p


def seed(v) -> int:
    return _intake.as_int(v, "seed")


def stop_set(model, stop_tokens) -> frozenset:
    """The checked stop ids: None -> the model's eos_token_ids; a
    collection of ids (empty: none)."""
    if stop_tokens is None:
        return frozenset(model.eos_token_ids)
    if isinstance(stop_tokens, (str, bytes)) or not hasattr(stop_tokens, "__iter__") \
            or not hasattr(stop_tokens, "__len__"):
        raise TypeError(f"stop_tokens must be a collection of token ids (or None for the "
                        f"model's end-of-sequence ids), got {type(stop_tokens).__name__}")
    ids = list(stop_tokens)
    return frozenset(model.check_tokens(ids, "stop_tokens")) if ids else frozenset()


def start_state(model, state):
    """A checked copy of a batch-1 model state to start a request from."""
    if state is None:
        return None
    model.check_state(state, "state", batch=1)
    try:
        out = [st.copy() for st in state]
    except ValueError as e:  # (check_state refuses a held state first)
        raise ValueError(f"state: {e}") from None
    for i, st in enumerate(out):
        if getattr(st, "pending", False):
            raise ValueError(f"state[{i}] has input states pending (set_input_states): "
                             "a request continues a state that has run")
    return out


class Request:
    """One generation request of a Batcher (made by ``Batcher.submit``).

    ``cancel()`` may be called from any thread; read the other attributes
    from the thread that drives the Batcher (or once ``done``).

    Attributes
    ----------
    id : int
        Order of submission.
    prompt : tuple of int
    tokens : list of int
        The tokens generated so far.
    logits : list of mojolearn.Array or None
        With ``keep_logits``: the (vocab_size,) float32 logits each token was
        chosen from.
    done : bool
    finish_reason : None, 'stop', 'length', 'cancelled' or 'error'
        'stop': a stop token was generated (it is the last of ``tokens``);
        'length': max_new_tokens reached; 'cancelled': ``cancel()``;
        'error': a fault in this request's own work (``error``).
    error : Exception or None
        What retired the request when finish_reason is 'error'.
    prompt_tokens_done : int
        Prompt tokens prefilled so far (cached ones included).
    cached_tokens : int
        Prompt tokens skipped thanks to the prefix cache.
    """

    def __init__(self, rid, prompt, max_new_tokens, temperature, top_k, top_p, seed,
                 stop_tokens, keep_logits, state, lock, on_cancel):
        self.id = rid
        self.prompt = tuple(prompt)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.seed = seed
        self.stop_tokens = stop_tokens
        self.tokens = []
        self.logits = [] if keep_logits else None
        self.done = False
        self.finish_reason = None
        self.error = None
        self.prompt_tokens_done = 0
        self.cached_tokens = 0
        self._rng = random.Random(seed)
        self._initial = state  # a private copy of the state to start from, or None
        self._states = None  # the request's own layer states while it prefills
        self._hidden = None  # (array, row) of its last prompt token's output
        self._cacheable = False  # its prefix states go to the Batcher's cache
        self._cancel = False
        self._lock = lock  # the Batcher's
        self._on_cancel = on_cancel

    def cancel(self) -> None:
        """Ask for the request to end: at the Batcher's next step it is
        retired (done, finish_reason 'cancelled') and its row freed. No
        effect on a request that is done. Thread-safe."""
        with self._lock:
            if not self.done:
                self._cancel = True
                self._on_cancel(self)

    @property
    def cancel_requested(self) -> bool:
        """Whether cancel() was called."""
        return self._cancel

    def _uniform(self) -> float:
        """The next number of the request's stream (drawn once per token)."""
        return self._rng.getrandbits(_U_BITS) / float(1 << _U_BITS)

    def _finish(self, reason, error=None):
        self.done, self.finish_reason, self.error = True, reason, error
        self._states = self._initial = self._hidden = None

    def __repr__(self):
        return (f"Request(id={self.id}, prompt={len(self.prompt)} tokens, "
                f"generated={len(self.tokens)}, done={self.done}, "
                f"finish_reason={self.finish_reason!r})")


@dataclass
class BatcherStats:
    """Running counters of a Batcher (``Batcher.stats`` gives a snapshot).

    Attributes
    ----------
    requests_submitted, requests_finished : int
        Requests accepted by submit; requests retired for any reason.
    requests_cancelled, requests_failed : int
        Of those finished: by cancel(), by an error.
    prompt_tokens : int
        Prompt tokens prefilled (run through the layers).
    cached_tokens : int
        Prompt tokens skipped thanks to the prefix cache.
    tokens_generated : int
    steps : int
    prefix_cache_hits, prefix_cache_misses : int
        Lookups of a request's prompt in the prefix cache.
    prefix_cache_bytes, prefix_cache_entries : int
        What the cache holds now.
    active_rows : int
        Requests decoding (one row each).
    session_cache_bytes : int
        Bytes of the decode sessions' speed cache of the decoding rows as
        last opened (0: none, or no rows; Batcher's session_cache).
    pending_requests : int
        Submitted, not yet seen by a step.
    prefilling_requests : int
        Waiting for or in their prompt's prefill.
    last_step_seconds : float
        Wall time of the last step.
    """

    requests_submitted: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tokens_generated: int = 0
    steps: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_misses: int = 0
    prefix_cache_bytes: int = 0
    prefix_cache_entries: int = 0
    active_rows: int = 0
    session_cache_bytes: int = 0
    pending_requests: int = 0
    prefilling_requests: int = 0
    last_step_seconds: float = 0.0
