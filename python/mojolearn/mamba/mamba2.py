"""Mamba-2 (SSD): Mamba2Block, Mamba2BlockInference and Mamba2State."""
from __future__ import annotations

import math
import struct

from .. import _abi, _intake
from . import _grad_state
from ._base import _MambaBase, weight_views
from ._runner import BlockSpec, Runner
from ._state import StateBase
from .sessions import Mamba2DecodeSession

D_STATE = 128
HEAD_DIM = 64
D_CONV = 4
CHUNK = 256

# The block keeps its workspace between calls (no allocation per decode
# step) unless it is larger than this (a prefill of many rows).
_KEEP_WORK_BYTES = 64 << 20


def mamba2_dims(d: int, n_groups: int = 1) -> tuple:
    """(d_inner, nheads, conv_dim, in_proj rows) for d_model d and n_groups
    groups of B and C."""
    di = 2 * d
    h = di // HEAD_DIM
    cd = di + 2 * n_groups * D_STATE
    return di, h, cd, 2 * di + 2 * n_groups * D_STATE + h


def check_n_groups(n_groups, d: int, name: str = "n_groups") -> int:
    """n_groups as an int; ValueError naming ``name`` unless it is an
    integer >= 1 that divides the nheads = 2 d / 64 heads of d_model d."""
    g = _intake.as_int(n_groups, name)
    h = 2 * d // HEAD_DIM
    if g < 1 or h % g:
        raise ValueError(f"{name} must be a positive divisor of the {h} heads "
                         f"(nheads = 2 * d_model / 64 for d_model {d}), got {g}")
    return g


def mamba2_weight_shapes(d: int, n_groups: int = 1) -> dict:
    """{weight name: shape} for d_model d and n_groups (checked:
    check_n_groups)."""
    di, h, cd, npj = mamba2_dims(d, check_n_groups(n_groups, d))
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


# The weights, in the constructor's (and the gradients') order.
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

    With H = d_model / 32 heads and CD = 2 * d_model + 256 * n_groups
    convolution channels. Make one with ``Mamba2Block.allocate_state``; it is all zeros
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
        self._store(conv_window, h, buffer_xbc, buffer_dtraw)
        bt = _intake.as_int(buffered_tokens, "buffered_tokens")
        if not 0 <= bt < CHUNK:
            raise ValueError(f"buffered_tokens = {bt} is outside [0, {CHUNK})")
        self.buffered_tokens = bt
        self._version = 0  # bumped by every call that updates the state

    def __repr__(self):
        shape = getattr(memoryview(self.h), "shape", None)
        return (f"Mamba2State(h shape={tuple(shape) if shape else None}, "
                f"buffered_tokens={self.buffered_tokens})")


def _state_shapes(block, b):
    return {"conv_window": (b, block.conv_dim, D_CONV),
            "h": (b, block.nheads, HEAD_DIM, D_STATE),
            "buffer_xbc": (b, CHUNK, block.conv_dim),
            "buffer_dtraw": (b, CHUNK, block.nheads)}


def _state_views(block, state, batch):
    """The arrays of a Mamba2State (in _ARRAYS order) validated for batch
    rows (None: the state's own): shapes, finite (the buffers: their
    buffered rows only), no overlap."""
    block._check_state(state)
    bt = _intake.as_int(state.buffered_tokens, "state.buffered_tokens")
    if not 0 <= bt < CHUNK:
        raise ValueError(f"state.buffered_tokens = {bt} is outside [0, {CHUNK})")
    named = block._state_arrays(state, ndim=True)
    views = list(named.values())
    b = views[0].shape[0] if batch is None else batch
    if any(v.shape[0] != b for v in views):
        who = f"x has B={b}" if batch is not None else "the state arrays disagree"
        raise ValueError(f"batch mismatch: {who}; state rows: "
                         + ", ".join(f"{n} {v.shape[0]}" for n, v in named.items()))
    block._check_state_shapes(named, b)
    _intake.check_finite(block._lib, views[0])
    _intake.check_finite(block._lib, views[1])
    if bt:  # only the buffered rows are read
        block._check_rows_finite(views[2:], b, bt, CHUNK)
    _intake.refuse_overlap(views)
    return views


def _position_after(s: int, k: int) -> int:
    """buffered_tokens after k more tokens."""
    return (s + k) % CHUNK


