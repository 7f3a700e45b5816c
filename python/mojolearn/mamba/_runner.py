"""The shared runner of the Mamba blocks: one typed description of a family
(BlockSpec) and the sequence of allocate_state, forward, step and backward
built on it (Runner).

A block class owns one Runner (its ``_runner``), made from its family's
BlockSpec; its public methods call the runner, which calls the family's
own functions (state views, launch) named in the spec. A forward reaches
the native call in four Python frames: ``Block.forward``,
``Runner.forward``, the family's launch, ``Runner.run``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .. import _abi, _intake


def _same(sv):
    return sv


def _no_scalars(block) -> dict:
    return {}


@dataclass(frozen=True)
class BlockSpec:
    """What the shared runner needs to know about one family's block.

    Op ids and names
        ``forward_op``, ``prepare_op``, ``backward_op``: the names of the
        ops the block runs in the binary's op table (ops.mojo); their ids
        and slots are read from the binary.
        ``weight_order``: the weight names in the constructor's (and the
        gradients') order; ``projections``: the weights kept as matmul
        panels in the prepared blob, in its section order.
    State
        ``state_class``: the state class (its ``_ARRAYS`` name the arrays).
        ``state_shapes(block, b)``: {array name: shape} for b rows, in
        ``_ARRAYS`` order. ``state_views(block, state, batch)``: the state
        validated for a call (TypeError / ValueError naming the problem),
        in the form ``launch`` takes; ``written_views(views)``: the array
        views among them (checked against aliasing x). ``position_after``:
        (position, tokens) -> the state's chunk position after that many
        more tokens (None: the state has no chunk position).
    Running
        ``launch(block, xv, y, b, l, state, views, lens, kind)``: pack the
        forward op's arguments, run them with ``Runner.run`` and advance
        the state (state None: a zero-state prefill; lens: (keep-alive,
        address) of the ragged lengths; kind: 'forward' or 'step').
        ``prepare_scalars(block)``: the prepare op's block-specific scalar
        slots by name. ``ragged_state``: forward takes lengths together
        with a state (each row's state is left at its length).
    Backward
        ``written_grads``: the weight gradients the kernel writes in full
        (no zeroing); ``backward_panels``: it takes the transposed panels
        of the projections.
    Memory
        ``keep_work_bytes``: a thread workspace over this size is dropped
        after the call (None: always kept).
    """

    state_class: type
    forward_op: str
    prepare_op: str
    backward_op: str
    weight_order: tuple
    projections: tuple
    state_shapes: Callable
    state_views: Callable
    launch: Callable
    written_views: Callable = _same
    position_after: Optional[Callable] = None
    prepare_scalars: Callable = _no_scalars
    ragged_state: bool = False
    written_grads: tuple = ()
    backward_panels: bool = False
    keep_work_bytes: Optional[int] = None


class Runner:
    """The public calls of a block, shared by every family, driven by one
    BlockSpec. Holds no per-block data: every method takes the block."""

    __slots__ = ("spec",)

    def __init__(self, spec: BlockSpec):
        self.spec = spec

    # -- the public calls ---------------------------------------------------
    def allocate(self, block, batch_size):
        """allocate_state: a zero state for batch_size sequences."""
        from .._array import Array
        b = _intake.as_int(batch_size, "batch_size")
        if b < 1:
            raise ValueError(f"batch_size must be >= 1, got {b}")
        cls = self.spec.state_class
        shapes = self.spec.state_shapes(block, b)
        return cls(*(Array(shapes[n]) for n in cls._ARRAYS))

    def forward(self, block, x, state, lengths):
        """forward: intake of x and lengths, the state's views, overlap and
        finiteness checks, the output, then the family's launch."""
        from .._array import Array
        spec = self.spec
        xv = block._x_view(x)
        b, l, d = xv.shape
        lens = self.lengths(lengths, state, b, l)
        sv = None
        if state is not None:
            sv = spec.state_views(block, state, b)
            _intake.refuse_read_of_written(xv, spec.written_views(sv))
        _intake.check_finite(block._lib, xv, rows=(b, l), lengths_address=lens[1])
        y = Array((b, l, d), zero=False)
        spec.launch(block, xv, y, b, l, state, sv, lens, "forward")
        return y

    def step(self, block, x, state):
        """step: forward at L = 1 with a state (required)."""
        from .._array import Array
        if state is None:
            raise ValueError("step needs a state (use allocate_state)")
        spec = self.spec
        xv, b = block._step_x_view(x)
        sv = spec.state_views(block, state, b)
        _intake.refuse_read_of_written(xv, spec.written_views(sv))
        _intake.check_finite(block._lib, xv)
        y = Array((b, 1, block.d_model), zero=False)
        spec.launch(block, xv, y, b, 1, state, sv, (None, 0), "step")
        return y

    def forward_slots(self, block):
        """The forward op's OpSpec (its slots by name) in the block's binary."""
        return _abi.op_spec(block._lib, self.spec.forward_op)

    def run(self, block, args, op=None):
        """Run op (default: the forward op) with the calling thread's
        workspace in its work slot; a workspace over the spec's
        keep_work_bytes is dropped after the call."""
        lib = block._lib
        spec = _abi.op_spec(lib, self.spec.forward_op if op is None else op)
        work = block._workspace(spec.op, args)
        try:
            args[spec.slot("work")] = work.address
            lib.run(spec.op, args)
        finally:
            keep = self.spec.keep_work_bytes
            if keep is not None and work.size * 4 > keep:
                block._forget_workspace()

    def backward(self, block, x, grad_output, state=None, grad_state=None, lengths=None):
        """backward: the gradients of forward(x, state) (zeros if state is
        None) for the loss sum(y * grad_output) + the sum over the final
        state's arrays of array * grad_state[name]. The op takes x,
        grad_output, the blob, the float32 projections, the gradient arrays
        under 'grad:<weight name>', the transposed panels if the spec says
        so, and (only when given) the start state under 'state:<name>', the
        cotangents under 'grad_state:<name>', the lengths and the start
        state's gradient arrays. (Mamba-2 and Mamba-3 call it only for the
        zero-state backward: they have their own intake of the state
        arguments.)"""
        from . import _grad_state
        xv, gv, lens = self.backward_views(block, x, grad_output, lengths)
        b = xv.shape[0]
        sv = {} if state is None else _grad_state.start_state_views(block, state, b)
        gsv = {} if grad_state is None else _grad_state.cotangent_views(block, grad_state, b)
        named, shapes = {}, None
        if state is not None or grad_state is not None:
            shapes = self.spec.state_shapes(block, b)
            named.update({f"state:{n}": v for n, v in sv.items()})
            named.update({f"grad_state:{n}": v for n, v in gsv.items()})
        return self.run_backward(block, xv, gv, lens, named, shapes)

    def run_backward(self, block, xv, gv, lens, named, state_shapes=None, **scalars):
        """Run the backward op on views xv, gv (B, L, d) and the ragged
        lengths lens, with `named` holding the block's state and cotangent
        slots; allocate the gradients (the kernel writes the spec's
        written_grads and every 'state.<name>' of state_shapes in full: no
        memset) and return them. `scalars` go to the op's other named
        slots."""
        from .._array import Array
        spec = self.spec
        b, l, d = xv.shape
        w, blob = block._backward_weights()
        grads = block._grad_arrays((b, l, d), w, spec.weight_order, written=spec.written_grads)
        for n, shape in (state_shapes or {}).items():
            grads[f"state.{n}"] = named[f"grad:state.{n}"] = Array(shape, zero=False)
        named.update({n: w[n] for n in spec.projections})
        named.update({f"grad:{n}": grads[n] for n in spec.weight_order})
        if lens[1]:
            named["lengths"] = lens[1]
        if spec.backward_panels:
            named["panels"] = block._backward_panels(w)  # `named` holds it until the op returns
        args = _abi.op_spec(block._lib, spec.backward_op).pack(
            named, b=b, l=l, d=d, x=xv, grad_output=gv, blob=blob, dx=grads["x"], **scalars)
        self.run(block, args, spec.backward_op)
        return grads

    # -- intake -------------------------------------------------------------
    def lengths(self, lengths, state, b, l):
        """(keep-alive, address) of validated ragged lengths; (None, 0) if
        none. With a state only where the spec's ragged_state says so."""
        if lengths is None:
            return None, 0
        if state is not None and not self.spec.ragged_state:
            raise ValueError("lengths cannot be combined with a state")
        keep = _intake.lengths_array(lengths, b, l)
        return keep, keep[2]

    @staticmethod
    def backward_views(block, x, grad_output, lengths=None):
        """Validated (x, grad_output, (keep-alive, address) of the lengths)
        for backward: same shape, finite at the real positions (a ragged
        row's padding may hold anything: it is never read)."""
        if "A" in block._weight_names:
            raise ValueError("backward is not available for a block given weight A (as GGUF "
                             "files store it) in place of A_log: its gradients are taken "
                             "w.r.t. A_log")
        xv = block._x_view(x)
        gv = _intake.float32_view(grad_output, "grad_output", ndim=(3,))
        if gv.shape != xv.shape:
            raise ValueError(f"grad_output must have the shape of x {xv.shape}, "
                             f"got {gv.shape}")
        b, l, _ = xv.shape
        lens = (None, 0)
        if lengths is not None:
            keep = _intake.lengths_array(lengths, b, l)
            lens = keep, keep[2]
        _intake.check_finite(block._lib, xv, rows=(b, l), lengths_address=lens[1])
        _intake.check_finite(block._lib, gv, rows=(b, l), lengths_address=lens[1])
        return xv, gv, lens
