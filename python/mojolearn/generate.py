"""Generation from a MambaLM: ``generate`` for a batch of prompts, and
``Batcher`` for continuous batching (requests join and leave between steps).

Every request runs on its own rows: its prompt is prefilled alone, then each
step decodes one token for all active requests at once (batched block steps
and one LM-head pass for all rows), and its next token is chosen from its own
logits, parameters and random stream (seeded per request). Identical mode
makes a row's bits independent of the batch, so each request's tokens and
logits are bit-identical to generating its prompt alone, whatever else is in
the batch and whenever it joined.

All active requests decode in one batched step per layer: one pass over
each layer's weights and one over the LM head for all of them. Mamba-2/3
rows sit at different positions of their blocks' chunks (the buffered
tokens of the 256- or 64-token chunk): each row's own position goes to the
kernels (the forward op's row_tokens), which compute every row exactly as it
would alone.
"""
from __future__ import annotations

import math
import random

from . import _intake

_U_BITS = 24  # a float32 uniform in [0, 1): k / 2^24, exact


def _count(v, name: str, lo: int) -> int:
    v = _intake.as_int(v, name)
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return v


def _real(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v!r}")
    return v


class Request:
    """One generation request of a Batcher (made by ``Batcher.submit``).

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
    finish_reason : None, 'stop' (a stop token was generated; it is the
        last of ``tokens``) or 'length' (max_new_tokens reached)
    """

    def __init__(self, rid, prompt, max_new_tokens, temperature, top_k, top_p, seed,
                 stop_tokens, keep_logits):
        self.id = rid
        self.prompt = tuple(prompt)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.seed = seed
        self.stop_tokens = frozenset(stop_tokens)
        self.tokens = []
        self.logits = [] if keep_logits else None
        self.done = False
        self.finish_reason = None
        self._rng = random.Random(seed)
        self._states = None  # the request's own layer states until it joins a group

    def _uniform(self) -> float:
        """The next number of the request's stream (drawn once per token)."""
        return self._rng.getrandbits(_U_BITS) / float(1 << _U_BITS)

    def __repr__(self):
        return (f"Request(id={self.id}, prompt={len(self.prompt)} tokens, "
                f"generated={len(self.tokens)}, done={self.done})")


class _Rows:
    """The active requests and their layer states (row i of each state is
    request i), decoded through open decode sessions while the membership
    stays the same (the state is checked once, not at every token); a change
    of membership closes them first. Mamba-2/3 rows keep their own chunk
    positions (``pos``, given to the sessions as row_tokens)."""

    def __init__(self, kind):
        self.kind = kind
        self.requests = []
        self.states = None
        self.pos = []
        self.sessions = None

    def open(self, blocks):
        if self.sessions is None:
            from .mamba.sessions import Mamba2DecodeSession, Mamba3DecodeSession
            cls = {"mamba2": Mamba2DecodeSession, "mamba3": Mamba3DecodeSession}.get(self.kind)
            if cls is None:  # Mamba-1: block.step (a session would hold a workspace per layer)
                self.sessions = [_Stepper(blk, st) for blk, st in zip(blocks, self.states)]
            else:  # one row-position array for all layers, advanced once a step
                from array import array
                from ._array import Array
                rows = Array((len(self.pos),), "int64", zero=False)
                memoryview(rows).cast("B")[:] = array("q", self.pos).tobytes()
                self.sessions = [cls(blk, st, _row_tokens=rows, _in_place=True)
                                 for blk, st in zip(blocks, self.states)]

    def step(self, x):
        """x through every layer's session, then the rows' positions move on."""
        for s in self.sessions:
            x = s.step(x)
        if self.kind != "mamba":
            self.sessions[0].advance_rows()
        return x

    def close(self):
        if self.sessions is not None:
            if self.kind != "mamba":
                self.pos = self.sessions[0]._row_positions()
            for s in self.sessions:
                s.close()
            self.sessions = None


class _Stepper:
    """block.step on one state, with a decode session's step/close."""

    def __init__(self, block, state):
        self.block, self.state = block, state

    def step(self, x):
        return self.block.step(x, self.state)

    def close(self):
        pass


def _position(states) -> int:
    """A fresh request's chunk position (buffered tokens; 0 for Mamba-1)."""
    st = states[0]
    if getattr(st, "pending", False):
        raise ValueError("a request's state has input states pending")
    return getattr(st, "buffered_tokens", 0)


