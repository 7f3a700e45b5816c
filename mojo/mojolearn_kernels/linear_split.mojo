"""Lane-split matrix products: y[r, o] = sum_k x[r, k] * W[o, k] with the
k axis split over 16 lanes, for the long reductions where one sequential
chain loses too much (Mamba-2/3 out_proj: K = d_inner, and outputs that
cancel to near zero).

Canonical order (identical mode), per output element:
    lane l (0..15) = fma chain over k = l, l + 16, l + 32, ... ascending,
                     starting from +0.0 (k >= K contributes x = +0.0);
    y = tree16(lanes): l + (l + 8), then + 4, + 2, + 1 (tree16 below).
Sixteen partial sums of K/16 terms: the rounding of a 512-term reduction is
about six times smaller than one chain's. The tile shape, the vector width
and the task split never change an operand, so never a bit.

Weights are packed once in groups of G = 8 output rows, k-block-major:
element [g, kb, j, l] = W[g * G + j, kb * 16 + l] (zeros past M and K), so
the G weight vectors of one k block are contiguous: one stream per tile.
Formats (mojolearn.lowbit, kept packed; widened exactly on load):
  WF_F32  float32 elements;  WF_BF16  bfloat16 bits (uint16) elements;
  WF_INT8 one float32 scale 2^e per (padded) row, then int8 code elements.
"""
from std.collections import Array
from std.memory import Pointer, bitcast
from std.sys import get_defined_string
from .abi import F32Ptr, ALIGN_FLOATS, ceil_div, round_up
from .linear import TileRange, WF_F32, WF_BF16, WF_INT8

comptime KL = 16  # lanes of the k split
comptime VK = SIMD[DType.float32, KL]
comptime WIDE = get_defined_string["ML_ARCH", "x86-64-v3"]() == "x86-64-v4"
# Register tiles (rows x outputs) of 16-lane accumulators: AVX-512 holds
# 3 x 8 of them for row blocks and 1 x 16 for a one-token step; with AVX2
# each takes two registers, so 1 x 4.
comptime SR = 3 if WIDE else 1
comptime SC = 8 if WIDE else 4
comptime SC1 = 16 if WIDE else 4  # outputs per tile for a single row
comptime G = 8  # output rows per packed group
comptime MPAD = 16  # packed rows: M rounded up to this (the widest tile)


def split_ld(k: Int) -> Int:
    """K rounded up to a multiple of 16."""
    return ceil_div(k, KL) * KL


def split_rows(m: Int) -> Int:
    """Packed rows: M padded so a tile may read (never store) past M."""
    return ceil_div(m, MPAD) * MPAD


def split_floats(m: Int, k: Int, wf: Int = WF_F32) -> Int:
    """Floats (4-byte units) of the packed (m, k) weight in format wf."""
    var n = split_rows(m) * split_ld(k)
    if wf == WF_BF16:
        n = n // 2
    elif wf == WF_INT8:
        n = split_rows(m) + n // 4
    return round_up(n, ALIGN_FLOATS)


comptime U16Ptr = Pointer[UInt16, MutUntrackedOrigin]
comptime I8Ptr = Pointer[Int8, MutUntrackedOrigin]
comptime I32Ptr = Pointer[Int32, MutUntrackedOrigin]


@always_inline
def pow2_f32(e: Int) -> Float32:
    """2^e exactly for e in [-149, 127] (through float64: no rounding)."""
    return Float32(bitcast[DType.float64, 1](UInt64(e + 1023) << 52))


def split_pack(w: F32Ptr, m: Int, k: Int, dst: F32Ptr):
    """Row-major float32 W (m, k) -> the packed float32 form."""
    split_pack_wf(WF_F32, Int(w), 0, m, k, dst)


