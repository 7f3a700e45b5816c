"""Watch a block's calls into its binary (tests only)."""
import contextlib


class _Watched:
    """A block's binary that calls on_run(op, args) before each run."""

    def __init__(self, lib, on_run):
        self._lib, self._on_run = lib, on_run

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def run(self, op, args):
        self._on_run(op, args)
        return self._lib.run(op, args)


@contextlib.contextmanager
def watching_runs(block, on_run):
    """For the with body, block's binary calls on_run(op, args) before
    each run (the block's own binary again afterwards)."""
    lib = block._lib
    block._lib = _Watched(lib, on_run)
    try:
        yield
    finally:
        block._lib = lib
