"""Mamba-1 backward: the VJP of the scan, the conv and the norm, and the
column sums of the weight gradients, per chunk (the stages backward.mojo's
pass B runs; equations and canonical orders in backward.mojo's docstring
and docs/backward.md, "Mamba-1").
"""
from std.collections import Array
from ..abi import F32Ptr, I64Ptr, arg_int, arg_f32
from ..lane_tree import tree16  # the one fixed 16-lane halving tree
from ..norms import rmsnorm_plain_vjp
from ..block_backward import norm_backward_rows
from ..numerics import exp_f32, silu_f32, silu_grad_f32, softplus_grad_f32
from ..lanes import ld16, st16
from .forward import M1Dims, NSTATE, KCONV
from .backward_layout import (
    BW_G_CONVW, BW_G_CONVB, BW_G_DTB, BW_G_ALOG, BW_G_D, LANES, LV, ROWS_PER_TASK, CH_PER_TASK,
    BWork, BW_GS_CONV, BW_LENGTHS, row_length,
)


def scan_backward(dims: M1Dims, wk: BWork, work: F32Ptr, blob: F32Ptr,
                   c: Int, bb: Int, q: Int, nreal: Int):
    """VJP of the scan, y and the gate for 16 channels of row bb over chunk
    c, tokens last to first. Writes du (scan part), dv (softplus input),
    dgate, dD terms, dB/dC block partials, dA terms (over hs), and carries
    dh to the previous chunk. Tokens j >= nreal are a ragged row's padding:
    every term of theirs is +0.0 and dh passes them unchanged (the final
    state's cotangent applies after the row's last real token)."""
    var di = dims.di
    var nx = dims.nx
    var b = wk.b
    var nc = wk.chunk_tokens(c)
    var c0 = q * LANES
    var nv = min(LANES, di - c0)
    var ck = work.unsafe_offset(wk.o_ckh + (c * b + bb) * NSTATE * di)
    var dhc = work.unsafe_offset(wk.o_dh + bb * NSTATE * di)
    var dl = work.unsafe_offset(wk.o_dl)
    var vv = work.unsafe_offset(wk.o_v)
    var u = work.unsafe_offset(wk.o_u)
    var dbc = work.unsafe_offset(wk.o_dbc)
    var hg = work.unsafe_offset(wk.o_hg)
    var yb = work.unsafe_offset(wk.o_y)
    var dyg = work.unsafe_offset(wk.o_dyg)
    var du_o = work.unsafe_offset(wk.o_du)
    var dv_o = work.unsafe_offset(wk.o_dv)
    var ddc = work.unsafe_offset(wk.o_ddc)
    var dhg = work.unsafe_offset(wk.o_dhg)
    var part = work.unsafe_offset(wk.o_part)
    var hs = work.unsafe_offset(wk.o_hs + (bb * wk.nblk + q) * wk.tc * NSTATE * LANES)
    var dh = Array[LV, NSTATE](fill=LV(0.0))
    var a = Array[LV, NSTATE](fill=LV(0.0))
    comptime for n in range(NSTATE):
        dh[n] = ld16(dhc, n * di + c0, nv)
        a[n] = ld16(blob, dims.o_a + n * di + c0, nv)
    var dskip = ld16(blob, dims.o_dskip + c0, nv)
    for jp in range(nreal, nc):
        var row = bb * nc + jp
        var o = row * di + c0
        st16(dhg, row * 2 * di + di + c0, LV(0.0), nv)
        st16(ddc, o, LV(0.0), nv)
        st16(du_o, o, LV(0.0), nv)
        st16(dv_o, o, LV(0.0), nv)
        var pp = part.unsafe_offset((row * wk.nblk + q) * 2 * NSTATE)
        for n in range(2 * NSTATE):
            pp[unsafe_offset=n] = 0.0
        for n in range(NSTATE):
            hs.unsafe_store((jp * NSTATE + n) * LANES, LV(0.0))
    var j = nreal - 1
    while j >= 0:
        var row = bb * nc + j
        var o = row * di + c0
        var delta = ld16(dl, o, nv)
        var uu = ld16(u, o, nv)
        var gate = ld16(hg, row * 2 * di + di + c0, nv)
        var g_yg = ld16(dyg, o, nv)
        var y = ld16(yb, o, nv)
        var bc = dbc.unsafe_offset(row * nx + dims.r)
        var pp = part.unsafe_offset((row * wk.nblk + q) * 2 * NSTATE)
        var dy = g_yg * silu_f32[LANES](gate)
        st16(dhg, row * 2 * di + di + c0, (g_yg * y) * silu_grad_f32[LANES](gate), nv)
        st16(ddc, o, dy * uu, nv)
        var du = dy * dskip
        var ddl = LV(0.0)
        var dlu = delta * uu
        comptime for n in range(NSTATE):
            var bn = LV(bc[unsafe_offset=n])
            var cn = LV(bc[unsafe_offset=NSTATE + n])
            var hn = hs.unsafe_load[width=LANES]((j * NSTATE + n) * LANES)
            var hp: LV
            if j > 0:
                hp = hs.unsafe_load[width=LANES](((j - 1) * NSTATE + n) * LANES)
            else:
                hp = ld16(ck, n * di + c0, nv)
            var dH = dy.fma(cn, dh[n])
            pp[unsafe_offset=NSTATE + n] = tree16(dy * hn)
            pp[unsafe_offset=n] = tree16(dH * dlu)
            var da = exp_f32[LANES](delta * a[n])
            var garg = (dH * hp) * da
            ddl = garg.fma(a[n], ddl)
            ddl = (dH * uu).fma(bn, ddl)
            du = dH.fma(delta * bn, du)
            hs.unsafe_store((j * NSTATE + n) * LANES, garg * delta)
            dh[n] = dH * da
        st16(du_o, o, du, nv)
        st16(dv_o, o, ddl * softplus_grad_f32[LANES](ld16(vv, o, nv)), nv)
        j -= 1
    comptime for n in range(NSTATE):
        st16(dhc, n * di + c0, dh[n], nv)


