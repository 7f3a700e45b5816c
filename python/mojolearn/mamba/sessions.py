"""The decode sessions: Mamba1DecodeSession, Mamba2DecodeSession and
Mamba3DecodeSession, and their base (open/closed bookkeeping, the
one-native-call step with its full-intake fallback, closing).

A session takes everything block-specific from its block (the forward op
and its slots, the state class, the layout constants), so this module
imports no block module: the block modules import it.
"""
from __future__ import annotations

import weakref
from array import array

from .. import _abi, _intake
from ._base import copy_bytes, workspace_floats
from ._state import array_view, check_not_held


# The Examples section of every session's docstring (the docs run it on the
# page's block).
_EXAMPLES = """

    Examples
    --------
    >>> state = block.allocate_state(2)
    >>> tokens = np.random.default_rng(1).random((8, 2, block.d_model), dtype=np.float32)
    >>> with block.decode_session(state) as session:
    ...     for x_t in tokens:
    ...         y_t = session.step(x_t)
    """


def _with_examples(cls):
    """cls with _EXAMPLES appended to its docstring (none under python -OO)."""
    if cls.__doc__ is not None:
        cls.__doc__ = cls.__doc__.rstrip() + _EXAMPLES
    return cls


class DecodeSessionBase:
    """Base of Mamba{1,2,3}DecodeSession (not public).

    A subclass calls ``_bind``, builds ``self._args`` (the block's forward
    op's arguments), calls ``_activate``, and implements ``sync_state()``,
    ``_release()`` and, where the step needs them, ``_before_step(args)``
    and ``_after_step()``.
    """

    def _bind(self, block, state, b):
        """The fields every session has; not open yet. A state already held
        by an open session is refused (two sessions on one state would each
        write their own tokens back, and one's would be lost)."""
        self._open = False
        check_not_held(state)
        self._block = block
        self._lib = block._lib
        self._op = _abi.op_spec(self._lib, block._runner.spec.forward_op).op
        self._blob = block._blob  # pinned: a later set_params is not seen
        self._state = state
        self._b = b
        self._d = block.d_model
        self._spec = block._runner.forward_slots(block)  # the forward op's slots by name
        self._x_slot, self._y_slot = self._spec.slot("x"), self._spec.slot("y")

    _thread_work = False  # the op's workspace is the calling thread's (scratch only)
    cache_bytes = 0  # bytes of the session's speed cache (none: 0)

    @staticmethod
    def _check_cache(cache) -> bool:
        """The sessions' `cache` argument: True or False (TypeError else)."""
        if not isinstance(cache, bool):
            raise TypeError(f"cache must be True or False, got {cache!r}")
        return cache

    def _use_thread_workspace(self):
        """Steps run on the calling thread's shared workspace (the blocks'
        one): for ops whose workspace is scratch, so a model of many
        sessions holds one workspace, not one per layer."""
        self._thread_work = True
        self._work_slot = self._spec.slot("work")

    def _own_workspace(self, args, zero=False):
        """Allocate the session's private workspace for args (kept from
        open to close) and put its address in the op's work slot."""
        from .._array import Array
        self._work = Array((workspace_floats(self._lib, self._op, args),), zero=zero)
        args[self._spec.slot("work")] = self._work.address

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
        args[self._y_slot] = y.address
        self._before_step(args)
        if self._thread_work:
            args[self._work_slot] = self._block._workspace(self._op, args).address
        # A plain C-contiguous float32 x is checked and run in one native
        # call; anything else goes through the full intake (and its errors).
        if not self._lib.run_step(self._op, args, x, self._b, self._d, self._x_slot):
            xv, b = self._block._step_x_view(x)
            if b != self._b:
                raise ValueError(f"x has B={b}, the session decodes {self._b} rows")
            _intake.check_finite(self._lib, xv)
            args[self._x_slot] = xv.address
            self._lib.run(self._op, args)
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
        targets = []
        for name, src in pairs:
            v = array_view(state, name)
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


