"""Op dispatch shared by every entry (CPU binary, GPU binaries): plan, task
and slot declaration by op id, read off the op table (ops.mojo). The GPU
kernel calls `device_op_task` per thread, so the formula code a GPU runs is
the very code the CPU runs; only the scheduling differs.

Each entry point is a visitor over `visit_ops`: it compares the op id with
each op's comptime ID in table order and calls that op's function, which
after inlining is a plain if-chain over the ids.
"""
from std.memory import Pointer
from .abi import I64Ptr
from .ops import Op, OpVisitor, visit_ops
from .opspec import SlotSink


@fieldwise_init
struct _Plan(OpVisitor):
    var op: Int
    var args: I64Ptr
    var p: Int
    var out: Int

    @always_inline
    def visit[O: Op](mut self) -> Bool:
        if self.op != O.ID:
            return False
        self.out = O.plan(self.args, self.p)
        return True


def op_plan(op: Int, args: I64Ptr, p: Int) -> Int:
    """Tasks in phase p of op (PHASE_END past the last; workspace bytes for
    PLAN_WORKSPACE; -2 for an unknown op)."""
    var v = _Plan(op, args, p, -2)
    _ = visit_ops(v)
    return v.out


@fieldwise_init
struct _Task[DEVICE: Bool](OpVisitor):
    """Runs the task of the op with id `op`; with DEVICE, only the ops a GPU
    runs are compiled in (a host op's code never reaches a GPU kernel)."""
    var op: Int
    var args: I64Ptr
    var p: Int
    var t: Int

    @always_inline
    def visit[O: Op](mut self) -> Bool:
        comptime if Self.DEVICE and O.HOST:
            return False
        else:
            if self.op != O.ID:
                return False
            O.task(self.args, self.p, self.t)
            return True


def op_task(op: Int, args: I64Ptr, p: Int, t: Int) -> Int:
    """Runs task t of phase p of op; 0, or -2 for an unknown op."""
    var v = _Task[False](op, args, p, t)
    return 0 if visit_ops(v) else -2


def device_op_task(op: Int, args: I64Ptr, p: Int, t: Int) -> Int:
    """op_task for the ops a GPU runs (every block output); -2 for others."""
    var v = _Task[True](op, args, p, t)
    return 0 if visit_ops(v) else -2


@fieldwise_init
struct _Host(OpVisitor):
    var op: Int
    var host: Bool

    @always_inline
    def visit[O: Op](mut self) -> Bool:
        if self.op != O.ID:
            return False
        self.host = O.HOST
        return True


def is_host_op(op: Int) -> Bool:
    """Ops a GPU binary runs on the host (Op.HOST in ops.mojo); False for
    an unknown op."""
    var v = _Host(op, False)
    _ = visit_ops(v)
    return v.host


@fieldwise_init
struct _Spec[S: SlotSink, origin: MutOrigin](OpVisitor):
    var op: Int
    var args: I64Ptr
    var sink: Pointer[Self.S, Self.origin]

    @always_inline
    def visit[O: Op](mut self) -> Bool:
        if self.op != O.ID:
            return False
        O.spec(self.args, self.sink[])
        return True


def op_spec[S: SlotSink](op: Int, args: I64Ptr, mut s: S) -> Bool:
    """Every slot of `op` into s (opspec.mojo); False for an unknown op."""
    var v = _Spec[S, origin_of(s)](op, args, Pointer(to=s))
    return visit_ops(v)
