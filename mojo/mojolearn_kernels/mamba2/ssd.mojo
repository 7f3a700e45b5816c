"""Mamba-2 SSD chunk math (the canonical order of docs/mamba2.md, steps
3-11): dt and dA rows, CB, the per-head outputs of the new rows, the fold and
the h_last report. Every path (prefill, decode, report) calls these, and so
does the backward's recompute (mamba2/backward_recompute.mojo): the row
functions take pointers and an XRows (where the xBC rows are), not a call.
Many-row outputs and the fold run in register tiles (mamba2/ssd_tiles.mojo),
with the same chain per element as the one-row ssd_row."""
from std.collections import Array
from ..abi import F32Ptr, ceil_div
from ..numerics import exp_f32, softplus_f32
from .layout import (
    P, N, Q, VW, V, CB_ROWS_PER_TASK, DIRECT_CB_MAX, SCR, CACHE_HDR, M2Call, M2Group, XRows,
)
from .ssd_tiles import finish_rows, ssd_rows, fold_rows, weight_row


@always_inline
def dt_clamp[W: Int](sp: SIMD[DType.float32, W], lo: SIMD[DType.float32, W],
                     hi: SIMD[DType.float32, W]) -> SIMD[DType.float32, W]:
    """dt = clamp(sp, lo, hi) of sp = softplus(dtraw + dt_bias): t = lo if
    sp < lo else sp; dt = hi if t > hi else t."""
    var dt = sp.lt(lo).select(lo, sp)
    return dt.gt(hi).select(hi, dt)


def dt_rows(cl: M2Call, c: Int, bb: Int, hh: Int, lo_row: Int, hi_row: Int, cached: Bool):
    """Head hh of row bb, chunk rows i in [lo_row, hi_row): dt_i = clamp(softplus(dtraw_i +
    dt_bias)) (t = lo if v < lo else v; dt = hi if t > hi else t) and
    dA_i = dt_i * A; 16 rows per vector (every function works lane by lane,
    so the bits do not depend on the grouping). cached (M2Call.dt_cached):
    into the decode cache, skipping the rows it already holds."""
    var dims = cl.dims
    var blob = cl.blob
    var a = V(blob[unsafe_offset=dims.o_a + hh])
    var bias = V(blob[unsafe_offset=dims.o_dtb + hh])
    var lo = V(blob[unsafe_offset=dims.o_lim])
    var hi = V(blob[unsafe_offset=dims.o_lim + 1])
    var da = cl.da_row(bb, hh, cached)
    var dts = cl.dt_row(bb, hh, cached)
    var i0 = lo_row
    if cached:
        var dc = cl.dtcache(bb, hh)
        var have = Int(dc[unsafe_offset=0])
        if have < hi_row:  # (else a new chunk began, or the same row again)
            i0 = max(lo_row, have)
        dc[unsafe_offset=0] = Float32(hi_row)
    while i0 < hi_row:
        var raw = V(0.0)
        var m = min(VW, hi_row - i0)
        if m == VW:  # constant lane indices: no store and reload per lane
            comptime for k in range(VW):
                raw[k] = cl.dtraw(bb, c, i0 + k, hh)
        else:
            for k in range(m):
                raw[k] = cl.dtraw(bb, c, i0 + k, hh)
        var dt = dt_clamp[VW](softplus_f32[VW](raw + bias), lo, hi)
        var dav = dt * a
        for k in range(m):  # rows past hi_row belong to a later group
            da[unsafe_offset=i0 + k] = dav[k]
            dts[unsafe_offset=i0 + k] = dt[k]
        i0 += VW


