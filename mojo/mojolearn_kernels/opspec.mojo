"""The one declaration of every op's argument slots.

For each op (ops.mojo), its OpSpec struct (`*Spec`) lists every slot once:
its name, kind (a scalar or the element type of a buffer), direction and,
for a buffer, its size in bytes for the call in `args`. The slot numbers themselves are the comptime
constants next to each kernel (FWD_X, BW_G_IN, ...); nothing else spells
them. Everything else is derived from this table:

- the buffer table a device binary stages (buffers.mojo, `ml_buffers`),
- the names the Python layer packs arguments by (`ml_op_spec`: the table
  as text, read once per op; python/mojolearn/_abi.py).

A sink receives the rows; `args` may be all zeros (the text form), so a
size formula must not read through a pointer slot (blob_formats of a null
blob is all float32).
"""
from .abi import I64Ptr, arg_int, arg_f32
from .mamba1 import forward as m1
from .mamba1 import backward_layout as m1b
from .mamba2 import layout as m2
from .mamba2 import backward_layout as m2b
from .mamba3 import layout as m3
from .mamba3 import backward_layout as m3b
from . import lowbit as lb
from . import weight_panels as wp
from . import linear_grad as lg
from . import checks as ck
from . import math_eval as me
from . import lm
from .weight_panels import blob_formats
from .linear_grad import TPanels

# Kinds: a scalar, or a buffer of one element type. K_CODES: uint16
# bfloat16 bits, int8 codes or q4_0 / q8_0 blocks' bytes, by the op's
# format argument (lowbit.code_bytes). K_WORK: the op's
# workspace (its bytes are ml_plan(op, args, PLAN_WORKSPACE)).
comptime K_INT = 0
comptime K_F32 = 1
comptime K_I64 = 2
comptime K_I32 = 3
comptime K_CODES = 4
comptime K_WORK = 5

# Directions of a buffer: IN is read by the op, OUT written; neither: scratch
# (the op writes it before reading it). A device copies IN to the device
# before the op and OUT back after it.
comptime BUF_IN = 1
comptime BUF_OUT = 2
comptime BUF_INOUT = 3
comptime F4 = 4  # bytes per float32 or int32
comptime I8 = 8  # bytes per int64


trait SlotSink:
    def slot(mut self, name: StaticString, slot: Int, kind: Int, dir: Int, bytes: Int):
        """One slot of the op: bytes is 0 for a scalar or a workspace."""
        ...


trait OpSpec:
    """One op's slot declaration (the Spec of its ops.TableOp)."""

    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        """Every argument slot of the call in args into s."""
        ...


struct MathEvalSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        var n = arg_int(args, me.ME_N)
        _int(s, "fn", me.ME_FN)
        s.slot("src", me.ME_SRC, K_F32, BUF_IN, n * F4)
        s.slot("dst", me.ME_DST, K_F32, BUF_OUT, n * F4)
        _int(s, "n", me.ME_N)
        _int(s, "width", me.ME_WIDTH)


struct FirstNonfiniteSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        _int(s, "b", ck.NF_B)
        _int(s, "l", ck.NF_L)
        _int(s, "inner", ck.NF_INNER)
        var bl = arg_int(args, ck.NF_B) * arg_int(args, ck.NF_L)
        s.slot("src", ck.NF_PTR, K_F32, BUF_IN, bl * arg_int(args, ck.NF_INNER) * F4)
        s.slot("lengths", ck.NF_LENGTHS, K_I64, BUF_IN, arg_int(args, ck.NF_B) * I8)
        s.slot("out", ck.NF_OUT, K_I64, BUF_OUT, I8)


struct LowbitPackSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        var rows = arg_int(args, lb.PK_ROWS)
        var n = rows * arg_int(args, lb.PK_COLS)
        _int(s, "fmt", lb.PK_FMT)
        _int(s, "rows", lb.PK_ROWS)
        _int(s, "cols", lb.PK_COLS)
        s.slot("src", lb.PK_SRC, K_F32, BUF_IN, n * F4)
        s.slot("dst", lb.PK_DST, K_CODES, BUF_OUT,
               lb.code_bytes(arg_int(args, lb.PK_FMT), rows, arg_int(args, lb.PK_COLS)))
        s.slot("aux", lb.PK_AUX, K_I32, BUF_OUT, rows * F4)


