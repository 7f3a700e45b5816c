"""Mamba-2 (SSD): Mamba2Block, Mamba2BlockInference and Mamba2State."""
from __future__ import annotations

import math
import struct

from .. import _abi, _intake
from ._state import StateBase
from ._session_base import DecodeSessionBase, check_not_held
from ._base import _MambaBase, copy_bytes, weight_address, weight_views

D_STATE = 128
HEAD_DIM = 64
D_CONV = 4
CHUNK = 256

# OP_M2_FORWARD argument slots (mojo/mojolearn_kernels/mamba2.mojo).
_FWD_SLOTS = 16
_FWD_WORK = 14
_FWD_CACHE = 15  # a decode session's cache (mamba2_layout.mojo, CACHE_HDR)
_CACHE_HDR = 16
# The block keeps its workspace between calls (no allocation per decode
# step) unless it is larger than this (a prefill of many rows).
_KEEP_WORK_BYTES = 64 << 20


def mamba2_dims(d: int) -> tuple:
    """(d_inner, nheads, conv_dim, in_proj rows) for d_model d."""
    di = 2 * d
    h = di // HEAD_DIM
    cd = di + 2 * D_STATE
    return di, h, cd, 2 * di + 2 * D_STATE + h


def mamba2_weight_shapes(d: int) -> dict:
    di, h, cd, npj = mamba2_dims(d)
    return {
        "block_norm.weight": (d,),
        "in_proj.weight": (npj, d),
        "conv1d.weight": ((cd, 1, D_CONV), (cd, D_CONV)),
        "conv1d.bias": (cd,),
        "dt_bias": (h,),
        "A_log": (h,),
        "D": (h,),
        "norm.weight": (di,),
        "out_proj.weight": (d, di),
    }


# Gradient arrays of Mamba2Block.backward, in the kernel's argument order
# (OP_M2_BACKWARD slots 10..18, mojo/mojolearn_kernels/mamba2_backward.mojo).
_BACKWARD_GRAD_NAMES = ("block_norm.weight", "in_proj.weight", "conv1d.weight",
                        "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
                        "out_proj.weight")

_WEIGHT_ORDER = ("block_norm.weight", "in_proj.weight", "conv1d.weight", "conv1d.bias",
                 "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")


def check_dt_limit(dt_limit) -> tuple:
    """(lo, hi) as Python floats; ValueError for anything but two numbers
    without NaN and with lo <= hi."""
    if isinstance(dt_limit, (str, bytes)):
        raise ValueError(f"dt_limit must be a tuple of two numbers (lo, hi), got {dt_limit!r}")
    try:
        items = tuple(dt_limit)
    except TypeError:
        raise ValueError(f"dt_limit must be a tuple of two numbers (lo, hi), got "
                         f"{dt_limit!r}") from None
    if len(items) != 2:
        raise ValueError(f"dt_limit must be two numbers (lo, hi), got {len(items)}: {dt_limit!r}")
    vals = []
    for v in items:
        if isinstance(v, bool) or not hasattr(type(v), "__float__") or isinstance(v, complex):
            raise ValueError(f"dt_limit must hold two real numbers, got {dt_limit!r}")
        try:
            vals.append(float(v))
        except (TypeError, ValueError):
            raise ValueError(f"dt_limit must hold two real numbers, got {dt_limit!r}") from None
    lo, hi = vals
    if math.isnan(lo) or math.isnan(hi):
        raise ValueError(f"dt_limit must not contain NaN, got {dt_limit!r}")
    if lo > hi:
        raise ValueError(f"dt_limit needs lo <= hi, got {dt_limit!r}")
    return lo, hi


def _f32_bits(v: float) -> int:
    """float32 bit pattern of v (rounded to nearest; beyond the float32 range
    -> +-inf) as a signed int32."""
    if math.isinf(v) or abs(v) > 3.4028235677973366e38:
        v = math.copysign(math.inf, v)
    return struct.unpack("<i", struct.pack("<f", v))[0]


