"""What every Mamba block shares besides its runner (mamba/_runner.py):
construction checks, numeric modes, the binary it runs on, the weights it
keeps and their prepared blob, params, the intake of x and the state
checks every family's state views use."""
from __future__ import annotations

import threading

from .. import _abi, _intake
from ..lowbit import FORMAT_IDS
from .._loader import available_modes, describe, library
from ._state import array_view, check_not_held

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
    shapes = _given_a_shapes(names, shapes)
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
    if GIVEN_A in views:
        _check_given_a(views[GIVEN_A])
    return views


# A block may take the decay rates A = -exp(A_log) themselves, under the name
# "A" in place of "A_log": GGUF files store A (computed by torch), and
# -exp(log(-A)) would not give those float32 bits back. The prepare op then
# copies A instead of computing it (its slot "a_given"). Such a block has no
# A_log, so backward (whose gradient is taken w.r.t. A_log) is refused.
GIVEN_A = "A"


def _given_a_shapes(names, shapes: dict) -> dict:
    """shapes with "A" in place of "A_log" when the weights give A and not
    A_log (Mamba-1 and Mamba-2 only: Mamba-3 has no A_log)."""
    if "A_log" in shapes and GIVEN_A in names and "A_log" not in names:
        return {(GIVEN_A if n == "A_log" else n): v for n, v in shapes.items()}
    return shapes


def _check_given_a(view) -> None:
    """A = -exp(A_log) is never positive: ValueError naming A and the first
    positive entry otherwise."""
    vals = view.mv.cast("B").cast("f")
    for i, a in enumerate(vals):
        if a > 0:
            raise ValueError(f"weight A must be <= 0 everywhere (A = -exp(A_log)); "
                             f"A[{i}] (flat index) = {a!r}")


class _Views(dict):
    """weight_views' result: {name: View} of float32 values, plus the format
    the weights were given in (weight_format: 'float32', a mojolearn.lowbit
    format or 'mixed') and the packed values as given (packed: {name: PackedWeight})."""

    weight_format = "float32"
    packed: dict = {}




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


# The calling thread's workspace (_MambaBase._workspace, Runner.run).
_THREAD_WORK = threading.local()


