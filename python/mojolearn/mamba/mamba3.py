"""Mamba-3 (SISO): Mamba3Block, Mamba3BlockInference and Mamba3State.

Every token goes through one per-token evaluation of the chunked (Q = 64)
formula in the kernel (mojo/mojolearn_kernels/mamba3/forward.mojo, order in
docs/mamba3.md); the working chunk's rows live in the state, so prefill,
continuation and token-by-token decode give the same bits.
"""
from __future__ import annotations

import threading

from .. import _intake
from . import _grad_state
from ._base import _MambaBase, copy_bytes, weight_views
from ._runner import BlockSpec, Runner
from ._state import StateBase
from .sessions import Mamba3DecodeSession

D_STATE = 128      # N
HEAD_DIM = 64      # P
N_ANGLES = 32      # R
CHUNK = 64         # Q

_WEIGHT_ORDER = ("block_norm.weight", "in_proj.weight", "dt_bias", "B_norm.weight",
                 "C_norm.weight", "B_bias", "C_bias", "D", "out_proj.weight")
# backward gradients the kernel writes in full (no zeroing needed)
_WRITTEN_GRADS = ("in_proj.weight", "out_proj.weight")


def mamba3_dims(d: int) -> dict:
    di = 2 * d
    h = di // HEAD_DIM
    return {"d_model": d, "d_inner": di, "nheads": h,
            "d_in_proj": 2 * di + 2 * D_STATE + 3 * h + N_ANGLES}


def mamba3_weight_shapes(d: int) -> dict:
    dm = mamba3_dims(d)
    di, h = dm["d_inner"], dm["nheads"]
    return {
        "block_norm.weight": (d,),
        "in_proj.weight": (dm["d_in_proj"], d),
        "dt_bias": (h,),
        "B_norm.weight": (D_STATE,),
        "C_norm.weight": (D_STATE,),
        "B_bias": (h, D_STATE),
        "C_bias": (h, D_STATE),
        "D": (h,),
        "out_proj.weight": (d, di),
    }


def _state_shapes(b: int, h: int) -> dict:
    """{array name: shape} of a Mamba3State, in its _ARRAYS order."""
    return {
        "theta": (b, h, N_ANGLES),
        "h": (b, h, HEAD_DIM, D_STATE),
        "buffer_qrot": (b, CHUNK, h, D_STATE),
        "buffer_krot": (b, CHUNK, h, D_STATE),
        "buffer_v": (b, CHUNK, h, HEAD_DIM),
        "buffer_dt": (b, CHUNK, h),
        "buffer_sig": (b, CHUNK, h),
        "buffer_adt": (b, CHUNK, h),
        "pending_k": (b, h, D_STATE),
        "pending_v": (b, h, HEAD_DIM),
    }


def _count_after(n0: int, k: int) -> int:
    """buffered_tokens after k more tokens (chunks aligned to positions)."""
    return n0 if k == 0 else (n0 + k - 1) % CHUNK + 1


