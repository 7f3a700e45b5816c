"""The intake of backward's state arguments, shared by the blocks.

backward(x, grad_output, state, grad_state=..., lengths=...) differentiates
forward(x, state): `state` is the state that forward starts from (read,
never written), `grad_state` the cotangent of the state it leaves (the
gradient arriving from later chunks of a sequence). Both are validated
here into {array name: View} in the block's state shapes, before anything
runs, so a refused call changes nothing. The arrays are read only, so a
read-only or non-contiguous buffer is accepted (the latter copied).
"""
from __future__ import annotations

from collections.abc import Mapping

from .. import _intake
from ._state import check_not_held


def backward_intake(block, x, grad_output, state, grad_state, lengths):
    """The start of a backward that may take a state: (x, grad_output and
    lengths as the runner's backward_views gives them, whether a state or
    cotangents were given). Ragged lengths together with a state or
    cotangents are a ValueError (ragged rows only from a zero state)."""
    stated = state is not None or grad_state is not None
    if lengths is not None and stated:
        raise ValueError("lengths cannot be combined with state or grad_state "
                         "(ragged rows are supported only without a state)")
    xv, gv, lens = block._runner.backward_views(block, x, grad_output, lengths)
    return xv, gv, lens, stated


def start_state_views(block, state, b: int) -> dict:
    """{array name: View} of the state forward starts from: a state of the
    block's class (TypeError otherwise), not held by an open decode session,
    every array in the block's shape for B = b, finite."""
    block._check_state_type(state)
    check_not_held(state)
    return _views(block, {n: getattr(state, n) for n in state._ARRAYS}, b,
                  lambda n: f"state.{n}")


def cotangent_views(block, grad_state, b: int, check_finite=None) -> dict:
    """{array name: View} of the final state's cotangent: a mapping of state
    array names to float32 buffers (a missing name means zeros: it has no
    entry; an unknown one is a ValueError) or a state of the block's class
    (its arrays are read). TypeError for anything else. Every view is
    checked finite, or, with `check_finite`, handed to it after every type
    and shape check (blocks with open-chunk buffers check only the rows
    the final state holds)."""
    cls = block._runner.spec.state_class
    names = cls._ARRAYS
    if isinstance(grad_state, cls):
        check_not_held(grad_state)
        return _views(block, {n: getattr(grad_state, n) for n in names}, b,
                      lambda n: f"grad_state.{n}", check_finite)
    if not isinstance(grad_state, Mapping):
        raise TypeError(f"grad_state must be a dict of state array name -> float32 "
                        f"buffer, or a {cls.__name__}, got {type(grad_state).__name__}")
    unknown = sorted(repr(k) for k in grad_state if k not in names)
    if unknown:
        raise ValueError(f"grad_state has unknown names {', '.join(unknown)}; the "
                         f"{cls.__name__} arrays are {list(names)}")
    return _views(block, {n: grad_state[n] for n in names if n in grad_state}, b,
                  lambda n: f"grad_state[{n!r}]", check_finite)


def _views(block, arrays: dict, b: int, label, check_finite=None) -> dict:
    shapes = block._runner.spec.state_shapes(block, b)
    out = {}
    for n, buf in arrays.items():
        v = _intake.float32_view(buf, label(n))
        _intake.check_shape(v, shapes[n], f" (B={b} rows of x)")
        out[n] = v
    if check_finite is not None:  # after every type and shape check
        check_finite(out)
    else:
        for v in out.values():
            _intake.check_finite(block._lib, v)
    return out