def reduce_bc(dims: M1Dims, wk: BWork, work: F32Ptr, nc: Int, task: Int):
    """ddbc[r, R + k] = block partials summed in ascending block order."""
    var nx = dims.nx
    var rows = wk.b * nc
    var r0 = task * ROWS_PER_TASK
    var r1 = min(rows, r0 + ROWS_PER_TASK)
    var part = work.unsafe_offset(wk.o_part)
    var ddbc = work.unsafe_offset(wk.o_ddbc)
    for r in range(r0, r1):
        var base = r * wk.nblk * 2 * NSTATE
        for kk in range(2 * NSTATE):
            var acc = part[unsafe_offset=base + kk]
            for qb in range(1, wk.nblk):
                acc = acc + part[unsafe_offset=base + qb * 2 * NSTATE + kk]
            ddbc[unsafe_offset=r * nx + dims.r + kk] = acc


def bcdt_backward(dims: M1Dims, wk: BWork, work: F32Ptr, nc: Int, task: Int):
    """ddbc through the B/C/dt norms, in place: each row's dtr, B and C
    segments get rmsnorm_plain_vjp of their values before the norms (kept
    by pass B's forward stage)."""
    var nx = dims.nx
    var r0 = task * ROWS_PER_TASK
    var raw = work.unsafe_offset(wk.o_dbcr)
    var ddbc = work.unsafe_offset(wk.o_ddbc)
    for r in range(r0, min(wk.b * nc, r0 + ROWS_PER_TASK)):
        var o = r * nx
        rmsnorm_plain_vjp(raw.unsafe_offset(o), dims.r, dims.bcdt_eps,
                          ddbc.unsafe_offset(o), ddbc.unsafe_offset(o))
        rmsnorm_plain_vjp(raw.unsafe_offset(o + dims.r), NSTATE, dims.bcdt_eps,
                          ddbc.unsafe_offset(o + dims.r), ddbc.unsafe_offset(o + dims.r))
        rmsnorm_plain_vjp(raw.unsafe_offset(o + dims.r + NSTATE), NSTATE, dims.bcdt_eps,
                          ddbc.unsafe_offset(o + dims.r + NSTATE),
                          ddbc.unsafe_offset(o + dims.r + NSTATE))


def column_sums(args: I64Ptr, dims: M1Dims, wk: BWork, work: F32Ptr, nc: Int,
                 q: Int):
    """For 16 channels: dt_proj.bias += dv, D += dD terms, dA += dA terms,
    rows b ascending then tokens ascending (one + chain per element)."""
    var di = dims.di
    var b = wk.b
    var rows = b * nc
    var c0 = q * LANES
    var nv = min(LANES, di - c0)
    var dv = work.unsafe_offset(wk.o_dv)
    var ddc = work.unsafe_offset(wk.o_ddc)
    var gdtb = arg_f32(args, BW_G_DTB)
    var gd = arg_f32(args, BW_G_D)
    var ga = arg_f32(args, BW_G_ALOG)
    var s1 = ld16(gdtb, c0, nv)
    var s2 = ld16(gd, c0, nv)
    for r in range(rows):
        s1 = s1 + ld16(dv, r * di + c0, nv)
        s2 = s2 + ld16(ddc, r * di + c0, nv)
    st16(gdtb, c0, s1, nv)
    st16(gd, c0, s2, nv)
    for n in range(NSTATE):
        var acc = LV(0.0)
        for jl in range(nv):
            acc[jl] = ga[unsafe_offset=(c0 + jl) * NSTATE + n]
        for bb in range(b):
            var hs = work.unsafe_offset(wk.o_hs + (bb * wk.nblk + q) * wk.tc * NSTATE * LANES)
            for j in range(nc):
                acc = acc + hs.unsafe_load[width=LANES]((j * NSTATE + n) * LANES)
        for jl in range(nv):
            ga[unsafe_offset=(c0 + jl) * NSTATE + n] = acc[jl]