class Mamba3State(StateBase):
    """Recurrent state of a Mamba3Block, owned by the caller.

    With H = d_model / 32 heads, N = 128, P = 64, R = 32 and Q = 64. Make one
    with ``Mamba3Block.allocate_state``; it is all zeros (buffered_tokens 0,
    pending False) before the first token. forward and step update it in
    place. Any writable, C-contiguous float32 buffers are accepted; their
    bytes can be saved and restored exactly.

    Parameters
    ----------
    theta : float32 buffer, shape (B, H, R)
        Rotary angles, each in [0, 2 pi).
    h : float32 buffer, shape (B, H, P, N)
        SSM state entering the working chunk.
    buffer_qrot : float32 buffer, shape (B, Q, H, N)
        Rotated, bias-added, unscaled q rows of the working chunk.
    buffer_krot : float32 buffer, shape (B, Q, H, N)
        Rotated, bias-added, unscaled k rows of the working chunk.
    buffer_v : float32 buffer, shape (B, Q, H, P)
        Raw v rows.
    buffer_dt : float32 buffer, shape (B, Q, H)
        dt rows.
    buffer_sig : float32 buffer, shape (B, Q, H)
        sigmoid(trap) rows.
    buffer_adt : float32 buffer, shape (B, Q, H)
        A * dt rows.
    pending_k : float32 buffer, shape (B, H, N)
        Input-state k, used only while pending.
    pending_v : float32 buffer, shape (B, H, P)
        Input-state v, used only while pending.
    buffered_tokens : int, default 0
        Valid buffer rows, in [0, Q]; in [1, Q] after a call.
    pending : bool, default False
        Set by set_input_states, consumed by the next call.
    """

    _ARRAYS = ("theta", "h", "buffer_qrot", "buffer_krot", "buffer_v", "buffer_dt",
               "buffer_sig", "buffer_adt", "pending_k", "pending_v")
    _VALUES = ("buffered_tokens", "pending")

    def __init__(self, theta, h, buffer_qrot, buffer_krot, buffer_v, buffer_dt,
                 buffer_sig, buffer_adt, pending_k, pending_v, buffered_tokens=0,
                 pending=False):
        self._store(theta, h, buffer_qrot, buffer_krot, buffer_v, buffer_dt, buffer_sig,
                    buffer_adt, pending_k, pending_v)
        self.buffered_tokens = _intake.as_int(buffered_tokens, "buffered_tokens")
        if not isinstance(pending, bool):
            raise TypeError(f"pending must be a bool, got {type(pending).__name__}")
        self.pending = pending
        self._calls = 0  # advanced by every call that uses the state

    def set_input_states(self, theta, h, k, v):
        """Start from a reference Input_States continuation.

        Copies theta, h, k (the last rotated k) and v into theta, h,
        pending_k and pending_v and marks them pending. The next call must
        be the state's first (buffered_tokens == 0), else it raises
        ValueError; its first token adds ``v k^T * dt_0 * (1 - sg_0)`` to h.
        Arrays must be float32 of the state's shapes; nothing is converted.
        """
        targets = {}
        for name, val, dst_name in (("theta", theta, "theta"), ("h", h, "h"),
                                    ("k", k, "pending_k"), ("v", v, "pending_v")):
            dst = _intake.float32_view(getattr(self, dst_name), f"state.{dst_name}",
                                       writable=True, contiguous_only=True)
            src = _intake.float32_view(val, name)
            if src.shape != dst.shape:
                raise ValueError(f"{name} must have shape {dst.shape} (the state's "
                                 f"{dst_name}), got {src.shape}")
            targets[dst_name] = (dst, src)
        for dst_name, (dst, src) in targets.items():
            copy_bytes(getattr(self, dst_name), src.mv)
        self.pending = True
        return self

    def __repr__(self):
        shape = getattr(memoryview(self.h), "shape", None)
        return (f"Mamba3State(h shape={tuple(shape) if shape else None}, "
                f"buffered_tokens={self.buffered_tokens}, pending={self.pending})")


_STATE_BUFFERS = Mamba3State._ARRAYS


