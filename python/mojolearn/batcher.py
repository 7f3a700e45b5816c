"""The continuous-batching engine: ``Batcher`` (public as
mojolearn.generate.Batcher).

Each step decodes one token for every active request in one batched pass
over the layers (MambaLM.open_rows), prefills joining prompts in bounded
chunks on their own states (or from the prefix cache), picks each
request's next token from its own logits and random stream, and restacks
the rows when requests join or leave. It uses only the model's engine
interface (MambaLM.embed_ids, forward_tokens, open_rows, restack_states,
row_position, head_logits, next_tokens).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque

from . import request as _req
from .prefill_pacer import PrefillPacer
from .prefix_cache import PrefixCache, copy_states
from .request import BatcherStats, Request

__all__ = ["Batcher"]


class _Rows:
    """The decoding requests and their layer states (row i of each state is
    request i), run through a RowDecoder while the membership stays the
    same; a change of membership closes it first. ``pos``: each row's chunk
    position while no decoder is open."""

    def __init__(self):
        self.requests = []
        self.states = None
        self.pos = []
        self.decoder = None

    def close(self):
        if self.decoder is not None:
            decoder, self.decoder = self.decoder, None
            self.pos = decoder.close()


class Batcher:
    """Continuous batching over a MambaLM.

    ``submit`` adds a request at any time. Each ``step`` decodes one token
    for every active request (one batched pass), prefills up to
    ``prefill_chunk`` prompt tokens of the joining requests (first come,
    first served; a long prompt is split over several steps), gives every
    request whose prompt is complete its first token, and retires the
    finished and cancelled requests. Each request's tokens and logits are
    bit-identical to generating it alone.

    Parameters
    ----------
    model : MambaLM
    keep_logits : bool, default False
        Keep the logits each token was chosen from (``Request.logits``).
    prefill_chunk : int >= 1, 'auto' or None, default 256
        Prompt tokens prefilled per step at most (all joining requests
        together), so that a long prompt does not stall the running ones;
        None prefills every joining prompt whole in its first step. 'auto'
        sizes it as the engine runs (mojolearn.prefill_pacer): 8 to 256
        tokens, so that a step's prefill takes about 1.5 times its decode
        while requests decode, and 256 while none does. Any chunking gives
        the same bits.
    prefix_cache_bytes : int >= 0, default 0
        Bytes of model states kept in a prefix cache (0: no cache). The
        state after each prompt, at each chunk end and after each finished
        request's prompt and reply is kept (least recently used first out);
        a prompt that extends a cached prefix starts from a copy of its
        state and prefills only the rest (``Request.cached_tokens``).
    max_rows : int >= 1 or None, default None
        Requests decoding at once at most (one row each); further ones wait,
        first come first served, before their prefill starts. None: no
        limit.
    session_cache : True, False or 'auto', default 'auto'
        Whether the decoding rows' sessions keep their speed cache
        (``MambaLM.session_cache_bytes(rows)``; Mamba-2: about as large as
        the rows' states, Mamba-1: about 1.3 times; Mamba-3 keeps none). It makes a
        batched step faster and costs memory per row; the tokens and
        logits are the same bits either way. 'auto' decides each time the
        set of decoding rows changes: on while the cache of those rows
        takes at most ``session_cache_budget`` bytes.
    session_cache_budget : int >= 0 or None, default None
        The bytes 'auto' allows the cache. None: half of the memory the
        system reports available (MemAvailable) when the rows open, or no
        limit where that cannot be read.

    Attributes
    ----------
    model : MambaLM
    keep_logits : bool
    prefill_chunk : int, 'auto' or None
    max_rows : int or None
    session_cache : bool or 'auto'
    session_cache_budget : int or None
    prefix_cache : mojolearn.prefix_cache.PrefixCache or None
    dropped : list of Request
        The requests that ended in the last step without a token
        (cancelled, or retired by an error).

    Notes
    -----
    Thread safety: ``submit``, ``Request.cancel`` and ``stats`` may be
    called from any thread; ``step`` and ``run`` from one thread (the
    engine thread) at a time.

    Failure: every request parameter is checked by ``submit``. A fault that
    still happens in one request's own work during a step (its sampling, its
    stop check, its prefill) retires that request (finish_reason 'error',
    the exception in ``Request.error``) and leaves every other request as
    if it had never joined. A fault in the batched layer step itself (out
    of memory, say) retires every decoding request that way. ``step`` does
    not raise for either; ``dropped`` lists the requests that ended in the
    last step without a token.

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

    def __init__(self, model, *, keep_logits: bool = False, prefill_chunk=256,
                 prefix_cache_bytes=0, max_rows=None, session_cache="auto",
                 session_cache_budget=None):
        self.model = model
        self.keep_logits = bool(keep_logits)
        self._pacer = None
        if prefill_chunk is None:
            self.prefill_chunk = None
        elif isinstance(prefill_chunk, str):
            if prefill_chunk != "auto":
                raise ValueError(f"prefill_chunk must be an int >= 1, 'auto' or None, "
                                 f"got {prefill_chunk!r}")
            self.prefill_chunk, self._pacer = "auto", PrefillPacer()
        else:
            self.prefill_chunk = _req.count(prefill_chunk, "prefill_chunk", 1)
        self.max_rows = None if max_rows is None else _req.count(max_rows, "max_rows", 1)
        cache_bytes = _req.count(prefix_cache_bytes, "prefix_cache_bytes", 0)
        if not (isinstance(session_cache, bool) or session_cache == "auto"):
            raise ValueError(f"session_cache must be True, False or 'auto', got {session_cache!r}")
        self.session_cache = session_cache
        self.session_cache_budget = None if session_cache_budget is None else \
            _req.count(session_cache_budget, "session_cache_budget", 0)
        self.prefix_cache = PrefixCache(cache_bytes) if cache_bytes else None
        self._lock = threading.Lock()
        self._pending = []  # submitted, not yet taken by a step (under _lock)
        self._queue = deque()  # taken, waiting for or in their prefill
        self._rows = _Rows()
        self._next_id = 0
        self._cancels = False  # a cancel() since the last step (under _lock)
        self._stats = BatcherStats()  # the engine thread's
        self._published = BatcherStats()  # a copy made at the end of each step (under _lock)
        self._submitted = 0  # (under _lock)
        self._last_x = None
        self.dropped = []

    @property
    def busy(self) -> bool:
        """Whether a request is pending, prefilling or active."""
        return bool(self._pending or self._queue or self._rows.requests)

    @property
    def active(self) -> list:
        """The requests being decoded (not pending, not done)."""
        return list(self._rows.requests)

    @property
    def stats(self) -> BatcherStats:
        """The running counters as of the last step (a new BatcherStats;
        requests_submitted and pending_requests as of now). Thread-safe."""
        with self._lock:
            snap = dataclasses.replace(self._published)
            snap.requests_submitted = self._submitted
            snap.pending_requests = len(self._pending)
        return snap

    def submit(self, prompt, *, max_new_tokens=32, temperature=0.0, top_k=0, top_p=1.0,
               seed=0, stop_tokens=None, state=None) -> Request:
        """Add a request; its prefill starts at a coming step. Thread-safe.

        Every argument is checked here (TypeError or ValueError naming it);
        a refused call changes nothing.

        Parameters
        ----------
        prompt : sequence of int
            Token ids (at least one, each in [0, vocab_size)).
        max_new_tokens : int >= 1
        temperature : float >= 0
            0: greedy (the first id of the largest logit).
        top_k : int in [0, 2**63)
            Keep the k most likely ids (0: all).
        top_p : float in (0, 1]
            Keep the most likely ids up to this probability mass (1: all).
        seed : int
            Seeds the request's own random stream.
        stop_tokens : collection of int, or None
            Generating one of these ends the request (it is kept as the last
            token). None: the model's ``eos_token_ids``; (): none.
        state : list of layer states of batch 1, or None
            Start from this model state (as ``lm.allocate_state(1)`` makes and
            ``lm.forward_tokens`` advances) instead of a zero state: the
            prompt continues it. It is copied; the caller's is not changed.

        Returns
        -------
        Request
        """
        m = self.model
        prompt = m.check_tokens(prompt, "prompt")
        args = (_req.count(max_new_tokens, "max_new_tokens", 1),
                _req.temperature(temperature), _req.count(top_k, "top_k", 0),
                _req.top_p(top_p), _req.seed(seed), _req.stop_set(m, stop_tokens))
        initial = _req.start_state(m, state)
        with self._lock:
            req = Request(self._next_id, prompt, *args, self.keep_logits, initial, self._lock,
                          self._note_cancel)
            self._next_id += 1
            self._pending.append(req)
            self._submitted += 1
        return req

    # -- one step -----------------------------------------------------------
    def step(self) -> list:
        """Decode one token for every active request, prefill the joining
        ones up to prefill_chunk tokens, retire the finished ones. Returns
        [(request, token)] in request order of the step (the decoding
        requests, then those whose prompt completed)."""
        t0 = time.perf_counter()
        with self._lock:
            taken, self._pending = self._pending, []
        self._queue.extend(taken)
        self.dropped = []
        self._last_x = None  # this step's decode outputs (row i: request i)
        if self._cancels:
            self._retire_cancelled()
        t1 = time.perf_counter()
        rows = self._decode()
        t2 = time.perf_counter()
        prompt_tokens = self._stats.prompt_tokens
        first = self._prefill()
        if self._pacer is not None and rows:
            self._pacer.observe(self._stats.prompt_tokens - prompt_tokens,
                                time.perf_counter() - t2, t2 - t1)
        out = self._choose(rows + first)
        self._regroup([r for r, _, _ in first])
        st = self._stats
        st.steps += 1
        st.tokens_generated += len(out)
        st.active_rows = len(self._rows.requests)
        if not self._rows.requests:
            st.session_cache_bytes = 0
        st.prefilling_requests = len(self._queue)
        if self.prefix_cache is not None:
            c = self.prefix_cache
            st.prefix_cache_hits, st.prefix_cache_misses = c.hits, c.misses
            st.prefix_cache_bytes, st.prefix_cache_entries = c.nbytes, len(c)
        st.last_step_seconds = time.perf_counter() - t0
        with self._lock:
            self._published = dataclasses.replace(st)
        return out

    def run(self):
        """Step until no request is pending or active, yielding (request,
        token) as tokens come."""
        while self.busy:
            yield from self.step()

    def _retire(self, req, reason, error=None):
        req._finish(reason, error)
        st = self._stats
        st.requests_finished += 1
        st.requests_cancelled += reason == "cancelled"
        st.requests_failed += reason == "error"

    def _drop(self, req, reason, error=None):
        """Retire a request that gets no token this step."""
        self._retire(req, reason, error)
        self.dropped.append(req)

    def _note_cancel(self, req):
        """Request.cancel's call (under the lock): seen at the next step."""
        self._cancels = True

    def _retire_cancelled(self):
        with self._lock:
            self._cancels = False
        for req in [r for r in self._queue if r._cancel]:
            self._queue.remove(req)
            self._drop(req, "cancelled")
        g = self._rows
        if any(r._cancel for r in g.requests):
            for r in g.requests:
                if r._cancel:
                    self._drop(r, "cancelled")
            self._regroup([])

    def _decode(self) -> list:
        """One token of every decoding request through the layers:
        [(request, outputs, row)]."""
        m, g = self.model, self._rows
        if not g.requests:
            return []
        try:
            x = m.embed_ids([r.tokens[-1] for r in g.requests])
            x = x.reshape((len(g.requests), 1, m.d_model))
            if g.decoder is None:
                g.decoder = m.open_rows(g.states, g.pos, cache=self._use_cache(len(g.requests)))
                self._stats.session_cache_bytes = g.decoder.cache_bytes
            x = self._last_x = g.decoder.step(x)
        except Exception as e:  # the batched step itself: no row is sound
            for r in g.requests:
                self._drop(r, "error", e)
            g.decoder = None
            g.requests, g.states, g.pos = [], None, []
            return []
        return [(r, x, i) for i, r in enumerate(g.requests)]

    def _use_cache(self, rows: int) -> bool:
        """Whether `rows` decoding rows keep the sessions' speed cache (the
        session_cache rule)."""
        if self.session_cache != "auto":
            return self.session_cache
        need = self.model.session_cache_bytes(rows)
        if need == 0:
            return True  # (nothing to allocate)
        budget = self.session_cache_budget
        if budget is None:
            avail = _available_memory()
            if avail is None:
                return True
            budget = avail // 2
        return need <= budget

    def _prefill(self) -> list:
        """Prefill joining requests, first come first served, up to
        prefill_chunk tokens in all: [(request, outputs, row)] of those
        whose prompt is complete."""
        m = self.model
        budget = self.prefill_chunk
        if self._pacer is not None:
            budget = self._pacer.budget(bool(self._rows.requests))
        cache = self.prefix_cache
        complete = []
        st = self._stats
        while self._queue and (budget is None or budget > 0):
            req = self._queue[0]
            if req._states is None and self.max_rows is not None and \
                    len(self._rows.requests) + len(complete) >= self.max_rows:
                break  # no row for it yet
            try:
                if req._states is None:
                    self._start(req)
                done, total = req.prompt_tokens_done, len(req.prompt)
                n = total - done if budget is None else min(budget, total - done)
                if n:
                    x = m.forward_tokens([req.prompt[done:done + n]], req._states)
                    req.prompt_tokens_done = done = done + n
                    req._hidden = (x, n - 1)
                    st.prompt_tokens += n
                    if budget is not None:
                        budget -= n
                    if cache is not None and req._cacheable:
                        self._keep(req, x, n)
            except Exception as e:
                self._queue.popleft()
                self._drop(req, "error", e)
                continue
            if done < total:
                break  # the budget is spent
            self._queue.popleft()
            arr, row = req._hidden
            req._hidden = None
            complete.append((req, arr, row))
        return complete

    def _keep(self, req, x, n):
        """Cache the request's state after its prompt so far (row n-1 of x:
        the last token's output). The cache is an optimisation: a state it
        cannot take (out of memory) is not kept, and the request goes on."""
        d4 = 4 * self.model.d_model
        try:
            self.prefix_cache.store(req.prompt[:req.prompt_tokens_done], req._states,
                                    memoryview(x).cast("B")[(n - 1) * d4:n * d4])
        except MemoryError:
            pass

    def _keep_finished(self):
        """Cache the state of each request that ended normally this step:
        after its prompt and every token but the last (which no step has
        run yet), with the output row that chose the last token. The next
        turn of a conversation (prompt, reply, new text) extends it."""
        m, g = self.model, self._rows
        d4 = 4 * m.d_model
        for i, r in enumerate(g.requests):
            if r.finish_reason not in ("stop", "length") or not r._cacheable:
                continue
            try:
                one = m.restack_states([(g.states, i)])
                for st in one:  # the row's own position (kept outside the state)
                    if hasattr(st, "buffered_tokens"):
                        st.buffered_tokens = g.pos[i]
                self.prefix_cache.store(r.prompt + tuple(r.tokens[:-1]), one,
                                        memoryview(self._last_x).cast("B")[i * d4:(i + 1) * d4],
                                        copy=False)
            except MemoryError:
                pass

    def _start(self, req):
        """The request's own state: its given one, a cached prefix's copy,
        or a zero state."""
        m = self.model
        req._cacheable = req._initial is None and self.prefix_cache is not None
        if req._initial is not None:
            req._states, req._initial = req._initial, None
            return
        entry = self.prefix_cache.lookup(req.prompt) if req._cacheable else None
        if entry is None:
            req._states = m.allocate_state(1)
            return
        req._states = copy_states(entry.states)
        req.prompt_tokens_done = req.cached_tokens = len(entry.tokens)
        req._hidden = (entry.hidden, 0)
        self._stats.cached_tokens += len(entry.tokens)

    # -- tokens ---------------------------------------------------------------
    def _choose(self, rows) -> list:
        """Each row's next token from its hidden row; a row whose own work
        fails is retired and the others go on as if it had not been there."""
        if not rows:
            return []
        m = self.model
        try:
            logits = m.head_logits(_gather(m, rows))
        except Exception:  # find the row at fault: the head works row by row
            return self._choose_each(rows)
        us = []
        for req, _, _ in rows:
            try:
                us.append(req._uniform())
            except Exception as e:
                self._drop(req, "error", e)
                us.append(0.0)
        reqs = [r for r, _, _ in rows]  # a retired row: greedy, its token unused
        try:
            toks = m.next_tokens(logits, [0.0 if r.done else r.temperature for r in reqs],
                                 [0 if r.done else r.top_k for r in reqs],
                                 [1.0 if r.done else r.top_p for r in reqs], us)
        except Exception:
            toks = [None if req.done else self._next_one(logits, i, req, us[i])
                    for i, (req, _, _) in enumerate(rows)]
        out = []
        for i, (req, _, _) in enumerate(rows):
            if toks[i] is not None and not req.done:
                self._accept(req, toks[i], logits, i, out)
        return out

    def _choose_each(self, rows) -> list:
        out = []
        for row in rows:
            req = row[0]
            try:
                logits = self.model.head_logits(_gather(self.model, [row]))
                u = req._uniform()
            except Exception as e:
                self._drop(req, "error", e)
                continue
            tok = self._next_one(logits, 0, req, u)
            if tok is not None:
                self._accept(req, tok, logits, 0, out)
        return out

    def _next_one(self, logits, i, req, u):
        """Row i's token alone (the rule is row by row: the same bits), or
        None with the request retired."""
        m = self.model
        try:
            one = _row(logits, i, m.vocab_size).reshape((1, m.vocab_size))
            return m.next_tokens(one, [req.temperature], [req.top_k], [req.top_p], [u])[0]
        except Exception as e:
            self._drop(req, "error", e)
            return None

    def _accept(self, req, tok, logits, i, out):
        """Append the token (and its logits), then the stop checks; a fault
        takes the token back and retires the request."""
        n = len(req.tokens)
        try:
            req.tokens.append(tok)
            if req.logits is not None:
                req.logits.append(_row(logits, i, self.model.vocab_size))
            if tok in req.stop_tokens:
                reason = "stop"
            elif len(req.tokens) >= req.max_new_tokens:
                reason = "length"
            else:
                reason = None
        except Exception as e:
            del req.tokens[n:]
            if req.logits is not None:
                del req.logits[n:]
            self._drop(req, "error", e)
            return
        if reason is not None:
            self._retire(req, reason)
        out.append((req, tok))

    # -- membership -------------------------------------------------------------
    def _regroup(self, completed):
        """Retire the finished requests' rows; the completed prefills that go
        on join."""
        m, g = self.model, self._rows
        keep = [i for i, r in enumerate(g.requests) if not r.done]
        joining = [r for r in completed if not r.done]
        if len(keep) == len(g.requests) and not joining:
            return
        try:
            g.close()  # the states are complete again
            if self.prefix_cache is not None and self._last_x is not None:
                self._keep_finished()
            parts = [(g.states, i) for i in keep] + [(r._states, 0) for r in joining]
            pos = [g.pos[i] for i in keep] + [m.row_position(r._states) for r in joining]
            states = m.restack_states(parts, consume=True) if parts else None
        except Exception as e:  # no row set is sound any more
            for r in [g.requests[i] for i in keep] + joining:
                self._drop(r, "error", e)
            g.decoder, g.requests, g.states, g.pos = None, [], None, []
            return
        g.requests = [g.requests[i] for i in keep] + joining
        g.states, g.pos = states, pos
        for r in joining:
            r._states = None


def _available_memory():
    """Bytes the system reports available for new allocations
    (/proc/meminfo's MemAvailable; else free physical pages), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import os
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _row(a, i, n):
    """Row i of n float32 values of a as a new (n,) Array."""
    from ._array import Array
    out = Array((n,), zero=False)
    memoryview(out).cast("B")[:] = memoryview(a).cast("B")[i * n * 4:(i + 1) * n * 4]
    return out


def _gather(m, rows):
    """The hidden rows as one (R, d) Array: the decode outputs themselves
    when they are all the rows, in order (no copy)."""
    x0 = rows[0][1]
    if rows[-1][1] is x0 and rows[-1][2] == len(rows) - 1 and \
            memoryview(x0).nbytes == len(rows) * m.d_model * 4:
        return x0  # (rows of one array are numbered 0.. in order)
    from ._array import Array
    d4 = m.d_model * 4
    hidden = Array((len(rows), m.d_model), zero=False)
    dst = memoryview(hidden).cast("B")
    for i, (_, x, j) in enumerate(rows):
        dst[i * d4:(i + 1) * d4] = memoryview(x).cast("B")[j * d4:(j + 1) * d4]
    return hidden
