"""Mamba-2 SSD outputs and fold in register tiles (docs/mamba2.md steps 4-9
and 11) for calls with many rows per chunk (prefill, the backward's
recompute).

The rows of one head share every operand but their own C row, decay sums
and weights: an x_j or h^T row loaded once feeds TR rows' fma chains (the
fold: a B_i row feeds FR rows of h), instead of one load per fma. Tiling
only decides which independent chains run side by side; every element's
chain is the one of ssd.ssd_row (or the one-row fold): the same start, the
same terms in the same order, so the bits are the same."""
from std.collections import Array
from ..abi import F32Ptr
from ..linear import WIDE
from ..numerics import exp_f32, silu_f32
from .layout import P, N, Q, VW, V, TR, TILE_SCR, XRows

# 16-float vectors per tile row (of TR rows): AVX-512's 32 registers hold
# 4 rows x all 64 columns (16 accumulators), AVX2's 16 hold 4 rows x 16
# columns (8 ymm), so it sweeps the columns in 4 passes.
comptime TV = 4 if WIDE else 1
comptime TC = TV * VW
# With several column passes, the j (Ydiag) and n (Yoff) loops run in
# blocks of KB steps, all passes per block, so a block's x rows or h^T rows
# (8 KB) stay in L1 for the later passes; the accumulators go through the
# scratch between blocks (a store and a load: the chains are unchanged).
comptime KB = 32 if TC < P else Q
# Chunk rows per pass of the fold: u_i = w_i x_i rows kept in the scratch
# (FOLD_IB * P <= TILE_SCR); h is reloaded once per pass.
comptime FOLD_IB = 32
comptime FR = 4  # rows p of h per fold tile (a divisor of P)
comptime SW = 4 if TR <= 4 else 8  # lanes of _seg_rows' chains (a power of two)


@always_inline
def weight_row(seg: F32Ptr, cbrow: F32Ptr, dts: F32Ptr, i: Int, w: F32Ptr):
    """w_j = (CB_ij exp(S_i(j))) dt_j for j <= i (whole vectors: lanes past
    i are never read), from row i's decay sums seg and CB row cbrow."""
    var jv = 0
    while jv <= i:
        var e = exp_f32[VW](seg.unsafe_load[width=VW](jv))
        var u = cbrow.unsafe_load[width=VW](jv) * e
        w.unsafe_store(jv, u * dts.unsafe_load[width=VW](jv))
        jv += VW


@always_inline
def finish_rows[KEEP_Y: Bool](yd: V, yo: V, ec: V, xr: F32Ptr, zr: F32Ptr, dskip: V,
                              dst: F32Ptr, ydst: F32Ptr, off: Int):
    """y = fma(x, D, Ydiag + Yoff * exp(S_i(-1))); dst = y * silu(z); y
    itself into ydst if KEEP_Y."""
    var y = yd + yo * ec
    y = xr.unsafe_load[width=VW](off).fma(dskip, y)
    comptime if KEEP_Y:
        ydst.unsafe_store(off, y)
    dst.unsafe_store(off, y * silu_f32[VW](zr.unsafe_load[width=VW](off)))


def ssd_rows[KEEP_Y: Bool](xr: XRows, di: Int, hh: Int, ilo: Int, ihi: Int, da: F32Ptr,
                           dts: F32Ptr, cb: F32Ptr, ht: F32Ptr, dskip: V, zx: F32Ptr,
                           ldz: Int, dst: F32Ptr, ydst: F32Ptr, scr: F32Ptr):
    """Head hh's outputs of chunk rows [ilo, ihi), the same bits as ssd_row
    (not direct) on each row. Row ilo's operands: cb (CB rows Q apart), zx
    (z at the head, rows ldz apart), dst and ydst (at the head, rows di
    apart); ht: h^T (N, P); scr: TILE_SCR floats."""
    var i0 = ilo
    while i0 + TR <= ihi:
        var k = i0 - ilo
        _rows_tile[TR, KEEP_Y](xr, di, hh, i0, da, dts, cb.unsafe_offset(k * Q), ht, dskip,
                               zx.unsafe_offset(k * ldz), ldz, dst.unsafe_offset(k * di),
                               ydst.unsafe_offset(k * di), scr)
        i0 += TR
    var k = i0 - ilo
    comptime for R in range(1, TR):
        if ihi - i0 == R:
            _rows_tile[R, KEEP_Y](xr, di, hh, i0, da, dts, cb.unsafe_offset(k * Q), ht, dskip,
                                  zx.unsafe_offset(k * ldz), ldz, dst.unsafe_offset(k * di),
                                  ydst.unsafe_offset(k * di), scr)


