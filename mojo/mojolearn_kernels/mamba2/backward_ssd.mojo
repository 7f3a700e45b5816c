"""Mamba-2 backward, the SSD part of pass B: per head and chunk, the VJP of
the chunked SSD (dx, d dt, d(dA), dh carried to the previous chunk: the
equations in backward.mojo's docstring and docs/backward.md, "Mamba-2"),
and the shared-by-heads sums dCB -> dC, dB. Called by backward.mojo's
stages; the canonical orders are those written there.
"""
from std.collections import Array
from ..abi import F32Ptr, I64Ptr, arg_f32
from ..numerics import exp_f32
from .layout import P, N, Q
from .ssd import seg_row
from .backward_layout import (
    BW_C_H, BW_C_BD, BW_GS_H, BW_GS_BD, LANES, LV,
    ROWS_PER_TASK, SCR, BW2,
)
from .backward_recompute import _cx


@always_inline
def _dot_tree(a: F32Ptr, b: F32Ptr) -> Float32:
    """sum over p = 0..63 of a[p] b[p] as a pairwise tree: products rounded
    one by one, (v0 + v1) + (v2 + v3) over the four 16-lane blocks, then
    lane j + lane j+8, +4, +2, +1."""
    var v0 = a.unsafe_load[width=LANES](0) * b.unsafe_load[width=LANES](0)
    var v1 = a.unsafe_load[width=LANES](LANES) * b.unsafe_load[width=LANES](LANES)
    var v2 = a.unsafe_load[width=LANES](2 * LANES) * b.unsafe_load[width=LANES](2 * LANES)
    var v3 = a.unsafe_load[width=LANES](3 * LANES) * b.unsafe_load[width=LANES](3 * LANES)
    var v = (v0 + v1) + (v2 + v3)
    var s8 = v.slice[8, offset=0]() + v.slice[8, offset=8]()
    var s4 = s8.slice[4, offset=0]() + s8.slice[4, offset=4]()
    var s2 = s4.slice[2, offset=0]() + s4.slice[2, offset=2]()
    return s2[0] + s2[1]


@always_inline
def _row_times_ht(v: F32Ptr, ht: F32Ptr, dst: F32Ptr):
    """dst[p] = fma chain over n of v[n] ht[n][p] from +0.0: a B or C row
    (N) times a transposed (N, P) state matrix."""
    comptime PV = P // LANES
    var acc = Array[LV, PV](fill=LV(0.0))
    for n in range(N):
        var vn = LV(v[unsafe_offset=n])
        comptime for q in range(PV):
            acc[q] = vn.fma(ht.unsafe_load[width=LANES](n * P + q * LANES), acc[q])
    comptime for q in range(PV):
        dst.unsafe_store(q * LANES, acc[q])