class _RowPositions:
    """Rows at their own chunk positions: the row_tokens part of the
    Mamba-2 and Mamba-3 decode sessions (not public)."""

    # Rows at their own positions (Mamba-2/3: the row_tokens argument, used
    # by mojolearn.row_decode for continuous batching). The state's scalar
    # position is then not used or updated; each row's buffered_tokens lives
    # in an int64 Array the op reads (its row_tokens slot), and
    # row_positions() reads it back. An int64 Array given as row_tokens is
    # shared, not copied: the sessions of a model's layers read one array,
    # and their owner calls advance_rows() once per model step (the
    # sessions do not advance it).
    def _use_row_tokens(self, row_tokens):
        from .._array import Array
        self._rows_shared = isinstance(row_tokens, Array)
        if self._rows_shared:
            if row_tokens.shape != (self._b,) or row_tokens.dtype != "int64":
                raise ValueError(f"row_tokens must be an int64 Array of shape ({self._b},)")
            self._rows = row_tokens
        else:
            rows = [_intake.as_int(t, "row_tokens") for t in row_tokens]
            if len(rows) != self._b:
                raise ValueError(f"row_tokens has {len(rows)} entries, the state {self._b} rows")
            self._rows = Array((self._b,), "int64", zero=False)
            memoryview(self._rows).cast("B")[:] = array("q", rows).tobytes()
        self._args[self._spec.slot("row_tokens")] = self._rows.address

    def row_positions(self) -> list:
        """Each row's chunk position (for a session opened with row_tokens)."""
        self._check_rows("row_positions")
        return memoryview(self._rows).tolist()

    def _check_rows(self, what):
        if self._rows is None:
            raise ValueError(f"{what}: the session was opened without row_tokens")

    def _row_after(self, n):
        """A chunk position after one more token."""
        return self._block._runner.spec.position_after(n, 1)

    def _position_after_step(self, n):
        """The session's position after a step from position n: n moved on
        by a token, or, with row_tokens, n unchanged and each row moved on
        instead (here, unless the row_tokens Array is shared: its owner
        moves it)."""
        if self._rows is None:
            return self._row_after(n)
        if not self._rows_shared:
            self.advance_rows()
        return n

    def advance_rows(self):
        """Move every row's position on by one token (opened with a shared
        row_tokens Array: the owner calls this once per model step)."""
        self._check_rows("advance_rows")
        mv = memoryview(self._rows)
        after = self._row_after
        for i in range(self._b):
            mv[i] = after(mv[i])


@_with_examples
class Mamba1DecodeSession(DecodeSessionBase):
    """Token-by-token decoding on one Mamba1Block and one Mamba1State.

    Made by ``Mamba1Block.decode_session(state)``. Every output is byte for
    byte what ``Mamba1Block.step`` gives. On a CPU-only install the session
    keeps the state in its own workspace, in the kernel's layout, so a step
    validates only x and converts nothing. Until close() or sync_state() the state's arrays
    are stale and the block refuses that state; weight edits (set_params)
    after opening are not seen; edits to the state arrays are not seen until
    load_state(). Not thread-safe. Use it as a context manager.
    """

    def __init__(self, block, state):
        cw, h = block._state_views(state, None)
        self._bind(block, state, cw.shape[0])
        # FWD_FLAGS bits (mamba1/forward.mojo), read from the binary
        flag = {n: _abi.constant("M1_FLAG_" + n, self._lib)
                for n in ("NO_LOAD", "NO_SAVE", "NO_TOKENS")}
        self._NO_LOAD, self._NO_SAVE = flag["NO_LOAD"], flag["NO_SAVE"]
        self._NO_TOKENS = flag["NO_TOKENS"]
        # The state lives in this private workspace, in the kernel's layout,
        # from open to close; steps neither load nor save it.
        args = self._spec.pack(b=self._b, l=1, d=self._d, blob=self._blob)
        self._own_workspace(args, zero=True)
        self.cache_bytes = 4 * self._work.size  # (the block's _session_cache_bytes)
        self._args = args
        self._transfer(cw, h, self._NO_TOKENS | self._NO_SAVE)
        args[self._spec.slot("flags")] = self._NO_LOAD | self._NO_SAVE
        self._activate()

    def _transfer(self, cw, h, flags):
        """Load (NO_SAVE) or save (NO_LOAD) the state through the kernel."""
        args = list(self._args)
        slot = self._spec.slot
        args[slot("conv_window")], args[slot("h")] = cw.address, h.address
        args[slot("flags")] = flags
        args[self._x_slot] = args[self._y_slot] = 0  # no tokens: no x or y buffer (a device stages none)
        self._lib.run(self._op, args)

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