@always_inline
def _rows_tile[R: Int, KEEP_Y: Bool](xr: XRows, di: Int, hh: Int, i0: Int, da: F32Ptr,
                                     dts: F32Ptr, cb: F32Ptr, ht: F32Ptr, dskip: V,
                                     zx: F32Ptr, ldz: Int, dst: F32Ptr, ydst: F32Ptr,
                                     scr: F32Ptr):
    """Rows i0 .. i0 + R - 1 (ssd_rows' operands, at row i0)."""
    var seg = scr
    var w = scr.unsafe_offset(TR * Q)
    var yd = scr.unsafe_offset(2 * TR * Q)
    var yo = yd.unsafe_offset(TR * P)
    var ci = _seg_rows[R](da, i0, seg)
    comptime for r in range(R):
        weight_row(seg.unsafe_offset(r * Q), cb.unsafe_offset(r * Q), dts, i0 + r,
                   w.unsafe_offset(r * Q))
    var j0 = 0
    while j0 <= i0:  # Ydiag: every row takes j <= i0, then its last terms
        var j1 = min(i0 + 1, j0 + KB)
        for c0 in range(0, P, TC):
            _ydiag_tile[R](xr, hh * P + c0, j0, j1, i0, w, yd.unsafe_offset(c0))
        j0 = j1
    var crow = Array[F32Ptr, R](fill=cb)
    comptime for r in range(R):
        crow[r] = xr.row(i0 + r).unsafe_offset(xr.co)
    for n0 in range(0, N, KB):
        for c0 in range(0, P, TC):
            _yoff_tile[R](ht.unsafe_offset(c0), n0, crow, yo.unsafe_offset(c0))
    for r in range(R):  # (loops: R x 4 inlined silu bodies would only grow the code)
        var ec = V(exp_f32[1](ci[r]))
        var xrow = xr.row(i0 + r).unsafe_offset(hh * P)
        for off in range(0, P, VW):
            finish_rows[KEEP_Y](yd.unsafe_load[width=VW](r * P + off),
                                yo.unsafe_load[width=VW](r * P + off), ec, xrow,
                                zx.unsafe_offset(r * ldz), dskip, dst.unsafe_offset(r * di),
                                ydst.unsafe_offset(r * di), off)


@always_inline
def _seg_rows[R: Int](da: F32Ptr, i0: Int, seg: F32Ptr) -> SIMD[DType.float32, SW]:
    """ssd.seg_row for rows i0 + r, r < R (into seg + r Q), returning their
    S(-1) (lanes past R unused). Each row's chain is its own; below row i0
    every row adds the same dA_{j+1} at the same j, so the chains advance
    side by side (one add latency per j for all of them, not per row)."""
    comptime S = SIMD[DType.float32, SW]
    var acc = S(0.0)
    comptime for r in range(R):  # row i0 + r down to j = i0
        var a: Float32 = 0.0
        seg[unsafe_offset=r * Q + i0 + r] = a
        comptime for t in range(r):
            var j = i0 + r - 1 - t
            a = a + da[unsafe_offset=j + 1]
            seg[unsafe_offset=r * Q + j] = a
        acc[r] = a
    var j = i0 - 1
    while j >= 0:
        acc = acc + S(da[unsafe_offset=j + 1])
        comptime for r in range(R):
            seg[unsafe_offset=r * Q + j] = acc[r]
        j -= 1
    return acc + S(da[unsafe_offset=0])


@always_inline
def _rows_fma[R: Int, RS: Int, JS: Int](xr: XRows, col: Int, j0: Int, j1: Int, coef: F32Ptr,
                                        mut acc: Array[V, R * TV]):
    """For chunk rows j in [j0, j1) ascending, each tile row r's chains
    acc[r][0:TC] = fma(coef[r RS + (j - j0) JS], x_j[col:col+TC], acc[r]):
    one load of a row's TC columns feeds all R rows' chains (Ydiag: the
    weights w_r[j]; the fold: the u_j[p] of R rows p of h)."""
    var j = j0
    while j < j1:
        var je = xr.run_end(j, j1)
        var xp = xr.row(j).unsafe_offset(col)
        while j < je:
            var xv = Array[V, TV](fill=V(0.0))
            comptime for v in range(TV):
                xv[v] = xp.unsafe_load[width=VW](v * VW)
            var cj = coef.unsafe_offset((j - j0) * JS)
            comptime for r in range(R):
                var cr = V(cj[unsafe_offset=r * RS])
                comptime for v in range(TV):
                    acc[r * TV + v] = cr.fma(xv[v], acc[r * TV + v])
            xp = xp.unsafe_offset(xr.cd)
            j += 1


