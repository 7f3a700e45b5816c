"""Which argument slots of an op are buffers, their sizes and directions.

A GPU binary cannot run the tasks on host addresses: it copies each buffer
to the device, runs the tasks on an args copy whose pointer slots hold the
device addresses, and copies back what the op writes. This table is what it
needs, written here next to the slot layouts (the binary knows its ABI; the
Python callers stay unchanged). The host layer can stage the same way on the
CPU (native.cpp, `emulate_device`), which is how the table is tested
without a GPU: a missing slot, a short size or a wrong direction changes
the result bytes or trips a guard.

op_buffers(op, args, table, cap) writes rows (slot, bytes, flags) for the
non-null pointer slots of `op` (at most `cap` rows) and returns the count.
"""
from .abi import (
    I64Ptr, arg_int, arg_f32, OP_MATH_EVAL, OP_M1_FORWARD, OP_M1_BACKWARD,
    OP_M2_FORWARD, OP_M2_BACKWARD, OP_M3_FORWARD, OP_M3_BACKWARD, PLAN_WORKSPACE,
)
from . import mamba1 as m1
from . import mamba1_backward_layout as m1b
from . import mamba2_layout as m2
from . import mamba2_backward_layout as m2b
from . import mamba3_layout as m3
from . import mamba3_backward_layout as m3b
from .dispatch import op_plan
from .weight_panels import blob_format
from .linear_grad import TPanels

# Directions: IN is copied to the device before the op, OUT back after it.
# Neither: device scratch (the op writes it before reading it).
comptime BUF_IN = 1
comptime BUF_OUT = 2
comptime BUF_INOUT = 3
comptime BUF_ROW = 3  # Int64s per table row
comptime F4 = 4  # bytes per float32
comptime I8 = 8  # bytes per int64 (lengths)


struct BufTable:
    var rows: I64Ptr
    var cap: Int
    var n: Int
    var args: I64Ptr

    def __init__(out self, rows: I64Ptr, cap: Int, args: I64Ptr):
        self.rows = rows
        self.cap = cap
        self.n = 0
        self.args = args

    def add(mut self, slot: Int, bytes: Int, flags: Int):
        """A row for slot unless it holds a null pointer or no bytes."""
        if arg_int(self.args, slot) == 0 or bytes <= 0:
            return
        if self.n < self.cap:
            var r = self.rows.unsafe_offset(self.n * BUF_ROW)
            r[unsafe_offset=0] = Int64(slot)
            r[unsafe_offset=1] = Int64(bytes)
            r[unsafe_offset=2] = Int64(flags)
        self.n += 1


def op_buffers(op: Int, args: I64Ptr, rows: I64Ptr, cap: Int) -> Int:
    """Rows (slot, bytes, flags) of op's buffers; -2 for an unknown op or
    one that runs on the host (dispatch.is_host_op)."""
    var t = BufTable(rows, cap, args)
    if op == OP_M1_FORWARD or op == OP_M1_BACKWARD:
        _mamba1(op, args, t)
    elif op == OP_M2_FORWARD or op == OP_M2_BACKWARD:
        _mamba2(op, args, t)
    elif op == OP_M3_FORWARD or op == OP_M3_BACKWARD:
        _mamba3(op, args, t)
    elif op == OP_MATH_EVAL:
        var n = arg_int(args, 3)  # slots: fn, src, dst, n, width
        t.add(1, n * F4, BUF_IN)
        t.add(2, n * F4, BUF_OUT)
    else:
        return -2
    return t.n


def _work(op: Int, args: I64Ptr, mut t: BufTable, slot: Int, flags: Int):
    t.add(slot, op_plan(op, args, PLAN_WORKSPACE), flags)


def _blob_wf(args: I64Ptr) -> Int:
    """Weight format of the prepared blob in slot 5 (every forward and
    backward op), read from its header in host memory."""
    return blob_format(arg_f32(args, 5))


def _tokens(args: I64Ptr) -> Int:
    """B * L * d floats: x, y, grad_output, dx (slots 0, 1, 2 in every op)."""
    return arg_int(args, 0) * arg_int(args, 1) * arg_int(args, 2)


