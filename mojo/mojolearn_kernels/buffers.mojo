"""Which argument slots of an op are buffers, their sizes and directions.

A GPU binary cannot run the tasks on host addresses: it copies each buffer
to the device, runs the tasks on an args copy whose pointer slots hold the
device addresses, and copies back what the op writes. The table it needs is
read off the op's slot declaration (opspec.mojo). The host layer can stage
the same way on the CPU (native.cpp, `emulate_device`), which is how the
table is tested without a GPU: a missing slot, a short size or a wrong
direction changes the result bytes or trips a guard.

op_buffers(op, args, table, cap) writes rows (slot, bytes, flags) for the
non-null buffer slots of `op` (at most `cap` rows) and returns the count.
"""
from .abi import I64Ptr, arg_int, PLAN_WORKSPACE
from .dispatch import op_plan, is_host_op, op_spec
from .opspec import SlotSink, K_INT, K_WORK, BUF_IN, BUF_OUT, BUF_INOUT

comptime BUF_ROW = 3  # Int64s per table row


@fieldwise_init
struct _Rows:
    """Rows (slot, bytes, flags) written into the caller's table as far as
    cap allows; n counts them all."""
    var rows: I64Ptr
    var cap: Int
    var n: Int

    def add(mut self, slot: Int, nbytes: Int, dir: Int):
        if self.n < self.cap:
            var r = self.rows.unsafe_offset(self.n * BUF_ROW)
            r[unsafe_offset=0] = Int64(slot)
            r[unsafe_offset=1] = Int64(nbytes)
            r[unsafe_offset=2] = Int64(dir)
        self.n += 1


@fieldwise_init
struct BufTable(SlotSink):
    """Collects the buffer rows of one call (a SlotSink)."""
    var out: _Rows
    var args: I64Ptr
    var work_bytes: Int  # the op's workspace, planned once before the slots

    def slot(mut self, name: StaticString, slot: Int, kind: Int, dir: Int, bytes: Int):
        """A row for a buffer slot unless it holds a null pointer or no bytes."""
        if kind == K_INT:
            return
        var nbytes = self.work_bytes if kind == K_WORK else bytes
        if arg_int(self.args, slot) == 0 or nbytes <= 0:
            return
        self.out.add(slot, nbytes, dir)


def op_buffers(op: Int, args: I64Ptr, rows: I64Ptr, cap: Int) -> Int:
    """Rows (slot, bytes, flags) of op's buffers; -2 for an unknown op or
    one that runs on the host (dispatch.is_host_op)."""
    if is_host_op(op):
        return -2
    var t = BufTable(_Rows(rows, cap, 0), args, op_plan(op, args, PLAN_WORKSPACE))
    if not op_spec(op, args, t):
        return -2
    return t.out.n
