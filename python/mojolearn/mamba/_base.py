"""What every Mamba block shares: construction checks, numeric modes, the
binary it runs on, params, the intake of x and lengths, and the sequence of
forward, step, backward and allocate_state, driven by each block's
description (class attributes and a few methods, listed in _MambaBase)."""
from __future__ import annotations

import threading

from .. import _abi, _intake
from .._loader import available_modes, describe, library
from ._state import array_view, check_not_held
from . import _grad_state

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
        raise TypeError(f"weights must be a dict of name -> float32 buffer, got "
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
    from .. import lowbit  # packed weights: expanded exactly to float32 (docs/checkpoints.md)
    packed = {n: weights[n] for n in weights.keys() if lowbit.is_packed(weights[n])}
    weights, fmt = lowbit.unpack(weights)  # the expansion validates shapes and values
    views = _Views()
    views.weight_format = fmt
    views.packed = packed
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
    """weight_views' result: {name: View} of float32 values, plus the format
    the weights were given in (weight_format: 'float32', 'bfloat16' or
    'int8') and the packed values as given (packed: {name: PackedWeight})."""

    weight_format = "float32"
    packed: dict = {}


# Weight format ids of the prepare ops (mojo/mojolearn_kernels/linear.mojo WF_*).
_WF_ID = {"float32": 0, "bfloat16": 1, "int8": 2}


def _is_packed(w) -> bool:
    from ..lowbit import is_packed
    return is_packed(w)


def weight_address(w) -> int:
    """Address of a kept weight's values (a packed weight's codes)."""
    return w.data.address if _is_packed(w) else w.address


def _exponent_address(w) -> int:
    return w.exponents.address if _is_packed(w) and w.exponents is not None else 0


def copy_bytes(dst, src) -> None:
    """Copy the bytes of buffer src into buffer dst (same size)."""
    memoryview(dst).cast("B")[:] = memoryview(src).cast("B")


def workspace_floats(lib, op, args) -> int:
    """Floats (at least 1) of the workspace op needs for args."""
    return max(1, -(-lib.workspace_bytes(op, args) // 4))


# The calling thread's workspace (_MambaBase._workspace).
_THREAD_WORK = threading.local()


class _MambaBase:
    """Shared behaviour of the Mamba block estimators.

    A block describes itself with class attributes: ``_STATE_CLASS``; the
    forward op ``_FWD_OP``; the prepare op ``_PREPARE_OP`` and the weight
    names ``_WEIGHT_ORDER`` (the constructor's, and the gradients'); the
    backward op ``_BWD_OP``, the
    gradients it writes in full ``_BWD_WRITTEN``, whether it takes the
    transposed panels ``_BWD_PANELS``, whether its backward takes a start
    state, the final state's cotangents and ragged lengths ``_BWD_STATE``
    (every block now; mojolearn.torch's dict states need it); whether forward takes lengths with a state
    ``_RAGGED_STATE`` (each row's state is left at its length);
    ``_KEEP_WORK_BYTES`` (forward and
    backward workspaces over it are not kept; None: always kept). And with
    methods: ``_state_shapes(b)`` ({array name: shape}, in the state's
    ``_ARRAYS`` order), ``_state_views(state, batch)`` (the validated state,
    in the block's form), ``_written_views(sv)`` (its arrays), and
    ``_launch(...)`` (the op's arguments, the run and the state's advance).
    """

    _param_names: tuple = ("weights", "numeric_mode")
    _STATE_CLASS = None
    _FWD_OP = _PREPARE_OP = _BWD_OP = None
    _WEIGHT_ORDER: tuple = ()
    _BWD_WRITTEN: tuple = ()
    _BWD_PANELS = False
    _BWD_STATE = False
    _RAGGED_STATE = False  # forward takes lengths with a state
    _KEEP_WORK_BYTES = None

    def _setup_common(self, numeric_mode):
        self.numeric_mode = check_numeric_mode(numeric_mode)
        self._lib = library(self.numeric_mode)
        self._bwd_panels = None  # W_in^T | W_out^T panels, from the first backward

    # -- weights ------------------------------------------------------------
    # The projection weights live only in the prepared blob, in the format
    # they were given in: the prepare op copies float32 values, or the codes
    # of packed weights (mojolearn.lowbit), into matmul panels (bfloat16 /
    # int8 panels are widened exactly on load). get_params and backward read
    # them back out with OP_PANELS_EXTRACT. So a float32 block holds one copy
    # of its projections, and a packed block about 1/2 (bfloat16) or 1/4
    # (int8) of that, giving the bits of the block on unpack(weights). The
    # small weights (norms, biases, ...) are kept as float32 copies.
    _packed_names: tuple = ()  # the projections (panels), in blob section order

    def _keep_weights(self, views) -> dict:
        """Keep private float32 copies of the small weights in self._weights;
        return the weights for the prepare op (the projections as given, or
        for float32 ones a temporary copy: the prepare op copies them into
        the blob, and the block keeps only that)."""
        from .._array import Array
        self.weight_format = views.weight_format
        self._weight_names = tuple(views.keys())
        self._weights = {}
        self._packed_shapes = {}
        self._bwd_weights = None  # float32 projections, from the first backward
        prep = {}
        for name, v in views.items():
            p = views.packed.get(name)
            if p is not None and name in self._packed_names:
                self._packed_shapes[name] = p.shape
                prep[name] = p
                continue
            a = Array(v.shape, zero=False)
            copy_bytes(a, v.mv)
            prep[name] = a
            if name in self._packed_names:
                self._packed_shapes[name] = tuple(v.shape)
            else:
                self._weights[name] = a
        return prep

    def _projection(self, name):
        """Projection `name` read back out of the blob, as given: a new
        float32 Array (float32 block) or a new PackedWeight with its codes."""
        from .._array import Array
        from ..lowbit import PackedWeight
        rows, cols = self._packed_shapes[name]
        fmt = self.weight_format
        dtype = {"float32": "float32", "bfloat16": "uint16", "int8": "int8"}[fmt]
        data = Array((rows, cols), dtype, zero=False)
        ex = Array((rows,), "int32", zero=False) if fmt == "int8" else None
        if rows * cols:
            op = _abi.OP_PANELS_EXTRACT
            self._lib.run(op, _abi.op_spec(self._lib, op).pack(
                blob=self._blob, section=self._packed_names.index(name), rows=rows,
                cols=cols, dst=data, exponents=ex))
        return data if fmt == "float32" else PackedWeight._wrap(fmt, (rows, cols), data, ex)

    def _make_blob(self, w):
        """Run the prepare op: the prepared weights (packed weights stay
        packed in it)."""
        from .._array import Array
        fmt = "float32"
        for n in self._packed_names:
            if _is_packed(w[n]):
                fmt = w[n].format
        named = {n: weight_address(w[n]) for n in self._WEIGHT_ORDER}
        named.update({f"exp:{n}": _exponent_address(w[n]) for n in self._packed_names})
        named.update(self._prepare_extra())
        spec = _abi.op_spec(self._lib, self._PREPARE_OP)
        args = spec.pack(named, d=self.d_model, wfmt=_WF_ID[fmt])
        blob = Array((self._lib.workspace_bytes(self._PREPARE_OP, args) // 4,), zero=True)
        args[spec.slot("blob")] = blob.address
        self._lib.run(self._PREPARE_OP, args)
        return blob

    def _prepare_extra(self) -> dict:
        """The prepare op's block-specific scalar slots, by name."""
        return {}

    def _backward_weights(self):
        """(float32 weights, blob of float32 panels) for backward. A float32
        block reads its projections out of the blob on its first backward
        and keeps them (weights never change after construction; a racing
        first call reads its own copy: same bytes). On packed weights both
        are expanded per call (backward reads float32 panels), so such a
        block keeps holding only its packed bytes: the bits are those of the
        block on the expanded weights."""
        if self.weight_format == "float32":
            if self._bwd_weights is None:
                self._bwd_weights = self._float32_weights()
            return self._bwd_weights, self._blob
        w = self._float32_weights()
        return w, self._make_blob(w)

    def _float32_weights(self) -> dict:
        """Every weight as a float32 Array: the kept small ones, and the
        projections read out of the blob (packed ones expanded)."""
        w = dict(self._weights)
        for n in self._packed_shapes:
            p = self._projection(n)
            w[n] = p if self.weight_format == "float32" else p.to_float32()
        return w

    def _session_cache_bytes(self, batch_size: int) -> int:
        """Bytes of a decode session's speed cache for batch_size rows: none
        here (Mamba-2 keeps one)."""
        return 0

    def _held_bytes(self) -> int:
        """Bytes of the weight copies and the prepared blob the block holds
        (and the projections and transposed panels a float32 block keeps
        once a backward has made them)."""
        p = self._bwd_panels
        bw = self._bwd_weights
        extra = 0 if bw is None else sum(bw[n].nbytes for n in self._packed_shapes)
        return (self._blob.nbytes + sum(v.nbytes for v in self._weights.values())
                + extra + (0 if p is None else p.nbytes))

    def _backward_panels(self, w):
        """in_proj.weight^T and out_proj.weight^T of the float32 weights w in
        the matmul kernel's panels (the two weights' size), for the Mamba-2/3
        backwards' activation products. A float32 block packs them on its
        first backward and keeps them (weights never change after
        construction); a block on packed weights packs them per call, so it
        keeps holding only its packed bytes. Hold the result until the op
        returns."""
        p = self._bwd_panels
        if p is None:
            from .._array import Array
            wi, wo = w["in_proj.weight"], w["out_proj.weight"]
            (k1, m1), (k2, m2) = wi.shape, wo.shape
            op = _abi.OP_PACK_TRANSPOSED
            spec = _abi.op_spec(self._lib, op)
            args = spec.pack(k1=k1, m1=m1, w1=wi, k2=k2, m2=m2, w2=wo)
            p = Array((self._lib.workspace_bytes(op, args) // 4,), zero=False)
            args[spec.slot("dst")] = p.address
            self._lib.run(op, args)
            if self.weight_format == "float32":
                self._bwd_panels = p  # a racing first call packs its own copy: same bytes
        return p

    # -- estimator API ------------------------------------------------------
    def get_params(self, deep: bool = True) -> dict:
        """Constructor parameters: {'weights': copies, 'numeric_mode': ...};
        packed weights are returned packed, with the codes they were given
        (the projections are read back out of the prepared blob: the bytes
        the block was given)."""
        weights = {n: self._weights[n].copy() if n in self._weights else self._projection(n)
                   for n in self._weight_names}
        return {"weights": weights, "numeric_mode": self.numeric_mode}

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

    # -- the shared sequence of the public calls ---------------------------
    def _allocate(self, batch_size):
        """allocate_state: a zero state for batch_size sequences."""
        from .._array import Array
        b = _intake.as_int(batch_size, "batch_size")
        if b < 1:
            raise ValueError(f"batch_size must be >= 1, got {b}")
        shapes = self._state_shapes(b)
        return self._STATE_CLASS(*(Array(shapes[n]) for n in self._STATE_CLASS._ARRAYS))

    def _forward(self, x, state, lengths):
        """forward: intake of x and lengths, the state's views, overlap and
        finiteness checks, the output, then _launch."""
        from .._array import Array
        xv = self._x_view(x)
        b, l, d = xv.shape
        lens = self._lengths(lengths, state, b, l)
        sv = None
        if state is not None:
            sv = self._state_views(state, b)
            _intake.refuse_read_of_written(xv, self._written_views(sv))
        _intake.check_finite(self._lib, xv, rows=(b, l), lengths_address=lens[1])
        y = Array((b, l, d), zero=False)
        self._launch(xv, y, b, l, state, sv, lens, "forward")
        return y

    def _step(self, x, state):
        """step: forward at L = 1 with a state (required)."""
        from .._array import Array
        if state is None:
            raise ValueError("step needs a state (use allocate_state)")
        xv, b = self._step_x_view(x)
        sv = self._state_views(state, b)
        _intake.refuse_read_of_written(xv, self._written_views(sv))
        _intake.check_finite(self._lib, xv)
        y = Array((b, 1, self.d_model), zero=False)
        self._launch(xv, y, b, 1, state, sv, (None, 0), "step")
        return y

    def _launch(self, xv, y, b, l, state, sv, lens, kind):
        """Run the forward op on validated views (state None: a zero-state
        prefill) and advance the state. lens: (keep-alive, address) of the
        lengths; kind: 'forward' or 'step'."""
        raise NotImplementedError

    @staticmethod
    def _written_views(sv):
        """The state arrays among _state_views' result."""
        return sv

    def _fwd_spec(self):
        """The forward op's OpSpec (its slots by name)."""
        return _abi.op_spec(self._lib, self._FWD_OP)

    def _run(self, args):
        """Run the forward op with the thread's workspace in its work slot."""
        # a big prefill's workspace is not kept (if _KEEP_WORK_BYTES is set)
        self._run_op(self._FWD_OP, args, keep_bytes=self._KEEP_WORK_BYTES)

    def _backward(self, x, grad_output, state=None, grad_state=None, lengths=None):
        """backward: the gradients of forward(x, state) (zeros if state is
        None) for the loss sum(y * grad_output) + the sum over the final
        state's arrays of array * grad_state[name]. The op takes x,
        grad_output, the blob, the float32 projections, the gradient arrays
        under 'grad:<weight name>', if _BWD_PANELS the transposed panels,
        and (only when given) the start state, the cotangents, the lengths
        and the start state's gradient arrays. (Mamba-2 and Mamba-3 call it
        only for the zero-state backward: they have their own intake of
        the state arguments.)"""
        xv, gv, lens = self._backward_views(x, grad_output, lengths)
        b = xv.shape[0]
        sv = {} if state is None else _grad_state.start_state_views(self, state, b)
        gsv = {} if grad_state is None else _grad_state.cotangent_views(self, grad_state, b)
        named, shapes = {}, None
        if state is not None or grad_state is not None:
            all_shapes = self._state_shapes(b)
            shapes = {n: all_shapes[n] for n in self._bwd_state_arrays()}
            named.update(self._backward_state_args(state, sv))
            named.update({f"grad_state:{n}": v for n, v in gsv.items()})
        return self._run_backward(xv, gv, lens, named, shapes)

    def _run_backward(self, xv, gv, lens, named, state_shapes=None, **scalars):
        """Run the backward op on views xv, gv (B, L, d) and the ragged
        lengths lens, with `named` holding the block's state and cotangent
        slots; allocate the gradients (the kernel writes the _BWD_WRITTEN
        ones and every 'state.<name>' of state_shapes in full: no memset)
        and return them. `scalars` go to the op's other named slots."""
        from .._array import Array
        b, l, d = xv.shape
        w, blob = self._backward_weights()
        grads = self._grad_arrays((b, l, d), w, self._WEIGHT_ORDER, written=self._BWD_WRITTEN)
        for n, shape in (state_shapes or {}).items():
            grads[f"state.{n}"] = named[f"grad:state.{n}"] = Array(shape, zero=False)
        named.update({n: w[n] for n in self._packed_names})
        named.update({f"grad:{n}": grads[n] for n in self._WEIGHT_ORDER})
        if lens[1]:
            named["lengths"] = lens[1]
        if self._BWD_PANELS:
            named["panels"] = self._backward_panels(w)  # `named` holds it until the op returns
        args = _abi.op_spec(self._lib, self._BWD_OP).pack(
            named, b=b, l=l, d=d, x=xv, grad_output=gv, blob=blob, dx=grads["x"], **scalars)
        self._run_op(self._BWD_OP, args, keep_bytes=self._KEEP_WORK_BYTES)
        return grads

    # -- state views --------------------------------------------------------
    def _check_state_type(self, state):
        """TypeError for a state of another class than _STATE_CLASS."""
        cls = self._STATE_CLASS
        if not isinstance(state, cls):
            raise TypeError(f"state must be a {cls.__name__}, got {type(state).__name__}")

    def _check_state(self, state):
        """_check_state_type, then ValueError if an open decode session holds it."""
        self._check_state_type(state)
        check_not_held(state)

    def _state_arrays(self, state, ndim=False) -> dict:
        """{name: view} of the state's arrays, in _ARRAYS order (ndim: each
        must have as many dimensions as its shape)."""
        shapes = self._state_shapes(1) if ndim else None
        return {n: array_view(state, n, (len(shapes[n]),) if ndim else None)
                for n in state._ARRAYS}

    def _check_state_shapes(self, views: dict, b):
        for n, shape in self._state_shapes(b).items():
            _intake.check_shape(views[n], shape)

    def _check_rows_finite(self, views, b, rows, chunk):
        """check_finite on rows [0, rows) of each (b, chunk, ...) view: only
        the buffered rows of the working chunk are ever read."""
        from array import array as _pyarray
        from .._loader import native
        lens = _pyarray("q", [rows] * b)
        lmv = memoryview(lens)
        addr = native().address(lmv)
        for v in views:
            _intake.check_finite(self._lib, v, rows=(b, chunk), lengths_address=addr)

    # -- intake -------------------------------------------------------------
    def _x_view(self, x, name="x"):
        v = _intake.float32_view(x, name, ndim=(3,))
        b, l, d = v.shape
        if b == 0 or l == 0:
            raise ValueError(f"{name} must have B >= 1 and L >= 1, got shape {v.shape}")
        if d != self.d_model:
            raise ValueError(f"{name} has d_model {d}, the block has {self.d_model}")
        return v

    def _lengths(self, lengths, state, b, l):
        """(keep-alive, address) of validated ragged lengths; (None, 0) if
        none. With a state only where the forward ends each row's state at
        its length (_RAGGED_STATE)."""
        if lengths is None:
            return None, 0
        if state is not None and not self._RAGGED_STATE:
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

    def _run_op(self, op, args, keep_bytes=None):
        """Run op with the thread's workspace address in its work slot; a
        workspace over keep_bytes (if given) is dropped after the call."""
        work = self._workspace(op, args)
        try:
            args[_abi.op_spec(self._lib, op).slot("work")] = work.address
            self._lib.run(op, args)
        finally:
            if keep_bytes is not None and work.size * 4 > keep_bytes:
                self._forget_workspace()

    @staticmethod
    def _grad_arrays(x_shape, w, names, written=()):
        """The backward's outputs: 'x' and one Array per weight name in
        `names` (shaped like w[name]); zeroed, except the `written` ones,
        which the kernel writes in full."""
        from .._array import Array
        grads = {"x": Array(x_shape, zero=False)}
        for name in names:
            grads[name] = Array(w[name].shape, zero=name not in written)
        return grads

    def _bwd_state_arrays(self) -> tuple:
        """The state arrays the output depends on: backward returns a
        'state.<name>' gradient for each (all of the state's arrays by
        default)."""
        return self._STATE_CLASS._ARRAYS

    def _backward_state_args(self, state, sv: dict) -> dict:
        """The backward op's arguments for the start state: its validated
        arrays sv under 'state:<name>' (state None: {}, zeros). A block
        whose state also has plain values the kernel needs adds them here."""
        return {f"state:{n}": v for n, v in sv.items()}

    def _backward_views(self, x, grad_output, lengths=None):
        """Validated (x, grad_output, (keep-alive, address) of the lengths)
        for backward: same shape, finite at the real positions (a ragged
        row's padding may hold anything: it is never read)."""
        xv = self._x_view(x)
        gv = _intake.float32_view(grad_output, "grad_output", ndim=(3,))
        if gv.shape != xv.shape:
            raise ValueError(f"grad_output must have the shape of x {xv.shape}, "
                             f"got {gv.shape}")
        b, l, _ = xv.shape
        lens = (None, 0)
        if lengths is not None:
            keep = _intake.lengths_array(lengths, b, l)
            lens = keep, keep[2]
        _intake.check_finite(self._lib, xv, rows=(b, l), lengths_address=lens[1])
        _intake.check_finite(self._lib, gv, rows=(b, l), lengths_address=lens[1])
        return xv, gv, lens

    def _workspace(self, op, args):
        """The calling thread's workspace, at least as large as op needs.

        One workspace per thread, shared by every block that thread calls
        (grown to the largest call so far): repeated calls neither allocate
        nor fault in fresh pages, and a model of many blocks holds one
        workspace, not one per block. It is scratch only: nothing is read
        from it after the op returns. Threads never share one, so blocks
        may be called from several threads at once.
        """
        from .._array import Array
        floats = workspace_floats(self._lib, op, args)
        work = getattr(_THREAD_WORK, "array", None)
        if work is None or work.size < floats:
            _THREAD_WORK.array = None  # free the smaller one first
            work = _THREAD_WORK.array = Array((floats,), zero=False)
        return work

    @staticmethod
    def _forget_workspace():
        """Drop the calling thread's workspace (after an unusually big call)."""
        _THREAD_WORK.array = None