def _launch(block, xv, y, b, l, state, sv, lens, kind):
    from .._array import Array
    if state is None:
        h_last = Array((b, block.nheads, HEAD_DIM, D_STATE), zero=False)
        args = block._args(b, l, xv.address, y.address, None, 0, lens[1],
                           h_last.address, False)
        block._runner.run(block, args)
        block._h_last, block._h_last_src = h_last, None
    else:
        s = _intake.as_int(state.buffered_tokens, "state.buffered_tokens")
        args = block._args(b, l, xv.address, y.address, sv, s, 0, 0, True)
        block._runner.run(block, args)
        state.buffered_tokens = _position_after(s, l)
        state._version += 1
        # h_last_ is computed on first access from the state this call left
        block._h_last = None
        block._h_last_src = (state, state._version, sv, b, state.buffered_tokens)


def _prepare_scalars(block) -> dict:
    lo, hi = block.dt_limit
    return {"dt_lo_bits": _f32_bits(lo), "dt_hi_bits": _f32_bits(hi), "n_groups": block.n_groups}


_PROJECTIONS = ("in_proj.weight", "out_proj.weight")
_SPEC = BlockSpec(
    state_class=Mamba2State, forward_op="m2_forward", prepare_op="m2_prepare",
    backward_op="m2_backward", weight_order=_WEIGHT_ORDER, projections=_PROJECTIONS,
    state_shapes=_state_shapes, state_views=_state_views, launch=_launch,
    position_after=_position_after, prepare_scalars=_prepare_scalars,
    # the kernel writes the projections' gradients in full (no memset)
    written_grads=_PROJECTIONS, backward_panels=True, keep_work_bytes=_KEEP_WORK_BYTES)