def ssd_head_backward(args: I64Ptr, bw: BW2, work: F32Ptr, blob: F32Ptr, c: Int, bb: Int,
                       hh: Int, task: Int):
    """Head hh of row bb over chunk c: dx (x part of d xBC), d dtraw, the
    d dt_bias / dA / dD terms, exp(S_i(-1)) and exp(S_last(j)) dt_j for the
    dB/dC stage, and dh at the chunk start (carried to chunk c - 1).
    Orders: dx_j[p]: fma chain over i = j..n-1 ascending of u_ij dy_i[p],
    then the h_end term (fma), then fma(D, dy_j[p], .); d dt_j: fma chain
    over i ascending of w_ij G_ij, then the h_end term (fma), then
    fma(A, d(dA_j), .); d(dA_k): + chain over i ascending of the row
    prefix sums R_i(k) = T_i,-1 + T_i,0 + ... + T_i,k-1, then the h_end
    row's prefix sum; dh0 = exp(S_last(-1)) dh_end, then fma over i
    ascending of (e_i dy_i[p]) C_i[n].
    Through the state: rows i run over the tokens only (a state row has no
    output); the h_end terms run whenever dh_end may be nonzero (not the
    last chunk, or a full last chunk with the final h's cotangent); the
    open last chunk's dh0 starts at the final h's cotangent instead (the
    final h is the h entering it), its d dtraw_j gets the final
    buffer_dtraw's cotangent (one add, after the dt_bias term is taken);
    chunk 0 writes state.h and the state rows' state.buffer_dtraw."""
    var dims = bw.dims
    var di = dims.di
    var nh = dims.nh
    var npj = dims.npj
    var cd = dims.cd
    var ck = bw.chunk(c)
    var open_last = bw.last_open(c)
    var cot_h = bw.has(args, BW_C_H)
    var fold_terms = bw.fold_terms(args, c)
    var hs = bw.b * nh * P * N
    var scr = work.unsafe_offset(bw.o_scr + task * SCR)
    var dxacc = scr  # (Q, P)
    var dh0 = scr.unsafe_offset(Q * P)  # (P, N)
    var ht = scr.unsafe_offset(Q * P + P * N)  # (N, P) h0 or dh_end transposed
    var seg = scr.unsafe_offset(Q * P + 2 * P * N)
    var wrow = seg.unsafe_offset(Q)
    var urow = seg.unsafe_offset(2 * Q)
    var trow = seg.unsafe_offset(3 * Q)
    var ddt = seg.unsafe_offset(4 * Q)
    var dda = seg.unsafe_offset(5 * Q)
    var yo = seg.unsafe_offset(6 * Q)  # P floats
    var off_h = (bb * nh + hh) * P * N
    var h0 = work.unsafe_offset(bw.o_ckh + c * hs + off_h)
    var dhe = work.unsafe_offset(bw.o_dh + (c % 2) * hs + off_h)
    var dhout = work.unsafe_offset(bw.o_dh + ((c + 1) % 2) * hs + off_h)
    var g = dims.group(hh)
    var bcol = dims.bcol(g)
    var ccol = dims.ccol(g)
    var cb = work.unsafe_offset(bw.o_cb + bw.qq(g, bb))
    var o = bw.hq(bb, hh)
    var dts = work.unsafe_offset(bw.o_dt + o)
    var da = work.unsafe_offset(bw.o_da + o)
    var a = blob[unsafe_offset=dims.o_a + hh]
    var dskip = blob[unsafe_offset=dims.o_dskip + hh]
    for kz in range(ck.nc * P):
        dxacc[unsafe_offset=kz] = 0.0
    for j in range(Q):
        ddt[unsafe_offset=j] = 0.0
        dda[unsafe_offset=j] = 0.0
    # dh0 starts as exp(S_last(-1)) dh_end (the open last chunk: the final
    # h's cotangent, the final h being h0)
    var elt = exp_f32[1](seg_row(da, ck.nc - 1, seg))
    var k = 0
    if open_last and cot_h:
        var ch = arg_f32(args, BW_C_H).unsafe_offset(off_h)
        while k < P * N:
            dh0.unsafe_store(k, ch.unsafe_load[width=LANES](k))
            k += LANES
    else:
        while k < P * N:
            dh0.unsafe_store(k, LV(elt) * dhe.unsafe_load[width=LANES](k))
            k += LANES
    for p in range(P):
        for n in range(N):
            ht[unsafe_offset=n * P + p] = h0[unsafe_offset=p * N + n]
    for i in range(ck.s0, ck.nc):
        var r = bb * ck.nt + i - ck.s0
        var ci = seg_row(da, i, seg)
        var eo = exp_f32[1](ci)
        work[unsafe_offset=bw.o_eoff + o + i] = eo
        var jv = 0
        while jv <= i:
            var e = exp_f32[LANES](seg.unsafe_load[width=LANES](jv))
            var w = cb.unsafe_load[width=LANES](i * Q + jv) * e
            wrow.unsafe_store(jv, w)
            urow.unsafe_store(jv, w * dts.unsafe_load[width=LANES](jv))
            jv += LANES
        var dyp = work.unsafe_offset(bw.o_dy + r * di + hh * P)
        var dyv = Array[LV, 4](fill=LV(0.0))
        comptime for q in range(4):
            dyv[q] = dyp.unsafe_load[width=LANES](q * LANES)
        for j in range(i + 1):
            var xj = _cx(bw, work, bb, ck.nc, j).unsafe_offset(hh * P)
            var g = _dot_tree(dyp, xj)
            var uj = urow[unsafe_offset=j]
            var ac = dxacc.unsafe_offset(j * P)
            comptime for q in range(4):
                ac.unsafe_store(q * LANES, LV(uj).fma(dyv[q], ac.unsafe_load[width=LANES](q * LANES)))
            ddt[unsafe_offset=j] = wrow[unsafe_offset=j].fma(g, ddt[unsafe_offset=j])
            trow[unsafe_offset=j] = uj * g
        # Yoff: yo[p] = C_i . h0[p]; T_i,-1 = e_i * (dy_i . yo)
        var crow = _cx(bw, work, bb, ck.nc, i).unsafe_offset(ccol)
        _row_times_ht(crow, ht, yo)
        var racc = eo * _dot_tree(dyp, yo)
        dda[unsafe_offset=0] = dda[unsafe_offset=0] + racc
        for kk in range(1, i + 1):
            racc = racc + trow[unsafe_offset=kk - 1]
            dda[unsafe_offset=kk] = dda[unsafe_offset=kk] + racc
        # dh0 += (e_i dy_i) C_i^T
        var cv = Array[LV, N // LANES](fill=LV(0.0))
        comptime for q in range(N // LANES):
            cv[q] = crow.unsafe_load[width=LANES](q * LANES)
        for p in range(P):
            var coef = LV(eo * dyp[unsafe_offset=p])
            var tp = dh0.unsafe_offset(p * N)
            comptime for q in range(N // LANES):
                tp.unsafe_store(q * LANES, coef.fma(cv[q], tp.unsafe_load[width=LANES](q * LANES)))
    if fold_terms:  # h_end = fold of this (full) chunk; dh_end is nonzero
        var total = seg_row(da, ck.nc - 1, seg)
        for p in range(P):
            for n in range(N):
                ht[unsafe_offset=n * P + p] = dhe[unsafe_offset=p * N + n]
        var sacc: Float32 = 0.0
        for kk in range(P * N):
            sacc = dhe[unsafe_offset=kk].fma(h0[unsafe_offset=kk], sacc)
        var racc = exp_f32[1](total) * sacc
        for j in range(ck.nc):
            var el = exp_f32[1](seg[unsafe_offset=j])
            var eld = el * dts[unsafe_offset=j]
            work[unsafe_offset=bw.o_elast + o + j] = eld
            var row = _cx(bw, work, bb, ck.nc, j)
            _row_times_ht(row.unsafe_offset(bcol), ht, yo)
            var xj = row.unsafe_offset(hh * P)
            var sxq = _dot_tree(xj, yo)
            var ac = dxacc.unsafe_offset(j * P)
            comptime for q in range(4):
                ac.unsafe_store(q * LANES, LV(eld).fma(yo.unsafe_load[width=LANES](q * LANES),
                                                       ac.unsafe_load[width=LANES](q * LANES)))
            ddt[unsafe_offset=j] = el.fma(sxq, ddt[unsafe_offset=j])
            trow[unsafe_offset=j] = eld * sxq
        dda[unsafe_offset=0] = dda[unsafe_offset=0] + racc
        for kk in range(1, ck.nc):
            racc = racc + trow[unsafe_offset=kk - 1]
            dda[unsafe_offset=kk] = dda[unsafe_offset=kk] + racc
    # finish: dx, d dtraw, column-sum terms
    var sg = work.unsafe_offset(bw.o_sg + o)
    var cot_bd = open_last and bw.has(args, BW_C_BD)
    var gsbd = arg_f32(args, BW_GS_BD)
    for j in range(ck.nc):
        var r = bb * ck.nc + j  # (scan row)
        var xj = _cx(bw, work, bb, ck.nc, j).unsafe_offset(hh * P)
        var ac = dxacc.unsafe_offset(j * P)
        var dtot = a.fma(dda[unsafe_offset=j], ddt[unsafe_offset=j])
        var dv = dtot * sg[unsafe_offset=j]
        var dvo = dv  # d dtraw_j (+ the final buffer's cotangent)
        if cot_bd:
            dvo = dv + arg_f32(args, BW_C_BD)[unsafe_offset=(bb * Q + j) * nh + hh]
        work[unsafe_offset=bw.o_pdtb + o + j] = dv
        work[unsafe_offset=bw.o_pa + o + j] = dda[unsafe_offset=j] * dts[unsafe_offset=j]
        if j < ck.s0:  # a state row: no output, no D term
            comptime for q in range(4):
                work.unsafe_store(bw.o_dcx + r * cd + hh * P + q * LANES,
                                  ac.unsafe_load[width=LANES](q * LANES))
            gsbd[unsafe_offset=(bb * Q + j) * nh + hh] = dvo
            work[unsafe_offset=bw.o_pd + o + j] = 0.0
            continue
        var rt = bb * ck.nt + j - ck.s0  # (token row)
        var dyp = work.unsafe_offset(bw.o_dy + rt * di + hh * P)
        comptime for q in range(4):
            work.unsafe_store(bw.o_dcx + r * cd + hh * P + q * LANES,
                              LV(dskip).fma(dyp.unsafe_load[width=LANES](q * LANES),
                                            ac.unsafe_load[width=LANES](q * LANES)))
        work[unsafe_offset=bw.o_dzx + rt * npj + di + cd + hh] = dvo
        work[unsafe_offset=bw.o_pd + o + j] = _dot_tree(dyp, xj)
    # the chunk's terms of d dt_bias, dA, dD: a pairwise tree over the Q
    # token slots (slot j + slot j + w for w = 128, 64, ..., 1; slots past
    # the chunk are +0.0), left in slot 0
    for j in range(ck.nc, Q):
        work[unsafe_offset=bw.o_pdtb + o + j] = 0.0
        work[unsafe_offset=bw.o_pa + o + j] = 0.0
        work[unsafe_offset=bw.o_pd + o + j] = 0.0
    var wd = Q // 2
    while wd >= 1:
        for j in range(wd):
            work[unsafe_offset=bw.o_pdtb + o + j] = (work[unsafe_offset=bw.o_pdtb + o + j]
                                                     + work[unsafe_offset=bw.o_pdtb + o + j + wd])
            work[unsafe_offset=bw.o_pa + o + j] = (work[unsafe_offset=bw.o_pa + o + j]
                                                   + work[unsafe_offset=bw.o_pa + o + j + wd])
            work[unsafe_offset=bw.o_pd + o + j] = (work[unsafe_offset=bw.o_pd + o + j]
                                                   + work[unsafe_offset=bw.o_pd + o + j + wd])
        wd //= 2
    if c > 0 or bw.stated:  # the carry to chunk c - 1, or state.h
        var dst = dhout if c > 0 else arg_f32(args, BW_GS_H).unsafe_offset(off_h)
        k = 0
        while k < P * N:
            dst.unsafe_store(k, dh0.unsafe_load[width=LANES](k))
            k += LANES
    if c == 0 and bw.stated:  # state.buffer_dtraw rows past n0: +0.0
        for j in range(ck.s0, Q):
            gsbd[unsafe_offset=(bb * Q + j) * nh + hh] = 0.0


def dcb_rows(bw: BW2, work: F32Ptr, c: Int, bb: Int, rb: Int, t: Int):
    """For each B/C group g: dCB_ij = + chain over the group's heads
    ascending (from +0.0) of (G_ij * exp(S_i(j))) * dt_j, G_ij =
    _dot_tree(dy_i, x_j)."""
    var dims = bw.dims
    var di = dims.di
    var ck = bw.chunk(c)
    var seg = work.unsafe_offset(bw.o_scr2 + t * Q)
    # token rows i only (a state row has no output: its dCB row is zero)
    for g in range(dims.ng):
        var dcb = work.unsafe_offset(bw.o_dcb + bw.qq(g, bb))
        for i in range(max(ck.s0, rb * ROWS_PER_TASK),
                       min(ck.nc, rb * ROWS_PER_TASK + ROWS_PER_TASK)):
            var r = bb * ck.nt + i - ck.s0
            for j in range(i + 1):
                dcb[unsafe_offset=i * Q + j] = 0.0
            for hh in range(g * dims.hpg, (g + 1) * dims.hpg):
                var o = bw.hq(bb, hh)
                _ = seg_row(work.unsafe_offset(bw.o_da + o), i, seg)
                var dyp = work.unsafe_offset(bw.o_dy + r * di + hh * P)
                for j in range(i + 1):
                    var gij = _dot_tree(dyp, _cx(bw, work, bb, ck.nc, j).unsafe_offset(hh * P))
                    var e = exp_f32[1](seg[unsafe_offset=j])
                    dcb[unsafe_offset=i * Q + j] = dcb[unsafe_offset=i * Q + j] + (
                        (gij * e) * work[unsafe_offset=bw.o_dt + o + j])


comptime NV = N // LANES  # LV vectors of one (N) row


@always_inline
def _add_head_term(e: Float32, v: F32Ptr, m: F32Ptr, mut acc: Array[LV, NV]):
    """A head's term of a dB or dC row: t[n] = fma chain over p of v[p]
    m[p][n] from +0.0 (m: a (P, N) state matrix), then acc = fma(e, t, acc)."""
    var t = Array[LV, NV](fill=LV(0.0))
    for p in range(P):
        var vp = LV(v[unsafe_offset=p])
        comptime for q in range(NV):
            t[q] = vp.fma(m.unsafe_load[width=LANES](p * N + q * LANES), t[q])
    var ev = LV(e)
    comptime for q in range(NV):
        acc[q] = ev.fma(t[q], acc[q])


def dbc_rows(args: I64Ptr, bw: BW2, work: F32Ptr, c: Int, bb: Int, rb: Int):
    """For each B/C group g (its heads h): dC_i[n] = fma chain over j =
    0..i of dCB_ij B_j[n], then for the heads ascending fma(e_i, t[n], .)
    with t[n] = fma chain over p of dy_i[p] h0[p][n]. dB_j[n] = fma chain
    over i = j..n-1 of dCB_ij C_i[n], then (when dh_end may be nonzero) for
    the heads ascending fma(el_j dt_j, t[n], .) with t[n] = fma chain over
    p of x_j[p] dh_end[p][n]. A state row has no output: its dC is +0.0 and
    its dB sums over the token rows i2 only; the h_end terms run as in
    ssd_head_backward."""
    var dims = bw.dims
    var di = dims.di
    var cd = dims.cd
    var nh = dims.nh
    var ck = bw.chunk(c)
    var fold_terms = bw.fold_terms(args, c)
    var hs = bw.b * nh * P * N
    for g in range(dims.ng):
        var dcb = work.unsafe_offset(bw.o_dcb + bw.qq(g, bb))
        var bcol = dims.bcol(g)
        var ccol = dims.ccol(g)
        var h_lo = g * dims.hpg
        var h_hi = h_lo + dims.hpg
        for i in range(rb * ROWS_PER_TASK, min(ck.nc, rb * ROWS_PER_TASK + ROWS_PER_TASK)):
            var r = bb * ck.nc + i  # (scan row)
            var row = _cx(bw, work, bb, ck.nc, i)
            var acc = Array[LV, NV](fill=LV(0.0))  # dC_i (+0.0 for a state row)
            if i >= ck.s0:
                for j in range(i + 1):
                    var s = LV(dcb[unsafe_offset=i * Q + j])
                    var br = _cx(bw, work, bb, ck.nc, j).unsafe_offset(bcol)
                    comptime for q in range(NV):
                        acc[q] = s.fma(br.unsafe_load[width=LANES](q * LANES), acc[q])
                for hh in range(h_lo, h_hi):
                    var h0 = work.unsafe_offset(bw.o_ckh + c * hs + (bb * nh + hh) * P * N)
                    var dyp = work.unsafe_offset(bw.o_dy + (bb * ck.nt + i - ck.s0) * di + hh * P)
                    _add_head_term(work[unsafe_offset=bw.o_eoff + bw.hq(bb, hh) + i], dyp, h0, acc)
            comptime for q in range(NV):
                work.unsafe_store(bw.o_dcx + r * cd + ccol + q * LANES, acc[q])
            var bacc = Array[LV, NV](fill=LV(0.0))
            for i2 in range(max(i, ck.s0), ck.nc):
                var s = LV(dcb[unsafe_offset=i2 * Q + i])
                var cr = _cx(bw, work, bb, ck.nc, i2).unsafe_offset(ccol)
                comptime for q in range(NV):
                    bacc[q] = s.fma(cr.unsafe_load[width=LANES](q * LANES), bacc[q])
            if fold_terms:
                for hh in range(h_lo, h_hi):
                    var dhe = work.unsafe_offset(bw.o_dh + (c % 2) * hs + (bb * nh + hh) * P * N)
                    _add_head_term(work[unsafe_offset=bw.o_elast + bw.hq(bb, hh) + i],
                                   row.unsafe_offset(hh * P), dhe, bacc)
            comptime for q in range(NV):
                work.unsafe_store(bw.o_dcx + r * cd + bcol + q * LANES, bacc[q])