struct LowbitUnpackSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        var rows = arg_int(args, lb.UP_ROWS)
        var n = rows * arg_int(args, lb.UP_COLS)
        _int(s, "fmt", lb.UP_FMT)
        _int(s, "rows", lb.UP_ROWS)
        _int(s, "cols", lb.UP_COLS)
        s.slot("src", lb.UP_SRC, K_CODES, BUF_IN,
               lb.code_bytes(arg_int(args, lb.UP_FMT), rows, arg_int(args, lb.UP_COLS)))
        s.slot("aux", lb.UP_AUX, K_I32, BUF_IN, rows * F4)
        s.slot("dst", lb.UP_DST, K_F32, BUF_OUT, n * F4)


struct PanelsExtractSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        # the blob's size is not in the arguments: this op runs on the host
        var rows = arg_int(args, wp.EX_ROWS)
        var wf = wp.extract_format(args)
        _int(s, "section", wp.EX_SECTION)
        _int(s, "rows", wp.EX_ROWS)
        _int(s, "cols", wp.EX_COLS)
        s.slot("blob", wp.EX_BLOB, K_F32, BUF_IN, 0)
        s.slot("dst", wp.EX_DST, K_CODES, BUF_OUT,
               lb.code_bytes(wf, rows, arg_int(args, wp.EX_COLS)))
        s.slot("exponents", wp.EX_EXP, K_I32, BUF_OUT, rows * F4)


struct PackTransposedSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        var k1 = arg_int(args, lg.PT_K1)
        var m1_ = arg_int(args, lg.PT_M1)
        var k2 = arg_int(args, lg.PT_K2)
        var m2_ = arg_int(args, lg.PT_M2)
        _int(s, "k1", lg.PT_K1)
        _int(s, "m1", lg.PT_M1)
        s.slot("w1", lg.PT_W1, K_F32, BUF_IN, k1 * m1_ * F4)
        _int(s, "k2", lg.PT_K2)
        _int(s, "m2", lg.PT_M2)
        s.slot("w2", lg.PT_W2, K_F32, BUF_IN, k2 * m2_ * F4)
        s.slot("dst", lg.PT_DST, K_F32, BUF_OUT, TPanels(k1, m1_, k2, m2_).floats * F4)


@always_inline
def _int[S: SlotSink](mut s: S, name: StaticString, slot: Int):
    s.slot(name, slot, K_INT, 0, 0)


@always_inline
def _f32[S: SlotSink](mut s: S, name: StaticString, slot: Int, dir: Int, floats: Int):
    s.slot(name, slot, K_F32, dir, floats * F4)