class Mamba2State(StateBase):
    """Recurrent state of a Mamba2Block, owned by the caller.

    With H = d_model / 32 heads and CD = 2 * d_model + 256 convolution
    channels. Make one with ``Mamba2Block.allocate_state``; it is all zeros
    (and buffered_tokens == 0) before the first token. forward and step
    update it in place. Setting h nonzero on a fresh state supplies the
    reference's initial_states.

    Parameters
    ----------
    conv_window : float32 buffer, shape (B, CD, 4)
        The last four pre-convolution xBC inputs, oldest first.
    h : float32 buffer, shape (B, H, 64, 128)
        SSM state as of the last completed 256-token chunk.
    buffer_xbc : float32 buffer, shape (B, 256, CD)
        Post-convolution, post-SiLU xBC rows of the open chunk. Rows at and
        past buffered_tokens are not read (the block keeps them +0.0).
    buffer_dtraw : float32 buffer, shape (B, 256, H)
        Raw dt rows of the open chunk (dt_bias not added).
    buffered_tokens : int in [0, 256)
        Valid rows in the open-chunk buffers (tokens so far mod 256).
    """

    _ARRAYS = ("conv_window", "h", "buffer_xbc", "buffer_dtraw")
    _VALUES = ("buffered_tokens",)

    def __init__(self, conv_window, h, buffer_xbc, buffer_dtraw, buffered_tokens=0):
        self.conv_window = conv_window
        self.h = h
        self.buffer_xbc = buffer_xbc
        self.buffer_dtraw = buffer_dtraw
        bt = _intake.as_int(buffered_tokens, "buffered_tokens")
        if not 0 <= bt < CHUNK:
            raise ValueError(f"buffered_tokens = {bt} is outside [0, {CHUNK})")
        self.buffered_tokens = bt
        self._version = 0  # bumped by every call that updates the state
        self._held_by = None  # an open Mamba2DecodeSession

    def __repr__(self):
        shape = getattr(memoryview(self.h), "shape", None)
        return (f"Mamba2State(h shape={tuple(shape) if shape else None}, "
                f"buffered_tokens={self.buffered_tokens})")