def cb_task(cl: M2Call, gp: M2Group, task: Int):
    """CB_ij = fma chain over n of C_i[n] B_j[n], for the group's rows i and
    j <= i (computed 16 j at a time; lanes past i are never read), for each
    B/C group in turn."""
    var wk = cl.wk
    var dims = cl.dims
    var nrb = ceil_div(gp.gn, CB_ROWS_PER_TASK)
    var bb = task // nrb
    var rb = task % nrb
    var rg = cl.row_group(gp, bb)  # (rows with their own positions)
    var c = rg.c
    var gn = rg.gn
    var r1 = min(gn, rb * CB_ROWS_PER_TASK + CB_ROWS_PER_TASK)
    for g in range(dims.ng):
        var bt = cl.work.unsafe_offset(wk.o_bt + (bb * dims.ng + g) * N * Q)
        var xr = cl.xrows(bb, c, g)
        for r in range(rb * CB_ROWS_PER_TASK, r1):
            var i = rg.i0 + rg.gs + r
            var crow = xr.row(i).unsafe_offset(xr.co)
            var dst = cl.work.unsafe_offset(wk.o_cb + ((g * wk.b + bb) * gn + r) * Q)
            if rg.nnew <= DIRECT_CB_MAX:
                if cl.has_cache:
                    cb_row_cached(cl, c, bb, g, i, crow, dst)
                else:
                    cb_row_direct(xr, i, crow, dst)
                continue
            var jv = 0
            while jv + 4 * VW <= i + 1:  # four independent chains at a time
                var a0 = V(0.0)
                var a1 = V(0.0)
                var a2 = V(0.0)
                var a3 = V(0.0)
                for n in range(N):
                    var cn = V(crow[unsafe_offset=n])
                    var bp = bt.unsafe_offset(n * Q + jv)
                    a0 = cn.fma(bp.unsafe_load[width=VW](0), a0)
                    a1 = cn.fma(bp.unsafe_load[width=VW](VW), a1)
                    a2 = cn.fma(bp.unsafe_load[width=VW](2 * VW), a2)
                    a3 = cn.fma(bp.unsafe_load[width=VW](3 * VW), a3)
                dst.unsafe_store(jv, a0)
                dst.unsafe_store(jv + VW, a1)
                dst.unsafe_store(jv + 2 * VW, a2)
                dst.unsafe_store(jv + 3 * VW, a3)
                jv += 4 * VW
            while jv <= i:
                var acc = V(0.0)
                for n in range(N):
                    acc = V(crow[unsafe_offset=n]).fma(bt.unsafe_load[width=VW](n * Q + jv), acc)
                dst.unsafe_store(jv, acc)
                jv += VW


@always_inline
def held_rows(cache: F32Ptr, i: Int) -> Int:
    """Open-chunk rows 0.. a session's row copy (its count at cache[0]) still
    holds for a step at chunk row i: the count, or 0 when it is past i (a
    new chunk began, or row i is computed again)."""
    var have = Int(cache[unsafe_offset=0])
    return 0 if have > i else have


def cb_row_cached(cl: M2Call, c: Int, bb: Int, g: Int, i: Int, crow: F32Ptr, dst: F32Ptr):
    """CB_ij of B/C group g for j = 0..i from the session's transposed copy
    of the open chunk's B rows (rows not yet copied are added first, every
    group's at once): the same fma chain over n per element, 16 j per
    vector."""
    var bc = cl.bcache(bb)
    var gn = cl.dims.ng * N
    for j in range(held_rows(bc, i), i + 1):
        var br = cl.xbc_row(bb, c, j).unsafe_offset(cl.dims.di)
        for n in range(gn):
            bc[unsafe_offset=CACHE_HDR + n * Q + j] = br[unsafe_offset=n]
    bc[unsafe_offset=0] = Float32(i + 1)
    var bt = bc.unsafe_offset(CACHE_HDR + g * N * Q)
    var jv = 0
    while jv <= i:  # lanes past i hold stale values and are never read
        var acc = V(0.0)
        for n in range(N):
            acc = V(crow[unsafe_offset=n]).fma(bt.unsafe_load[width=VW](n * Q + jv), acc)
        dst.unsafe_store(jv, acc)
        jv += VW


def cb_row_direct(xr: XRows, i: Int, crow: F32Ptr, dst: F32Ptr):
    """CB_ij for j = 0..i from row-major B rows (xr's group): the same fma
    chain over n per element as the transposed path, eight chains
    interleaved."""
    comptime G = 8
    var j0 = 0
    while j0 <= i:
        var g = min(G, i + 1 - j0)
        var rows = Array[F32Ptr, G](fill=crow)
        for k in range(g):
            rows[k] = xr.row(j0 + k).unsafe_offset(xr.bo)
        var acc = SIMD[DType.float32, G](0.0)
        for n in range(N):
            var cn = crow[unsafe_offset=n]
            comptime for k in range(G):
                acc[k] = cn.fma(rows[k][unsafe_offset=n], acc[k])
        for k in range(g):
            dst[unsafe_offset=j0 + k] = acc[k]
        j0 += G


