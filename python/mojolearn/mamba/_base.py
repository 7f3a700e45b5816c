"""What every Mamba block shares: construction checks, numeric modes, the
binary it runs on, params, and the intake of x and lengths."""
from __future__ import annotations

import threading

from .. import _intake
from .._loader import available_modes, describe, library

NUMERIC_MODES = ("identical", "fast")


def check_numeric_mode(mode) -> str:
    if mode not in NUMERIC_MODES:
        raise ValueError(f"numeric_mode must be 'identical' or 'fast', got {mode!r}")
    if mode not in available_modes():
        raise ValueError(f"numeric_mode {mode!r} is not available: no binary for "
                         f"it is installed (available: {available_modes()})")
    return mode


def weight_views(weights, shapes: dict, lib) -> dict:
    """Validate a weight dict against {name: shape or tuple of shapes}.

    Returns {name: View}; raises ValueError listing missing/unknown names,
    naming a wrong shape, TypeError naming a wrong dtype, ValueError naming
    a non-finite weight and its first flat index.
    """
    if not hasattr(weights, "keys"):
        raise ValueError(f"weights must be a dict of name -> float32 buffer, got "
                         f"{type(weights).__name__}")
    names = set(weights.keys())
    missing = sorted(set(shapes) - names)
    unknown = sorted(str(n) for n in names - set(shapes))
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unknown:
            parts.append(f"unknown {unknown}")
        raise ValueError("weights: " + "; ".join(parts) + f" (expected {sorted(shapes)})")
    from .. import lowbit  # packed weights: expanded exactly to float32 (SPEC section 8)
    weights, fmt = lowbit.unpack(weights)
    views = _Views()
    views.weight_format = fmt
    for name, want in shapes.items():
        v = _intake.float32_view(weights[name], name)
        options = want if isinstance(want[0], tuple) else (want,)
        if v.shape not in options:
            raise ValueError(f"weight {name} must have shape "
                             f"{' or '.join(str(o) for o in options)}, got {v.shape}")
        _intake.check_finite(lib, v)
        views[name] = v
    return views


class _Views(dict):
    """weight_views' result: {name: View} plus the format the weights were
    given in (weight_format: 'float32', 'bfloat16' or 'int8')."""

    weight_format = "float32"


class _MambaBase:
    """Shared behaviour of the Mamba block estimators."""

    _param_names: tuple = ("weights", "numeric_mode")

    def _setup_common(self, numeric_mode):
        self.numeric_mode = check_numeric_mode(numeric_mode)
        self._lib = library(self.numeric_mode)
        self._work_lock = threading.Lock()
        self._work = None

    # -- estimator API ------------------------------------------------------
    def get_params(self, deep: bool = True) -> dict:
        """Constructor parameters: {'weights': copies, 'numeric_mode': ...}."""
        p = {"weights": {k: v.copy() for k, v in self._weights.items()},
             "numeric_mode": self.numeric_mode}
        if getattr(self, "weight_format", "float32") != "float32":
            from .. import lowbit  # re-packing the exact expansion gives the same values
            p["weights"] = lowbit.pack(p["weights"], self.weight_format)
        return p

    def set_params(self, **params):
        """Set constructor parameters; the block is rebuilt through its
        constructor, so every constructor check runs again."""
        unknown = sorted(set(params) - set(self._param_names))
        if unknown:
            raise ValueError(f"unknown parameters {unknown}; valid: {list(self._param_names)}")
        current = self.get_params()
        current.update(params)
        weights = current.pop("weights")
        fresh = type(self)(weights, **current)
        self.__dict__.clear()
        self.__dict__.update(fresh.__dict__)
        return self

    def numeric_mode_used(self) -> str:
        """'identical' or 'fast', read from the compiled binary in use."""
        from .._abi import NUMERIC_MODES as modes
        return modes[self._lib.numeric_mode]

    def vendor_used(self) -> str:
        """'cpu', 'cuda', 'hip' or 'metal', read from the compiled binary in use."""
        from .._abi import VENDORS
        return VENDORS[self._lib.vendor]

    def binary_info(self) -> dict:
        """The self-description of the binary in use."""
        return describe(self._lib)

    # -- intake -------------------------------------------------------------
    def _x_view(self, x, name="x"):
        v = _intake.float32_view(x, name, ndim=(3,))
        b, l, d = v.shape
        if b == 0 or l == 0:
            raise ValueError(f"{name} must have B >= 1 and L >= 1, got shape {v.shape}")
        if d != self.d_model:
            raise ValueError(f"{name} has d_model {d}, the block has {self.d_model}")
        return v

    @staticmethod
    def _lengths(lengths, state, b, l):
        """(keep-alive, address) of validated ragged lengths; (None, 0) if none."""
        if lengths is None:
            return None, 0
        if state is not None:
            raise ValueError("lengths cannot be combined with a state")
        keep = _intake.lengths_array(lengths, b, l)
        return keep, keep[2]

    def _step_x_view(self, x):
        v = _intake.float32_view(x, "x", ndim=(2, 3))
        if len(v.shape) == 3:
            if v.shape[1] != 1:
                raise ValueError(f"step takes one token per row: x must be (B, d_model) "
                                 f"or (B, 1, d_model), got {v.shape}")
            b, d = v.shape[0], v.shape[2]
        else:
            b, d = v.shape
        if b == 0:
            raise ValueError(f"x must have B >= 1, got shape {v.shape}")
        if d != self.d_model:
            raise ValueError(f"x has d_model {d}, the block has {self.d_model}")
        return v, b

    def _run_op(self, op, args, work_slot):
        """Run op with the block's workspace address in args[work_slot]."""
        work, lock = self._workspace(op, args)
        try:
            args[work_slot] = work.address
            self._lib.run(op, args)
        finally:
            if lock is not None:
                lock.release()

    def _backward_views(self, x, grad_output):
        """Validated (x, grad_output) views for backward: same shape, finite."""
        xv = self._x_view(x)
        gv = _intake.float32_view(grad_output, "grad_output", ndim=(3,))
        if gv.shape != xv.shape:
            raise ValueError(f"grad_output must have the shape of x {xv.shape}, "
                             f"got {gv.shape}")
        _intake.check_finite(self._lib, xv)
        _intake.check_finite(self._lib, gv)
        return xv, gv

    def _workspace(self, op, args):
        """(workspace Array, lock or None) for one call of op.

        The block keeps one workspace (grown to the largest call so far), so
        repeated calls neither allocate nor fault in fresh pages; a caller
        that finds it in use (another thread) gets a private one. Release
        the returned lock after the call.
        """
        from .._array import Array
        floats = max(1, -(-self._lib.workspace_bytes(op, args) // 4))
        if self._work_lock.acquire(blocking=False):
            if self._work is None or self._work.size < floats:
                self._work = None
                self._work = Array((floats,), zero=False)
            return self._work, self._work_lock
        return Array((floats,), zero=False), None