class Mamba2Block(_MambaBase):
    """One Mamba-2 (SSD) block: RMSNorm, mixer and residual.

    Matches Hugging Face's ``Mamba2Block.forward`` (torch path). Takes
    (B, L, d_model) float32 and returns (B, L, d_model) float32, with the
    recurrent state explicit and caller-owned (Mamba2State).

    d_model must be a multiple of 32. Fixed: d_state 128, head dim 64, one
    group, chunk 256, expand 2, conv 4 with bias, gate applied before the
    gated RMSNorm. Decoding resumes the open chunk, so step and a forward
    with a carried state continue a prefill bit for bit (docs/mamba2.md).

    Parameters
    ----------
    weights : dict of str to float32 buffer
        With d = d_model, di = 2d, H = di / 64 heads and CD = di + 256;
        copied at construction. Projection weights may be packed with
        :mod:`mojolearn.lowbit`; they stay packed in the block (the kernels
        widen them exactly on load).

        - ``block_norm.weight`` (d,), the block norm
        - ``in_proj.weight`` (2di + 256 + H, d), rows z | xBC | dt
        - ``conv1d.weight`` (CD, 1, 4) or (CD, 4)
        - ``conv1d.bias`` (CD,)
        - ``dt_bias`` (H,)
        - ``A_log`` (H,), one value per head
        - ``D`` (H,)
        - ``norm.weight`` (di,), the gated norm
        - ``out_proj.weight`` (d, di)
    dt_limit : (lo, hi), default (0.0, inf)
        dt = min(max(softplus(dtraw + dt_bias), lo), hi); the limits are
        rounded to float32. NaN, lo > hi or not two numbers: ValueError.
    numeric_mode : {'identical', 'fast'}, default 'identical'
        See the user guide's numeric modes page.

    Attributes
    ----------
    d_model : int
        Model dimension, read from block_norm.weight.
    d_inner : int
        Inner dimension, 2 * d_model.
    nheads : int
        Number of heads H, d_inner / 64.
    conv_dim : int
        Convolution channels CD, d_inner + 256.
    dt_limit : tuple of float
        The dt clamp (lo, hi), rounded to float32.
    weight_format : str
        Format the weights were given in ('float32', 'bfloat16' or 'int8').
    h_last_ : float32 mojolearn.Array, shape (B, H, 64, 128)
        After every forward/step: the SSM state after all tokens so far (a
        report: on a chunk boundary it equals state.h bitwise; mid-chunk it
        is the fold formula applied to the partial chunk). After a call with
        a state it is computed on first access from that state, which must
        not have been advanced by another call in between (ValueError).

    Examples
    --------
    >>> import numpy as np, mojolearn
    >>> block = mojolearn.Mamba2Block(weights, numeric_mode="identical")
    >>> x = np.random.default_rng(0).random((2, 16, block.d_model), dtype=np.float32)
    >>> y = block.forward(x)
    >>> state = block.allocate_state(batch_size=x.shape[0])
    >>> y0 = block.step(x[:, :1], state)
    """

    _param_names = ("weights", "numeric_mode", "dt_limit")

    _packed_names = ("in_proj.weight", "out_proj.weight")

    def __init__(self, weights, *, dt_limit=(0.0, math.inf), numeric_mode: str = "identical"):
        self._setup_common(numeric_mode)
        lo, hi = check_dt_limit(dt_limit)
        if not hasattr(weights, "keys") or "block_norm.weight" not in weights:
            weight_views(weights, mamba2_weight_shapes(32), self._lib)  # names the problem
        norm = _intake.float32_view(weights["block_norm.weight"], "block_norm.weight", ndim=(1,))
        d = norm.shape[0]
        if d < 32 or d % 32:
            raise ValueError(f"Mamba-2 needs d_model a positive multiple of 32; "
                             f"block_norm.weight has {d} entries")
        views = weight_views(weights, mamba2_weight_shapes(d), self._lib)
        prep = self._keep_weights(views)
        self.d_model = d
        self.d_inner, self.nheads, self.conv_dim, self._npj = mamba2_dims(d)
        self.dt_limit = (lo, hi)
        self._blob = self._make_blob(prep)
        self._h_last = None
        self._h_last_src = None

    def _make_blob(self, w):
        """The prepared weights (packed weights stay packed in it)."""
        lo, hi = self.dt_limit
        args = ([self.d_model] + [weight_address(w[n]) for n in _WEIGHT_ORDER]
                + [_f32_bits(lo), _f32_bits(hi), 0])
        return self._build_blob(_abi.OP_M2_PREPARE, args, w)

    def get_params(self, deep: bool = True) -> dict:
        """Constructor parameters: weights (copies), numeric_mode, dt_limit."""
        p = super().get_params(deep)
        p["dt_limit"] = self.dt_limit
        return p

    # -- state --------------------------------------------------------------
    def allocate_state(self, batch_size) -> Mamba2State:
        """Return a zero Mamba2State for batch_size sequences.

        Set its h nonzero before the first call to supply initial_states.
        """
        from .._array import Array
        b = _intake.as_int(batch_size, "batch_size")
        if b < 1:
            raise ValueError(f"batch_size must be >= 1, got {b}")
        return Mamba2State(Array((b, self.conv_dim, D_CONV)),
                           Array((b, self.nheads, HEAD_DIM, D_STATE)),
                           Array((b, CHUNK, self.conv_dim)),
                           Array((b, CHUNK, self.nheads)), 0)

    def _state_views(self, state, batch):
        if not isinstance(state, Mamba2State):
            raise TypeError(f"state must be a Mamba2State, got {type(state).__name__}")
        check_not_held(state)
        bt = _intake.as_int(state.buffered_tokens, "state.buffered_tokens")
        if not 0 <= bt < CHUNK:
            raise ValueError(f"state.buffered_tokens = {bt} is outside [0, {CHUNK})")
        names = ("conv_window", "h", "buffer_xbc", "buffer_dtraw")
        views = [_intake.float32_view(getattr(state, n), f"state.{n}", ndim=(len(s),),
                                      writable=True, contiguous_only=True)
                 for n, s in zip(names, self._state_shapes(1))]
        b = views[0].shape[0] if batch is None else batch
        rows = [v.shape[0] for v in views]
        if any(r != b for r in rows):
            who = f"x has B={b}" if batch is not None else "the state arrays disagree"
            raise ValueError(f"batch mismatch: {who}; state rows: "
                             + ", ".join(f"{n} {r}" for n, r in zip(names, rows)))
        for v, shape in zip(views, self._state_shapes(b)):
            _intake.check_shape(v, shape)
        _intake.check_finite(self._lib, views[0])
        _intake.check_finite(self._lib, views[1])
        if bt:  # only the buffered rows are read
            from array import array as _pyarray
            from .._loader import native
            lens = _pyarray("q", [bt] * b)
            lmv = memoryview(lens)
            addr = native().address(lmv)
            _intake.check_finite(self._lib, views[2], rows=(b, CHUNK), lengths_address=addr)
            _intake.check_finite(self._lib, views[3], rows=(b, CHUNK), lengths_address=addr)
        _intake.refuse_overlap(views)
        return views

    def _state_shapes(self, b):
        return ((b, self.conv_dim, D_CONV), (b, self.nheads, HEAD_DIM, D_STATE),
                (b, CHUNK, self.conv_dim), (b, CHUNK, self.nheads))

    # -- compute ------------------------------------------------------------
    def forward(self, x, state=None, *, lengths=None):
        """Run the block over a sequence.

        Parameters
        ----------
        x : float32 buffer, shape (B, L, d_model)
        state : Mamba2State or None
            None: a self-contained prefill from a zero state. A state is read
            at entry and updated in place (a later call continues it bit for
            bit).
        lengths : sequence of int or None
            Ragged batch: B ints in [1, L]; padding outputs are exactly +0.0
            and padding inputs are read as +0.0. Not allowed with a state.

        Returns
        -------
        y : mojolearn.Array, shape (B, L, d_model)
        """
        from .._array import Array
        xv = self._x_view(x)
        b, l, d = xv.shape
        lens_keep, lens_addr = self._lengths(lengths, state, b, l)
        sv = None
        if state is not None:
            sv = self._state_views(state, b)
            _intake.refuse_overlap(sv, (xv,))
        _intake.check_finite(self._lib, xv, rows=(b, l), lengths_address=lens_addr)
        y = Array((b, l, d), zero=False)
        self._call(xv, y, b, l, state, sv, lens_addr)
        return y

    def step(self, x, state):
        """Run one decode token: forward at L = 1 with the state carried.

        Parameters
        ----------
        x : float32 buffer, shape (B, 1, d_model) or (B, d_model)
        state : Mamba2State (required; updated in place)

        Returns
        -------
        y : mojolearn.Array, shape (B, 1, d_model)
        """
        from .._array import Array
        if state is None:
            raise ValueError("step needs a state (use allocate_state)")
        xv, b = self._step_x_view(x)
        sv = self._state_views(state, b)
        _intake.refuse_overlap(sv, (xv,))
        _intake.check_finite(self._lib, xv)
        y = Array((b, 1, self.d_model), zero=False)
        self._call(xv, y, b, 1, state, sv, 0)
        return y

    def _args(self, b, l, x_addr, y_addr, sv, s, lens_addr, hlast_addr, save):
        args = [0] * _FWD_SLOTS
        args[0:6] = [b, l, self.d_model, x_addr, y_addr, self._blob.address]
        if sv is not None:
            args[6:11] = [sv[0].address, sv[1].address, sv[2].address, sv[3].address, s]
        args[11:14] = [lens_addr, hlast_addr, 1 if save else 0]
        return args

    def _call(self, xv, y, b, l, state, sv, lens_addr):
        from .._array import Array
        if state is None:
            h_last = Array((b, self.nheads, HEAD_DIM, D_STATE), zero=False)
            args = self._args(b, l, xv.address, y.address, None, 0, lens_addr,
                              h_last.address, False)
            self._run(args)
            self._h_last, self._h_last_src = h_last, None
        else:
            s = _intake.as_int(state.buffered_tokens, "state.buffered_tokens")
            args = self._args(b, l, xv.address, y.address, sv, s, 0, 0, True)
            self._run(args)
            state.buffered_tokens = (s + l) % CHUNK
            state._version += 1
            # h_last_ is computed on first access from the state this call left
            self._h_last = None
            self._h_last_src = (state, state._version, sv, b, state.buffered_tokens)

    def _run(self, args):
        """Run the forward op with the thread's workspace in slot FWD_WORK."""
        # a big prefill's workspace is not kept
        self._run_op(_abi.OP_M2_FORWARD, args, _FWD_WORK, keep_bytes=_KEEP_WORK_BYTES)

    @property
    def h_last_(self):
        """SSM state after all tokens of the last call, (B, H, 64, 128)."""
        if self._h_last is None:
            if self._h_last_src is None:
                raise AttributeError("h_last_ is set by forward or step; call one first")
            from .._array import Array
            state, version, sv, b, s = self._h_last_src
            if state._version != version:
                raise ValueError("h_last_ of the last call is no longer available: its "
                                 "state was advanced by another call since")
            h_last = Array((b, self.nheads, HEAD_DIM, D_STATE), zero=False)
            args = self._args(b, 0, 0, 0, sv, s, 0, h_last.address, False)
            self._run(args)
            self._h_last, self._h_last_src = h_last, None
        return self._h_last

    def decode_session(self, state):
        """Open a Mamba2DecodeSession: token-by-token decoding that gives the
        bytes of ``step`` without re-validating the state at every token."""
        return Mamba2DecodeSession(self, state)

    def backward(self, x, grad_output):
        """Gradients of a zero-state prefill (a vector-Jacobian product).

        Recomputes the forward with the current weights on every call; no
        earlier forward, state or ``h_last_`` is used or changed. The gradient
        through the dt_limit clamp follows torch.clamp: it passes where
        lo <= softplus(dtraw + dt_bias) <= hi (bounds included) and is zero
        outside. Kernel order and memory: docs/backward.md ("Mamba-2").

        Parameters
        ----------
        x : float32 buffer, shape (B, L, d_model)
        grad_output : float32 buffer, shape (B, L, d_model), finite

        Returns
        -------
        grads : dict of str to mojolearn.Array
            'x' (B, L, d_model) and one entry per constructor weight, under the
            same name and in the shape the weight was given.
        """
        xv, gv = self._backward_views(x, grad_output)
        b, l, d = xv.shape
        w, blob = self._backward_weights()
        # the kernel writes the projections' gradients in full (no memset)
        grads = self._grad_arrays((b, l, d), w, _BACKWARD_GRAD_NAMES,
                                  written=("in_proj.weight", "out_proj.weight"))
        args = ([b, l, d, xv.address, gv.address, blob.address, 0,
                 grads["x"].address, w["in_proj.weight"].address,
                 w["out_proj.weight"].address]
                + [grads[n].address for n in _BACKWARD_GRAD_NAMES])
        panels = self._backward_panels(w)  # held until the op returns
        args.append(panels.address)
        # a big backward workspace is not kept
        self._run_op(_abi.OP_M2_BACKWARD, args, 6, keep_bytes=_KEEP_WORK_BYTES)
        return grads


