"""Mamba1DecodeSession: token-by-token decoding on one block and one state."""
from __future__ import annotations

from .. import _abi, _intake


class Mamba1DecodeSession:
    """Token-by-token decoding on one Mamba1Block and one Mamba1State.

    Made by ``Mamba1Block.decode_session(state)``. Every output is byte for
    byte what ``Mamba1Block.step`` gives. On a CPU-only install the session
    keeps the state in its own workspace, in the kernel's layout, so a step
    validates only x and converts nothing. Until close() or sync_state() the state's arrays
    are stale and the block refuses that state; weight edits (set_params)
    after opening are not seen; edits to the state arrays are not seen until
    load_state(). Not thread-safe. Use it as a context manager.

    Examples
    --------
    >>> state = block.allocate_state(2)
    >>> tokens = np.random.default_rng(1).random((8, 2, block.d_model), dtype=np.float32)
    >>> with block.decode_session(state) as session:
    ...     for x_t in tokens:
    ...         y_t = session.step(x_t)
    """

    # FWD_FLAGS bits (mojo/mojolearn_kernels/mamba1.mojo)
    _NO_LOAD, _NO_SAVE, _NO_TOKENS = 1, 2, 4

    def __init__(self, block, state):
        from .._array import Array
        cw, h = block._state_views(state, None)
        self._block = block
        self._lib = block._lib
        self._blob = block._blob  # pinned: later set_params is not seen
        self._state = state
        self._b = cw.shape[0]
        self._d = block.d_model
        # The state lives in this private workspace, in the kernel's layout,
        # from open to close; steps neither load nor save it.
        args = [self._b, 1, self._d, 0, 0, self._blob.address, 0, 0, 0, 0, 0]
        self._work = Array((max(1, -(-self._lib.workspace_bytes(
            _abi.OP_M1_FORWARD, args) // 4)),), zero=True)
        args[9] = self._work.address
        self._args = args
        self._transfer(cw, h, self._NO_TOKENS | self._NO_SAVE)
        args[10] = self._NO_LOAD | self._NO_SAVE
        state._held_by = self
        self._open = True

    def _transfer(self, cw, h, flags):
        """Load (NO_SAVE) or save (NO_LOAD) the state through the kernel."""
        args = list(self._args)
        args[6], args[7], args[10] = cw.address, h.address, flags
        self._lib.run(_abi.OP_M1_FORWARD, args)

    @property
    def state(self):
        """The Mamba1State this session decodes from."""
        return self._state

    @property
    def is_open(self) -> bool:
        """Whether the session is open."""
        return self._open

    def _check_open(self):
        if not self._open:
            raise ValueError("the Mamba1DecodeSession is closed")

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
        args[4] = y.address
        # A plain C-contiguous float32 x is checked and run in one native
        # call; anything else goes through the full intake (and its errors).
        if not self._lib.run_step(_abi.OP_M1_FORWARD, args, x, self._b, self._d, 3):
            xv, b = self._block._step_x_view(x)
            if b != self._b:
                raise ValueError(f"x has B={b}, the session decodes {self._b} rows")
            _intake.check_finite(self._lib, xv)
            args[3] = xv.address
            self._lib.run(_abi.OP_M1_FORWARD, args)
        self._state.absolute_position += 1
        return y

    def _views(self):
        holder, self._state._held_by = self._state._held_by, None
        try:
            return self._block._state_views(self._state, self._b, check_finite=False)
        finally:
            self._state._held_by = holder

    def sync_state(self):
        """Copy the session's state into the Mamba1State arrays; return it."""
        self._check_open()
        cw, h = self._views()
        self._transfer(cw, h, self._NO_LOAD | self._NO_TOKENS)
        return self._state

    def load_state(self):
        """Reload the session from the Mamba1State arrays; return it."""
        self._check_open()
        holder, self._state._held_by = self._state._held_by, None
        try:
            cw, h = self._block._state_views(self._state, self._b)
        finally:
            self._state._held_by = holder
        self._transfer(cw, h, self._NO_TOKENS | self._NO_SAVE)
        return self._state

    def close(self):
        """Copy the state back, release the buffers and close. Idempotent."""
        if not self._open:
            return
        self.sync_state()
        self._state._held_by = None
        self._open = False
        self._work = None

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