class _MambaBase:
    """Shared behaviour of the Mamba block estimators.

    A block class sets ``_runner``, a Runner made from its family's
    BlockSpec (mamba/_runner.py): the ops, weight names, state class and
    the family's own functions. Its public calls go to the runner.
    """

    _param_names: tuple = ("weights", "numeric_mode")
    _runner = None

    def _setup_common(self, numeric_mode):
        self.numeric_mode = check_numeric_mode(numeric_mode)
        self._lib = library(self.numeric_mode)
        self._bwd_panels = None  # W_in^T | W_out^T panels, from the first backward

    # -- weights ------------------------------------------------------------
    # The projection weights live only in the prepared blob, in the format
    # they were given in: the prepare op copies float32 values, or the codes
    # of packed weights (mojolearn.lowbit), into matmul panels (packed
    # panels are widened exactly on load). get_params and backward read
    # them back out with OP_PANELS_EXTRACT. So a float32 block holds one copy
    # of its projections, and a packed block about 1/2 (bfloat16), 1/4
    # (int8, q8_0: 8.5 bits a value) or 1/7 (q4_0: 4.5 bits) of that, giving
    # the bits of the block on unpack(weights). Each projection keeps its own
    # format (a mix: weight_format 'mixed'; the blob header records one
    # format per projection). The small weights (norms, biases, ...) are
    # kept as float32 copies.
    @property
    def d_model(self) -> int:
        """Model dimension d_model, read from the block's norm weight."""
        return self._d_model

    @property
    def d_inner(self) -> int:
        """Inner dimension, 2 * d_model."""
        return 2 * self._d_model

    @property
    def weight_format(self) -> str:
        """Format the projection weights were given in ('float32',
        'bfloat16', 'int8', 'q4_0', 'q8_0', or 'mixed' when they differ)."""
        return self._weight_format

    @property
    def weight_formats(self) -> dict:
        """Each projection weight's format, by name (a new dict each read)."""
        return dict(self._weight_formats)

    def _keep_weights(self, views) -> dict:
        """Keep private float32 copies of the small weights in self._weights;
        return the weights for the prepare op (the projections as given, or
        for float32 ones a temporary copy: the prepare op copies them into
        the blob, and the block keeps only that)."""
        from .._array import Array
        from ..lowbit import _common_format
        projections = self._runner.spec.projections
        for name in views.packed:
            if name not in projections:
                raise ValueError(f"weight {name} is packed; only the projection weights "
                                 f"{list(projections)} may be (give it as float32)")
        self._weight_formats = {n: views.packed[n].format if n in views.packed else "float32"
                                for n in projections}
        self._weight_format = _common_format(self._weight_formats)
        self._weight_names = tuple(views.keys())
        self._weights = {}
        self._packed_shapes = {}
        self._bwd_weights = None  # float32 projections, from the first backward
        prep = {}
        for name, v in views.items():
            p = views.packed.get(name)
            if p is not None:
                self._packed_shapes[name] = p.shape
                prep[name] = p
                continue
            a = Array(v.shape, zero=False)
            copy_bytes(a, v.mv)
            prep[name] = a
            if name in self._runner.spec.projections:
                self._packed_shapes[name] = tuple(v.shape)
            else:
                self._weights[name] = a
        return prep

    def _projection(self, name):
        """Projection `name` read back out of the blob, as given: a new
        float32 Array (float32 block) or a new PackedWeight with its codes."""
        from .._array import Array
        from ..lowbit import BLOCK, BLOCK_BYTES, PackedWeight
        rows, cols = self._packed_shapes[name]
        fmt = self._weight_formats[name]
        if fmt in BLOCK_BYTES:  # the blocks' bytes (lowbit)
            data = Array((rows, -(-cols // BLOCK) * BLOCK_BYTES[fmt]), "uint8", zero=False)
        else:
            dtype = {"float32": "float32", "bfloat16": "uint16", "int8": "int8"}[fmt]
            data = Array((rows, cols), dtype, zero=False)
        ex = Array((rows,), "int32", zero=False) if fmt == "int8" else None
        if rows * cols:
            op = _abi.OP_PANELS_EXTRACT
            self._lib.run(op, _abi.op_spec(self._lib, op).pack(
                blob=self._blob, section=self._runner.spec.projections.index(name), rows=rows,
                cols=cols, dst=data, exponents=ex))
        return data if fmt == "float32" else PackedWeight._wrap(fmt, (rows, cols), data, ex)

    def _make_blob(self, w):
        """Run the prepare op: the prepared weights (packed weights stay
        packed in it)."""
        from .._array import Array
        bs = self._runner.spec
        # one 4-bit format id per projection, in the order of the blob's sections
        wfmt = sum(FORMAT_IDS[w[n].format if _is_packed(w[n]) else "float32"] << (4 * i)
                   for i, n in enumerate(bs.projections))
        given_a = GIVEN_A in w  # the A_log slot then takes A, copied as is
        named = {n: weight_address(w[GIVEN_A if given_a and n == "A_log" else n])
                 for n in bs.weight_order}
        if given_a:
            named["a_given"] = 1
        named.update({f"exp:{n}": _exponent_address(w[n]) for n in bs.projections})
        named.update(bs.prepare_scalars(self))
        spec = _abi.op_spec(self._lib, bs.prepare_op)
        op = spec.op
        args = spec.pack(named, d=self.d_model, wfmt=wfmt)
        blob = Array((self._lib.workspace_bytes(op, args) // 4,), zero=True)
        args[spec.slot("blob")] = blob.address
        self._lib.run(op, args)
        return blob

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
            w[n] = p if self._weight_formats[n] == "float32" else p.to_float32()
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
    def forward(self, x, state=None, *, lengths=None):
        """Run the block over a sequence.

        Parameters
        ----------
        x : float32 buffer, shape (B, L, d_model)
        state : the block's state (a Mamba1State for a Mamba1Block, and so
            on) or None
            None: a self-contained prefill from a zero state. A state is read
            at entry and updated in place (a later call continues it bit for
            bit).
        lengths : sequence of int or None
            Ragged batch: B ints in [1, L]; padding outputs are exactly +0.0
            (Mamba-1 never reads padding inputs; Mamba-2 reads them as +0.0).
            Mamba-2 and Mamba-3 refuse lengths with a state; on a Mamba1Block row b's
            state is left as it was after its first lengths[b] tokens (what
            the row alone at its length leaves, bit for bit) and
            absolute_position still advances by L.

        Returns
        -------
        y : mojolearn.Array, shape (B, L, d_model)
        """
        return self._runner.forward(self, x, state, lengths)

    def step(self, x, state):
        """Run one decode token: forward at L = 1 with the state carried.

        Parameters
        ----------
        x : float32 buffer, shape (B, 1, d_model) or (B, d_model)
        state : the block's state (a Mamba1State for a Mamba1Block, and so
            on; required; updated in place)

        Returns
        -------
        y : mojolearn.Array, shape (B, 1, d_model)
        """
        return self._runner.step(self, x, state)

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

    # -- state views --------------------------------------------------------
    def _check_state_type(self, state):
        """TypeError for a state of another class than the spec's."""
        cls = self._runner.spec.state_class
        if not isinstance(state, cls):
            raise TypeError(f"state must be a {cls.__name__}, got {type(state).__name__}")

    def _check_state(self, state):
        """_check_state_type, then ValueError if an open decode session holds it."""
        self._check_state_type(state)
        check_not_held(state)

    def _state_arrays(self, state, ndim=False) -> dict:
        """{name: view} of the state's arrays, in _ARRAYS order (ndim: each
        must have as many dimensions as its shape)."""
        shapes = self._runner.spec.state_shapes(self, 1) if ndim else None
        return {n: array_view(state, n, (len(shapes[n]),) if ndim else None)
                for n in state._ARRAYS}

    def _check_state_shapes(self, views: dict, b):
        for n, shape in self._runner.spec.state_shapes(self, b).items():
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
