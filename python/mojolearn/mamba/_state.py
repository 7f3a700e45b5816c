"""What the three state classes share: copying and pickling, the views of
a state's arrays, and the hold check of decode sessions.

A state is its arrays (``_ARRAYS``, in constructor order) and a few plain
values (``_VALUES``, keyword arguments of the constructor). A copy or an
unpickled state has the same bytes in new, independent mojolearn.Arrays,
whatever buffers the original used. A state held by an open decode session
is refused by name: its arrays are stale until the session syncs them.
"""
from __future__ import annotations

from .. import _intake


def holder_of(state):
    """The open decode session holding state, or None. A state refers to
    its session weakly: a session dropped without close() is collected (its
    finaliser writes the state back), and never keeps the state locked."""
    ref = getattr(state, "_held_by", None)
    session = ref() if ref is not None else None
    return session if session is not None and getattr(session, "_open", False) else None


def check_not_held(state):
    """ValueError if an open decode session holds state."""
    session = holder_of(state)
    if session is not None:
        raise ValueError(f"state is held by an open {type(session).__name__}; use the "
                         "session's step, or close()/sync_state() it first")


def array_view(state, name, ndim=None):
    """The writable, C-contiguous float32 view of state.<name> (the kernels
    update state arrays in place); ndim: allowed dimension counts, or None."""
    return _intake.float32_view(getattr(state, name), f"state.{name}", ndim=ndim,
                                writable=True, contiguous_only=True)


def _as_array(buf, name):
    """A new mojolearn.Array with the bytes of a float32 state buffer."""
    from .._array import Array
    v = _intake.float32_view(buf, name)
    out = Array(v.shape, zero=False)
    if v.mv.nbytes:  # (v is C-contiguous: float32_view copies any other layout)
        memoryview(out).cast("B")[:] = v.mv.cast("B")
    return out


def _rebuild(cls, arrays, values):
    return cls(*arrays, **values)


class StateBase:
    """Base of Mamba{1,2,3}State (not public): copy() and pickling."""

    _ARRAYS: tuple = ()
    _VALUES: tuple = ()

    def _store(self, *arrays):
        """Keep the given arrays (any buffers, in ``_ARRAYS`` order) as the
        state's attributes; the state starts held by no session."""
        for name, value in zip(self._ARRAYS, arrays, strict=True):
            setattr(self, name, value)
        self._held_by = None

    def _parts(self):
        check_not_held(self)
        arrays = [_as_array(getattr(self, n), f"state.{n}") for n in self._ARRAYS]
        values = {n: getattr(self, n) for n in self._VALUES}
        return arrays, values

    def copy(self):
        """An independent state with the same bytes (new mojolearn.Arrays).

        Use it to fork a decode state (beam search, speculative decoding,
        saving a conversation). Raises ValueError if an open decode session
        holds this state (sync_state() or close() it first)."""
        arrays, values = self._parts()
        return type(self)(*arrays, **values)

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()

    def __reduce__(self):
        arrays, values = self._parts()
        return (_rebuild, (type(self), arrays, values))