@always_inline
def _ydiag_tile[R: Int](xr: XRows, col: Int, j0: Int, j1: Int, i0: Int, w: F32Ptr,
                        yd: F32Ptr):
    """Steps j in [j0, j1) (j1 <= i0 + 1) of yd[r][0:TC] = fma chain over
    j = 0..i0+r of (w_r[j], x_j[col:col+TC]) from +0.0 (j0 = 0: from zero,
    else from yd); after step i0, row r alone takes its last r terms."""
    var acc = Array[V, R * TV](fill=V(0.0))
    if j0 > 0:
        comptime for r in range(R):
            comptime for v in range(TV):
                acc[r * TV + v] = yd.unsafe_load[width=VW](r * P + v * VW)
    _rows_fma[R, Q, 1](xr, col, j0, j1, w.unsafe_offset(j0), acc)
    if j1 == i0 + 1:
        comptime for t in range(1, R):
            var jt = i0 + t
            var xp = xr.row(jt).unsafe_offset(col)
            comptime for v in range(TV):
                var xv = xp.unsafe_load[width=VW](v * VW)
                comptime for r in range(t, R):
                    acc[r * TV + v] = V(w[unsafe_offset=r * Q + jt]).fma(xv, acc[r * TV + v])
    comptime for r in range(R):
        comptime for v in range(TV):
            yd.unsafe_store(r * P + v * VW, acc[r * TV + v])


@always_inline
def _yoff_tile[R: Int](ht: F32Ptr, n0: Int, crow: Array[F32Ptr, R], yo: F32Ptr):
    """Steps n in [n0, n0 + KB) of yo[r][0:TC] = fma chain over n = 0..N-1
    of (C_r[n], h^T[n][0:TC]) from +0.0 (n0 = 0: from zero, else from yo)."""
    var acc = Array[V, R * TV](fill=V(0.0))
    if n0 > 0:
        comptime for r in range(R):
            comptime for v in range(TV):
                acc[r * TV + v] = yo.unsafe_load[width=VW](r * P + v * VW)
    for n in range(n0, min(N, n0 + KB)):
        var hp = ht.unsafe_offset(n * P)
        var hv = Array[V, TV](fill=V(0.0))
        comptime for v in range(TV):
            hv[v] = hp.unsafe_load[width=VW](v * VW)
        comptime for r in range(R):
            var cn = V(crow[r][unsafe_offset=n])
            comptime for v in range(TV):
                acc[r * TV + v] = cn.fma(hv[v], acc[r * TV + v])
    comptime for r in range(R):
        comptime for v in range(TV):
            yo.unsafe_store(r * P + v * VW, acc[r * TV + v])


def fold_rows(xr: XRows, di: Int, hh: Int, nr: Int, wrow: F32Ptr, el: V, src: F32Ptr,
              dst: F32Ptr, u: F32Ptr):
    """dst[p][n] = el * src[p][n], then for i = 0..nr-1 ascending:
    dst[p][n] = fma(u_i[p], B_i[n], dst[p][n]), u_i[p] = wrow[i] * x_i[p]
    (the fold of ssd.fold_chunk; src may be dst). u: FOLD_IB * P floats."""
    var ib0 = 0
    while True:
        var ib1 = min(nr, ib0 + FOLD_IB)
        for i in range(ib0, ib1):  # the products w_i x_i[p], each rounded once
            var xp = xr.row(i).unsafe_offset(hh * P)
            var wi = V(wrow[unsafe_offset=i])
            comptime for q in range(P // VW):
                u.unsafe_store((i - ib0) * P + q * VW, wi * xp.unsafe_load[width=VW](q * VW))
        var first = ib0 == 0
        for p0 in range(0, P, FR):
            for n0 in range(0, N, TC):
                _fold_tile(xr, xr.bo + n0, ib0, ib1, u.unsafe_offset(p0), el, first,
                           src.unsafe_offset(p0 * N + n0), dst.unsafe_offset(p0 * N + n0))
        ib0 = ib1
        if ib0 >= nr:
            break


@always_inline
def _fold_tile(xr: XRows, col: Int, ib0: Int, ib1: Int, u: F32Ptr, el: V, first: Bool,
               src: F32Ptr, dst: F32Ptr):
    """FR rows p x TC columns n of the fold, chunk rows [ib0, ib1): starts
    from el * src (first pass) or from dst."""
    var acc = Array[V, FR * TV](fill=V(0.0))
    comptime for r in range(FR):
        comptime for v in range(TV):
            var o = r * N + v * VW
            if first:
                acc[r * TV + v] = el * src.unsafe_load[width=VW](o)
            else:
                acc[r * TV + v] = dst.unsafe_load[width=VW](o)
    _rows_fma[FR, 1, P](xr, col, ib0, ib1, u, acc)
    comptime for r in range(FR):
        comptime for v in range(TV):
            dst.unsafe_store(r * N + v * VW, acc[r * TV + v])
