"""Rows of a MambaLM decoded together: the engine side of the model.

A batching engine keeps every active sequence as one row of each layer's
state. ``RowDecoder`` runs one token per row through every layer (one
batched pass over each layer's weights) while the rows stay the same;
``restack_rows`` builds the states of a new set of rows from rows of
other states (when sequences join or leave). Mamba-2/3 rows sit at their
own positions of their blocks' chunks: each row's position goes to the
kernels (the forward op's row_tokens), which compute every row exactly as
it would alone, so a row's bits do not depend on the others.

Reached through MambaLM.open_rows, MambaLM.restack_states and
MambaLM.row_position; mojolearn.generate.Batcher is built on them.
"""
from __future__ import annotations

from array import array


class RowDecoder:
    """One token per row through every layer of a MambaLM, for a fixed set
    of rows (made by ``MambaLM.open_rows``).

    Mamba-2/3 layers decode through decode sessions that step on the
    states' own arrays (nothing copied) and read one shared int64 array of
    row positions, advanced once per ``step``. Mamba-1 layers decode
    through decode sessions with ``cache`` (each keeps its rows' state in
    its own workspace, in the kernel's layout: a step neither checks,
    loads nor saves it), through ``block.step`` without. Until ``close()``
    the states are held (a block refuses them; a Mamba-1 session writes
    them back at close) and, for Mamba-2/3, their scalar positions are not
    used: the rows' positions are ``positions()``. Not thread-safe.

    Parameters
    ----------
    model : MambaLM
    states : list of block states
        One per layer, all with the same rows (B >= 1).
    positions : sequence of int
        Each row's position in its blocks' chunks (``MambaLM.row_position``
        of the row's own state; ignored for Mamba-1).
    cache : bool, default True
        Whether the sessions keep their speed cache (Mamba-1 and Mamba-2:
        ``MambaLM.session_cache_bytes``; the same bits either way).
    """

    def __init__(self, model, states, positions, cache=True):
        from ._array import Array
        from .families import family
        if len(states) != model.n_layers:
            raise ValueError(f"states must hold {model.n_layers} layer states, got {len(states)}")
        self.kind = model.kind
        self.states = states
        fam = family(model.kind)
        if not fam.row_positions:  # Mamba-1: a session per layer, or block.step
            self._layers = []
            self._rows = None
            self._positions = [0] * len(positions)
            try:
                for blk, st in zip(model.blocks, states):
                    self._layers.append(blk.decode_session(st) if cache else _Stepper(blk, st))
            except BaseException:
                self.close()
                raise
        else:  # one row-position array for all layers
            rows = Array((len(positions),), "int64", zero=False)
            memoryview(rows).cast("B")[:] = array("q", positions).tobytes()
            self._rows = rows
            self._layers = []
            try:
                cls = fam.session_class
                for blk, st in zip(model.blocks, states):
                    self._layers.append(cls(blk, st, row_tokens=rows, in_place=True,
                                            cache=cache))
            except BaseException:
                self.close()
                raise

    @property
    def cache_bytes(self) -> int:
        """Bytes of the sessions' speed caches (0 without them)."""
        return sum(getattr(layer, "cache_bytes", 0) for layer in self._layers)

    def step(self, x):
        """x (B, 1, d_model) through every layer; then each row's position
        moves on by one. Returns the last layer's outputs (B, 1, d_model)."""
        for layer in self._layers:
            x = layer.step(x)
        if self._rows is not None:
            self._layers[0].advance_rows()
        return x

    def positions(self) -> list:
        """Each row's chunk position now (zeros for Mamba-1)."""
        if self._rows is None:
            return list(self._positions)
        return memoryview(self._rows).tolist()

    def close(self) -> list:
        """Release the states (complete again) and return the rows'
        positions. Idempotent."""
        pos = self.positions()
        for layer in self._layers:
            layer.close()
        self._layers = []
        return pos


class _Stepper:
    """block.step on one state, with a decode session's step/close."""

    def __init__(self, block, state):
        self.block, self.state = block, state

    def step(self, x):
        return self.block.step(x, self.state)

    def close(self):
        pass


def row_position(states) -> int:
    """A batch-1 state's chunk position (buffered tokens; 0 for Mamba-1).
    ValueError if it has input states pending (a Mamba-3 state that has
    not run a token since set_input_states)."""
    st = states[0]
    if getattr(st, "pending", False):
        raise ValueError("state has input states pending: run at least one token first")
    return getattr(st, "buffered_tokens", 0)


def restack_rows(blocks, parts, consume=False) -> list:
    """Per layer, a new state whose row i is row r of states s for the i-th
    (s, r) in parts; the plain values (positions) are the first part's.
    consume: each source layer state is dropped (set to None in its list)
    once copied, so a restack holds one layer's states twice at most, not
    the whole model's."""
    out = []
    for layer, blk in enumerate(blocks):
        first = parts[0][0][layer]
        new = blk.allocate_state(len(parts))
        for name in type(first)._ARRAYS:
            dst = memoryview(getattr(new, name)).cast("B")
            row = dst.nbytes // len(parts)
            for i, (states, r) in enumerate(parts):
                src = memoryview(getattr(states[layer], name)).cast("B")
                dst[i * row:(i + 1) * row] = src[r * row:(r + 1) * row]
        for name in type(first)._VALUES:
            setattr(new, name, getattr(first, name))
        out.append(new)
        if consume:
            for states, _ in parts:
                states[layer] = None
    return out