@_with_examples
class Mamba2DecodeSession(_RowPositions, DecodeSessionBase):
    """Token-by-token decoding on one Mamba2Block and one Mamba2State.

    Made by ``Mamba2Block.decode_session(state)``. Every output is byte for
    byte what ``Mamba2Block.step`` gives. The session holds its own copies of
    the state (its steps run on the calling thread's shared workspace), so a
    step validates only x (the state is validated once, when the session
    opens or reloads). Until
    close() or sync_state() the state's arrays and buffered_tokens are
    stale, and the block refuses that state; weight edits (set_params) after
    opening are not seen; edits to the state arrays are not seen until
    load_state(). The block's ``h_last_`` is not updated by session steps. Not
    thread-safe. Use it as a context manager.

    Parameters
    ----------
    block : Mamba2Block
    state : Mamba2State
    row_tokens : int64 mojolearn.Array of shape (B,), sequence of int, or None
        Rows at their own chunk positions (continuous batching): row i's
        buffered-token count. The state's scalar ``buffered_tokens`` is then
        neither used nor updated; ``row_positions()`` reads the rows' back.
        An Array is shared, not copied, and not advanced by ``step``: its
        owner calls ``advance_rows()`` once per token (one array can serve
        every layer of a model). A sequence is copied and advanced by each
        step.
    in_place : bool, default False
        Step on the state's own arrays instead of copies (for an engine that
        owns the state and does not touch it while the session is open).
    cache : bool, default True
        Keep the speed cache: per row, copies of the state laid out for the
        one-token step (each head's h transposed, the open chunk's B rows
        transposed, its dt and dA rows and head-major x rows;
        ``cache_bytes``, 2.54 MB per row at d_model = 768). False allocates
        none and steps the way ``block.step`` does. The bits are the same
        either way.
    """

    def __init__(self, block, state, *, row_tokens=None, in_place=False, cache=True):
        from .._array import Array
        cache = self._check_cache(cache)
        views = block._state_views(state, None)
        self._bind(block, state, views[0].shape[0])
        # in_place (an engine that owns the state and never touches it
        # while the session is open): step on the state's own arrays, not on
        # copies, so its memory is not held twice
        self.in_place = bool(in_place)
        if in_place:
            self._arrays = list(views)
        else:
            self._arrays = [Array(v.shape, zero=False) for v in views]
            self._copy_in(views)
        self._s = _intake.as_int(state.buffered_tokens, "state.buffered_tokens")
        self._rows = None
        self._args = block._args(self._b, 1, 0, 0, self._arrays, self._s, 0, 0, True)
        self._s_slot = self._spec.slot("buffered_tokens")
        if row_tokens is not None:
            self._s = self._args[self._s_slot] = 0
            self._use_row_tokens(row_tokens)
        self._use_thread_workspace()
        # transposed copies of h and of the open chunk's B rows, its dt rows
        # and head-major x rows, rebuilt by the kernel whenever a marker or
        # count says so: same chains, vectorized or read contiguously
        # (mamba2/layout.mojo, cache_floats_per_row; its size read from the
        # op's buffer table). Without it (slot 0) the kernel takes
        # block.step's path: the same chains from the state's own rows.
        self._cache = None
        if cache:
            self._cache = Array((block._session_cache_bytes(self._b) // 4,), zero=True)
            self._args[self._spec.slot("cache")] = self._cache.address
        self._activate()

    @property
    def cache_bytes(self) -> int:
        """Bytes of the session's speed cache (0: opened with cache=False)."""
        return 0 if self._cache is None else self._cache.nbytes

    def _copy_in(self, views):
        for a, v in zip(self._arrays, views):
            copy_bytes(a, v.mv)

    def _before_step(self, args):
        args[self._s_slot] = self._s

    def _after_step(self):
        self._s = self._position_after_step(self._s)

    def sync_state(self):
        """Copy the session's state into the Mamba2State; return it."""
        self._check_open()
        st = self._state
        if not self.in_place:
            self._write_back(st, list(zip(st._ARRAYS, self._arrays)))
        if self._rows is None:
            st.buffered_tokens = self._s
        st._version += 1
        return st

    def load_state(self):
        """Reload the session from the Mamba2State (after you edit it); return it."""
        self._check_open()
        views = self._unheld_views(lambda: self._block._state_views(self._state, self._b))
        self._copy_in(views)
        self._s = _intake.as_int(self._state.buffered_tokens, "state.buffered_tokens")
        if self._cache is not None:
            memoryview(self._cache).cast("B")[:] = bytes(self._cache.nbytes)  # all stale
        return self._state

    def _release(self):
        self._arrays = self._work = self._cache = None


@_with_examples
class Mamba3DecodeSession(_RowPositions, DecodeSessionBase):
    """Token-by-token decoding on one Mamba3Block and one Mamba3State.

    Made by ``Mamba3Block.decode_session(state)``. It works as
    Mamba2DecodeSession does, on this block and state: every output is byte
    for byte what ``Mamba3Block.step`` gives; its own copies of the state,
    so a step validates only x; until close() or sync_state() the state is
    stale (its ``pending`` flag as well) and refused by the block. The
    block's reports (``h_last_``, ...) and ``session_info()`` are not
    updated by session steps. Not thread-safe. Use it as a context manager.

    Parameters
    ----------
    block : Mamba3Block
    state : Mamba3State
    row_tokens : int64 mojolearn.Array of shape (B,), sequence of int, or None
    in_place : bool, default False
        As for Mamba2DecodeSession (rows at their own chunk positions; step
        on the state's own arrays).
    cache : bool, default True
        Accepted for the same call as Mamba2DecodeSession's; a Mamba-3
        session keeps no speed cache (its state's buffers are already laid
        out for the one-token step), so nothing is allocated either way.
    """

    def __init__(self, block, state, *, row_tokens=None, in_place=False, cache=True):
        from .._array import Array
        self._check_cache(cache)
        self._bind(block, state, 0)
        views, nb = self._validated()
        self._b = views["h"].shape[0]
        self.in_place = bool(in_place)  # (as Mamba2DecodeSession's)
        if in_place:
            self._arrays = dict(views)
            self._nb, self._pending = nb, self._state.pending
        else:
            self._arrays = {n: Array(v.shape, zero=False) for n, v in views.items()}
            self._copy_in(views, nb)
        self._rows = None
        self._args = block._args(self._b, 1, 0, 0, self._arrays, nb, self._pending, 0, 0)
        self._n0_slot = self._spec.slot("buffered_tokens")
        self._pending_slot = self._spec.slot("pending")
        if row_tokens is not None:
            if self._pending:
                raise ValueError("row_tokens: the state has input states pending")
            self._nb = self._args[self._n0_slot] = 0
            self._use_row_tokens(row_tokens)
        self._use_thread_workspace()
        self._activate()

    def _validated(self):
        """The state's views after the block's full checks (as step does)."""
        st = self._state
        self._block._check_state_type(st)
        return self._unheld_views(lambda: self._block._state_views(
            st, _intake.float32_view(st.h, "state.h").shape[0]))

    def _copy_in(self, views, nb):
        for n, a in self._arrays.items():
            copy_bytes(a, views[n].mv)
        self._nb = nb
        self._pending = self._state.pending

    def _before_step(self, args):
        args[self._n0_slot] = self._nb
        args[self._pending_slot] = 1 if self._pending else 0

    def _after_step(self):
        self._nb = self._position_after_step(self._nb)
        self._pending = False

    def sync_state(self):
        """Copy the session's state into the Mamba3State; return it."""
        self._check_open()
        st = self._state
        if not self.in_place:
            self._write_back(st, list(self._arrays.items()))
        if self._rows is None:
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
