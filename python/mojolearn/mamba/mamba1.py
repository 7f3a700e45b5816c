"""Mamba-1: Mamba1Block, Mamba1BlockInference and Mamba1State."""
from __future__ import annotations

import struct

from .. import _intake
from ._base import _MambaBase, weight_views
from ._runner import BlockSpec, Runner
from ._state import StateBase
from .sessions import Mamba1DecodeSession

D_STATE = 16
D_CONV = 4


def mamba1_weight_shapes(d: int) -> dict:
    di, r = 2 * d, -(-d // 16)
    return {
        "norm.weight": (d,),
        "in_proj.weight": (2 * di, d),
        "conv1d.weight": ((di, 1, D_CONV), (di, D_CONV)),
        "conv1d.bias": (di,),
        "x_proj.weight": (r + 2 * D_STATE, di),
        "dt_proj.weight": (di, r),
        "dt_proj.bias": (di,),
        "A_log": (di, D_STATE),
        "D": (di,),
        "out_proj.weight": (d, di),
    }


def check_bcdt_rms_eps(eps):
    """The B/C/dt norms' eps as a Python float, or None (no norms).
    TypeError for a non-number, ValueError for one that is not finite and
    positive in float32 (the kernels use float32(eps))."""
    return None if eps is None else _intake.positive_float32(eps, "bcdt_rms_eps")


class Mamba1State(StateBase):
    """Recurrent state of a Mamba1Block, owned by the caller.

    Make one with ``Mamba1Block.allocate_state``; it is all zeros before the
    first token. forward and step update the arrays in place. The arrays are
    mojolearn.Array when allocate_state made them, or any writable, C-contiguous
    float32 buffer you supply; their bytes can be saved and restored exactly.

    Parameters
    ----------
    conv_window : float32 buffer, shape (B, d_inner, 4)
        The last four inputs to the convolution, oldest first.
    h : float32 buffer, shape (B, d_inner, 16)
        SSM state.
    profile_id : int, default 1
        Caller's tag for the state; kept, not interpreted.
    absolute_position : int, default 0
        Tokens consumed so far; forward and step advance it.
    affine_boundary, affine_a, affine_b : None
        Reserved; anything but None raises ValueError.
    """

    _ARRAYS = ("conv_window", "h")
    _VALUES = ("profile_id", "absolute_position")

    def __init__(self, conv_window, h, *, profile_id=1, absolute_position=0,
                 affine_boundary=None, affine_a=None, affine_b=None):
        for name, val in (("affine_boundary", affine_boundary), ("affine_a", affine_a),
                          ("affine_b", affine_b)):
            if val is not None:
                raise ValueError(f"{name} is not supported by this version; pass None")
        self._store(conv_window, h)
        self.profile_id = _intake.as_int(profile_id, "profile_id")
        self.absolute_position = _intake.as_int(absolute_position, "absolute_position")
        self.affine_boundary = self.affine_a = self.affine_b = None

    def __repr__(self):
        shape = getattr(memoryview(self.h), "shape", None)
        return f"Mamba1State(h shape={tuple(shape) if shape else None}, " \
               f"absolute_position={self.absolute_position})"


# The weights, in the constructor's (and the gradients') order.
_WEIGHT_ORDER = ("norm.weight", "in_proj.weight", "conv1d.weight", "conv1d.bias",
                 "x_proj.weight", "dt_proj.weight", "dt_proj.bias", "A_log", "D",
                 "out_proj.weight")


def _state_shapes(block, b):
    return {"conv_window": (b, block.d_inner, D_CONV), "h": (b, block.d_inner, D_STATE)}


def _state_views(block, state, batch, check_finite=True):
    """(conv_window, h) views of a Mamba1State validated for batch rows (None:
    the state's own); check_finite False skips the finiteness checks."""
    block._check_state(state)
    views = block._state_arrays(state, ndim=True)
    cw, h = views.values()
    b = cw.shape[0] if batch is None else batch
    if cw.shape[0] != b or h.shape[0] != b:
        raise ValueError(f"batch mismatch: x has B={b}, state.conv_window has "
                         f"{cw.shape[0]} rows and state.h {h.shape[0]}")
    block._check_state_shapes(views, b)
    if check_finite:
        _intake.check_finite(block._lib, cw)
        _intake.check_finite(block._lib, h)
    _intake.refuse_overlap((cw, h))
    return cw, h


def _launch(block, xv, y, b, l, state, sv, lens, kind):
    cw, h = sv if sv is not None else (None, None)
    args = block._runner.forward_slots(block).pack(
        b=b, l=l, d=block.d_model, x=xv, y=y, blob=block._blob, conv_window=cw, h=h,
        lengths=lens[1])
    block._runner.run(block, args)
    if state is not None:
        state.absolute_position += l


def _prepare_scalars(block) -> dict:
    # recorded in the prepared blob: every op on it (forward, step,
    # sessions, backward) reads the option from there
    eps = block.bcdt_rms_eps
    bits = 0 if eps is None else struct.unpack("<i", struct.pack("<f", eps))[0]
    return {"bcdt_eps_bits": bits}


_SPEC = BlockSpec(
    state_class=Mamba1State, forward_op="m1_forward", prepare_op="m1_prepare",
    backward_op="m1_backward", weight_order=_WEIGHT_ORDER,
    projections=("in_proj.weight", "x_proj.weight", "dt_proj.weight", "out_proj.weight"),
    state_shapes=_state_shapes, state_views=_state_views, launch=_launch,
    prepare_scalars=_prepare_scalars,
    ragged_state=True)  # a ragged forward leaves each row's state at its length


class Mamba1Block(_MambaBase):
    """One Mamba-1 block: RMSNorm, selective-scan mixer and residual.

    Matches Hugging Face's ``MambaBlock.forward``. Takes (B, L, d_model)
    float32 and returns (B, L, d_model) float32, with the recurrent state
    explicit and caller-owned (Mamba1State).

    Fixed by the block: d_state 16, d_conv 4, expand 2, dt_rank
    ceil(d_model / 16), convolution bias on, projection bias off, SiLU.
    With ``bcdt_rms_eps`` it is the Falcon-Mamba block (Hugging Face's
    ``FalconMambaBlock``): the same weights, and x_proj's dt, B and C
    outputs each go through a weightless RMS norm before use.

    Parameters
    ----------
    weights : dict of str to float32 buffer
        Weights under the reference parameter names, with d = d_model and
        R = dt_rank = ceil(d / 16); copied at construction. Projection
        weights may be packed with :mod:`mojolearn.lowbit`; they stay packed
        in the block (the kernels widen them exactly on load), each in
        its own format (a mix is allowed).

        - ``norm.weight`` (d,)
        - ``in_proj.weight`` (4d, d)
        - ``conv1d.weight`` (2d, 1, 4) or (2d, 4)
        - ``conv1d.bias`` (2d,)
        - ``x_proj.weight`` (R + 32, 2d)
        - ``dt_proj.weight`` (2d, R)
        - ``dt_proj.bias`` (2d,)
        - ``A_log`` (2d, 16); or ``A`` (2d, 16) in its place, the decay
          rates -exp(A_log) themselves, used as given (GGUF files store
          them; entries must be <= 0; backward is then refused)
        - ``D`` (2d,)
        - ``out_proj.weight`` (d, 2d)
    bcdt_rms_eps : float or None, default None
        None: plain Mamba-1 (the bits of a block built without it). A
        number > 0: Falcon-Mamba's norms, ``v / sqrt(mean(v^2) + eps)``
        over each of dt (R values), B (16) and C (16) of every token, with
        this eps rounded to float32 (transformers' ``mixer_rms_eps``,
        1e-6 in the published Falcon-Mamba configs). The norms have no
        weights.
    numeric_mode : {'identical', 'fast'}, default 'identical'
        'identical': every output bit is a pure function of the inputs (any
        thread count, batch composition, prefill or decode).

    Attributes
    ----------
    dt_rank : int
        Rank of the dt projection, ceil(d_model / 16).
    bcdt_rms_eps : float or None
        The B/C/dt norms' eps as given (None: no such norms).

    Notes
    -----
    Thread safety: forward may be called concurrently on one block; step
    too (every thread has its own workspace, shared by the blocks it
    calls). A state must not be used by two calls at once.

    Examples
    --------
    >>> import numpy as np, mojolearn
    >>> weights = mojolearn.init_weights("mamba1", 32, seed=0)   # or a checkpoint's
    >>> block = mojolearn.Mamba1Block(weights)   # a dict of float32 arrays, as above
    >>> x = np.random.default_rng(0).random((2, 16, block.d_model), dtype=np.float32)
    >>> y = block.forward(x)
    >>> state = block.allocate_state(2)
    >>> y = block.forward(x, state)
    >>> y_next = block.step(x[:, -1], state)
    """

    _runner = Runner(_SPEC)
    _param_names = ("weights", "numeric_mode", "bcdt_rms_eps")

    def __init__(self, weights, *, bcdt_rms_eps=None, numeric_mode: str = "identical"):
        self.bcdt_rms_eps = check_bcdt_rms_eps(bcdt_rms_eps)
        self._setup_common(numeric_mode)
        if not hasattr(weights, "keys") or "norm.weight" not in weights:
            weight_views(weights, mamba1_weight_shapes(1), self._lib)  # names the problem
        norm = _intake.float32_view(weights["norm.weight"], "norm.weight", ndim=(1,))
        d = norm.shape[0]
        if d < 1:
            raise ValueError("norm.weight must have d_model >= 1 entries")
        views = weight_views(weights, mamba1_weight_shapes(d), self._lib)
        prep = self._keep_weights(views)
        self._d_model = d
        self.dt_rank = -(-d // 16)
        self._blob = self._make_blob(prep)

    def get_params(self, deep: bool = True) -> dict:
        """Constructor parameters: weights (copies), numeric_mode, bcdt_rms_eps."""
        p = super().get_params(deep)
        p["bcdt_rms_eps"] = self.bcdt_rms_eps
        return p

    # -- state --------------------------------------------------------------
    def allocate_state(self, batch_size) -> Mamba1State:
        """Return a zero Mamba1State for batch_size sequences."""
        return self._runner.allocate(self, batch_size)

    _state_shapes = _state_shapes
    _state_views = _state_views

    # -- compute ------------------------------------------------------------
    def backward(self, x, grad_output, state=None, *, grad_state=None, lengths=None):
        """Gradients of ``forward(x, state)`` (a vector-Jacobian product).

        The loss differentiated is ``sum(y * grad_output)`` plus, for each
        array of the final state (the state forward leaves), ``sum(array *
        grad_state[name])``. Recomputes the forward with the current weights
        on every call; nothing is kept between calls and no state is
        changed. Kernel order and memory: docs/backward.md.

        Chunked training (a sequence too long for one call, run in pieces
        with the state carried): run backward on the pieces last to first,
        each with the state its forward started from and, as grad_state,
        the previous piece's ``'state.*'`` gradients (the one-shot
        gradient, up to the summation order of the weight gradients).

        Parameters
        ----------
        x : float32 buffer, shape (B, L, d_model)
        grad_output : float32 buffer, shape (B, L, d_model), finite at the
            real positions
        state : Mamba1State or None
            The state the forward started from (read, never changed); None:
            zeros.
        grad_state : dict or Mamba1State or None
            Cotangent of the final state: {'conv_window': (B, d_inner, 4),
            'h': (B, d_inner, 16)} float32 buffers (a missing name is zeros)
            or a Mamba1State whose arrays are read; None: zeros.
        lengths : sequence of int or None
            Ragged rows: B ints in [1, L]. Row b's forward ends after its
            first lengths[b] tokens (its final state is the state there, where
            grad_state applies); its padding is never read (grad_output
            there is ignored) and its x gradient there is +0.0.

        Returns
        -------
        grads : dict of str to mojolearn.Array
            'x' (B, L, d_model) and one entry per constructor weight, under the
            same name and in the shape the weight was given; with a state or
            grad_state also 'state.conv_window' (B, d_inner, 4) and 'state.h'
            (B, d_inner, 16), the gradients of the start state.
        """
        return self._runner.backward(self, x, grad_output, state, grad_state, lengths)

    def decode_session(self, state):
        """Open a Mamba1DecodeSession for fast token-by-token decoding."""
        return Mamba1DecodeSession(self, state)

    def _session_cache_bytes(self, batch_size: int) -> int:
        """Bytes of a decode session's speed cache for batch_size rows: its
        private workspace, which holds the state in the kernel's layout from
        open to close (so a step neither checks, loads nor saves the state,
        as block.step does)."""
        from .. import _abi
        from ._base import workspace_floats
        op = _abi.op_spec(self._lib, self._runner.spec.forward_op).op
        args = self._runner.forward_slots(self).pack(b=batch_size, l=1, d=self.d_model,
                                                     blob=self._blob)
        return 4 * workspace_floats(self._lib, op, args)


class Mamba1BlockInference(Mamba1Block):
    """Forward-only Mamba1Block on the CPU host binary.

    Same constructor and checks as Mamba1Block; forward, allocate_state,
    step and decode_session give the same bits. backward raises
    NotImplementedError.
    """

    def backward(self, x, grad_output, state=None, *, grad_state=None, lengths=None):
        raise NotImplementedError("Mamba1BlockInference is forward-only; use "
                                  "Mamba1Block for gradients")
