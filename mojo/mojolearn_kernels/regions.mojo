"""Regions of a workspace or a blob laid out one after another.

A layout struct (a block's blob, a call's workspace) names each region by
its offset in floats. Regions carves them in order: take(n) returns where
the next region starts and reserves n floats rounded up to ALIGN_FLOATS (so
every region starts on a vector boundary); take_exact(n) reserves exactly
n, for sizes that are already whole panels (linear.packed_floats) or that
pack small arrays together. Integer bookkeeping only: no kernel reads it.
"""
from .abi import ALIGN_FLOATS, round_up


struct Regions(ImplicitlyCopyable):
    """Offsets of consecutive regions, in floats; `end` is the size so far."""
    var end: Int

    def __init__(out self, start: Int = 0):
        self.end = start

    def take(mut self, floats: Int) -> Int:
        """Start of a region of `floats` floats; the next one starts at the
        following ALIGN_FLOATS boundary."""
        var at = self.end
        self.end += round_up(floats, ALIGN_FLOATS)
        return at

    def take_exact(mut self, floats: Int) -> Int:
        """Start of a region of exactly `floats` floats."""
        var at = self.end
        self.end += floats
        return at