def _mamba1(op: Int, args: I64Ptr, mut t: BufTable):
    var b = arg_int(args, 0)
    var dm = m1.M1Dims(arg_int(args, 2), _blob_wf(args))
    var d = dm.d
    var di = dm.di
    var bx = _tokens(args) * F4
    if op == OP_M1_FORWARD:
        # A decode session's state transfers (FLAG_NO_TOKENS) read and write
        # no tokens: their x and y slots are not staged (the session passes 0).
        var flags = arg_int(args, m1.FWD_FLAGS)
        if (flags & m1.FLAG_NO_TOKENS) == 0:
            t.add(m1.FWD_X, bx, BUF_IN)
            t.add(m1.FWD_Y, bx, BUF_OUT)
        t.add(m1.FWD_BLOB, dm.blob * F4, BUF_IN)
        var state = 0 if (flags & m1.FLAG_NO_LOAD) != 0 else BUF_IN
        if (flags & m1.FLAG_NO_SAVE) == 0:
            state |= BUF_OUT
        t.add(m1.FWD_CONV_WINDOW, b * di * m1.KCONV * F4, state)
        t.add(m1.FWD_H, b * di * m1.NSTATE * F4, state)
        t.add(m1.FWD_LENGTHS, b * I8, BUF_IN)
        # A decode session keeps its state in the workspace between calls.
        _work(op, args, t, m1.FWD_WORK, BUF_INOUT)
        return
    t.add(m1b.BW_X, bx, BUF_IN)
    t.add(m1b.BW_G, bx, BUF_IN)
    t.add(m1b.BW_BLOB, dm.blob * F4, BUF_IN)
    _work(op, args, t, m1b.BW_WORK, 0)
    t.add(m1b.BW_DX, bx, BUF_OUT)
    t.add(m1b.BW_W_IN, 2 * di * d * F4, BUF_IN)
    t.add(m1b.BW_W_X, dm.nx * di * F4, BUF_IN)
    t.add(m1b.BW_W_DT, di * dm.r * F4, BUF_IN)
    t.add(m1b.BW_W_OUT, d * di * F4, BUF_IN)
    # Gradients are zero on entry and accumulated into: in and out.
    t.add(m1b.BW_G_NORM, d * F4, BUF_INOUT)
    t.add(m1b.BW_G_IN, 2 * di * d * F4, BUF_INOUT)
    t.add(m1b.BW_G_CONVW, di * m1.KCONV * F4, BUF_INOUT)
    t.add(m1b.BW_G_CONVB, di * F4, BUF_INOUT)
    t.add(m1b.BW_G_X, dm.nx * di * F4, BUF_INOUT)
    t.add(m1b.BW_G_DT, di * dm.r * F4, BUF_INOUT)
    t.add(m1b.BW_G_DTB, di * F4, BUF_INOUT)
    t.add(m1b.BW_G_ALOG, di * m1.NSTATE * F4, BUF_INOUT)
    t.add(m1b.BW_G_D, di * F4, BUF_INOUT)
    t.add(m1b.BW_G_OUT, d * di * F4, BUF_INOUT)


def _mamba2(op: Int, args: I64Ptr, mut t: BufTable):
    var b = arg_int(args, 0)
    var dm = m2.M2Dims(arg_int(args, 2), _blob_wf(args))
    var d = dm.d
    var bx = _tokens(args) * F4
    var heads = b * dm.nh * m2.P * m2.N * F4  # h, h_last: (B, H, P, N)
    if op == OP_M2_FORWARD:
        t.add(m2.FWD_X, bx, BUF_IN)
        t.add(m2.FWD_Y, bx, BUF_OUT)
        t.add(m2.FWD_BLOB, dm.blob * F4, BUF_IN)
        t.add(m2.FWD_CONV_WINDOW, b * dm.cd * m2.KCONV * F4, BUF_INOUT)
        t.add(m2.FWD_H, heads, BUF_INOUT)
        t.add(m2.FWD_BUF_XBC, b * m2.Q * dm.cd * F4, BUF_INOUT)
        t.add(m2.FWD_BUF_DT, b * m2.Q * dm.nh * F4, BUF_INOUT)
        t.add(m2.FWD_LENGTHS, b * I8, BUF_IN)
        t.add(m2.FWD_HLAST, heads, BUF_OUT)
        t.add(m2.FWD_CACHE, b * m2.cache_floats_per_row(dm.nh) * F4, BUF_INOUT)
        _work(op, args, t, m2.FWD_WORK, BUF_INOUT)
        return
    t.add(m2b.BW_X, bx, BUF_IN)
    t.add(m2b.BW_G, bx, BUF_IN)
    t.add(m2b.BW_BLOB, dm.blob * F4, BUF_IN)
    _work(op, args, t, m2b.BW_WORK, 0)
    t.add(m2b.BW_DX, bx, BUF_OUT)
    t.add(m2b.BW_W_IN, dm.npj * d * F4, BUF_IN)
    t.add(m2b.BW_W_OUT, d * dm.di * F4, BUF_IN)
    t.add(m2b.BW_G_NORM, d * F4, BUF_INOUT)
    t.add(m2b.BW_G_IN, dm.npj * d * F4, BUF_INOUT)
    t.add(m2b.BW_G_CONVW, dm.cd * m2.KCONV * F4, BUF_INOUT)
    t.add(m2b.BW_G_CONVB, dm.cd * F4, BUF_INOUT)
    t.add(m2b.BW_G_DTB, dm.nh * F4, BUF_INOUT)
    t.add(m2b.BW_G_ALOG, dm.nh * F4, BUF_INOUT)
    t.add(m2b.BW_G_D, dm.nh * F4, BUF_INOUT)
    t.add(m2b.BW_G_GNORM, dm.di * F4, BUF_INOUT)
    t.add(m2b.BW_G_OUT, d * dm.di * F4, BUF_INOUT)
    # W_in^T | W_out^T in matmul panels (OP_PACK_TRANSPOSED of (npj, d), (d, di))
    t.add(m2b.BW_PANELS, TPanels(dm.npj, d, d, dm.di).floats * F4, BUF_IN)