def _restack(blocks, parts):
    """Per layer, a new state whose row i is row r of state s for the i-th
    (states, r) in parts (values from the first). The sources are consumed:
    each layer's are dropped once copied, so a restack holds one layer's
    states twice at most, not the whole model's."""
    out = []
    for layer, blk in enumerate(blocks):
        first = parts[0][0][layer]
        new = blk.allocate_state(len(parts))
        for name in type(first)._ARRAYS:
            dst = memoryview(getattr(new, name)).cast("B")
            row = dst.nbytes // len(parts)
            for i, (states, r) in enumerate(parts):
                src = memoryview(getattr(states[layer], name)).cast("B")
                dst[i * row:(i + 1) * row] = src[r * row:(r + 1) * row]
        for name in type(first)._VALUES:
            setattr(new, name, getattr(first, name))
        out.append(new)
        for states, _ in parts:
            states[layer] = None
    return out


class Batcher:
    """Continuous batching over a MambaLM.

    ``submit`` adds a request at any time; ``step`` prefills the requests
    submitted since the last step (each alone) and decodes one token for
    every other active request, then retires the finished ones. Each
    request's tokens and logits are bit-identical to generating it alone.
    Drive it from one thread.

    Examples
    --------
    >>> lm = mojolearn.MambaLM(lm_folder)
    >>> b = lm.batcher()
    >>> first = b.submit([1, 2, 3], max_new_tokens=4)
    >>> b.step()[0][0] is first                # prefilled: its first token
    True
    >>> second = b.submit([5], max_new_tokens=2, temperature=0.8, seed=1)
    >>> done = list(b.run())                   # (request, token) as they come
    >>> len(first.tokens), len(second.tokens), first.finish_reason
    (4, 2, 'length')
    """

    def __init__(self, model, *, keep_logits: bool = False):
        self.model = model
        self.keep_logits = bool(keep_logits)
        self._pending = []
        self._rows = _Rows(model.kind)
        self._next_id = 0

    @property
    def busy(self) -> bool:
        """Whether a request is pending or active."""
        return bool(self._pending or self._rows.requests)

    @property
    def active(self) -> list:
        """The requests being decoded (not pending, not done)."""
        return list(self._rows.requests)

    def submit(self, prompt, *, max_new_tokens=32, temperature=0.0, top_k=0, top_p=1.0,
               seed=0, stop_tokens=()) -> Request:
        """Add a request; it is prefilled at the next step.

        Parameters
        ----------
        prompt : sequence of int
            Token ids (at least one, each in [0, vocab_size)).
        max_new_tokens : int >= 1
        temperature : float >= 0
            0: greedy (the first id of the largest logit).
        top_k : int >= 0
            Keep the k most likely ids (0: all).
        top_p : float in (0, 1]
            Keep the most likely ids up to this probability mass (1: all).
        seed : int
            Seeds the request's own random stream.
        stop_tokens : collection of int
            Generating one of these ends the request (it is kept as the last token).
        """
        m = self.model
        prompt = m.check_tokens(prompt, "prompt")
        req = Request(
            self._next_id, prompt, _count(max_new_tokens, "max_new_tokens", 1),
            self._temperature(temperature), _count(top_k, "top_k", 0), self._top_p(top_p),
            _intake.as_int(seed, "seed"),
            m.check_tokens(list(stop_tokens), "stop_tokens") if len(stop_tokens) else (),
            self.keep_logits)
        self._next_id += 1
        self._pending.append(req)
        return req

    @staticmethod
    def _temperature(t):
        t = _real(t, "temperature")
        if t < 0:
            raise ValueError(f"temperature must be >= 0, got {t}")
        return t

    @staticmethod
    def _top_p(p):
        p = _real(p, "top_p")
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p}")
        return p

    def step(self) -> list:
        """Decode one token for every active request and prefill the pending
        ones; returns [(request, token)] in request order of the step (the
        decoded groups, then the admitted requests)."""
        from ._array import Array
        m = self.model
        d = m.d_model
        rows = []  # (request, hidden-row source (Array, index))
        g = self._rows
        if g.requests:
            last = [r.tokens[-1] for r in g.requests]
            x = m._embed_ids(last).reshape((len(last), 1, d))
            g.open(m.blocks)
            x = g.step(x)
            rows += [(r, (x, i)) for i, r in enumerate(g.requests)]
        admitted, self._pending = self._pending, []
        for req in admitted:
            req._states = m.allocate_state(1)
            x = m.forward_tokens([req.prompt], req._states)
            rows.append((req, (x, len(req.prompt) - 1)))
        if not rows:
            return []
        hidden = Array((len(rows), d), zero=False)
        dst = memoryview(hidden).cast("B")
        for i, (_, (x, j)) in enumerate(rows):
            dst[i * d * 4:(i + 1) * d * 4] = memoryview(x).cast("B")[j * d * 4:(j + 1) * d * 4]
        logits = m._head(hidden.address, len(rows))
        reqs = [r for r, _ in rows]
        toks = m.next_tokens(logits, [r.temperature for r in reqs], [r.top_k for r in reqs],
                             [r.top_p for r in reqs], [r._uniform() for r in reqs])
        out = []
        v = m.vocab_size
        lmv = memoryview(logits).cast("B")
        for i, (req, tok) in enumerate(zip(reqs, toks)):
            req.tokens.append(tok)
            if req.logits is not None:
                keep = Array((v,), zero=False)
                memoryview(keep).cast("B")[:] = lmv[i * v * 4:(i + 1) * v * 4]
                req.logits.append(keep)
            if tok in req.stop_tokens:
                req.done, req.finish_reason = True, "stop"
            elif len(req.tokens) >= req.max_new_tokens:
                req.done, req.finish_reason = True, "length"
            out.append((req, tok))
        self._regroup(admitted)
        return out

    def _regroup(self, admitted):
        """Retire finished requests; admitted requests that go on join."""
        blocks = self.model.blocks
        g = self._rows
        keep = [i for i, r in enumerate(g.requests) if not r.done]
        joining = [r for r in admitted if not r.done]
        for r in admitted:
            if r.done:
                r._states = None
        if len(keep) == len(g.requests) and not joining:
            return
        g.close()  # the states are complete again
        parts = [(g.states, i) for i in keep] + [(r._states, 0) for r in joining]
        g.pos = [g.pos[i] for i in keep] + [_position(r._states) for r in joining]
        g.requests = [g.requests[i] for i in keep] + joining
        g.states = _restack(blocks, parts) if parts else None
        for r in joining:
            r._states = None

    def run(self):
        """Step until no request is pending or active, yielding (request,
        token) as tokens come."""
        while self.busy:
            yield from self.step()


