"""What the three decode sessions share: open/closed bookkeeping, the
one-native-call step with its full-intake fallback, and closing."""
from __future__ import annotations

import weakref

from .. import _intake


def holder_of(state):
    """The open decode session holding state, or None. A state refers to
    its session weakly: a session dropped without close() is collected (its
    finaliser writes the state back), and never keeps the state locked."""
    ref = getattr(state, "_held_by", None)
    session = ref() if isinstance(ref, weakref.ref) else ref
    return session if session is not None and getattr(session, "_open", False) else None


def check_not_held(state):
    """ValueError if an open decode session holds state."""
    session = holder_of(state)
    if session is not None:
        raise ValueError(f"state is held by an open {type(session).__name__}; use the "
                         "session's step, or close()/sync_state() it first")


class DecodeSessionBase:
    """Base of Mamba{1,2,3}DecodeSession (not public).

    A subclass sets ``_OP`` (the forward op id), calls ``_bind``, builds
    ``self._args`` (x in slot 3, y in slot 4), calls ``_activate``, and
    implements ``sync_state()``, ``_release()`` and, where the step needs
    them, ``_before_step(args)`` and ``_after_step()``.
    """

    _OP = None
    _X_SLOT, _Y_SLOT = 3, 4

    def _bind(self, block, state, b):
        """The fields every session has; not open yet. A state already held
        by an open session is refused (two sessions on one state would each
        write their own tokens back, and one's would be lost)."""
        self._open = False
        check_not_held(state)
        self._block = block
        self._lib = block._lib
        self._blob = block._blob  # pinned: a later set_params is not seen
        self._state = state
        self._b = b
        self._d = block.d_model
        self._open = False

    def _own_workspace(self, args, slot, zero=False):
        """Allocate the session's private workspace for args (kept from
        open to close) and put its address in args[slot]."""
        from .._array import Array
        from ._base import workspace_floats
        self._work = Array((workspace_floats(self._lib, self._OP, args),), zero=zero)
        args[slot] = self._work.address

    def _activate(self):
        """Open: from now on the block refuses the state."""
        check_not_held(self._state)
        self._state._held_by = weakref.ref(self)
        self._open = True

    @property
    def state(self):
        """The state the session decodes from."""
        return self._state

    @property
    def is_open(self) -> bool:
        """Whether the session is open."""
        return self._open

    def _check_open(self):
        if not self._open:
            raise ValueError(f"the {type(self).__name__} is closed")

    def _unheld_views(self, fetch):
        """fetch() with the state briefly not held (the block's checks)."""
        holder, self._state._held_by = getattr(self._state, "_held_by", None), None
        try:
            return fetch()
        finally:
            self._state._held_by = holder

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
        self._check_open()
        y = Array((self._b, 1, self._d), zero=False)
        args = self._args
        args[self._Y_SLOT] = y.address
        self._before_step(args)
        # A plain C-contiguous float32 x is checked and run in one native
        # call; anything else goes through the full intake (and its errors).
        if not self._lib.run_step(self._OP, args, x, self._b, self._d, self._X_SLOT):
            xv, b = self._block._step_x_view(x)
            if b != self._b:
                raise ValueError(f"x has B={b}, the session decodes {self._b} rows")
            _intake.check_finite(self._lib, xv)
            args[self._X_SLOT] = xv.address
            self._lib.run(self._OP, args)
        self._after_step()
        return y

    def _before_step(self, args):
        pass

    def _after_step(self):
        pass

    def close(self):
        """Copy the state back, release the buffers and close. Idempotent.

        If the state's arrays can no longer take the session's state (one
        was replaced by a buffer of another shape, dtype or layout), close
        raises ValueError naming it before writing anything, and the
        session stays open: fix the array and close again. A session that
        is dropped without close() closes itself when it is collected."""
        if not self._open:
            return
        self.sync_state()
        self._state._held_by = None
        self._open = False
        self._release()

    @staticmethod
    def _write_back(state, pairs):
        """Copy (name, session array) pairs into state.<name>: every target
        is checked first, so a refused write-back changes no byte."""
        from ._base import copy_bytes
        targets = []
        for name, src in pairs:
            v = _intake.float32_view(getattr(state, name), f"state.{name}", writable=True,
                                     contiguous_only=True)
            shape = tuple(memoryview(src).shape)
            if v.shape != shape:
                raise ValueError(f"state.{name} must have shape {shape} to take the "
                                 f"session's state back, got {v.shape}")
            targets.append(v)
        _intake.refuse_overlap(targets)
        for v, (_, src) in zip(targets, pairs):
            copy_bytes(v.mv, src)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        # Dropped while open: write the state back (no tokens lost); if the
        # state can no longer take it, just let the state go.
        try:
            if self._open:
                try:
                    self.close()
                except Exception:
                    self._open = False
        except AttributeError:
            pass