def split_pack_wf(wf: Int, src: Int, exps: Int, m: Int, k: Int, dst: F32Ptr):
    """The (m, k) weight at address src in format wf (float32 values,
    bfloat16 bits, or int8 codes with int32 exponents at exps, one per row)
    -> the packed form: a copy of the given values, no conversion."""
    var ld = split_ld(k)
    var mp = split_rows(m)
    var codes = dst
    if wf == WF_INT8:
        for o in range(mp):
            var e = Int(I32Ptr(unsafe_from_address=exps)[unsafe_offset=o]) if o < m else 0
            dst[unsafe_offset=o] = pow2_f32(e)
        codes = dst.unsafe_offset(mp)
    for o in range(mp):
        for kk in range(ld):
            var at = _woff(o, kk // KL, ld) + kk % KL
            var inside = o < m and kk < k
            if wf == WF_BF16:
                var v: UInt16 = 0
                if inside:
                    v = U16Ptr(unsafe_from_address=src)[unsafe_offset=o * k + kk]
                codes.unsafe_bitcast[UInt16]()[unsafe_offset=at] = v
            elif wf == WF_INT8:
                var v: Int8 = 0
                if inside:
                    v = I8Ptr(unsafe_from_address=src)[unsafe_offset=o * k + kk]
                codes.unsafe_bitcast[Int8]()[unsafe_offset=at] = v
            else:
                var v: Float32 = 0.0
                if inside:
                    v = F32Ptr(unsafe_from_address=src)[unsafe_offset=o * k + kk]
                codes[unsafe_offset=at] = v


def split_extract(wf: Int, w: F32Ptr, m: Int, k: Int, r0: Int, r1: Int,
                  dst: Int, exps: Int):
    """Rows [r0, r1) of a float32 / bfloat16 / int8 weight back to row-major
    values or codes (float32, uint16 bits or int8) and, for int8, int32
    exponents."""
    var ld = split_ld(k)
    var codes = w.unsafe_offset(split_rows(m)) if wf == WF_INT8 else w
    for o in range(r0, r1):
        if wf == WF_INT8:
            # the scale is 2^e exactly; float64 keeps it normal: e is its exponent
            var b = bitcast[DType.uint64, 1](Float64(w[unsafe_offset=o]))
            I32Ptr(unsafe_from_address=exps)[unsafe_offset=o] = Int32(Int((b >> 52) & 0x7FF) - 1023)
        for kk in range(k):
            var at = _woff(o, kk // KL, ld) + kk % KL
            if wf == WF_F32:
                F32Ptr(unsafe_from_address=dst)[unsafe_offset=o * k + kk] = w[unsafe_offset=at]
            elif wf == WF_BF16:
                U16Ptr(unsafe_from_address=dst)[unsafe_offset=o * k + kk] = (
                    codes.unsafe_bitcast[UInt16]()[unsafe_offset=at])
            else:
                I8Ptr(unsafe_from_address=dst)[unsafe_offset=o * k + kk] = (
                    codes.unsafe_bitcast[Int8]()[unsafe_offset=at])


@always_inline
def _wload[WF: Int](codes: F32Ptr, scales: F32Ptr, o: Int, at: Int) -> VK:
    """16 weights of row o at element `at`, widened exactly to float32."""
    comptime if WF == WF_BF16:
        var h = codes.unsafe_bitcast[UInt16]().unsafe_load[width=KL](at)
        return bitcast[DType.float32, KL](h.cast[DType.uint32]() << 16)
    elif WF == WF_INT8:
        var c = codes.unsafe_bitcast[Int8]().unsafe_load[width=KL](at)
        return c.cast[DType.float32]() * VK(scales[unsafe_offset=o])  # exact
    else:
        return codes.unsafe_load[width=KL](at)


@always_inline
def _woff(o: Int, kb: Int, ld: Int) -> Int:
    """Offset of W[o, kb * 16 : kb * 16 + 16] in the packed form."""
    return (o // G) * G * ld + kb * (G * KL) + (o % G) * KL


@always_inline
def tree16(acc: VK) -> Float32:
    """Fixed halving tree: lanes l + l+8, then l + l+4, l + l+2, l + l+1."""
    var s8 = acc.slice[8, offset=0]() + acc.slice[8, offset=8]()
    var s4 = s8.slice[4, offset=0]() + s8.slice[4, offset=4]()
    var s2 = s4.slice[2, offset=0]() + s4.slice[2, offset=2]()
    return s2[0] + s2[1]


# The same tree for 16, 8 or 4 accumulators at once: each level adds the
# same two partial sums per output as tree16, with the outputs' halves moved
# side by side first, so lane c of the result is tree16(acc[c]) bit for bit.
@always_inline
def _level8(a: VK, b: VK) -> VK:
    """[a_l + a_l+8 (l < 8), b_l + b_l+8]."""
    return (a.shuffle[0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23](b)
            + a.shuffle[8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31](b))


@always_inline
def _level4(a: VK, b: VK) -> VK:
    """Four outputs of 8 partial sums each -> four of 4: s_l + s_l+4."""
    return (a.shuffle[0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27](b)
            + a.shuffle[4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31](b))


@always_inline
def _level2(a: VK, b: VK) -> VK:
    """Eight outputs of 4 partial sums -> eight of 2: s_l + s_l+2."""
    return (a.shuffle[0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29](b)
            + a.shuffle[2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31](b))


@always_inline
def _level1(a: VK, b: VK) -> VK:
    """Sixteen outputs of 2 partial sums -> the sums: s_0 + s_1."""
    return (a.shuffle[0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30](b)
            + a.shuffle[1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31](b))


@always_inline
def reduce_many[M: Int](acc: Array[VK, M]) -> SIMD[DType.float32, M]:
    """Lane c = tree16(acc[c]) for M in {4, 8, 16}."""
    comptime assert M == 4 or M == 8 or M == 16, "M must be 4, 8 or 16"
    comptime if M == 16:
        var z0 = _level2(_level4(_level8(acc[0], acc[1]), _level8(acc[2], acc[3])),
                         _level4(_level8(acc[4], acc[5]), _level8(acc[6], acc[7])))
        var z1 = _level2(_level4(_level8(acc[8], acc[9]), _level8(acc[10], acc[11])),
                         _level4(_level8(acc[12], acc[13]), _level8(acc[14], acc[15])))
        return rebind[SIMD[DType.float32, M]](_level1(z0, z1))
    elif M == 8:
        var z = _level2(_level4(_level8(acc[0], acc[1]), _level8(acc[2], acc[3])),
                        _level4(_level8(acc[4], acc[5]), _level8(acc[6], acc[7])))
        return rebind[SIMD[DType.float32, M]](_level1(z, z).slice[8, offset=0]())
    else:
        var w = _level4(_level8(acc[0], acc[1]), _level8(acc[2], acc[3]))
        return rebind[SIMD[DType.float32, M]](_level1(_level2(w, w), w).slice[4, offset=0]())


@always_inline
def _xblock(x: F32Ptr, k0: Int, k: Int) -> VK:
    """x[k0 : k0 + 16] with +0.0 past k (only the last block is partial)."""
    if k0 + KL <= k:
        return x.unsafe_load[width=KL](k0)
    var v = VK(0.0)
    for j in range(k - k0):
        v[j] = x[unsafe_offset=k0 + j]
    return v


@always_inline
def _tile[R: Int, C: Int, WF: Int](
    x: F32Ptr, ldx: Int, w: F32Ptr, sc: F32Ptr, ld: Int, k: Int, c: Int, nc: Int,
    y: F32Ptr, ldy: Int,
):
    """R rows x outputs [c, c + C) (c a multiple of min(C, G), C <= G or a
    multiple of G); stores the
    first nc: y[i, c + j] = tree16(lane chains of x[i, :] . W[c + j, :])."""
    var acc = Array[VK, R * C](fill=VK(0.0))
    var kfull = k // KL
    # element offset of (c + j, kb) = base + j's constant part + kb * G * KL
    # (c is a multiple of 8, or C divides 8: c + j stays in c's group)
    var base = (c // G) * G * ld + (c % G) * KL
    for kb in range(kfull):
        var xs = Array[VK, R](fill=VK(0.0))
        comptime for i in range(R):
            xs[i] = x.unsafe_load[width=KL](i * ldx + kb * KL)
        var at = base + kb * (G * KL)
        comptime for j in range(C):
            var wv = _wload[WF](w, sc, c + j, at + (j // G) * G * ld + (j % G) * KL)
            comptime for i in range(R):
                acc[i * C + j] = xs[i].fma(wv, acc[i * C + j])
    if kfull * KL < k:  # the last, partial block: lanes past k add x = +0.0
        var at = base + kfull * (G * KL)
        comptime for i in range(R):
            var xv = _xblock(x.unsafe_offset(i * ldx), kfull * KL, k)
            comptime for j in range(C):
                acc[i * C + j] = xv.fma(
                    _wload[WF](w, sc, c + j, at + (j // G) * G * ld + (j % G) * KL),
                    acc[i * C + j])
    var yc = y.unsafe_offset(c)
    comptime if R * C == 24 and C == 8:  # two rows, then one
        var a = Array[VK, 16](fill=VK(0.0))
        var b = Array[VK, 8](fill=VK(0.0))
        comptime for j in range(16):
            a[j] = acc[j]
        comptime for j in range(8):
            b[j] = acc[16 + j]
        var ra = reduce_many[16](a)
        _store[8](yc, ra.slice[8, offset=0](), nc)
        _store[8](yc.unsafe_offset(ldy), ra.slice[8, offset=8](), nc)
        _store[8](yc.unsafe_offset(2 * ldy), reduce_many[8](b), nc)
    elif R * C == 16 or R * C == 8 or R * C == 4:
        var r = reduce_many[R * C](acc)
        comptime for i in range(R):
            _store[C](yc.unsafe_offset(i * ldy), r.slice[C, offset=i * C](), nc)
    else:
        comptime for i in range(R):
            comptime for j in range(C):
                if j < nc:
                    yc[unsafe_offset=i * ldy + j] = tree16(acc[i * C + j])


@always_inline
def _store[C: Int](y: F32Ptr, v: SIMD[DType.float32, C], nc: Int):
    if nc >= C:
        y.unsafe_store(0, v)
    else:
        for j in range(nc):
            y[unsafe_offset=j] = v[j]


def split_matmul_block[WF: Int = WF_F32](
    x: F32Ptr, ldx: Int, r0: Int, r1: Int, wp: F32Ptr, k: Int, m: Int,
    c0: Int, c1: Int, y: F32Ptr, ldy: Int,
):
    """Rows [r0, r1) x outputs [c0, c1) of y = x @ W^T (W packed (m, k) in
    format WF; c0 a multiple of 16)."""
    var ld = split_ld(k)
    var w = wp.unsafe_offset(split_rows(m)) if WF == WF_INT8 else wp
    if r1 - r0 == 1:  # one row (a decode step): more outputs per tile
        var c = c0
        while c < c1:
            _tile[1, SC1, WF](x.unsafe_offset(r0 * ldx), ldx, w, wp, ld, k, c, c1 - c,
                              y.unsafe_offset(r0 * ldy), ldy)
            c += SC1
        return
    # Output tiles outside, rows inside: the tile's weights stay in L1 while
    # the block's rows stream past them.
    var c = c0
    while c < c1:
        var r = r0
        while r + SR <= r1:
            _tile[SR, SC, WF](x.unsafe_offset(r * ldx), ldx, w, wp, ld, k, c, c1 - c,
                              y.unsafe_offset(r * ldy), ldy)
            r += SR
        while r < r1:
            _tile[1, SC, WF](x.unsafe_offset(r * ldx), ldx, w, wp, ld, k, c, c1 - c,
                             y.unsafe_offset(r * ldy), ldy)
            r += 1
        c += SC


# Task grid: row blocks x output blocks.
comptime SPLIT_ROW_BLOCK = 48
comptime SPLIT_COL_BLOCK = 48


def split_matmul_ntasks(rows: Int, m: Int) -> Int:
    return ceil_div(rows, SPLIT_ROW_BLOCK) * ceil_div(m, SPLIT_COL_BLOCK)


def split_matmul_task_wf(
    wf: Int, task: Int, x: F32Ptr, ldx: Int, rows: Int, w: F32Ptr, k: Int, m: Int,
    y: F32Ptr, ldy: Int,
) -> TileRange:
    """split_matmul_task on a weight in the run-time format wf."""
    if wf == WF_BF16:
        return split_matmul_task[WF_BF16](task, x, ldx, rows, w, k, m, y, ldy)
    if wf == WF_INT8:
        return split_matmul_task[WF_INT8](task, x, ldx, rows, w, k, m, y, ldy)
    return split_matmul_task[WF_F32](task, x, ldx, rows, w, k, m, y, ldy)


def split_matmul_task[WF: Int = WF_F32](
    task: Int, x: F32Ptr, ldx: Int, rows: Int, w: F32Ptr, k: Int, m: Int,
    y: F32Ptr, ldy: Int,
) -> TileRange:
    """Run task `task` of the (row block, output block) grid."""
    var ncb = ceil_div(m, SPLIT_COL_BLOCK)
    var r0 = (task // ncb) * SPLIT_ROW_BLOCK
    var r1 = min(rows, r0 + SPLIT_ROW_BLOCK)
    var c0 = (task % ncb) * SPLIT_COL_BLOCK
    var c1 = min(m, c0 + SPLIT_COL_BLOCK)
    split_matmul_block[WF](x, ldx, r0, r1, w, k, m, c0, c1, y, ldy)
    return TileRange(r0, r1, c0, c1)