class Mamba2BlockInference(Mamba2Block):
    """Forward-only Mamba2Block on the CPU host binary.

    Same constructor arguments and checks as Mamba2Block; forward,
    allocate_state and step give the same bits. backward raises
    NotImplementedError.
    """

    def backward(self, x, grad_output):
        raise NotImplementedError("Mamba2BlockInference is forward-only; use "
                                  "Mamba2Block for gradients")


class Mamba2DecodeSession(DecodeSessionBase):
    """Token-by-token decoding on one Mamba2Block and one Mamba2State.

    Made by ``Mamba2Block.decode_session(state)``. Every output is byte for
    byte what ``Mamba2Block.step`` gives. The session holds its own copies of
    the state and a preallocated workspace, so a step validates only x (the
    state is validated once, when the session opens or reloads). Until
    close() or sync_state() the state's arrays and buffered_tokens are
    stale, and the block refuses that state; weight edits (set_params) after
    opening are not seen; edits to the state arrays are not seen until
    load_state(). The block's ``h_last_`` is not updated by session steps. Not
    thread-safe. Use it as a context manager.

    Examples
    --------
    >>> state = block.allocate_state(2)
    >>> tokens = np.random.default_rng(1).random((8, 2, block.d_model), dtype=np.float32)
    >>> with block.decode_session(state) as session:
    ...     for x_t in tokens:
    ...         y_t = session.step(x_t)
    """

    _OP = _abi.OP_M2_FORWARD

    def __init__(self, block, state):
        from .._array import Array
        views = block._state_views(state, None)
        self._bind(block, state, views[0].shape[0])
        self._arrays = [Array(v.shape, zero=False) for v in views]
        self._copy_in(views)
        self._s = _intake.as_int(state.buffered_tokens, "state.buffered_tokens")
        self._args = block._args(self._b, 1, 0, 0, self._arrays, self._s, 0, 0, True)
        self._args[5] = self._blob.address
        self._own_workspace(self._args, _FWD_WORK)
        # transposed copies of h and of the open chunk's B rows, rebuilt by
        # the kernel whenever a marker is 0: same chains, vectorized
        per_row = (self._block.nheads * (_CACHE_HDR + D_STATE * HEAD_DIM)
                   + _CACHE_HDR + D_STATE * CHUNK)
        self._cache = Array((self._b * per_row,), zero=True)
        self._args[_FWD_CACHE] = self._cache.address
        self._activate()

    def _copy_in(self, views):
        for a, v in zip(self._arrays, views):
            copy_bytes(a, v.mv)

    def _before_step(self, args):
        args[10] = self._s

    def _after_step(self):
        self._s = (self._s + 1) % CHUNK

    def sync_state(self):
        """Copy the session's state into the Mamba2State; return it."""
        self._check_open()
        st = self._state
        self._write_back(st, list(zip(("conv_window", "h", "buffer_xbc", "buffer_dtraw"),
                                      self._arrays)))
        st.buffered_tokens = self._s
        st._version += 1
        return st

    def load_state(self):
        """Reload the session from the Mamba2State (after you edit it); return it."""
        self._check_open()
        views = self._unheld_views(lambda: self._block._state_views(self._state, self._b))
        self._copy_in(views)
        self._s = _intake.as_int(self._state.buffered_tokens, "state.buffered_tokens")
        memoryview(self._cache).cast("B")[:] = bytes(self._cache.nbytes)  # all stale
        return self._state

    def _release(self):
        self._arrays = self._work = self._cache = None
