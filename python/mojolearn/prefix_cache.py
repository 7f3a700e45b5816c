"""A prefix-state cache: model states keyed by the token prefixes that led
to them, least recently used first out, bounded in bytes.

A recurrent model's state after a prefix is a fixed-size snapshot, so a
prompt that extends a cached prefix can start from a copy of that state and
run only the rest: by the numerics contract (a sequence split between calls
gives the same bits) its outputs are the bits of a cold run. An entry also
keeps the last-layer output row of the prefix's last token, so a prompt
equal to a cached prefix needs no prefill at all (its first token's logits
come from that row).

mojolearn.generate.Batcher fills and reads one (``prefix_cache_bytes``).
"""
from __future__ import annotations

from collections import OrderedDict


class PrefixEntry:
    """One cached prefix: its tokens, the model state after them (batch 1,
    one state per layer; never changed once stored) and the last-layer
    output row of the last token (float32, d_model)."""

    __slots__ = ("tokens", "states", "hidden", "nbytes")

    def __init__(self, tokens: tuple, states: list, hidden):
        self.tokens = tokens
        self.states = states
        self.hidden = hidden
        self.nbytes = state_nbytes(states) + memoryview(hidden).nbytes


def state_nbytes(states) -> int:
    """Bytes of a model state's arrays (all layers)."""
    return sum(memoryview(getattr(st, n)).nbytes for st in states for n in type(st)._ARRAYS)


def copy_states(states) -> list:
    """An independent copy of a model state (each layer's state.copy())."""
    return [st.copy() for st in states]


class PrefixCache:
    """An LRU of PrefixEntry keyed by token tuples, at most ``capacity``
    bytes of arrays in all.

    Not thread-safe: one engine thread uses it.

    Parameters
    ----------
    capacity : int >= 0
        Bytes of states (and rows) kept at most; 0 keeps nothing.

    Examples
    --------
    >>> from mojolearn.prefix_cache import PrefixCache
    >>> cache = PrefixCache(1 << 20)
    >>> cache.lookup([1, 2, 3]) is None
    True
    """

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self._entries = OrderedDict()  # tokens -> PrefixEntry, least recent first
        self._lengths = {}  # prefix length -> count of entries of that length
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens) -> bool:
        return tuple(tokens) in self._entries

    def lookup(self, tokens, *, max_length=None):
        """The entry of the longest cached prefix of `tokens` (at most
        max_length tokens), marked most recently used; None if none. Counts
        a hit or a miss."""
        n = len(tokens) if max_length is None else min(max_length, len(tokens))
        for length in sorted(self._lengths, reverse=True):
            if length > n:
                continue
            key = tuple(tokens[:length])
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry
        self.misses += 1
        return None

    def store(self, tokens, states, hidden, *, copy: bool = True) -> bool:
        """Keep the state after `tokens` (copied unless copy=False: then the
        cache owns `states`) and the output row `hidden`; least recently
        used entries go until it fits. Returns whether it is kept (an entry
        larger than the capacity is not; a prefix already cached is only
        marked most recently used)."""
        key = tuple(tokens)
        old = self._entries.get(key)
        if old is not None:
            self._entries.move_to_end(key)
            return True
        size = state_nbytes(states) + memoryview(hidden).nbytes
        if not key or size > self.capacity:
            return False
        while self.nbytes + size > self.capacity:
            self._drop(next(iter(self._entries)))
        entry = PrefixEntry(key, copy_states(states) if copy else states, _row_copy(hidden))
        self._entries[key] = entry
        self._lengths[len(key)] = self._lengths.get(len(key), 0) + 1
        self.nbytes += entry.nbytes
        return True

    def _drop(self, key):
        entry = self._entries.pop(key)
        self.nbytes -= entry.nbytes
        left = self._lengths[len(key)] - 1
        if left:
            self._lengths[len(key)] = left
        else:
            del self._lengths[len(key)]

    def clear(self):
        """Drop every entry (the hit and miss counts stay)."""
        for key in list(self._entries):
            self._drop(key)


def _row_copy(hidden):
    """A new float32 mojolearn.Array with the bytes of a (d,) row."""
    from ._array import Array
    mv = memoryview(hidden).cast("B")
    out = Array((mv.nbytes // 4,), zero=False)
    memoryview(out).cast("B")[:] = mv
    return out