def ssd_task(cl: M2Call, group: M2Group, bb: Int, hh: Int, task: Int):
    """Head hh of row bb, one group of chunk gp.c: outputs of the group's
    rows (many rows: in register tiles, ssd_tiles.ssd_rows; few: ssd_row);
    after the chunk's last group, the fold (chunk complete) and/or the
    h_last report. h^T is made by the chunk's first group and kept in the
    task's scratch (the task index is the same (row, head) in every group,
    and h changes only at the fold)."""
    var gp = cl.row_group(group, bb)  # (rows with their own positions)
    var dims = cl.dims
    var wk = cl.wk
    var di = dims.di
    var nh = dims.nh
    var work = cl.work
    var c = gp.c
    var n_c = gp.n_c
    var gn = gp.gn
    var g_lo = gp.i0 + gp.gs
    var g_hi = g_lo + gn
    var vlen = cl.vlen(bb)
    var n_real = max(0, min(n_c, vlen - c * Q))
    var out_end = min(g_hi, max(g_lo, n_real))
    var cached = cl.dt_cached(gp)
    var da = cl.da_row(bb, hh, cached)
    var dts = cl.dt_row(bb, hh, cached)
    var scr = work.unsafe_offset(wk.o_scr + task * SCR)
    var seg = scr
    var wrow = scr.unsafe_offset(Q)
    var ht = scr.unsafe_offset(2 * Q)
    var tiles = scr.unsafe_offset(2 * Q + N * P)
    var hh_home = cl.hhome(bb, hh)
    var yg = work.unsafe_offset(wk.o_yg)
    var zx = work.unsafe_offset(wk.o_zx)
    var g = dims.group(hh)
    var cbg = wk.o_cb + g * wk.b * gn * Q  # the group's CB rows
    var direct = gn <= DIRECT_CB_MAX  # few rows (decode): no transpose of h
    var in_cache = False  # a session's step: h^T and the x rows from its cache
    if direct and cl.has_cache:  # a session keeps h^T until the next fold
        var hc = cl.hcache(bb, hh)
        ht = hc.unsafe_offset(CACHE_HDR)
        if hc[unsafe_offset=0] != 1.0:
            _transpose_h(hh_home, ht)
            hc[unsafe_offset=0] = 1.0
        direct = False
        in_cache = True
    elif not direct and out_end > g_lo and gp.k == 0:
        # later groups reuse it: a group with outputs follows a first group
        # with outputs, and a direct group (ht as scratch) can only be last
        _transpose_h(hh_home, ht)
    if out_end > g_lo:
        var dskip = V(cl.blob[unsafe_offset=dims.o_dskip + hh])
        var xr = cl.xrows(bb, c, g)
        var r0 = bb * gn
        if not direct and gn > DIRECT_CB_MAX:  # (else few rows: decode steps)
            var dst = yg.unsafe_offset(r0 * di + hh * P)
            ssd_rows[False](xr, di, hh, g_lo, out_end, da, dts,
                            work.unsafe_offset(cbg + r0 * Q), ht, dskip,
                            zx.unsafe_offset(r0 * dims.npj + hh * P), dims.npj, dst, dst, tiles)
        else:
            var xc = cl.xcache(bb, hh)
            for i in range(g_lo, out_end):
                var r = r0 + i - g_lo
                var dst = yg.unsafe_offset(r * di + hh * P)
                var cbrow = work.unsafe_offset(cbg + r * Q)
                var zr = zx.unsafe_offset(r * dims.npj + hh * P)
                if in_cache:
                    _extend_xcache(xr, hh, i, xc)
                    ssd_row[False, True](xr, di, hh, i, da, dts, cbrow, seg, wrow, hh_home, ht,
                                         direct, dskip, zr, dst, dst, xc.unsafe_offset(CACHE_HDR))
                else:
                    ssd_row[False](xr, di, hh, i, da, dts, cbrow, seg, wrow, hh_home, ht,
                                   direct, dskip, zr, dst, dst, xc)
    for i in range(out_end, g_hi):  # padding rows of a ragged batch
        var dst = yg.unsafe_offset((bb * gn + i - g_lo) * di + hh * P)
        for p in range(P):
            dst[unsafe_offset=p] = 0.0
    if not gp.last:
        return
    var last_c = (vlen - 1) // Q if vlen > 0 else 0
    var want = cl.has_hlast and c == last_c
    var hl = cl.hlast.unsafe_offset((bb * nh + hh) * P * N)
    if n_real == Q:
        fold_chunk(cl.xrows(bb, c, g), di, hh, da, dts, Q, hh_home, hh_home, seg, wrow, tiles)
        if cl.has_cache:
            cl.hcache(bb, hh)[unsafe_offset=0] = 0.0
        if want:
            for k in range(P * N):
                hl[unsafe_offset=k] = hh_home[unsafe_offset=k]
    elif want:
        fold_chunk(cl.xrows(bb, c, g), di, hh, da, dts, n_real, hh_home, hl, seg, wrow, tiles)


