"""Mamba1DecodeSession: token-by-token decoding on one block and one state."""
from __future__ import annotations

from .. import _abi
from ._session_base import DecodeSessionBase


class Mamba1DecodeSession(DecodeSessionBase):
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
    _OP = _abi.OP_M1_FORWARD

    def __init__(self, block, state):
        cw, h = block._state_views(state, None)
        self._bind(block, state, cw.shape[0])
        # The state lives in this private workspace, in the kernel's layout,
        # from open to close; steps neither load nor save it.
        args = [self._b, 1, self._d, 0, 0, self._blob.address, 0, 0, 0, 0, 0]
        self._own_workspace(args, 9, zero=True)
        self._args = args
        self._transfer(cw, h, self._NO_TOKENS | self._NO_SAVE)
        args[10] = self._NO_LOAD | self._NO_SAVE
        self._activate()

    def _transfer(self, cw, h, flags):
        """Load (NO_SAVE) or save (NO_LOAD) the state through the kernel."""
        args = list(self._args)
        args[6], args[7], args[10] = cw.address, h.address, flags
        args[3] = args[4] = 0  # no tokens: no x or y buffer (a device stages none)
        self._lib.run(_abi.OP_M1_FORWARD, args)

    def _after_step(self):
        self._state.absolute_position += 1

    def _views(self):
        return self._unheld_views(
            lambda: self._block._state_views(self._state, self._b, check_finite=False))

    def sync_state(self):
        """Copy the session's state into the Mamba1State arrays; return it."""
        self._check_open()
        cw, h = self._views()
        self._transfer(cw, h, self._NO_LOAD | self._NO_TOKENS)
        return self._state

    def load_state(self):
        """Reload the session from the Mamba1State arrays; return it."""
        self._check_open()
        cw, h = self._unheld_views(lambda: self._block._state_views(self._state, self._b))
        self._transfer(cw, h, self._NO_TOKENS | self._NO_SAVE)
        return self._state

    def _release(self):
        self._work = None