@always_inline
def _named[S: SlotSink, //, N: StaticString](mut s: S, slot: Int, dir: Int, floats: Int):
    """A float32 slot whose name N is built at compile time (a group's
    prefix + the array's name, see _m3_state)."""
    s.slot(N, slot, K_F32, dir, floats * F4)


def _forward_head[S: SlotSink](
    mut s: S, bx: Int, blob_floats: Int, x: Int, y: Int, blob: Int
):
    """The slots every block forward starts with: the sizes, x, y and the
    blob (bx bytes of x and of y)."""
    _sizes(s)
    s.slot("x", x, K_F32, BUF_IN, bx)
    s.slot("y", y, K_F32, BUF_OUT, bx)
    _f32(s, "blob", blob, BUF_IN, blob_floats)


def _backward_head[S: SlotSink](
    mut s: S, bx: Int, blob_floats: Int, x: Int, g: Int, blob: Int, work: Int, dx: Int
):
    """The slots every block backward starts with: the sizes, x,
    grad_output, the blob, the workspace and dx."""
    _sizes(s)
    s.slot("x", x, K_F32, BUF_IN, bx)
    s.slot("grad_output", g, K_F32, BUF_IN, bx)
    _f32(s, "blob", blob, BUF_IN, blob_floats)
    s.slot("work", work, K_WORK, 0, 0)
    s.slot("dx", dx, K_F32, BUF_OUT, bx)


def _tokens(args: I64Ptr) -> Int:
    """Bytes of x, y, grad_output or dx: B * L * d floats (slots 0, 1, 2 of
    every block op)."""
    return arg_int(args, 0) * arg_int(args, 1) * arg_int(args, 2) * F4


def _sizes[S: SlotSink](mut s: S):
    """Slots 0, 1, 2 of every block op: batch rows, tokens per row, d_model."""
    _int(s, "b", 0)
    _int(s, "l", 1)
    _int(s, "d", 2)


# ---- Mamba-1 ----------------------------------------------------------------
struct M1PrepareSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        _int(s, "d", m1.PREP_D)
        s.slot("norm.weight", m1.PREP_NORM, K_F32, BUF_IN, 0)
        s.slot("in_proj.weight", m1.PREP_IN, K_F32, BUF_IN, 0)
        s.slot("conv1d.weight", m1.PREP_CONVW, K_F32, BUF_IN, 0)
        s.slot("conv1d.bias", m1.PREP_CONVB, K_F32, BUF_IN, 0)
        s.slot("x_proj.weight", m1.PREP_X, K_F32, BUF_IN, 0)
        s.slot("dt_proj.weight", m1.PREP_DT, K_F32, BUF_IN, 0)
        s.slot("dt_proj.bias", m1.PREP_DTB, K_F32, BUF_IN, 0)
        s.slot("A_log", m1.PREP_ALOG, K_F32, BUF_IN, 0)
        s.slot("D", m1.PREP_D_SKIP, K_F32, BUF_IN, 0)
        s.slot("out_proj.weight", m1.PREP_OUT, K_F32, BUF_IN, 0)
        s.slot("blob", m1.PREP_BLOB, K_F32, BUF_OUT, 0)
        _int(s, "wfmt", m1.PREP_WFMT)
        s.slot("exp:in_proj.weight", m1.PREP_IN_EXP, K_I32, BUF_IN, 0)
        s.slot("exp:x_proj.weight", m1.PREP_X_EXP, K_I32, BUF_IN, 0)
        s.slot("exp:dt_proj.weight", m1.PREP_DT_EXP, K_I32, BUF_IN, 0)
        s.slot("exp:out_proj.weight", m1.PREP_OUT_EXP, K_I32, BUF_IN, 0)
        _int(s, "bcdt_eps_bits", m1.PREP_BCDT_EPS)
        _int(s, "a_given", m1.PREP_A_GIVEN)


struct M1ForwardSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        var b = arg_int(args, m1.FWD_B)
        var dm = m1.M1Dims(arg_int(args, m1.FWD_D), blob_formats(arg_f32(args, m1.FWD_BLOB)))
        var di = dm.di
        var flags = arg_int(args, m1.FWD_FLAGS)
        # A decode session's state transfers (FLAG_NO_TOKENS) read and write no
        # tokens: their x and y are not staged (the session passes 0).
        var bx = 0 if (flags & m1.FLAG_NO_TOKENS) != 0 else _tokens(args)
        _forward_head(s, bx, dm.blob, m1.FWD_X, m1.FWD_Y, m1.FWD_BLOB)
        var state = 0 if (flags & m1.FLAG_NO_LOAD) != 0 else BUF_IN
        if (flags & m1.FLAG_NO_SAVE) == 0:
            state |= BUF_OUT
        _m1_state[""](s, state, b * di, m1.FWD_CONV_WINDOW, m1.FWD_H)
        s.slot("lengths", m1.FWD_LENGTHS, K_I64, BUF_IN, b * I8)
        # A decode session keeps its state in the workspace between calls.
        s.slot("work", m1.FWD_WORK, K_WORK, BUF_INOUT, 0)
        _int(s, "flags", m1.FWD_FLAGS)


struct M1BackwardSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        var dm = m1.M1Dims(arg_int(args, m1b.BW_D), blob_formats(arg_f32(args, m1b.BW_BLOB)))
        var d = dm.d
        var di = dm.di
        _backward_head(s, _tokens(args), dm.blob, m1b.BW_X, m1b.BW_G, m1b.BW_BLOB, m1b.BW_WORK,
                       m1b.BW_DX)
        _f32(s, "in_proj.weight", m1b.BW_W_IN, BUF_IN, 2 * di * d)
        _f32(s, "x_proj.weight", m1b.BW_W_X, BUF_IN, dm.nx * di)
        _f32(s, "dt_proj.weight", m1b.BW_W_DT, BUF_IN, di * dm.r)
        _f32(s, "out_proj.weight", m1b.BW_W_OUT, BUF_IN, d * di)
        # Gradients are zero on entry and accumulated into: in and out.
        _f32(s, "grad:norm.weight", m1b.BW_G_NORM, BUF_INOUT, d)
        _f32(s, "grad:in_proj.weight", m1b.BW_G_IN, BUF_INOUT, 2 * di * d)
        _f32(s, "grad:conv1d.weight", m1b.BW_G_CONVW, BUF_INOUT, di * m1.KCONV)
        _f32(s, "grad:conv1d.bias", m1b.BW_G_CONVB, BUF_INOUT, di)
        _f32(s, "grad:x_proj.weight", m1b.BW_G_X, BUF_INOUT, dm.nx * di)
        _f32(s, "grad:dt_proj.weight", m1b.BW_G_DT, BUF_INOUT, di * dm.r)
        _f32(s, "grad:dt_proj.bias", m1b.BW_G_DTB, BUF_INOUT, di)
        _f32(s, "grad:A_log", m1b.BW_G_ALOG, BUF_INOUT, di * m1.NSTATE)
        _f32(s, "grad:D", m1b.BW_G_D, BUF_INOUT, di)
        _f32(s, "grad:out_proj.weight", m1b.BW_G_OUT, BUF_INOUT, d * di)
        # Through the state (optional, null = absent): the start state, the final
        # state's cotangents, ragged lengths, and the start state's gradients.
        var bdi = arg_int(args, m1b.BW_B) * di
        _m1_state["state:"](s, BUF_IN, bdi, m1b.BW_CONV_WINDOW, m1b.BW_H)
        _m1_state["grad_state:"](s, BUF_IN, bdi, m1b.BW_GS_CONV, m1b.BW_GS_H)
        s.slot("lengths", m1b.BW_LENGTHS, K_I64, BUF_IN, arg_int(args, m1b.BW_B) * I8)
        _m1_state["grad:state."](s, BUF_OUT, bdi, m1b.BW_G_CONV0, m1b.BW_G_H0)


def _m1_state[S: SlotSink, //, P: StaticString](mut s: S, dir: Int, bdi: Int, cw: Int, h: Int):
    """The Mamba-1 state arrays (B * di rows) named P + their name."""
    _named[P + "conv_window"](s, cw, dir, bdi * m1.KCONV)
    _named[P + "h"](s, h, dir, bdi * m1.NSTATE)


# ---- Mamba-2 ----------------------------------------------------------------
struct M2PrepareSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        _int(s, "d", m2.PREP_D)
        s.slot("block_norm.weight", m2.PREP_NORM, K_F32, BUF_IN, 0)
        s.slot("in_proj.weight", m2.PREP_IN, K_F32, BUF_IN, 0)
        s.slot("conv1d.weight", m2.PREP_CONVW, K_F32, BUF_IN, 0)
        s.slot("conv1d.bias", m2.PREP_CONVB, K_F32, BUF_IN, 0)
        s.slot("dt_bias", m2.PREP_DTB, K_F32, BUF_IN, 0)
        s.slot("A_log", m2.PREP_ALOG, K_F32, BUF_IN, 0)
        s.slot("D", m2.PREP_DSKIP, K_F32, BUF_IN, 0)
        s.slot("norm.weight", m2.PREP_GNORM, K_F32, BUF_IN, 0)
        s.slot("out_proj.weight", m2.PREP_OUT, K_F32, BUF_IN, 0)
        _int(s, "dt_lo_bits", m2.PREP_LO)
        _int(s, "dt_hi_bits", m2.PREP_HI)
        s.slot("blob", m2.PREP_BLOB, K_F32, BUF_OUT, 0)
        _int(s, "wfmt", m2.PREP_WFMT)
        s.slot("exp:in_proj.weight", m2.PREP_IN_EXP, K_I32, BUF_IN, 0)
        s.slot("exp:out_proj.weight", m2.PREP_OUT_EXP, K_I32, BUF_IN, 0)
        _int(s, "a_given", m2.PREP_A_GIVEN)
        _int(s, "n_groups", m2.PREP_NGROUPS)


struct M2ForwardSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        var b = arg_int(args, m2.FWD_B)
        var blob = arg_f32(args, m2.FWD_BLOB)
        var dm = m2.M2Dims(arg_int(args, m2.FWD_D), blob_formats(blob), m2.blob_ngroups(blob))
        var bx = _tokens(args)
        var heads = b * dm.nh * m2.P * m2.N  # h, h_last: (B, H, P, N)
        _forward_head(s, bx, dm.blob, m2.FWD_X, m2.FWD_Y, m2.FWD_BLOB)
        _m2_state[""](s, BUF_INOUT, b, dm, m2.FWD_CONV_WINDOW, m2.FWD_H, m2.FWD_BUF_XBC,
                      m2.FWD_BUF_DT)
        _int(s, "buffered_tokens", m2.FWD_S)
        s.slot("lengths", m2.FWD_LENGTHS, K_I64, BUF_IN, b * I8)
        _f32(s, "h_last", m2.FWD_HLAST, BUF_OUT, heads)
        _int(s, "save", m2.FWD_SAVE)
        # scratch: nothing in it outlives a call (a session's own copies live in
        # its state arrays and the cache)
        s.slot("work", m2.FWD_WORK, K_WORK, 0, 0)
        _f32(s, "cache", m2.FWD_CACHE, BUF_INOUT, b * m2.cache_floats_per_row(dm.nh, dm.ng))
        s.slot("row_tokens", m2.FWD_ROW_S, K_I64, BUF_IN, b * I8)


struct M2BackwardSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        var blob = arg_f32(args, m2b.BW_BLOB)
        var dm = m2.M2Dims(arg_int(args, m2b.BW_D), blob_formats(blob), m2.blob_ngroups(blob))
        var d = dm.d
        _backward_head(s, _tokens(args), dm.blob, m2b.BW_X, m2b.BW_G, m2b.BW_BLOB, m2b.BW_WORK,
                       m2b.BW_DX)
        _f32(s, "in_proj.weight", m2b.BW_W_IN, BUF_IN, dm.npj * d)
        _f32(s, "out_proj.weight", m2b.BW_W_OUT, BUF_IN, d * dm.di)
        _f32(s, "grad:block_norm.weight", m2b.BW_G_NORM, BUF_INOUT, d)
        _f32(s, "grad:in_proj.weight", m2b.BW_G_IN, BUF_INOUT, dm.npj * d)
        _f32(s, "grad:conv1d.weight", m2b.BW_G_CONVW, BUF_INOUT, dm.cd * m2.KCONV)
        _f32(s, "grad:conv1d.bias", m2b.BW_G_CONVB, BUF_INOUT, dm.cd)
        _f32(s, "grad:dt_bias", m2b.BW_G_DTB, BUF_INOUT, dm.nh)
        _f32(s, "grad:A_log", m2b.BW_G_ALOG, BUF_INOUT, dm.nh)
        _f32(s, "grad:D", m2b.BW_G_D, BUF_INOUT, dm.nh)
        _f32(s, "grad:norm.weight", m2b.BW_G_GNORM, BUF_INOUT, dm.di)
        _f32(s, "grad:out_proj.weight", m2b.BW_G_OUT, BUF_INOUT, d * dm.di)
        # W_in^T | W_out^T in matmul panels (OP_PACK_TRANSPOSED of (npj, d), (d, di))
        _f32(s, "panels", m2b.BW_PANELS, BUF_IN, TPanels(dm.npj, d, d, dm.di).floats)
        # Through the state (optional, null = zeros / absent): the start state
        # (buffered_tokens rows of its buffers), the final state's cotangents,
        # ragged lengths, and the start state's gradients (mamba2/backward_state.mojo).
        var b = arg_int(args, m2b.BW_B)
        _int(s, "buffered_tokens", m2b.BW_N0)
        _int(s, "stated", m2b.BW_STATED)
        s.slot("lengths", m2b.BW_LENGTHS, K_I64, BUF_IN, b * I8)
        _m2_state["state:"](s, BUF_IN, b, dm, m2b.BW_S_CONV, m2b.BW_S_H, m2b.BW_S_BX, m2b.BW_S_BD)
        _m2_state["grad_state:"](s, BUF_IN, b, dm, m2b.BW_C_CONV, m2b.BW_C_H, m2b.BW_C_BX,
                                 m2b.BW_C_BD)
        _m2_state["grad:state."](s, BUF_OUT, b, dm, m2b.BW_GS_CONV, m2b.BW_GS_H, m2b.BW_GS_BX,
                                 m2b.BW_GS_BD)


def _m2_state[S: SlotSink, //, P: StaticString](
    mut s: S, dir: Int, b: Int, dm: m2.M2Dims, cw: Int, h: Int, bxc: Int, bd: Int
):
    """The Mamba-2 state arrays of b rows (Mamba2State,
    python/mojolearn/mamba/mamba2.py) named P + their name."""
    _named[P + "conv_window"](s, cw, dir, b * dm.cd * m2.KCONV)
    _named[P + "h"](s, h, dir, b * dm.nh * m2.P * m2.N)
    _named[P + "buffer_xbc"](s, bxc, dir, b * m2.Q * dm.cd)
    _named[P + "buffer_dtraw"](s, bd, dir, b * m2.Q * dm.nh)


# ---- Mamba-3 ----------------------------------------------------------------
struct M3PrepareSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        _int(s, "d", m3.PREP_D)
        s.slot("block_norm.weight", m3.PREP_NORM, K_F32, BUF_IN, 0)
        s.slot("in_proj.weight", m3.PREP_IN, K_F32, BUF_IN, 0)
        s.slot("dt_bias", m3.PREP_DTB, K_F32, BUF_IN, 0)
        s.slot("B_norm.weight", m3.PREP_BNW, K_F32, BUF_IN, 0)
        s.slot("C_norm.weight", m3.PREP_CNW, K_F32, BUF_IN, 0)
        s.slot("B_bias", m3.PREP_BB, K_F32, BUF_IN, 0)
        s.slot("C_bias", m3.PREP_CB, K_F32, BUF_IN, 0)
        s.slot("D", m3.PREP_DSKIP, K_F32, BUF_IN, 0)
        s.slot("out_proj.weight", m3.PREP_OUT, K_F32, BUF_IN, 0)
        s.slot("blob", m3.PREP_BLOB, K_F32, BUF_OUT, 0)
        _int(s, "wfmt", m3.PREP_WFMT)
        s.slot("exp:in_proj.weight", m3.PREP_IN_EXP, K_I32, BUF_IN, 0)
        s.slot("exp:out_proj.weight", m3.PREP_OUT_EXP, K_I32, BUF_IN, 0)


struct M3ForwardSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        var b = arg_int(args, m3.FWD_B)
        var dm = m3.M3Dims(arg_int(args, m3.FWD_D), blob_formats(arg_f32(args, m3.FWD_BLOB)))
        var bh = b * dm.nh
        var bx = _tokens(args)
        _forward_head(s, bx, dm.blob, m3.FWD_X, m3.FWD_Y, m3.FWD_BLOB)
        s.slot("lengths", m3.FWD_LENGTHS, K_I64, BUF_IN, b * I8)
        s.slot("work", m3.FWD_WORK, K_WORK, 0, 0)  # scratch: nothing in it outlives a call
        _int(s, "buffered_tokens", m3.FWD_N0)
        _int(s, "pending", m3.FWD_PENDING)
        _int(s, "mode", m3.FWD_MODE)
        # The state (Mamba3State arrays, python/mojolearn/mamba/mamba3.py).
        _m3_state[""](s, BUF_INOUT, bh, m3.FWD_THETA, m3.FWD_H, m3.FWD_BQ, m3.FWD_BK, m3.FWD_BV,
                      m3.FWD_BDT, m3.FWD_BSG, m3.FWD_BADT, m3.FWD_PK, m3.FWD_PV)
        # Reports (mode 1).
        _f32(s, "report:h", m3.FWD_RH, BUF_OUT, bh * m3.HP * m3.NST)
        _f32(s, "report:k", m3.FWD_RK, BUF_OUT, bh * m3.NST)
        _f32(s, "report:v", m3.FWD_RV, BUF_OUT, bh * m3.HP)
        _f32(s, "report:theta", m3.FWD_RTHETA, BUF_OUT, bh * m3.NANG)
        s.slot("row_tokens", m3.FWD_ROW_N0, K_I64, BUF_IN, b * I8)


struct M3BackwardSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        var dm = m3.M3Dims(arg_int(args, m3b.BW_D), blob_formats(arg_f32(args, m3b.BW_BLOB)))
        var d = dm.d
        _backward_head(s, _tokens(args), dm.blob, m3b.BW_X, m3b.BW_G, m3b.BW_BLOB, m3b.BW_WORK,
                       m3b.BW_DX)
        _f32(s, "in_proj.weight", m3b.BW_W_IN, BUF_IN, dm.np * d)
        _f32(s, "out_proj.weight", m3b.BW_W_OUT, BUF_IN, d * dm.di)
        _f32(s, "grad:block_norm.weight", m3b.BW_G_NORM, BUF_INOUT, d)
        _f32(s, "grad:in_proj.weight", m3b.BW_G_IN, BUF_INOUT, dm.np * d)
        _f32(s, "grad:dt_bias", m3b.BW_G_DTB, BUF_INOUT, dm.nh)
        _f32(s, "grad:B_norm.weight", m3b.BW_G_BNW, BUF_INOUT, m3.NST)
        _f32(s, "grad:C_norm.weight", m3b.BW_G_CNW, BUF_INOUT, m3.NST)
        _f32(s, "grad:B_bias", m3b.BW_G_BB, BUF_INOUT, dm.nh * m3.NST)
        _f32(s, "grad:C_bias", m3b.BW_G_CB, BUF_INOUT, dm.nh * m3.NST)
        _f32(s, "grad:D", m3b.BW_G_D, BUF_INOUT, dm.nh)
        _f32(s, "grad:out_proj.weight", m3b.BW_G_OUT, BUF_INOUT, d * dm.di)
        _f32(s, "panels", m3b.BW_PANELS, BUF_IN, TPanels(dm.np, d, d, dm.di).floats)
        # gradients through the state (0 / null for the zero-state backward)
        var bh = arg_int(args, m3b.BW_B) * dm.nh
        _int(s, "buffered_tokens", m3b.BW_N0)
        _int(s, "pending", m3b.BW_PENDING)
        _int(s, "stated", m3b.BW_STATED)
        s.slot("lengths", m3b.BW_LENGTHS, K_I64, BUF_IN, arg_int(args, m3b.BW_B) * I8)
        _m3_state["state:"](s, BUF_IN, bh, m3b.BW_S_THETA, m3b.BW_S_H, -1, m3b.BW_S_BK,
                            m3b.BW_S_BV, m3b.BW_S_BDT, m3b.BW_S_BSG, m3b.BW_S_BADT, m3b.BW_S_PK,
                            m3b.BW_S_PV)
        _m3_state["cot:"](s, BUF_IN, bh, m3b.BW_C_THETA, m3b.BW_C_H, m3b.BW_C_BQ, m3b.BW_C_BK,
                          m3b.BW_C_BV, m3b.BW_C_BDT, m3b.BW_C_BSG, m3b.BW_C_BADT, m3b.BW_C_PK,
                          m3b.BW_C_PV)
        _m3_state["grad:state."](s, BUF_OUT, bh, m3b.BW_GS_THETA, m3b.BW_GS_H, m3b.BW_GS_BQ,
                                 m3b.BW_GS_BK, m3b.BW_GS_BV, m3b.BW_GS_BDT, m3b.BW_GS_BSG,
                                 m3b.BW_GS_BADT, m3b.BW_GS_PK, m3b.BW_GS_PV)


def _m3_state[S: SlotSink, //, P: StaticString](
    mut s: S, dir: Int, bh: Int, theta: Int, h: Int, bq: Int, bk: Int, bv: Int, bdt: Int,
    bsg: Int, badt: Int, pk: Int, pv: Int,
):
    """The Mamba-3 state arrays of bh (row, head) pairs (Mamba3State,
    python/mojolearn/mamba/mamba3.py) named P + their name; bq < 0: a group
    without buffer_qrot."""
    var rows = bh * m3.QC  # buffer rows (B, 64, H)
    _named[P + "theta"](s, theta, dir, bh * m3.NANG)
    _named[P + "h"](s, h, dir, bh * m3.HP * m3.NST)
    if bq >= 0:
        _named[P + "buffer_qrot"](s, bq, dir, rows * m3.NST)
    _named[P + "buffer_krot"](s, bk, dir, rows * m3.NST)
    _named[P + "buffer_v"](s, bv, dir, rows * m3.HP)
    _named[P + "buffer_dt"](s, bdt, dir, rows)
    _named[P + "buffer_sig"](s, bsg, dir, rows)
    _named[P + "buffer_adt"](s, badt, dir, rows)
    _named[P + "pending_k"](s, pk, dir, bh * m3.NST)
    _named[P + "pending_v"](s, pv, dir, bh * m3.HP)


# ---- language-model ends (lm.mojo) --------------------------------------------
struct LmPrepareSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        # a host op: sizes are not needed
        _int(s, "d", lm.LMP_D)
        _int(s, "vocab", lm.LMP_V)
        s.slot("norm_f.weight", lm.LMP_NORM, K_F32, BUF_IN, 0)
        s.slot("lm_head.weight", lm.LMP_HEAD, K_CODES, BUF_IN, 0)
        s.slot("exp:lm_head.weight", lm.LMP_HEAD_EXP, K_I32, BUF_IN, 0)
        s.slot("embeddings.weight", lm.LMP_EMB, K_CODES, BUF_IN, 0)
        s.slot("exp:embeddings.weight", lm.LMP_EMB_EXP, K_I32, BUF_IN, 0)
        _int(s, "wfmt", lm.LMP_WFMT)
        s.slot("blob", lm.LMP_BLOB, K_F32, BUF_OUT, 0)
        _int(s, "row0", lm.LMP_ROW0)
        _int(s, "nrows", lm.LMP_NROWS)


struct LmEmbedSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        var n = arg_int(args, lm.LME_N)
        var d = arg_int(args, lm.LME_D)
        var dm = lm.lm_blob_dims(arg_f32(args, lm.LME_BLOB), d, arg_int(args, lm.LME_V))
        _int(s, "n", lm.LME_N)
        _int(s, "d", lm.LME_D)
        _int(s, "vocab", lm.LME_V)
        s.slot("tokens", lm.LME_TOKENS, K_I64, BUF_IN, n * I8)
        _f32(s, "blob", lm.LME_BLOB, BUF_IN, dm.blob)
        _f32(s, "x", lm.LME_X, BUF_OUT, n * d)


struct LmLogitsSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        var r = arg_int(args, lm.LML_R)
        var d = arg_int(args, lm.LML_D)
        var v = arg_int(args, lm.LML_V)
        var dm = lm.lm_blob_dims(arg_f32(args, lm.LML_BLOB), d, v)
        _int(s, "rows", lm.LML_R)
        _int(s, "d", lm.LML_D)
        _int(s, "vocab", lm.LML_V)
        _f32(s, "x", lm.LML_X, BUF_IN, r * d)
        _f32(s, "blob", lm.LML_BLOB, BUF_IN, dm.blob)
        s.slot("work", lm.LML_WORK, K_WORK, 0, 0)
        _f32(s, "logits", lm.LML_OUT, BUF_OUT, r * v)


struct LmNextSpec(OpSpec):
    @staticmethod
    def spec[S: SlotSink](args: I64Ptr, mut s: S):
        var r = arg_int(args, lm.LMN_R)
        var v = arg_int(args, lm.LMN_V)
        _int(s, "rows", lm.LMN_R)
        _int(s, "vocab", lm.LMN_V)
        _f32(s, "logits", lm.LMN_LOGITS, BUF_IN, r * v)
        _f32(s, "temperature", lm.LMN_TEMP, BUF_IN, r)
        s.slot("top_k", lm.LMN_TOPK, K_I64, BUF_IN, r * I8)
        _f32(s, "top_p", lm.LMN_TOPP, BUF_IN, r)
        _f32(s, "u", lm.LMN_U, BUF_IN, r)
        s.slot("work", lm.LMN_WORK, K_WORK, 0, 0)
        s.slot("tokens", lm.LMN_OUT, K_I64, BUF_OUT, r * I8)