def _state_views(block, state, batch, check_finite=True):
    """({array name: View}, buffered_tokens) of a Mamba3State validated for
    batch rows: shapes, position and pending rules, and (unless
    check_finite is False: the block's own scratch state) no overlap and
    finite values (the buffers: their valid rows only)."""
    block._check_state(state)
    views = block._state_arrays(state)
    for n, v in views.items():
        if len(v.shape) < 1 or v.shape[0] != batch:
            raise ValueError(f"batch mismatch: x has B={batch}, state.{n} has shape "
                             f"{v.shape}")
    block._check_state_shapes(views, batch)
    nb = state.buffered_tokens
    if isinstance(nb, bool) or not isinstance(nb, int):
        nb = _intake.as_int(nb, "state.buffered_tokens")
    if not 0 <= nb <= CHUNK:
        raise ValueError(f"state.buffered_tokens = {nb} is outside [0, {CHUNK}]")
    if not isinstance(state.pending, bool):
        raise TypeError(f"state.pending must be a bool, got "
                        f"{type(state.pending).__name__}")
    if state.pending and nb != 0:
        raise ValueError("state.pending is set (set_input_states) but the state is "
                         f"not fresh (buffered_tokens = {nb}); input states apply "
                         "only to a state's first call")
    if not check_finite:  # the block's own scratch state: zeros it wrote
        return views, nb
    _intake.refuse_overlap(views.values())
    for n in ("theta", "h"):
        _intake.check_finite(block._lib, views[n])
    if state.pending:
        _intake.check_finite(block._lib, views["pending_k"])
        _intake.check_finite(block._lib, views["pending_v"])
    if nb:
        # only the valid rows [0, buffered_tokens) are ever read
        block._check_rows_finite([views[n] for n in ("buffer_qrot", "buffer_krot",
                                 "buffer_v", "buffer_dt", "buffer_sig", "buffer_adt")],
                                batch, nb, CHUNK)
    return views, nb

def _written_views(sv):
    return sv[0].values()

def _launch(block, xv, y, b, l, state, sv, lens, kind):
    lock = None
    if state is None:  # a stateless call runs on the block's scratch state
        state, lock = block._held_scratch(b)
    try:
        if sv is None:  # zeros the block wrote: not checked again
            sv = _state_views(block, state, b, check_finite=False)
        views, nb = sv
        args = block._args(b, l, xv.address, y.address, views, nb, state.pending, lens[1], 0)
        block._runner.run(block, args)
        block._record_call(state, nb, b, l, lens, kind)
    finally:
        if lock is not None:
            lock.release()


_SPEC = BlockSpec(
    state_class=Mamba3State, forward_op="m3_forward", prepare_op="m3_prepare",
    backward_op="m3_backward", weight_order=_WEIGHT_ORDER,
    projections=("in_proj.weight", "out_proj.weight"),
    state_shapes=lambda block, b: _state_shapes(b, block.nheads), state_views=_state_views,
    written_views=_written_views, launch=_launch, position_after=_count_after,
    written_grads=_WRITTEN_GRADS, backward_panels=True)



def _report_property(key, doc):
    """The read-only property ``<key>_last_``: the last call's report of key."""
    return property(lambda block: block._report_value(key), doc=doc)