def _extend_xcache(xr: XRows, hh: Int, i: Int, xc: F32Ptr):
    """Head hh's x rows up to chunk row i into the session's copy (count at
    xc[0], then Q rows of P): the rows it lacks, or all of them when its
    count is past i (a new chunk began, or row i is computed again)."""
    var rows = xc.unsafe_offset(CACHE_HDR)
    for j in range(held_rows(xc, i), i + 1):
        var src = xr.row(j).unsafe_offset(hh * P)
        var dst = rows.unsafe_offset(j * P)
        comptime for q in range(0, P, VW):
            dst.unsafe_store(q, src.unsafe_load[width=VW](q))
    xc[unsafe_offset=0] = Float32(i + 1)


def _transpose_h(h: F32Ptr, ht: F32Ptr):
    for p in range(P):
        for n in range(N):
            ht[unsafe_offset=n * P + p] = h[unsafe_offset=p * N + n]


def yoff_direct(crow: F32Ptr, h: F32Ptr, dst: F32Ptr):
    """dst[p] = fma chain over n of C[n] h[p][n] (h row-major, as stored):
    the same chain per element as the transposed path, eight interleaved."""
    comptime G = 8
    for p0 in range(0, P, G):
        var acc = SIMD[DType.float32, G](0.0)
        var hp = h.unsafe_offset(p0 * N)
        for n in range(N):
            var cn = crow[unsafe_offset=n]
            comptime for k in range(G):
                acc[k] = cn.fma(hp[unsafe_offset=k * N + n], acc[k])
        dst.unsafe_store(p0, acc)


