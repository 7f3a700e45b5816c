"""The engine thread: the one thread that drives a Batcher for the server.

Request handlers (on the event loop, or any thread) call ``Engine.submit``,
which only queues a Job; the engine thread admits waiting jobs into the
Batcher while it has fewer than ``max_rows`` requests, steps it, and hands
each step's tokens to the jobs' sinks. Cancels are passed on at the start of
a step. A full queue refuses at once (``QueueFull``), so a handler can answer
503 without waiting.

Thread safety: ``submit``, ``Job.cancel``, ``snapshot`` and ``stop`` may be
called from any thread; everything else runs on the engine thread.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("mojolearn.serve")


class QueueFull(Exception):
    """The engine's waiting queue is full (the server answers 503)."""


@dataclass(eq=False)  # a job is itself: compared and hashed by identity
class Job:
    """One request in the engine: its Batcher Request once admitted, and the
    sink that receives its tokens.

    ``sink(tokens, finish_reason, error)`` is called on the engine thread
    with the tokens of each step (a list) and finish_reason None, and once
    with the finish reason ('stop', 'length', 'cancelled' or 'error', with
    the exception) and that step's last tokens when the job ends; it must be
    quick and must not raise.
    """

    prompt: list
    params: dict
    sink: Callable
    request: object = None  # its Batcher Request once admitted
    cancelled: bool = False
    done: bool = False
    cached_tokens: int = 0
    stop_set: frozenset = frozenset()  # the stop token ids (for the text: not shown)
    submitted: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        self.prompt = list(self.prompt)

    def cancel(self):
        """Ask the engine to end this job (at its next step); any thread."""
        self.cancelled = True


class Engine:
    """Drives ``model.batcher(...)`` on its own thread.

    Parameters
    ----------
    model : MambaLM
    max_rows : int
        Requests decoded at once; more wait in the queue.
    max_queue : int
        Requests waiting at most; ``submit`` raises QueueFull beyond.
    batcher_options : dict
        Passed to ``model.batcher`` (prefill_chunk, prefix_cache_bytes).
    """

    def __init__(self, model, *, max_rows: int = 16, max_queue: int = 64,
                 batcher_options: dict | None = None):
        self.model = model
        self.max_rows = int(max_rows)
        self.max_queue = int(max_queue)
        self._options = dict(batcher_options or {})
        self.batcher = model.batcher(**self._options)
        self._cv = threading.Condition()
        self._waiting = deque()
        self._running = {}  # Request.id -> Job
        self._stopping = False
        self.counters = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0,
                         "cached_requests": 0, "cached_tokens": 0, "steps": 0, "step_seconds": 0.0,
                         "last_step_seconds": 0.0, "errors": 0, "cancelled": 0}
        self._thread = threading.Thread(target=self._loop, name="mojolearn-engine", daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------
    def submit(self, prompt, params: dict, sink) -> Job:
        """Queue a job (params: Batcher.submit's keywords); QueueFull when
        ``max_queue`` jobs already wait, RuntimeError once stopping."""
        job = Job(prompt, params, sink)
        with self._cv:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting")
            self._waiting.append(job)
            self._cv.notify()
        return job

    def wake(self):
        """Make the engine thread look at cancels now."""
        with self._cv:
            self._cv.notify()

    def snapshot(self) -> dict:
        """Counters and gauges for /metrics (a copy)."""
        with self._cv:
            out = dict(self.counters)
            out["queue_length"] = len(self._waiting)
            out["batch_size"] = len(self._running)
        stats = getattr(self.batcher, "stats", None)
        for key in ("prefix_cache_hits", "prefix_cache_misses", "prefix_cache_bytes",
                    "prefix_cache_entries", "prefilling_requests"):
            v = getattr(stats, key, None)  # the Batcher's own counters, as far as it keeps them
            if isinstance(v, (int, float)):
                out[key] = v
        return out

    def stop(self, *, drain: bool = True, timeout: float | None = None):
        """Stop taking jobs; with ``drain`` finish the running and waiting
        ones first, else cancel them. Returns once the thread has ended."""
        with self._cv:
            self._stopping = True
            if not drain:
                for job in list(self._waiting) + list(self._running.values()):
                    job.cancelled = True
            self._cv.notify()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the engine thread ----------------------------------------------------
    def _loop(self):
        while True:
            with self._cv:
                while not (self._waiting or self._running or self._stopping):
                    self._cv.wait()
                if self._stopping and not self._waiting and not self._running:
                    return
                admit = []
                while self._waiting and len(self._running) + len(admit) < self.max_rows:
                    admit.append(self._waiting.popleft())
            for job in admit:
                self._admit(job)
            self._pass_cancels()
            if not self._running:
                continue
            try:
                t = time.perf_counter()
                out = self.batcher.step()
                dt = time.perf_counter() - t
            except Exception as e:  # the Batcher failed as a whole: every job ends
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            self.counters["steps"] += 1
            self.counters["step_seconds"] += dt
            self.counters["last_step_seconds"] = dt
            self._deliver(out)

    def _admit(self, job):
        if job.cancelled:
            self._finish(job, "cancelled")
            return
        try:
            job.request = self.batcher.submit(job.prompt, **job.params)
        except Exception as e:  # checked by the handler already; this is a last guard
            self._finish(job, "error", e)
            return
        with self._cv:
            self._running[job.request.id] = job
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(job.prompt)

    def _pass_cancels(self):
        for job in list(self._running.values()):
            if job.cancelled and not job.request.cancel_requested:
                job.request.cancel()  # the Batcher frees the row at its next step

    def _deliver(self, out):
        """Each running job's tokens of this step, with its finish reason in
        the same call when the step ended it (so a sink knows whether the
        last token is the stop token)."""
        tokens = {}
        for req, tok in out:
            tokens.setdefault(req.id, []).append(tok)
        for rid, job in list(self._running.items()):
            req = job.request
            got = tokens.get(rid, [])
            if req.done:
                with self._cv:
                    del self._running[rid]
            if got and not job.cached_tokens and getattr(req, "cached_tokens", 0):
                job.cached_tokens = req.cached_tokens
                self.counters["cached_requests"] += 1
                self.counters["cached_tokens"] += req.cached_tokens
            self.counters["generated_tokens"] += len(got)
            if req.done:
                reason = req.finish_reason or "stop"
                self._finish(job, reason, getattr(req, "error", None), got)
            elif got:
                self._send(job, got, None)

    def _finish(self, job, reason, error=None, tokens=()):
        job.done = True
        if reason == "cancelled":
            self.counters["cancelled"] += 1
        elif reason == "error":
            self.counters["errors"] += 1
        self._send(job, list(tokens), reason, error)

    @staticmethod
    def _send(job, tokens, reason, error=None):
        try:
            job.sink(tokens, reason, error)
        except Exception:  # a sink must not stop the engine
            log.exception("a job's sink failed")

    def _fail_all(self, error):
        with self._cv:
            jobs = list(self._running.values())
            self._running.clear()
        for job in jobs:
            if not job.done:
                self._finish(job, "error", error)
        self.batcher = self.model.batcher(**self._options)