def _per_prompt(value, n, name, is_one):
    """value for each of n prompts: one value for all, or a sequence of n."""
    if is_one(value):
        return [value] * n
    vals = list(value)
    if len(vals) != n:
        raise ValueError(f"{name} must be one value or one per prompt ({n}), got {len(vals)}")
    return vals


def generate(model, prompts, *, max_new_tokens=32, temperature=0.0, top_k=0, top_p=1.0,
             seed=0, stop_tokens=(), stream=None, return_logits: bool = False):
    """Generate from a batch of prompts of any lengths.

    Parameters
    ----------
    model : MambaLM
    prompts : sequence of sequences of int
    max_new_tokens, temperature, top_k, top_p, seed
        One value for every prompt, or a sequence with one per prompt
        (Batcher.submit describes each). Sampling with a seed is
        reproducible: a request's random stream depends only on its seed.
    stop_tokens : collection of int, or a sequence of them (one per prompt)
    stream : callable(index, token) or None
        Called with the prompt's index and each token as it comes.
    return_logits : bool
        Also return, per prompt, the logits of each generated token.

    Returns
    -------
    list of list of int (and the list of lists of logits with return_logits)
        Each prompt's tokens are bit-identical to generating it alone.
    """
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or not len(prompts):
        raise ValueError("prompts must be a non-empty sequence of token-id sequences")
    n = len(prompts)
    scalar = lambda v: not hasattr(v, "__len__")  # noqa: E731
    per = {
        "max_new_tokens": _per_prompt(max_new_tokens, n, "max_new_tokens", scalar),
        "temperature": _per_prompt(temperature, n, "temperature", scalar),
        "top_k": _per_prompt(top_k, n, "top_k", scalar),
        "top_p": _per_prompt(top_p, n, "top_p", scalar),
        "seed": _per_prompt(seed, n, "seed", scalar),
        "stop_tokens": _per_prompt(stop_tokens, n, "stop_tokens",
                                   lambda v: all(scalar(t) for t in v)),
    }
    batcher = model.batcher(keep_logits=return_logits)
    reqs = []
    for i, p in enumerate(prompts):
        try:
            reqs.append(batcher.submit(p, **{k: v[i] for k, v in per.items()}))
        except (TypeError, ValueError) as e:
            raise type(e)(f"prompts[{i}]: {e}") from None
    index = {r.id: i for i, r in enumerate(reqs)}
    for req, tok in batcher.run():
        if stream is not None:
            stream(index[req.id], tok)
    tokens = [r.tokens for r in reqs]
    return (tokens, [r.logits for r in reqs]) if return_logits else tokens