def _mamba3(op: Int, args: I64Ptr, mut t: BufTable):
    var b = arg_int(args, 0)
    var dm = m3.M3Dims(arg_int(args, 2), _blob_wf(args))
    var d = dm.d
    var bh = b * dm.nh
    var bx = _tokens(args) * F4
    if op == OP_M3_FORWARD:
        t.add(m3.FWD_X, bx, BUF_IN)
        t.add(m3.FWD_Y, bx, BUF_OUT)
        t.add(m3.FWD_BLOB, dm.blob * F4, BUF_IN)
        t.add(m3.FWD_LENGTHS, b * I8, BUF_IN)
        _work(op, args, t, m3.FWD_WORK, BUF_INOUT)
        # The state (Mamba3State buffers, python/mojolearn/mamba/mamba3.py).
        t.add(m3.FWD_THETA, bh * m3.NANG * F4, BUF_INOUT)
        t.add(m3.FWD_H, bh * m3.HP * m3.NST * F4, BUF_INOUT)
        t.add(m3.FWD_BQ, bh * m3.QC * m3.NST * F4, BUF_INOUT)
        t.add(m3.FWD_BK, bh * m3.QC * m3.NST * F4, BUF_INOUT)
        t.add(m3.FWD_BV, bh * m3.QC * m3.HP * F4, BUF_INOUT)
        t.add(m3.FWD_BDT, bh * m3.QC * F4, BUF_INOUT)
        t.add(m3.FWD_BSG, bh * m3.QC * F4, BUF_INOUT)
        t.add(m3.FWD_BADT, bh * m3.QC * F4, BUF_INOUT)
        t.add(m3.FWD_PK, bh * m3.NST * F4, BUF_INOUT)
        t.add(m3.FWD_PV, bh * m3.HP * F4, BUF_INOUT)
        t.add(m3.FWD_RH, bh * m3.HP * m3.NST * F4, BUF_OUT)
        t.add(m3.FWD_RK, bh * m3.NST * F4, BUF_OUT)
        t.add(m3.FWD_RV, bh * m3.HP * F4, BUF_OUT)
        t.add(m3.FWD_RTHETA, bh * m3.NANG * F4, BUF_OUT)
        return
    t.add(m3b.BW_X, bx, BUF_IN)
    t.add(m3b.BW_G, bx, BUF_IN)
    t.add(m3b.BW_BLOB, dm.blob * F4, BUF_IN)
    _work(op, args, t, m3b.BW_WORK, 0)
    t.add(m3b.BW_DX, bx, BUF_OUT)
    t.add(m3b.BW_W_IN, dm.np * d * F4, BUF_IN)
    t.add(m3b.BW_W_OUT, d * dm.di * F4, BUF_IN)
    t.add(m3b.BW_G_NORM, d * F4, BUF_INOUT)
    t.add(m3b.BW_G_IN, dm.np * d * F4, BUF_INOUT)
    t.add(m3b.BW_G_DTB, dm.nh * F4, BUF_INOUT)
    t.add(m3b.BW_G_BNW, m3.NST * F4, BUF_INOUT)
    t.add(m3b.BW_G_CNW, m3.NST * F4, BUF_INOUT)
    t.add(m3b.BW_G_BB, dm.nh * m3.NST * F4, BUF_INOUT)
    t.add(m3b.BW_G_CB, dm.nh * m3.NST * F4, BUF_INOUT)
    t.add(m3b.BW_G_D, dm.nh * F4, BUF_INOUT)
    t.add(m3b.BW_G_OUT, d * dm.di * F4, BUF_INOUT)
    t.add(m3b.BW_PANELS, TPanels(dm.np, d, d, dm.di).floats * F4, BUF_IN)
