"""Op dispatch shared by every entry (CPU binary, GPU binaries): plan, task
and slot declaration by op id, read off the op table (ops.mojo). The GPU
kernel calls `device_op_task` per thread, so the formula code a GPU runs is
the very code the CPU runs; only the scheduling differs.

Each entry point is an _OpCall run by one visitor over `visit_ops` (_ById):
it compares the op id with each op's comptime ID in table order and calls
the entry point on that op, which after inlining is a plain if-chain over
the ids.
"""
from std.memory import Pointer
from .abi import I64Ptr
from .ops import Op, OpVisitor, visit_ops
from .opspec import SlotSink


trait _OpCall(TrivialRegisterPassable):
    """What an entry point does with the op whose id matched."""

    def call[O: Op](mut self) -> Bool:
        """False where this entry point lacks the op (as for an unknown id)."""
        ...


@fieldwise_init
struct _ById[C: _OpCall](OpVisitor):
    """Visits the table until the op with id `op` and calls c on it (c
    keeps what the call answers)."""
    var op: Int
    var c: Self.C

    @always_inline
    def visit[O: Op](mut self) -> Bool:
        if self.op != O.ID:
            return False
        return self.c.call[O]()


@fieldwise_init
struct _Plan(_OpCall):
    var args: I64Ptr
    var p: Int
    var out: Int

    @always_inline
    def call[O: Op](mut self) -> Bool:
        self.out = O.plan(self.args, self.p)
        return True


def op_plan(op: Int, args: I64Ptr, p: Int) -> Int:
    """Tasks in phase p of op (PHASE_END past the last; workspace bytes for
    PLAN_WORKSPACE; -2 for an unknown op)."""
    var v = _ById(op, _Plan(args, p, -2))
    _ = visit_ops(v)
    return v.c.out


@fieldwise_init
struct _Task[DEVICE: Bool](_OpCall):
    """Runs the op's task; with DEVICE, only the ops a GPU runs are
    compiled in (a host op's code never reaches a GPU kernel)."""
    var args: I64Ptr
    var p: Int
    var t: Int

    @always_inline
    def call[O: Op](mut self) -> Bool:
        comptime if Self.DEVICE and O.HOST:
            return False
        else:
            O.task(self.args, self.p, self.t)
            return True


def op_task(op: Int, args: I64Ptr, p: Int, t: Int) -> Int:
    """Runs task t of phase p of op; 0, or -2 for an unknown op."""
    var v = _ById(op, _Task[False](args, p, t))
    return 0 if visit_ops(v) else -2


def device_op_task(op: Int, args: I64Ptr, p: Int, t: Int) -> Int:
    """op_task for the ops a GPU runs (every block output); -2 for others."""
    var v = _ById(op, _Task[True](args, p, t))
    return 0 if visit_ops(v) else -2


@fieldwise_init
struct _Host(_OpCall):
    var host: Bool

    @always_inline
    def call[O: Op](mut self) -> Bool:
        self.host = O.HOST
        return True


def is_host_op(op: Int) -> Bool:
    """Ops a GPU binary runs on the host (Op.HOST in ops.mojo); False for
    an unknown op."""
    var v = _ById(op, _Host(False))
    _ = visit_ops(v)
    return v.c.host


@fieldwise_init
struct _Spec[S: SlotSink, origin: MutOrigin](_OpCall):
    var args: I64Ptr
    var sink: Pointer[Self.S, Self.origin]

    @always_inline
    def call[O: Op](mut self) -> Bool:
        O.spec(self.args, self.sink[])
        return True


def op_spec[S: SlotSink](op: Int, args: I64Ptr, mut s: S) -> Bool:
    """Every slot of `op` into s (opspec.mojo); False for an unknown op."""
    var v = _ById(op, _Spec[S, origin_of(s)](args, Pointer(to=s)))
    return visit_ops(v)
