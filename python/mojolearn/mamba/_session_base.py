"""What the three decode sessions share: open/closed bookkeeping, the
one-native-call step with its full-intake fallback, and closing."""
from __future__ import annotations

from .. import _intake


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
        """The fields every session has; not open yet."""
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
        self._state._held_by = self
        self._open = True

    @property
    def state(self):
        """The state this session decodes from."""
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
        holder, self._state._held_by = self._state._held_by, None
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
        """Copy the state back, release the buffers and close. Idempotent."""
        if not self._open:
            return
        self.sync_state()
        self._state._held_by = None
        self._open = False
        self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            if self._open:
                self._state._held_by = None
        except AttributeError:
            pass
