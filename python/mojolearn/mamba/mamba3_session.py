"""Mamba3DecodeSession: token-by-token decoding with the per-call checks of
``Mamba3Block.step`` done once, when the session opens."""
from __future__ import annotations

from .. import _abi, _intake
from ._base import copy_bytes
from ._session_base import DecodeSessionBase

_SLOT_WORK, _SLOT_N0, _SLOT_PENDING = 7, 8, 9


class Mamba3DecodeSession(DecodeSessionBase):
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

    _OP = _abi.OP_M3_FORWARD

    def __init__(self, block, state):
        from .._array import Array
        self._bind(block, state, 0)
        views, nb = self._validated()
        self._b = views["h"].shape[0]
        self._arrays = {n: Array(v.shape, zero=False) for n, v in views.items()}
        self._copy_in(views, nb)
        self._args = block._args(self._b, 1, 0, 0, self._arrays, nb, self._pending, 0, 0)
        self._own_workspace(self._args, _SLOT_WORK)
        self._activate()

    def _validated(self):
        """The state's views after the block's full checks (as step does)."""
        st = self._state
        from .mamba3 import Mamba3State
        if not isinstance(st, Mamba3State):
            raise TypeError(f"state must be a Mamba3State, got {type(st).__name__}")
        return self._unheld_views(lambda: self._block._state_views(
            st, _intake.float32_view(st.h, "state.h").shape[0]))

    def _copy_in(self, views, nb):
        for n, a in self._arrays.items():
            copy_bytes(a, views[n].mv)
        self._nb = nb
        self._pending = self._state.pending

    def _before_step(self, args):
        args[_SLOT_N0] = self._nb
        args[_SLOT_PENDING] = 1 if self._pending else 0

    def _after_step(self):
        from .mamba3 import _count_after
        self._nb = _count_after(self._nb, 1)
        self._pending = False

    def sync_state(self):
        """Copy the session's state into the Mamba3State; return it."""
        self._check_open()
        st = self._state
        self._write_back(st, list(self._arrays.items()))
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

    def _release(self):
        self._arrays = self._work = None
