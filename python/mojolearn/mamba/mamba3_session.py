"""Mamba3DecodeSession: token-by-token decoding with the per-call checks of
``Mamba3Block.step`` done once, when the session opens."""
from __future__ import annotations

from .. import _abi, _intake

_SLOT_X, _SLOT_Y, _SLOT_WORK, _SLOT_N0, _SLOT_PENDING = 3, 4, 7, 8, 9


def _copy_into(dst, src) -> None:
    memoryview(dst).cast("B")[:] = memoryview(src).cast("B")


class Mamba3DecodeSession:
    """Token-by-token decoding on one Mamba3Block and one Mamba3State.

    Made by ``Mamba3Block.decode_session(state)``. Every output is byte for
    byte what ``Mamba3Block.step`` gives. The session holds its own copies of
    the state and a preallocated workspace, so a step validates only x (the
    state is validated once, when the session opens or reloads). Until
    close() or sync_state() the state's arrays, buffered_tokens and pending
    are stale, and the block refuses that state; weight edits (set_params)
    after opening are not seen; edits to the state arrays are not seen until
    load_state(). The block's reports (``h_last_``, ...) and
    ``session_info()`` are not updated by session steps. Not thread-safe.
    Use it as a context manager.

    Examples
    --------
    >>> state = block.allocate_state(2)
    >>> tokens = np.random.default_rng(1).random((8, 2, block.d_model), dtype=np.float32)
    >>> with block.decode_session(state) as session:
    ...     for x_t in tokens:
    ...         y_t = session.step(x_t)
    """

    def __init__(self, block, state):
        from .._array import Array
        from .mamba3 import _STATE_BUFFERS
        self._names = _STATE_BUFFERS
        self._block = block
        self._lib = block._lib
        self._blob = block._blob  # pinned: a later set_params is not seen
        self._state = state
        views, nb = self._validated()
        self._b = views["h"].shape[0]
        self._d = block.d_model
        self._arrays = {n: Array(v.shape, zero=False) for n, v in views.items()}
        self._copy_in(views, nb)
        self._args = block._args(self._b, 1, 0, 0, self._arrays, nb, self._pending, 0, 0)
        self._work = Array((max(1, self._lib.workspace_bytes(
            _abi.OP_M3_FORWARD, self._args) // 4),), zero=False)
        self._args[_SLOT_WORK] = self._work.address
        state._held_by = self
        self._open = True

    def _validated(self):
        """The state's views after the block's full checks (as step does)."""
        st = self._state
        from .mamba3 import Mamba3State
        if not isinstance(st, Mamba3State):
            raise TypeError(f"state must be a Mamba3State, got {type(st).__name__}")
        holder, st._held_by = st._held_by, None
        try:
            b = _intake.float32_view(st.h, "state.h").shape[0]
            return self._block._state_views(st, b)
        finally:
            st._held_by = holder

    def _copy_in(self, views, nb):
        for n, a in self._arrays.items():
            _copy_into(a, views[n].mv)
        self._nb = nb
        self._pending = self._state.pending

    @property
    def state(self):
        """The Mamba3State this session decodes from."""
        return self._state

    @property
    def is_open(self) -> bool:
        return self._open

    def _check_open(self):
        if not self._open:
            raise ValueError("the Mamba3DecodeSession is closed")

    def step(self, x):
        """Decode one token per row.

        Parameters
        ----------
        x : float32 buffer, shape (B, 1, d_model) or (B, d_model)

        Returns
        -------
        y : mojolearn.Array, shape (B, 1, d_model)
        """
        from .._array import Array
        from .mamba3 import _count_after
        self._check_open()
        y = Array((self._b, 1, self._d), zero=False)
        args = self._args
        args[_SLOT_Y] = y.address
        args[_SLOT_N0] = self._nb
        args[_SLOT_PENDING] = 1 if self._pending else 0
        # A plain C-contiguous float32 x is checked and run in one native
        # call; anything else goes through the full intake (and its errors).
        if not self._lib.run_step(_abi.OP_M3_FORWARD, args, x, self._b, self._d, _SLOT_X):
            xv, b = self._block._step_x_view(x)
            if b != self._b:
                raise ValueError(f"x has B={b}, the session decodes {self._b} rows")
            _intake.check_finite(self._lib, xv)
            args[_SLOT_X] = xv.address
            self._lib.run(_abi.OP_M3_FORWARD, args)
        self._nb = _count_after(self._nb, 1)
        self._pending = False
        return y

    def sync_state(self):
        """Copy the session's state into the Mamba3State; return it."""
        self._check_open()
        st = self._state
        for n, a in self._arrays.items():
            _copy_into(getattr(st, n), a)
        st.buffered_tokens = self._nb
        st.pending = self._pending
        st._calls += 1  # reports of earlier calls on this state are gone
        return st

    def load_state(self):
        """Reload the session from the Mamba3State (after you edit it); return it."""
        self._check_open()
        views, nb = self._validated()
        if views["h"].shape[0] != self._b:
            raise ValueError(f"the state now has B={views['h'].shape[0]}, the session "
                             f"decodes {self._b} rows")
        self._copy_in(views, nb)
        return self._state

    def close(self):
        """Copy the state back, release the buffers and close. Idempotent."""
        if not self._open:
            return
        self.sync_state()
        self._state._held_by = None
        self._open = False
        self._arrays = self._work = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