class Mamba3Block(_MambaBase):
    """One Mamba-3 (SISO) block: RMSNorm, mixer and residual.

    Takes (B, L, d_model) float32 and returns (B, L, d_model) float32, with
    the recurrent state explicit and caller-owned (Mamba3State). d_model must
    be a multiple of 32. Fixed: d_state 128, head dimension 64, one group, 32
    rotary angles, A floor 1e-4, chunk size 64, expand 2, no convolution.

    Parameters
    ----------
    weights : dict of str to float32 buffer
        With d = d_model, H = 2d / 64 heads and
        d_in_proj = 4d + 256 + 3H + 32; copied at construction. Projection
        weights may be packed with :mod:`mojolearn.lowbit`; they stay packed
        in the block (the kernels widen them exactly on load), each in
        its own format (a mix is allowed).

        - ``block_norm.weight`` (d,), the block norm
        - ``in_proj.weight`` (d_in_proj, d), row order
          z | x | B | C | dd_dt | dd_A | trap | angle
        - ``dt_bias`` (H,)
        - ``B_norm.weight`` (128,), RMSNorm with eps 1e-5
        - ``C_norm.weight`` (128,)
        - ``B_bias`` (H, 128)
        - ``C_bias`` (H, 128)
        - ``D`` (H,)
        - ``out_proj.weight`` (d, 2d)
    numeric_mode : {'identical', 'fast'}, default 'identical'
        See the user guide's numeric modes page.

    Attributes
    ----------
    nheads : int
        Number of heads H, d_inner / 64.
    d_in_proj : int
        Rows of in_proj.weight.
    h_last_ : float32 mojolearn.Array, shape (B, H, 64, 128)
        Report of the last call: the state after all its tokens (the last
        token at gamma only). Computed on first access from the state that
        call left, so read it (and the three below) before the state is
        edited or advanced (afterwards access raises ValueError; before the
        first call, AttributeError).
    k_last_ : float32 mojolearn.Array, shape (B, H, 128)
        Report of the last call: the last rotated k.
    v_last_ : float32 mojolearn.Array, shape (B, H, 64)
        Report of the last call: the last v.
    theta_last_ : float32 mojolearn.Array, shape (B, H, 32)
        Report of the last call: the rotary angles.

    Examples
    --------
    >>> import numpy as np, mojolearn
    >>> weights = mojolearn.init_weights("mamba3", 32, seed=0)   # or a checkpoint's
    >>> block = mojolearn.Mamba3Block(weights)
    >>> x = np.random.default_rng(0).random((2, 16, block.d_model), dtype=np.float32)
    >>> y = block.forward(x)
    >>> state = block.allocate_state(x.shape[0])
    >>> y = block.forward(x, state)
    >>> y_next = block.step(x[:, -1], state)
    """

    _runner = Runner(_SPEC)

    def __init__(self, weights, *, numeric_mode: str = "identical"):
        self._setup_common(numeric_mode)
        if not hasattr(weights, "keys") or "block_norm.weight" not in weights:
            weight_views(weights, mamba3_weight_shapes(32), self._lib)  # names the problem
        norm = _intake.float32_view(weights["block_norm.weight"], "block_norm.weight",
                                    ndim=(1,))
        d = norm.shape[0]
        if d < 32 or d % 32:
            raise ValueError(f"Mamba-3 needs d_model a positive multiple of 32 "
                             f"(block_norm.weight has {d} entries)")
        views = weight_views(weights, mamba3_weight_shapes(d), self._lib)
        prep = self._keep_weights(views)
        dm = mamba3_dims(d)
        self._d_model = d  # d_inner (2 d) is a base property
        self.nheads = dm["nheads"]
        self.d_in_proj = dm["d_in_proj"]
        self._blob = self._make_blob(prep)
        self._report = None
        self._session = None
        # the scratch state of stateless forward calls (_held_scratch)
        self._scratch = None
        self._scratch_lock = threading.Lock()

    # -- state --------------------------------------------------------------
    def allocate_state(self, batch_size) -> Mamba3State:
        """Return a zero Mamba3State for batch_size sequences."""
        return self._runner.allocate(self, batch_size)

    def _state_shapes(self, b):
        return _state_shapes(b, self.nheads)

    def _scratch_state(self, b):
        """A fresh state for a stateless call: only theta and h need zeros
        (buffer rows are written before they are read, pending_k/v unused)."""
        from .._array import Array
        shapes = _state_shapes(b, self.nheads)
        return Mamba3State(*(Array(shapes[n], zero=n in ("theta", "h", "pending_k", "pending_v"))
                             for n in _STATE_BUFFERS))

    def _held_scratch(self, b):
        """(scratch state, lock or None) for a stateless call: the block
        keeps one and re-zeroes theta and h, so repeated calls do not fault
        in fresh pages (about 7% of a d=768 prefill); a caller that finds it
        in use (another thread) gets a fresh one. Release the lock after."""
        import ctypes
        if not self._scratch_lock.acquire(blocking=False):
            return self._scratch_state(b), None
        st = self._scratch
        if st is None or memoryview(st.h).shape[0] != b:
            st = self._scratch = None
            st = self._scratch = self._scratch_state(b)
        else:
            for a in (st.theta, st.h):
                ctypes.memset(a.address, 0, a.nbytes)
            st.buffered_tokens, st.pending = 0, False
        return st, self._scratch_lock

    _state_views = _state_views

    # -- compute ------------------------------------------------------------
    def decode_session(self, state, *, cache: bool = True):
        """Open a Mamba3DecodeSession: token-by-token decoding that gives the
        bytes of ``step`` without re-validating the state at every token.
        cache: as for Mamba-2's sessions; a Mamba-3 session keeps no speed
        cache, so it changes nothing."""
        return Mamba3DecodeSession(self, state, cache=cache)

    def _args(self, b, l, xaddr, yaddr, views, nb, pending, lens_addr, mode, reports=None):
        named = {n: views[n] for n in _STATE_BUFFERS}
        if reports:
            named.update({f"report:{k}": v for k, v in reports.items()})
        return self._runner.forward_slots(self).pack(
            named, b=b, l=l, d=self.d_model, x=xaddr, y=yaddr, blob=self._blob,
            lengths=lens_addr, buffered_tokens=nb, pending=1 if pending else 0, mode=mode)

    def _record_call(self, state, nb, b, l, lens, kind):
        """After a forward or step: advance the state's position and keep
        what the reports and session_info() read."""
        state.buffered_tokens = _count_after(nb, l)
        state.pending = False
        state._calls += 1
        self._report = {"state": state, "calls": state._calls, "lengths": lens[0],
                        "b": b, "cache": None}
        s = self._session
        if s is None:
            s = self._session = {"forward_calls": 0, "step_calls": 0, "tokens": 0,
                                 "weight_uploads": 1, "weight_recopies": 0,
                                 "weight_reuses": -1, "backward_stage_reuses": 0,
                                 "forward_recomputes": 0, "stages_held": 0}
        s[f"{kind}_calls"] += 1
        s["tokens"] += b * l
        s["weight_reuses"] += 1

    # -- reports ------------------------------------------------------------
    def _reports(self):
        r = self._report
        if r is None:
            return None
        if r["cache"] is None:
            from .._array import Array
            state = r["state"]
            if state._calls != r["calls"]:
                raise ValueError("the reports of the last call are no longer available: "
                                 "its state was advanced by a later call; read h_last_, "
                                 "k_last_, v_last_, theta_last_ right after the call")
            b, h = r["b"], self.nheads
            views = self._state_arrays(state)
            out = {"h": Array((b, h, HEAD_DIM, D_STATE), zero=False),
                   "k": Array((b, h, D_STATE), zero=False),
                   "v": Array((b, h, HEAD_DIM), zero=False),
                   "theta": Array((b, h, N_ANGLES), zero=False)}
            lens = r["lengths"]
            args = self._args(b, 0, 0, 0, views, state.buffered_tokens, False,
                              lens[2] if lens is not None else 0, 1, reports=out)
            self._runner.run(self, args)
            r["cache"] = out
        return r["cache"]

    def _report_value(self, key):
        rep = self._reports()
        if rep is None:  # (the rule for every block: hasattr() says whether it is set)
            raise AttributeError(f"{key}_last_ is set by forward or step; call one first")
        return rep[key]

    h_last_ = _report_property(
        "h", "State after all tokens of the last call (last token at gamma only).")
    k_last_ = _report_property("k", "Last token's rotated, bias-added k, (B, H, 128).")
    v_last_ = _report_property("v", "Last token's v, (B, H, 64).")
    theta_last_ = _report_property("theta", "Angles after the last token, (B, H, 32).")

    def session_info(self):
        """Counters of the prefill session as a dict, or None before the first call."""
        return None if self._session is None else dict(self._session)

    def backward(self, x, grad_output, state=None, *, grad_state=None, lengths=None):
        """Gradients of a forward (a vector-Jacobian product).

        The forward is ``y = forward(x, state)`` from ``state`` (None: a zero
        state), and the loss ``sum(y * grad_output) + <grad_state, final
        state>``, where the final state is the one that forward leaves.
        Recomputes the forward with the current weights on every call; no
        earlier forward or report is used, and nothing is changed: neither
        ``state`` (read only) nor anything else. Kernel order and memory:
        docs/backward.md (section Mamba-3).

        Parameters
        ----------
        x : float32 buffer, shape (B, L, d_model)
        grad_output : float32 buffer, shape (B, L, d_model), finite
        state : Mamba3State or None
            The state the forward started from: its buffered rows
            ``[0, buffered_tokens)`` (an open, partly full chunk) and pending
            input states are used as forward uses them.
        grad_state : dict of str to float32 buffer, Mamba3State or None
            Cotangents of the final state (the gradient arriving from later
            chunks of a sequence), by array name (``Mamba3State._ARRAYS``), each
            in that array's shape; a missing name or None means zeros. Buffer
            rows at or past the final ``buffered_tokens`` are ignored (and not
            checked). A Mamba3State's arrays are read as the cotangents.
        lengths : sequence of int or None
            Ragged batch: B ints in [1, L]; padding positions contribute
            nothing (their x gradient is +0.0). Not with state or grad_state.

        Returns
        -------
        grads : dict of str to mojolearn.Array
            'x' (B, L, d_model), one entry per constructor weight under the
            same name and shape, and, when state or grad_state is given,
            'state.<name>' for every state array (the initial state's
            gradient; buffer rows past its buffered_tokens, and buffer_qrot
            rows that the final state does not hold, are +0.0).
        """
        if state is None and grad_state is None and lengths is None:
            return self._runner.backward(self, x, grad_output)  # the zero-state op, unchanged
        return self._backward_through_state(x, grad_output, state, grad_state, lengths)

    def _grad_state_views(self, grad_state, b, final_rows):
        """{array name: View} of the final state's cotangents (zeros made
        for the missing ones: the kernel reads every one), validated:
        float32, the state's shapes, finite (buffer arrays: rows
        [0, final_rows) only, the rows that are read)."""
        from .._array import Array
        def finite(views):
            rows = []
            for n, v in views.items():
                if n.startswith("buffer_"):
                    rows.append(v)
                else:
                    _intake.check_finite(self._lib, v)
            if rows and final_rows:
                self._check_rows_finite(rows, b, final_rows, CHUNK)
        given = ({} if grad_state is None else
                 _grad_state.cotangent_views(self, grad_state, b, finite))
        shapes = _state_shapes(b, self.nheads)
        return {n: given[n] if n in given else Array(shapes[n]) for n in _STATE_BUFFERS}

    def _backward_through_state(self, x, grad_output, state, grad_state, lengths):
        """backward with a state, final-state cotangents or ragged rows (one
        op: OP_M3_BACKWARD with its state slots; docs/backward.md)."""
        from .._array import Array
        xv, gv, lens, stated = _grad_state.backward_intake(self, x, grad_output, state,
                                                           grad_state, lengths)
        b, l, d = xv.shape
        named, nb, pending = {}, 0, False
        if stated:
            if state is not None:
                sviews, nb = self._state_views(state, b)
                pending = state.pending
            else:  # a zero state: only theta and h are read
                shapes = _state_shapes(b, self.nheads)
                sviews = {"theta": Array(shapes["theta"]), "h": Array(shapes["h"])}
            cot = self._grad_state_views(grad_state, b, _count_after(nb, l))
            for n in _STATE_BUFFERS:
                if n != "buffer_qrot" and n in sviews:
                    named[f"state:{n}"] = sviews[n]
                named[f"cot:{n}"] = cot[n]
        return self._runner.run_backward(self, xv, gv, lens, named,
                                         _state_shapes(b, self.nheads) if stated else None,
                                         buffered_tokens=nb, pending=1 if pending else 0,
                                         stated=1 if stated else 0)


class Mamba3BlockInference(Mamba3Block):
    """Forward-only Mamba3Block on the CPU host binary.

    Same constructor and checks as Mamba3Block; forward, allocate_state and
    step give the same bits. backward raises NotImplementedError.
    """

    def backward(self, x, grad_output, state=None, *, grad_state=None, lengths=None):
        raise NotImplementedError("Mamba3BlockInference is forward-only; use "
                                  "Mamba3Block for gradients")