@always_inline
def ssd_row[KEEP_Y: Bool, XC: Bool = False](
    xr: XRows, di: Int, hh: Int, i: Int, da: F32Ptr, dts: F32Ptr, cbrow: F32Ptr, seg: F32Ptr,
    wrow: F32Ptr, h: F32Ptr, ht: F32Ptr, direct: Bool, dskip: V, zr: F32Ptr, dst: F32Ptr,
    ydst: F32Ptr, xc: F32Ptr,
):
    """Head hh's output of chunk row i (docs/mamba2.md steps 4-9): w_j =
    (CB_ij exp(S_i(j))) dt_j; Ydiag = fma chain over j <= i of w_j x_j;
    Yoff = fma chain over n of C_i[n] h[., n] (from h^T at ht, or direct:
    from the row-major h, ht then only 64 floats of scratch); then
    finish_rows into dst (and y before the gate into ydst if KEEP_Y).
    seg, wrow: Q floats of scratch each; da, dts, cbrow: the head's dA and
    dt rows and CB row i. XC: the x rows of the fma chain from xc (head
    hh's rows 0..i, P floats apart: a session's copy) instead of xr (xc
    is not read otherwise)."""
    var ci = seg_row(da, i, seg)
    weight_row(seg, cbrow, dts, i, wrow)
    var d0 = V(0.0)
    var d1 = V(0.0)
    var d2 = V(0.0)
    var d3 = V(0.0)
    for j in range(i + 1):
        var wj = V(wrow[unsafe_offset=j])
        var xp: F32Ptr
        comptime if XC:
            xp = xc.unsafe_offset(j * P)
        else:
            xp = xr.row(j).unsafe_offset(hh * P)
        d0 = wj.fma(xp.unsafe_load[width=VW](0), d0)
        d1 = wj.fma(xp.unsafe_load[width=VW](VW), d1)
        d2 = wj.fma(xp.unsafe_load[width=VW](2 * VW), d2)
        d3 = wj.fma(xp.unsafe_load[width=VW](3 * VW), d3)
    var row = xr.row(i)
    var crow = row.unsafe_offset(xr.co)
    var o0 = V(0.0)
    var o1 = V(0.0)
    var o2 = V(0.0)
    var o3 = V(0.0)
    if direct:
        var yo = ht  # 64 floats: C_i . h[p] from the row-major h
        yoff_direct(crow, h, yo)
        o0 = yo.unsafe_load[width=VW](0)
        o1 = yo.unsafe_load[width=VW](VW)
        o2 = yo.unsafe_load[width=VW](2 * VW)
        o3 = yo.unsafe_load[width=VW](3 * VW)
    else:
        for n in range(N):
            var cn = V(crow[unsafe_offset=n])
            var hp = ht.unsafe_offset(n * P)
            o0 = cn.fma(hp.unsafe_load[width=VW](0), o0)
            o1 = cn.fma(hp.unsafe_load[width=VW](VW), o1)
            o2 = cn.fma(hp.unsafe_load[width=VW](2 * VW), o2)
            o3 = cn.fma(hp.unsafe_load[width=VW](3 * VW), o3)
    var ec = V(exp_f32[1](ci))
    var xp = row.unsafe_offset(hh * P)
    finish_rows[KEEP_Y](d0, o0, ec, xp, zr, dskip, dst, ydst, 0)
    finish_rows[KEEP_Y](d1, o1, ec, xp, zr, dskip, dst, ydst, VW)
    finish_rows[KEEP_Y](d2, o2, ec, xp, zr, dskip, dst, ydst, 2 * VW)
    finish_rows[KEEP_Y](d3, o3, ec, xp, zr, dskip, dst, ydst, 3 * VW)


@always_inline
def seg_row(da: F32Ptr, i: Int, seg: F32Ptr) -> Float32:
    """seg[j] = S_i(j) for j = i, i-1, ..., 0 and returns S_i(-1), where
    S_i(i) = 0 and S_i(j) = S_i(j+1) + dA_{j+1} (descending, one rounding
    each): the decay from row j to row i, summed without cancellation."""
    var acc: Float32 = 0.0
    seg[unsafe_offset=i] = acc
    var j = i - 1
    while j >= 0:
        acc = acc + da[unsafe_offset=j + 1]
        seg[unsafe_offset=j] = acc
        j -= 1
    return acc + da[unsafe_offset=0]


def fold_chunk(xr: XRows, di: Int, hh: Int, da: F32Ptr, dts: F32Ptr, nr: Int,
               src: F32Ptr, dst: F32Ptr, seg: F32Ptr, wrow: F32Ptr, u: F32Ptr):
    """dst = exp(S_last(-1)) * src, then for i = 0..nr-1 ascending:
    dst[p][n] = fma((exp(S_last(i)) * dt_i) * x_i[p], B_i[n], dst[p][n]),
    last = nr - 1 (nr = 0: dst = exp(0) * src = src), in register tiles
    (ssd_tiles.fold_rows). da, dts: the head's dA and dt rows; seg, wrow:
    Q floats of scratch each; u: ssd_tiles.FOLD_IB * P floats."""
    var total: Float32 = 0.0
    if nr > 0:
        total = seg_row(da, nr - 1, seg)
    var el = V(exp_f32[1](total))
    var jv = 0
    while jv < nr:
        var e = exp_f32[VW](seg.unsafe_load[width=VW](jv))
        wrow.unsafe_store(jv, e * dts.unsafe_load[width=VW](jv))
        jv += VW
    fold_rows(xr, di, hh, nr, wrow, el, src, dst, u)