def conv_backward(args: I64Ptr, dims: M1Dims, wk: BWork, work: F32Ptr,
                   blob: F32Ptr, c: Int, task: Int):
    """Channels of one task: dhid (into dhg), conv weight/bias gradients,
    and the dpre look-ahead carried to the previous chunk."""
    var di = dims.di
    var b = wk.b
    var nc = wk.chunk_tokens(c)
    var c0 = task * CH_PER_TASK
    var c1 = min(di, c0 + CH_PER_TASK)
    var dpre = work.unsafe_offset(wk.o_dpre)
    var hg = work.unsafe_offset(wk.o_hg)
    var dhg = work.unsafe_offset(wk.o_dhg)
    var gcw = arg_f32(args, BW_G_CONVW)
    var gcb = arg_f32(args, BW_G_CONVB)
    var gs = arg_int(args, BW_GS_CONV)
    var ch = c0
    while ch < c1:
        var nv = min(LANES, c1 - ch)
        var w = Array[LV, KCONV](fill=LV(0.0))
        var gw = Array[LV, KCONV](fill=LV(0.0))
        comptime for k in range(KCONV):
            w[k] = ld16(blob, dims.o_convw + k * di + ch, nv)
            for jl in range(nv):
                gw[k][jl] = gcw[unsafe_offset=(ch + jl) * KCONV + k]
        var gb = ld16(gcb, ch, nv)
        for bb in range(b):
            var carry = work.unsafe_offset(wk.o_dpc + bb * 3 * di)
            var win = work.unsafe_offset(wk.o_ckw + (c * b + bb) * KCONV * di)
            var base = bb * nc
            var f0 = c * wk.tc - (row_length(args, bb) - KCONV)  # final-window slot of j = 0
            for j in range(nc):
                # dhid[t] = sum over m = 0..3 of w[3 - m] * dpre[t + m], from
                # the final window's cotangent if t is one of its 4 inputs
                var acc = window_cotangent(gs, bb, di, ch, nv, f0 + j)
                comptime for m in range(KCONV):
                    var src: LV
                    if j + m < nc:
                        src = ld16(dpre, (base + j + m) * di + ch, nv)
                    else:
                        src = ld16(carry, (j + m - nc) * di + ch, nv)
                    acc = w[KCONV - 1 - m].fma(src, acc)
                st16(dhg, (base + j) * 2 * di + ch, acc, nv)
                # weight and bias terms of token j
                var g = ld16(dpre, (base + j) * di + ch, nv)
                comptime for k in range(KCONV):
                    var pos = j - 3 + k
                    var inp: LV
                    if pos >= 0:
                        inp = ld16(hg, (base + pos) * 2 * di + ch, nv)
                    else:
                        inp = ld16(win, (KCONV + pos) * di + ch, nv)
                    gw[k] = g.fma(inp, gw[k])
                gb = gb + g
            # new carry: dpre rows 0..2 of this chunk (older carry past nc)
            var nw = Array[LV, 3](fill=LV(0.0))
            comptime for m in range(3):
                if m < nc:
                    nw[m] = ld16(dpre, (base + m) * di + ch, nv)
                else:
                    nw[m] = ld16(carry, (m - nc) * di + ch, nv)
            comptime for m in range(3):
                st16(carry, m * di + ch, nw[m], nv)
        comptime for k in range(KCONV):
            for jl in range(nv):
                gcw[unsafe_offset=(ch + jl) * KCONV + k] = gw[k][jl]
        st16(gcb, ch, gb, nv)
        ch += LANES


@always_inline
def window_cotangent(gs: Int, bb: Int, di: Int, ch: Int, nv: Int, f: Int) -> LV:
    """Lanes ch.. of the final conv window's cotangent at slot f (0 = the
    oldest of the last four inputs), row bb; +0.0 if f is not a slot or
    none was given (so the zero-cotangent chains are the former ones)."""
    var v = LV(0.0)
    if gs != 0 and f >= 0 and f < KCONV:
        var src = F32Ptr(unsafe_from_address=gs).unsafe_offset((bb * di + ch) * KCONV + f)
        for jl in range(nv):
            v[jl] = src[unsafe_offset=jl * KCONV]
    return v


def norm_backward(args: I64Ptr, dims: M1Dims, wk: BWork, work: F32Ptr,
                   blob: F32Ptr, c: Int, task: Int):
    """dx = g + RMSNorm VJP of dxn; pn = the norm weight's terms
    (norms.rmsnorm_row_vjp). A ragged row's padding: dx and pn are +0.0."""
    var nc = wk.chunk_tokens(c)
    var r0 = task * ROWS_PER_TASK
    norm_backward_rows(args, wk.l, dims.d, c * wk.tc, nc, arg_int(args, BW_LENGTHS), r0,
                       min(wk.b * nc, r0 + ROWS_PER_TASK), blob.unsafe_offset(dims.o_norm),
                       work.unsafe_offset(wk.o_dxn), work.unsafe_offset(wk.o_pn))