class Mamba2Block(_MambaBase):
    """One Mamba-2 (SSD) block: RMSNorm, mixer and residual.

    Matches Hugging Face's ``Mamba2Block.forward`` (torch path). Takes
    (B, L, d_model) float32 and returns (B, L, d_model) float32, with the
    recurrent state explicit and caller-owned (Mamba2State).

    d_model must be a multiple of 32. Fixed: d_state 128, head dim 64,
    chunk 256, expand 2, conv 4 with bias, gate applied before the gated
    RMSNorm. Decoding resumes the open chunk, so step and a forward with a
    carried state continue a prefill bit for bit (docs/mamba2.md).

    Parameters
    ----------
    weights : dict of str to float32 buffer
        With d = d_model, di = 2d, H = di / 64 heads, G = n_groups and
        CD = di + 256 G; copied at construction. Projection weights may be packed with
        :mod:`mojolearn.lowbit`; they stay packed in the block (the kernels
        widen them exactly on load), each in its own format (a mix is
        allowed).

        - ``block_norm.weight`` (d,), the block norm
        - ``in_proj.weight`` (2di + 256 G + H, d), rows z | xBC | dt,
          xBC = x (di) | B (G x 128) | C (G x 128)
        - ``conv1d.weight`` (CD, 1, 4) or (CD, 4)
        - ``conv1d.bias`` (CD,)
        - ``dt_bias`` (H,)
        - ``A_log`` (H,), one value per head; or ``A`` (H,) in its place,
          the decay rates -exp(A_log) themselves, used as given (GGUF files
          store them; entries must be <= 0; backward is then refused)
        - ``D`` (H,)
        - ``norm.weight`` (di,), the gated norm
        - ``out_proj.weight`` (d, di)
    n_groups : int, default 1
        Groups of B and C (transformers' ``n_groups``, mamba_ssm's
        ``ngroups``): head h reads group h // (H / G), and the gated
        RMSNorm normalises each group's di / G channels on its own. Must
        divide H (ValueError naming it). The default keeps the bits of a
        block without the option.
    dt_limit : (lo, hi), default (0.0, inf)
        dt = min(max(softplus(dtraw + dt_bias), lo), hi); the limits are
        rounded to float32. NaN, lo > hi or not two numbers: ValueError.
    numeric_mode : {'identical', 'fast'}, default 'identical'
        See the user guide's numeric modes page.

    Attributes
    ----------
    nheads : int
        Number of heads H, d_inner / 64.
    n_groups : int
        Groups G of B and C.
    conv_dim : int
        Convolution channels CD, d_inner + 256 G.
    dt_limit : tuple of float
        The dt clamp (lo, hi), rounded to float32.
    h_last_ : float32 mojolearn.Array, shape (B, H, 64, 128)
        After every forward/step: the SSM state after all tokens so far (a
        report: on a chunk boundary it equals state.h bitwise; mid-chunk it
        is the fold formula applied to the partial chunk). After a call with
        a state it is computed on first access from that state, which must
        not have been advanced by another call in between (ValueError).

    Examples
    --------
    >>> import numpy as np, mojolearn
    >>> weights = mojolearn.init_weights("mamba2", 32, seed=0)   # or a checkpoint's
    >>> block = mojolearn.Mamba2Block(weights, numeric_mode="identical")
    >>> x = np.random.default_rng(0).random((2, 16, block.d_model), dtype=np.float32)
    >>> y = block.forward(x)
    >>> state = block.allocate_state(batch_size=x.shape[0])
    >>> y0 = block.step(x[:, :1], state)
    """

    _param_names = ("weights", "numeric_mode", "dt_limit", "n_groups")
    _runner = Runner(_SPEC)

    def __init__(self, weights, *, n_groups=1, dt_limit=(0.0, math.inf),
                 numeric_mode: str = "identical"):
        self._setup_common(numeric_mode)
        lo, hi = check_dt_limit(dt_limit)
        if not hasattr(weights, "keys") or "block_norm.weight" not in weights:
            weight_views(weights, mamba2_weight_shapes(32), self._lib)  # names the problem
        norm = _intake.float32_view(weights["block_norm.weight"], "block_norm.weight", ndim=(1,))
        d = norm.shape[0]
        if d < 32 or d % 32:
            raise ValueError(f"Mamba-2 needs d_model a positive multiple of 32; "
                             f"block_norm.weight has {d} entries")
        g = check_n_groups(n_groups, d)
        views = weight_views(weights, mamba2_weight_shapes(d, g), self._lib)
        prep = self._keep_weights(views)
        self._d_model = d
        self.n_groups = g
        _, self.nheads, self.conv_dim, self._npj = mamba2_dims(d, g)
        self.dt_limit = (lo, hi)
        self._blob = self._make_blob(prep)
        self._h_last = None
        self._h_last_src = None

    def get_params(self, deep: bool = True) -> dict:
        """Constructor parameters: weights (copies), numeric_mode, dt_limit,
        n_groups."""
        p = super().get_params(deep)
        p["dt_limit"] = self.dt_limit
        p["n_groups"] = self.n_groups
        return p

    # -- state --------------------------------------------------------------
    def allocate_state(self, batch_size) -> Mamba2State:
        """Return a zero Mamba2State for batch_size sequences.

        Set its h nonzero before the first call to supply initial_states.
        """
        return self._runner.allocate(self, batch_size)

    _state_shapes = _state_shapes
    _state_views = _state_views

    # -- compute ------------------------------------------------------------
    def _args(self, b, l, x_addr, y_addr, sv, s, lens_addr, hlast_addr, save):
        named = dict(zip(Mamba2State._ARRAYS, sv)) if sv is not None else {}
        return self._runner.forward_slots(self).pack(
            named, b=b, l=l, d=self.d_model, x=x_addr, y=y_addr, blob=self._blob,
            buffered_tokens=s, lengths=lens_addr, h_last=hlast_addr, save=1 if save else 0)

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
            self._runner.run(self, args)
            self._h_last, self._h_last_src = h_last, None
        return self._h_last

    def decode_session(self, state, *, cache: bool = True):
        """Open a Mamba2DecodeSession: token-by-token decoding that gives the
        bytes of ``step`` without re-validating the state at every token.
        cache=False: without the session's speed cache (less memory, the
        same bits; Mamba2DecodeSession describes it)."""
        return Mamba2DecodeSession(self, state, cache=cache)

    def _session_cache_bytes(self, batch_size: int) -> int:
        """Bytes of a decode session's speed cache for batch_size rows (the
        op's buffer table gives the size: mamba2/layout.mojo)."""
        args = self._args(batch_size, 1, 0, 0, None, 0, 0, 0, False)
        return _abi.slot_bytes(self._lib, self._runner.spec.forward_op, args, "cache")

    def backward(self, x, grad_output, state=None, *, grad_state=None, lengths=None):
        """Gradients of a forward (a vector-Jacobian product).

        The forward is ``y = forward(x, state)`` from ``state`` (None: a zero
        state), and the loss ``sum(y * grad_output) + <grad_state, final
        state>``, where the final state is the one that forward leaves.
        Recomputes the forward with the current weights on every call; no
        earlier forward, state or ``h_last_`` is used, and nothing is
        changed: neither ``state`` (read only) nor anything else. The
        gradient through the dt_limit clamp follows torch.clamp: it passes
        where lo <= softplus(dtraw + dt_bias) <= hi (bounds included) and is
        zero outside. Kernel order and memory: docs/backward.md ("Mamba-2").

        Parameters
        ----------
        x : float32 buffer, shape (B, L, d_model)
        grad_output : float32 buffer, shape (B, L, d_model), finite
        state : Mamba2State or None
            The state the forward started from: its conv window, h and open
            chunk (the ``buffered_tokens`` rows of buffer_xbc and
            buffer_dtraw) are used as forward uses them. Read only (a
            read-only or non-contiguous buffer is accepted).
        grad_state : dict of str to float32 buffer, Mamba2State or None
            Cotangents of the final state (the gradient arriving from later
            pieces of a sequence), by array name (``Mamba2State._ARRAYS``),
            each in that array's shape; a missing name or None means zeros.
            Buffer rows at or past the final ``buffered_tokens`` are ignored
            (and not checked). A Mamba2State's arrays are read as the
            cotangents.
        lengths : sequence of int or None
            Ragged batch: B ints in [1, L]; padding positions contribute
            nothing (their x gradient is +0.0; x and grad_output there are
            never read). Not with state or grad_state.

        Returns
        -------
        grads : dict of str to mojolearn.Array
            'x' (B, L, d_model), one entry per constructor weight under the
            same name and in the shape the weight was given, and, when state
            or grad_state is given, 'state.<name>' for every state array
            (the start state's gradient; buffer rows past its
            buffered_tokens are +0.0, and so is conv_window's oldest slot,
            which no convolution reads).
        """
        if state is None and grad_state is None and lengths is None:
            return self._runner.backward(self, x, grad_output)  # the zero-state op, unchanged
        return self._backward_through_state(x, grad_output, state, grad_state, lengths)

    def _start_state_views(self, state, b):
        """({array name: View}, buffered_tokens) of the state backward
        starts from, validated as forward validates it, but read only:
        conv_window and h finite, the buffers' first buffered_tokens rows
        finite (the only rows read)."""
        self._check_state(state)
        bt = _intake.as_int(state.buffered_tokens, "state.buffered_tokens")
        if not 0 <= bt < CHUNK:
            raise ValueError(f"state.buffered_tokens = {bt} is outside [0, {CHUNK})")
        views = {n: _intake.float32_view(getattr(state, n), f"state.{n}")
                 for n in Mamba2State._ARRAYS}
        for n, shape in self._state_shapes(b).items():
            _intake.check_shape(views[n], shape, f" (B={b} rows of x)")
        _intake.check_finite(self._lib, views["conv_window"])
        _intake.check_finite(self._lib, views["h"])
        if bt:
            self._check_rows_finite([views["buffer_xbc"], views["buffer_dtraw"]], b, bt, CHUNK)
        return views, bt

    def _cotangent_views(self, grad_state, b, final_rows):
        """{array name: View} of the given cotangents of the final state
        (the kernel reads a missing one as zeros): float32, the state's
        shapes, finite (buffers: rows [0, final_rows) only, the rows the
        final state holds)."""
        def finite(views):
            for n in ("conv_window", "h"):
                if n in views:
                    _intake.check_finite(self._lib, views[n])
            rows = [views[n] for n in ("buffer_xbc", "buffer_dtraw") if n in views]
            if rows and final_rows:
                self._check_rows_finite(rows, b, final_rows, CHUNK)
        return _grad_state.cotangent_views(self, grad_state, b, finite)

    def _backward_through_state(self, x, grad_output, state, grad_state, lengths):
        """backward with a state, final-state cotangents or ragged rows (one
        op: OP_M2_BACKWARD with its state slots; docs/backward.md)."""
        xv, gv, lens, stated = _grad_state.backward_intake(self, x, grad_output, state,
                                                           grad_state, lengths)
        b, l, d = xv.shape
        named, bt = {}, 0
        if state is not None:
            sv, bt = self._start_state_views(state, b)
            named.update({f"state:{n}": v for n, v in sv.items()})
        if grad_state is not None:
            cot = self._cotangent_views(grad_state, b, _position_after(bt, l))
            named.update({f"grad_state:{n}": v for n, v in cot.items()})
        return self._runner.run_backward(self, xv, gv, lens, named,
                                         self._state_shapes(b) if stated else None,
                                         buffered_tokens=bt, stated=1 if stated else 0)


class Mamba2BlockInference(Mamba2Block):
    """Forward-only Mamba2Block on the CPU host binary.

    Same constructor arguments and checks as Mamba2Block; forward,
    allocate_state and step give the same bits. backward raises
    NotImplementedError.
    """

    def backward(self, x, grad_output, state=None, *, grad_state=None, lengths=None):
        raise NotImplementedError("Mamba2BlockInference is forward-only; use "
                                  "Mamba2Block for gradients")
