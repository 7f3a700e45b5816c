"""Mamba-2 backward through the state: where a start state (Mamba2State:
conv_window, h, the open chunk's buffer_xbc / buffer_dtraw rows) enters
the recompute, where the final state's cotangents enter the VJP, and where
the start state's gradients are written. The chunk VJP itself is
backward.mojo's, on the rows "n0 state rows, then the tokens".

The forward from a state (docs/mamba2.md, "Chunks, state and decode"):
chunk 0 holds the n0 buffered rows (post-SiLU xBC and raw dt, read from
the state) before its first tokens; the conv window before token 0 is the
state's; chunk 0 starts from the state's h. Its final state:
  h           = the fold of the last chunk if that chunk is full, else the
                h entering it (the last chunk is the open one);
  buffer_*    = the rows of the open last chunk (state rows included when
                no chunk was completed); nothing if the last chunk is full;
  conv_window = the conv inputs at positions L-4 .. L-1 (the start window's
                entries for negative positions).
So the cotangents enter as: h -> dh at the last chunk's end (full) or
added to the dh leaving it (open); buffer_xbc -> the post-SiLU gradient of
the open chunk's rows (one add); buffer_dtraw -> the raw dt gradient of
those rows (one add; dt_bias gets none: the buffer holds dt without it);
conv_window -> the start of the conv VJP chains of the last four inputs
(as Mamba-1). A state row has no output in this call: its dy is zero, so
the VJP runs only over the token rows i and the state rows take part as
the columns j (x, B, dt, dA) and in the fold.
"""
from std.collections import Array
from ..abi import F32Ptr, I64Ptr, arg_int, arg_f32
from .layout import P, N, Q, KCONV
from .backward_layout import (
    BW_WORK, BW_S_CONV, BW_S_H, BW_S_BX, BW_C_CONV, BW_C_H, BW_C_BX, BW_GS_CONV, BW_GS_BX,
    BW2, LANES, LV, CH_PER_TASK,
)


def init_state_row(args: I64Ptr, bw: BW2, bb: Int):
    """Row bb's chunk-0 checkpoint is the start state's h; a full last
    chunk's dh (the final h is its fold) starts as the final h's
    cotangent."""
    var work = arg_f32(args, BW_WORK)
    var hs = bw.dims.nh * P * N
    if bw.has(args, BW_S_H):
        var h = arg_f32(args, BW_S_H)
        for i in range(hs):
            work[unsafe_offset=bw.o_ckh + bb * hs + i] = h[unsafe_offset=bb * hs + i]
    var cl = bw.nch - 1
    if bw.has(args, BW_C_H) and not bw.last_open(cl):
        var ch = arg_f32(args, BW_C_H)
        var dst = bw.o_dh + (cl % 2) * bw.b * hs + bb * hs
        for i in range(hs):
            work[unsafe_offset=dst + i] = ch[unsafe_offset=bb * hs + i]


def state_rows_in(args: I64Ptr, bw: BW2, work: F32Ptr, c: Int, bb: Int, c0: Int):
    """Channels [c0, c0 + 64) of row bb: chunk 0's state rows are the start
    state's buffer_xbc rows; look-back rows before token 0 (the conv window
    of the chunk's first tokens) are the start conv_window's entries
    (slot 4 + t for position t < 0)."""
    var dims = bw.dims
    var cd = dims.cd
    var npj = dims.npj
    var nc = bw.nc(c)
    if bw.has(args, BW_S_BX):
        var bx = arg_f32(args, BW_S_BX)
        for j in range(bw.s0(c)):
            for ch in range(c0, c0 + CH_PER_TASK):
                work[unsafe_offset=bw.o_cx + (bb * nc + j) * cd + ch] = bx[
                    unsafe_offset=(bb * Q + j) * cd + ch]
    elif bw.s0(c) > 0:  # buffered rows of a state whose buffer is zeros
        for j in range(bw.s0(c)):
            for ch in range(c0, c0 + CH_PER_TASK):
                work[unsafe_offset=bw.o_cx + (bb * nc + j) * cd + ch] = 0.0
    if not bw.has(args, BW_S_CONV):
        return  # the look-back rows before the sequence are in_proj(0) = +0.0
    var cw = arg_f32(args, BW_S_CONV)
    for q in range(3):
        var t = bw.tok0(c) - 3 + q
        if t < 0:
            for ch in range(c0, c0 + CH_PER_TASK):
                work[unsafe_offset=bw.o_zxp + (bb * 3 + q) * npj + dims.di + ch] = cw[
                    unsafe_offset=(bb * cd + ch) * KCONV + KCONV + t]


