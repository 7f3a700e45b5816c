"""How many prompt tokens a Batcher step prefills when ``prefill_chunk='auto'``.

A step of a continuous-batching engine decodes one token for every running
request and then prefills some prompt tokens of the joining ones; the running
streams wait for both. With a fixed chunk, a chunk that is cheap on one model
and machine stalls the streams on another (on two cores a 256-token chunk of
a 130M model takes tens of decode steps). ``PrefillPacer`` sizes the chunk so
that a step's prefill takes about ``ratio`` times its decode, measured as the
engine runs: after each step that did both, the chunk is scaled by
target / measured time (averaged with the previous size, so one noisy step
does not swing it), within [low, high]. Its fixed point is the chunk whose
prefill costs the target, whatever the split between the per-call and the
per-token cost. With no stream running nothing waits, and the chunk is
``high``.

Chunk sizes never change results: a prompt prefilled in any pieces gives the
same bits (docs/numerics.md), so pacing by time is safe in identical mode.
"""
from __future__ import annotations

__all__ = ["PrefillPacer"]


class PrefillPacer:
    """Prompt tokens per step for ``Batcher(prefill_chunk='auto')``.

    Parameters
    ----------
    low, high : int
        Bounds of the chunk (high is also the chunk while no request decodes).
    ratio : float
        Target prefill time per step, as a multiple of the step's decode
        time (1.5: a stream's inter-token time grows at most about 2.5x
        while a long prompt joins).

    Not thread-safe: the engine thread's.
    """

    def __init__(self, low: int = 8, high: int = 256, ratio: float = 1.5):
        if not 1 <= low <= high:
            raise ValueError(f"PrefillPacer needs 1 <= low <= high, got {low}, {high}")
        self.low, self.high, self.ratio = low, high, float(ratio)
        self._size = float(low)  # kept fractional: small chunks must still grow

    @property
    def chunk(self) -> int:
        """Prompt tokens per step while requests decode."""
        return int(self._size)

    def budget(self, decoding: bool) -> int:
        """Prompt tokens the coming step may prefill."""
        return self.chunk if decoding else self.high

    def observe(self, tokens: int, prefill_seconds: float, decode_seconds: float) -> None:
        """A step prefilled `tokens` in prefill_seconds after decoding its
        running rows in decode_seconds (0 when none ran: nothing to learn)."""
        if tokens <= 0 or decode_seconds <= 0 or prefill_seconds <= 0:
            return
        # a full chunk scales the (fractional) size itself, so that small
        # chunks still grow; a prompt that ended early scales what it ran
        base = self._size if tokens >= self.chunk else tokens
        scaled = base * self.ratio * decode_seconds / prefill_seconds
        want = (self._size + scaled) / 2
        self._size = max(float(self.low), min(float(self.high), want))