@always_inline
def window_cot(args: I64Ptr, bw: BW2, bb: Int, ch: Int, t: Int) -> LV:
    """The final conv_window's cotangent at input position t (16 channels
    from ch): slot t - (L - 4) if t is one of the last four inputs, else
    +0.0 (and always +0.0 without that cotangent)."""
    var k = t - (bw.l - KCONV)
    var v = LV(0.0)
    if k >= 0 and bw.has(args, BW_C_CONV):
        var cw = arg_f32(args, BW_C_CONV)
        for jl in range(LANES):
            v[jl] = cw[unsafe_offset=(bb * bw.dims.cd + ch + jl) * KCONV + k]
    return v


def start_window_grads(args: I64Ptr, bw: BW2, bb: Int, ch: Int, w: Array[LV, KCONV],
                       dpre0: Array[LV, 3]):
    """16 channels of state.conv_window (after chunk 0's conv VJP): slot k
    is input position p = k - 4; its chain starts at the final window's
    cotangent (p >= L - 4) and adds fma(w[3 - m], dpre[p + m], .) for
    m = 0..3 with p + m >= 0 (dpre0: dpre of tokens 0..2, +0.0 past the
    sequence). Slot 0 feeds no convolution: +0.0."""
    var g = arg_f32(args, BW_GS_CONV)
    for k in range(KCONV):
        var p = k - KCONV
        var acc = window_cot(args, bw, bb, ch, p)
        for m in range(KCONV):
            if p + m >= 0:
                acc = w[KCONV - 1 - m].fma(dpre0[p + m], acc)
        for jl in range(LANES):
            g[unsafe_offset=(bb * bw.dims.cd + ch + jl) * KCONV + k] = acc[jl]


@always_inline
def open_cot(args: I64Ptr, bw: BW2, c: Int, bb: Int, j: Int, ch: Int) -> LV:
    """The final buffer_xbc's cotangent of row j of chunk c (16 channels):
    +0.0 unless c is the open last chunk and the cotangent is given."""
    if bw.last_open(c) and bw.has(args, BW_C_BX):
        return arg_f32(args, BW_C_BX).unsafe_load[width=LANES]((bb * Q + j) * bw.dims.cd + ch)
    return LV(0.0)


def state_xbc_grads(args: I64Ptr, bw: BW2, work: F32Ptr, bb: Int, ch: Int):
    """16 channels of state.buffer_xbc (chunk 0's pass B, after dB/dC):
    rows j < n0 get d xBC of their state row plus, if chunk 0 is the open
    last chunk, the final buffer's cotangent (one add); rows past n0: +0.0."""
    var cd = bw.dims.cd
    var nc = bw.nc(0)
    var g = arg_f32(args, BW_GS_BX)
    for j in range(Q):
        var v = LV(0.0)
        if j < bw.n0:
            v = work.unsafe_load[width=LANES](bw.o_dcx + (bb * nc + j) * cd + ch)
            if bw.last_open(0) and bw.has(args, BW_C_BX):
                v = v + open_cot(args, bw, 0, bb, j, ch)
        g.unsafe_store((bb * Q + j) * cd + ch, v)
