"""Canonical matrix products: y[r, o] = sum_k x[r, k] * W[o, k].

Canonical order of a forward product (identical mode): segmented k. The k
axis is cut into contiguous segments of KSEG = 32 steps; each segment is one
sequential fma chain in ascending k from +0.0, and the segment sums are
added in ascending order, the first one taken as it is:
    p_s = 0; for k in [32 s, min(32 s + 32, K)): p_s = fma(x[r, k], W[o, k], p_s)
    y = p_0; for s in 1, 2, ...: y = y + p_s
(K <= 32: one chain, as before.) The micro-kernel vectorizes across 16
outputs (one weight panel) and keeps MR rows in registers; its k loop stops
at every segment end, where it stores its registers to y (segment 0) or adds
them to y (one load, add, store per tile every 32 k steps). Segment ends are
fixed multiples of KSEG in k, so the bits do not depend on the SIMD width,
the tile shape, the rows of a batch or how tiles are spread on threads.
Why segments: chains of at most 32 terms plus one chain of K/32 sums round
in the class of a 16-lane split (docs/numerics.md), at the speed of
the broadcast micro-kernel.

SEG (a compile-time parameter): KSEG for every forward product (always so
in matmul_task_wf); ONE_CHAIN (the default of matmul_task) is one fma chain
over all of k, the order of the backward passes' activation products
(x @ W on transposed panels, the same chain as linear_grad.mojo's).

Weights are packed once into panels of NR = 16 output rows, k-major:
packed[p, k, j] = W[p * NR + j, k] (zero rows past M), so each k step loads
16 contiguous floats.

Weight format WF (a compile-time parameter; float32 is the default and its
code is the plain float32 kernel): the panels may also hold bfloat16 bits,
int8 codes or llama.cpp's q4_0 / q8_0 blocks (mojolearn.lowbit). Each
weight is widened to float32 on load, exactly (bf16: bits << 16; int8:
code * 2^e, a power-of-two scale per output row; q4_0: (q - 8) * d, q8_0:
q * d, d the float16 scale of a block of 32 k steps of one row), so the fma
chains see the same float32 values in the same order and give the same bits
as on the expanded float32 panels. A block format's blocks are the KSEG
segments of the canonical order, so each segment loads its scales once.
"""
from std.collections import Array
from std.memory import bitcast
from std.sys import get_defined_string, is_defined
from std.sys.intrinsics import prefetch, PrefetchOptions
from std.memory import Pointer, stack_allocation
from .abi import F32Ptr, ceil_div, round_up, ALIGN_FLOATS

comptime NR = 16
# Register tile: MR rows x TP panels of accumulators. AVX2 has 16 vector
# registers (6 rows x 1 panel = 12 ymm); AVX-512 has 32, and 6 rows x 2
# panels (12 zmm) was 1.25x faster on the Mamba-1 prefill than 6 x 1 (12 x 2,
# 8 x 2, 4 x 4, 6 x 3 were measured too: no better).
comptime WIDE = get_defined_string["ML_ARCH", "x86-64-v3"]() == "x86-64-v4"
comptime MR = 6
comptime TP = 2 if WIDE else 1
comptime VN = SIMD[DType.float32, NR]
# The segment length of the canonical forward order (module docstring). A
# constant of the formula: changing it changes bits (tests/digests.json).
comptime KSEG = 32
comptime ONE_CHAIN = 0  # SEG value: one chain over all of k (no segments)


@always_inline
def _seg_end[SEG: Int](k0: Int, k: Int) -> Int:
    """End of the segment that starts at k0 (segments start at multiples of
    SEG, and every caller starts at 0 and steps segment by segment)."""
    comptime if SEG == ONE_CHAIN:
        return k
    else:
        return min(k0 + SEG, k)

# Weight panel formats (ids shared with lowbit.mojo's FMT_* and the blobs).
comptime WF_F32 = 0  # packed[p, k, j] float32
comptime WF_BF16 = 1  # the same order, bfloat16 bits (uint16)
comptime WF_INT8 = 2  # per panel: NR float32 scales 2^e[row], then int8 codes [k, j]
# The block formats (a block: 32 k steps of one row): per panel and block,
# NR float16 scale bits d[row] (8 floats), then the codes of the block's 32
# steps. q4_0: 16 x NR bytes, byte [t, j] = q[row j, step t] | q[row j,
# step t + 16] << 4 (the nibble order of a ggml block); q8_0: 32 x NR int8.
comptime WF_Q4_0 = 3
comptime WF_Q8_0 = 4
comptime QBLOCK = 32  # k steps per block (= KSEG)
comptime Q4_BLOCK_FLOATS = NR // 2 + NR * QBLOCK // 8
comptime Q8_BLOCK_FLOATS = NR // 2 + NR * QBLOCK // 4


@always_inline
def panel_floats[WF: Int](k: Int) -> Int:
    """Floats (4-byte units) one panel of k steps occupies in format WF."""
    comptime if WF == WF_BF16:
        return k * NR // 2
    elif WF == WF_INT8:
        return NR + k * NR // 4
    elif WF == WF_Q4_0:
        return ceil_div(k, QBLOCK) * Q4_BLOCK_FLOATS
    elif WF == WF_Q8_0:
        return ceil_div(k, QBLOCK) * Q8_BLOCK_FLOATS
    else:
        return k * NR


def panel_floats_wf(wf: Int, k: Int) -> Int:
    """panel_floats for the run-time format wf."""
    if wf == WF_BF16:
        return panel_floats[WF_BF16](k)
    if wf == WF_INT8:
        return panel_floats[WF_INT8](k)
    if wf == WF_Q4_0:
        return panel_floats[WF_Q4_0](k)
    if wf == WF_Q8_0:
        return panel_floats[WF_Q8_0](k)
    return panel_floats[WF_F32](k)


def packed_floats(m: Int, k: Int, wf: Int = WF_F32) -> Int:
    """Floats in the packed form of an (m, k) matrix in format wf, rounded
    up to ALIGN_FLOATS (float32 panels are always a multiple of it)."""
    return round_up(ceil_div(m, NR) * panel_floats_wf(wf, k), ALIGN_FLOATS)


@always_inline
def f16_widen[W: Int](h: SIMD[DType.uint16, W]) -> SIMD[DType.float32, W]:
    """float16 bit patterns -> float32, exactly, in integer steps (finite
    inputs: the Python layer refuses non-finite scales)."""
    comptime V = SIMD[DType.float32, W]
    var hu = h.cast[DType.uint32]()
    var em = hu & 0x7FFF
    var normal = bitcast[DType.float32, W]((em << 13) + 0x38000000)  # rebias 15 -> 127
    var sub = em.cast[DType.float32]() * V(5.9604644775390625e-08)  # subnormal: em * 2^-24
    var mag = em.lt(SIMD[DType.uint32, W](0x400)).select(sub, normal)
    return bitcast[DType.float32, W](bitcast[DType.uint32, W](mag) | ((hu & 0x8000) << 16))


@always_inline
def _wscale[WF: Int](panel: F32Ptr, k0: Int) -> VN:
    """The scales of the segment that starts at k0: the panel's per-row
    scales (int8), the rows' block scales (q4_0, q8_0); unused (and
    optimised away) else."""
    comptime if WF == WF_INT8:
        return panel.unsafe_load[width=NR](0)
    elif WF == WF_Q4_0 or WF == WF_Q8_0:
        var blk = panel.unsafe_offset((k0 // QBLOCK) * panel_floats[WF](QBLOCK))
        return f16_widen[NR](blk.unsafe_bitcast[UInt16]().unsafe_load[width=NR](0))
    else:
        return VN(1.0)


@always_inline
def _wload[WF: Int, H: Int = 0](panel: F32Ptr, kk: Int, k0: Int, scale: VN) -> VN:
    """Step kk of one panel as NR float32 weights, widened exactly; k0 is
    the start of kk's segment (q4_0, q8_0: of its block, so the block's
    address is the same for all its steps; q4_0: H = 1 for the steps
    16..31 of a block, the high nibbles)."""
    comptime if WF == WF_BF16:
        var h = panel.unsafe_bitcast[UInt16]().unsafe_load[width=NR](kk * NR)
        return bitcast[DType.float32, NR](h.cast[DType.uint32]() << 16)
    elif WF == WF_INT8:
        var c = panel.unsafe_offset(NR).unsafe_bitcast[Int8]().unsafe_load[width=NR](kk * NR)
        return c.cast[DType.float32]() * scale  # code * 2^e is representable: exact
    elif WF == WF_Q4_0:
        var codes = panel.unsafe_offset((k0 // QBLOCK) * Q4_BLOCK_FLOATS + NR // 2)
        var b = codes.unsafe_bitcast[UInt8]().unsafe_load[width=NR]((kk - k0 - H * QBLOCK // 2) * NR)
        var q: SIMD[DType.uint8, NR]
        comptime if H == 1:
            q = b >> 4
        else:
            q = b & 0xF
        var qs = bitcast[DType.int8, NR](q - 8)  # q - 8 in [-8, 7], in bytes
        return qs.cast[DType.float32]() * scale  # (q - 8) * d: exact; 0 * d keeps d's sign
    elif WF == WF_Q8_0:
        var codes = panel.unsafe_offset((k0 // QBLOCK) * Q8_BLOCK_FLOATS + NR // 2)
        var c = codes.unsafe_bitcast[Int8]().unsafe_load[width=NR]((kk - k0) * NR)
        return c.cast[DType.float32]() * scale  # q * d: exact
    else:
        return panel.unsafe_load[width=NR](kk * NR)


# A segment's k steps in parts: q4_0 reads a block's low nibbles (steps
# 0..15), then its high nibbles (16..31), each part with a fixed shift;
# every other format is one part. The steps stay in ascending order.
@always_inline
def _parts[WF: Int]() -> Int:
    return 2 if WF == WF_Q4_0 else 1


@always_inline
def _part_start[WF: Int, H: Int](k0: Int, k1: Int) -> Int:
    comptime if WF == WF_Q4_0 and H == 1:
        return min(k1, k0 + QBLOCK // 2)
    return k0


@always_inline
def _part_end[WF: Int, H: Int](k0: Int, k1: Int) -> Int:
    comptime if WF == WF_Q4_0 and H == 0:
        return min(k1, k0 + QBLOCK // 2)
    return k1


@always_inline
def pack_panel[T: DType](
    src: Pointer[Scalar[T], MutUntrackedOrigin], m: Int, k: Int, rs: Int, cs: Int, p: Int,
    dst: Pointer[Scalar[T], MutUntrackedOrigin],
):
    """Panel p of an (m, k) matrix of T read as src[row * rs + kk * cs]
    (rs = k, cs = 1: row-major; rs = 1, cs = m: the transpose of a row-major
    (k, m) matrix) into dst, k-major: dst[kk * NR + j] = row p * NR + j, zero
    past m. Every format's panels (float32, bf16 bits, int8 codes) are laid
    out this way."""
    for kk in range(k):
        for j in range(NR):
            var row = p * NR + j
            var v: Scalar[T] = 0
            if row < m:
                v = src[unsafe_offset=row * rs + kk * cs]
            dst[unsafe_offset=kk * NR + j] = v


def pack_panels(w: F32Ptr, m: Int, k: Int, dst: F32Ptr):
    """Pack row-major W (m, k) into NR-row panels, k-major, zero padded."""
    for p in range(ceil_div(m, NR)):
        pack_panel(w, m, k, k, 1, p, dst.unsafe_offset(p * k * NR))


@always_inline
def _tile[R: Int, WF: Int = WF_F32, SEG: Int = KSEG](
    x: F32Ptr, ldx: Int, panel: F32Ptr, k: Int, y: F32Ptr, ldy: Int, ncols: Int,
    k_start: Int = 0,
):
    """R rows x one panel: y[i, 0:ncols] = x[i, :] . panel (order SEG).
    k_start > 0 (a multiple of SEG): only the segments of steps
    [k_start, k), added to y as every later segment is."""
    comptime assert WF < WF_Q4_0 or SEG == QBLOCK, "block formats: one block per segment"
    var k0 = k_start
    while True:  # one segment per pass; k = 0 stores +0.0
        var k1 = _seg_end[SEG](k0, k)
        var scale = _wscale[WF](panel, k0)
        var acc = Array[VN, R](fill=VN(0.0))
        comptime for h in range(_parts[WF]()):
            for kk in range(_part_start[WF, h](k0, k1), _part_end[WF, h](k0, k1)):
                var wv = _wload[WF, h](panel, kk, k0, scale)
                comptime for i in range(R):
                    acc[i] = VN(x[unsafe_offset=i * ldx + kk]).fma(wv, acc[i])
        if ncols == NR:
            if k0 == 0:
                comptime for i in range(R):
                    y.unsafe_store(i * ldy, acc[i])
            else:
                comptime for i in range(R):
                    y.unsafe_store(i * ldy, y.unsafe_load[width=NR](i * ldy) + acc[i])
        else:
            comptime for i in range(R):
                for j in range(ncols):
                    if k0 == 0:
                        y[unsafe_offset=i * ldy + j] = acc[i][j]
                    else:
                        y[unsafe_offset=i * ldy + j] = y[unsafe_offset=i * ldy + j] + acc[i][j]
        k0 = k1
        if k0 >= k:
            break


@always_inline
def _tile_panels[R: Int, NP: Int, WF: Int = WF_F32, PF: Int = 0, SEG: Int = KSEG, RS: Int = R](
    x: F32Ptr, ldx: Int, panel: F32Ptr, k: Int, y: F32Ptr, ldy: Int
):
    """R rows x NP consecutive full panels (order SEG). With few rows, one
    panel has too few independent fma chains to hide the fma latency;
    several panels do. PF > 0: ask for each panel's step kk + PF while at
    kk (the weights of a few-row product are used once; float32 panels
    only). RS < R: the rows in groups of RS (a divisor of R), one group
    after the other within each segment, so the later groups find the
    segment's weights in L1 and the stream from memory never pauses."""
    comptime assert WF < WF_Q4_0 or SEG == QBLOCK, "block formats: one block per segment"
    var pstride = panel_floats[WF](k)
    var k0 = 0
    while True:  # one segment per pass; k = 0 stores +0.0
        var k1 = _seg_end[SEG](k0, k)
        var scale = Array[VN, NP](fill=VN(1.0))
        comptime for q in range(NP):
            scale[q] = _wscale[WF](panel.unsafe_offset(q * pstride), k0)
        comptime for g in range(R // RS):
            _seg_group[RS, NP, WF, PF if g == 0 else 0](
                x.unsafe_offset(g * RS * ldx), ldx, panel, pstride, scale, k0, k1,
                y.unsafe_offset(g * RS * ldy), ldy)
        k0 = k1
        if k0 >= k:
            break


@always_inline
def _seg_group[RS: Int, NP: Int, WF: Int, PF: Int](
    x: F32Ptr, ldx: Int, panel: F32Ptr, pstride: Int, scale: Array[VN, NP], k0: Int, k1: Int,
    y: F32Ptr, ldy: Int,
):
    """One segment [k0, k1) of RS rows x NP full panels (pstride floats
    apart): the segment's fma chains from +0.0, stored to y (k0 = 0) or
    added to it. PF > 0: ask for each panel's step kk + PF while at kk
    (float32 panels only)."""
    var acc = Array[VN, RS * NP](fill=VN(0.0))
    comptime for h in range(_parts[WF]()):
        for kk in range(_part_start[WF, h](k0, k1), _part_end[WF, h](k0, k1)):
            comptime if PF > 0 and WF == WF_F32:
                comptime for q in range(NP):
                    prefetch[PrefetchOptions().for_read().high_locality()](
                        panel.unsafe_offset(q * pstride + (kk + PF) * NR))
            comptime for q in range(NP):
                var wv = _wload[WF, h](panel.unsafe_offset(q * pstride), kk, k0, scale[q])
                comptime for i in range(RS):
                    acc[i * NP + q] = VN(x[unsafe_offset=i * ldx + kk]).fma(wv, acc[i * NP + q])
    if k0 == 0:
        comptime for i in range(RS):
            comptime for q in range(NP):
                y.unsafe_store(i * ldy + q * NR, acc[i * NP + q])
    else:
        comptime for i in range(RS):
            comptime for q in range(NP):
                var o = i * ldy + q * NR
                y.unsafe_store(o, y.unsafe_load[width=NR](o) + acc[i * NP + q])


# Steps ahead the 8-row pass asks for its panels (64: 4 KB, a page ahead).
# A batch-8 step's weights and state outgrow L3, so the panels come from
# DRAM; this cut the two projections of a d = 768 batch-8 Mamba-3 step by
# 30-40%. Fewer rows stream from L3 at full speed without it.
comptime FEW_PF = 64


def _rows_few[R: Int, WF: Int = WF_F32, SEG: Int = KSEG, PF: Int = FEW_PF if R >= MR else 0,
              RS: Int = R](
    x: F32Ptr, ldx: Int, wp: F32Ptr, k: Int, m: Int, p0: Int, p1: Int,
    y: F32Ptr, ldy: Int,
):
    """R rows over panels [p0, p1), several full panels at a time: R < MR
    (leftover rows: four panels, fewer where R rows of them would not fit
    the registers: 32 on AVX-512; AVX2's 16 hold at most 12 accumulators,
    and 2-5 rows of four panels spilled them to the stack, 1.2-1.7x slower),
    or R = 8 on AVX-512 (a batch-8 step in one pass over the weights: 8 x 2
    panels, measured faster than 8 x 3). RS: rows per register group
    (_tile_panels). AVX2 batch-8 steps take _rows_many."""
    comptime NP = (min(4, max(1, 24 // R)) if R < MR else 2) if WIDE else min(4, max(1, 6 // RS))
    var ps = panel_floats[WF](k)
    var p = p0
    while p + NP <= p1 and (p + NP) * NR <= m:
        _tile_panels[R, NP, WF, PF, SEG, RS](
            x, ldx, wp.unsafe_offset(p * ps), k, y.unsafe_offset(p * NR), ldy)
        p += NP
    while p < p1:
        comptime for g in range(R // RS):  # RS rows at a time, as above
            _tile[RS, WF, SEG](x.unsafe_offset(g * RS * ldx), ldx, wp.unsafe_offset(p * ps), k,
                               y.unsafe_offset(g * RS * ldy + p * NR), ldy, min(NR, m - p * NR))
        p += 1


# Most rows the segment-major pass (_rows_many) takes: a batched decode
# step's rows, not a prefill chunk's 192-row blocks.
comptime MANY_ROWS = 64


@always_inline
def _group_rows(n: Int, g: Int) -> Int:
    """Rows of group g when n rows (n > MR) are cut into ceil(n / MR)
    register groups of nearly equal size (32 rows: 5, 5, 5, 5, 6, 6): each
    group keeps at least 3 rows (6 fma chains; a 1-2 row group has too few
    to hide the fma latency)."""
    var groups = ceil_div(n, MR)
    return n // groups + (1 if g >= groups - n % groups else 0)


def _rows_many[WF: Int, SEG: Int](
    x: F32Ptr, ldx: Int, n: Int, wp: F32Ptr, k: Int, m: Int, p0: Int, p1: Int,
    y: F32Ptr, ldy: Int,
):
    """n rows (MR < n <= MANY_ROWS) over panels [p0, p1), segment-major: per
    panel (TP panels on AVX-512) and k segment, every row group in turn,
    the first one asking for the panel's steps FEW_PF ahead. So the panel
    streams from memory once, while the other groups work on the segment in
    L1 (row tiles over whole panels, as for a prefill block, paused the
    stream for the other tiles; AVX2, one thread: 32-row products
    0.88-0.91x the time, 16-row 0.75-0.80x, bench/RESULTS.md). The fma
    chains and their order are those of every other pass (segment by
    segment, from +0.0)."""
    var ps = panel_floats[WF](k)
    comptime NP = TP
    comptime LDS = NP * NR
    # The running sums of the panel's rows, contiguous: y's rows are often a
    # multiple of 4 KB apart (Mamba-1's in_proj: 12 KB), so the same rows
    # of y would share one L1 set and be evicted between segments.
    var sums = F32Ptr(unsafe_from_address=Int(stack_allocation[MANY_ROWS * LDS, Float32,
                                                               alignment=64]()))
    var p = p0
    while p < p1 and (p + 1) * NR <= m:
        var panel = wp.unsafe_offset(p * ps)
        if NP > 1 and not (p + NP <= p1 and (p + NP) * NR <= m):
            break  # AVX-512: a last single panel goes to the per-tile pass below
        var k0 = 0
        while True:
            var k1 = _seg_end[SEG](k0, k)
            var scale = Array[VN, NP](fill=VN(1.0))
            comptime for q in range(NP):
                scale[q] = _wscale[WF](panel.unsafe_offset(q * ps), k0)
            var r = 0
            var g = 0
            while r < n:
                var rs = _group_rows(n, g)
                var xg = x.unsafe_offset(r * ldx)
                var sg = sums.unsafe_offset(r * LDS)
                comptime for RS in range(3, MR + 1):
                    if rs == RS:
                        if g == 0:
                            _seg_group[RS, NP, WF, FEW_PF](xg, ldx, panel, ps, scale, k0, k1, sg, LDS)
                        else:
                            _seg_group[RS, NP, WF, 0](xg, ldx, panel, ps, scale, k0, k1, sg, LDS)
                r += rs
                g += 1
            k0 = k1
            if k0 >= k:
                break
        for i in range(n):
            comptime for q in range(NP):
                y.unsafe_store(i * ldy + p * NR + q * NR, sums.unsafe_load[width=NR](i * LDS + q * NR))
        p += NP
    while p < p1:  # a partial last panel (m not a multiple of NR), or one AVX-512 panel
        var r = 0
        var ncols = min(NR, m - p * NR)
        while r + MR <= n:
            _tile[MR, WF, SEG](x.unsafe_offset(r * ldx), ldx, wp.unsafe_offset(p * ps), k,
                               y.unsafe_offset(r * ldy + p * NR), ldy, ncols)
            r += MR
        comptime for R in range(1, MR):
            if n - r == R:
                _tile[R, WF, SEG](x.unsafe_offset(r * ldx), ldx, wp.unsafe_offset(p * ps), k,
                                  y.unsafe_offset(r * ldy + p * NR), ldy, ncols)
        p += 1


def matmul_block[WF: Int = WF_F32, SEG: Int = KSEG](
    x: F32Ptr,
    ldx: Int,
    r0: Int,
    r1: Int,
    wp: F32Ptr,
    k: Int,
    m: Int,
    p0: Int,
    p1: Int,
    y: F32Ptr,
    ldy: Int,
):
    """Rows [r0, r1) x panels [p0, p1) of y = x @ W^T, W packed (m, k), in
    the order SEG (module docstring)."""
    comptime if WIDE:
        if r1 - r0 == 8:  # a batch-8 step in one pass over the weights
            _rows_few[8, WF, SEG](x.unsafe_offset(r0 * ldx), ldx, wp, k, m, p0, p1,
                             y.unsafe_offset(r0 * ldy), ldy)
            return
    # A batched decode step (AVX2 batch 8: per segment 4 rows, prefetching,
    # then 4 more on its weights in L1; was 4 rows over all the panels,
    # then 4 more from L2: in_proj and out_proj of a d = 768 step 0.88-0.93x
    # the time)
    if r1 - r0 > MR and r1 - r0 <= MANY_ROWS:
        _rows_many[WF, SEG](x.unsafe_offset(r0 * ldx), ldx, r1 - r0, wp, k, m, p0, p1,
                            y.unsafe_offset(r0 * ldy), ldy)
        return
    comptime if WF != WF_F32 and SEG == KSEG and SLABS:
        _rows_slabs[WF](x, ldx, r0, r1, wp, k, m, p0, p1, y, ldy)
        return
    var full = r0 + (r1 - r0) // MR * MR
    var p = p0
    while p < p1:
        var panel = wp.unsafe_offset(p * panel_floats[WF](k))
        var col = p * NR
        var r = r0
        if TP > 1 and p + TP <= p1 and (p + TP) * NR <= m:
            while r < full:
                _tile_panels[MR, TP, WF, 0, SEG](x.unsafe_offset(r * ldx), ldx, panel, k,
                                         y.unsafe_offset(r * ldy + col), ldy)
                r += MR
            p += TP
        else:
            var ncols = min(NR, m - col)
            while r < full:
                _tile[MR, WF, SEG](x.unsafe_offset(r * ldx), ldx, panel, k,
                              y.unsafe_offset(r * ldy + col), ldy, ncols)
                r += MR
            p += 1
    _rows_left[WF, SEG](x, ldx, full, r1, wp, k, m, p0, p1, y, ldy)


def _rows_left[WF: Int, SEG: Int](
    x: F32Ptr, ldx: Int, r0: Int, r1: Int, wp: F32Ptr, k: Int, m: Int, p0: Int, p1: Int,
    y: F32Ptr, ldy: Int,
):
    """The leftover rows [r0, r1) of a row block (fewer than MR) over panels
    [p0, p1): all of them in one pass over the panels."""
    var xr = x.unsafe_offset(r0 * ldx)
    var yr = y.unsafe_offset(r0 * ldy)
    comptime for R in range(1, MR):
        if r1 - r0 == R:
            _rows_few[R, WF, SEG](xr, ldx, wp, k, m, p0, p1, yr, ldy)


# k steps of one widened prefill slab (a multiple of KSEG: slab ends are
# segment ends): 768 steps are 48 KB of float32 on the stack, a d = 768
# in_proj panel in one slab, read from L2 by the row tiles as a float32
# panel is (256-step slabs, in L1: int8 in_proj 1.05x the time).
comptime KSLAB = 768
# The widened slabs: AVX2 CPU binaries only (AVX-512 keeps its 2-panel
# tiles; a GPU thread runs one task and has no 48 KB of stack to spare).
comptime SLABS = not WIDE and not is_defined["GPU_API"]()


@always_inline
def _expand_slab[WF: Int](panel: F32Ptr, kb: Int, ke: Int, dst: F32Ptr):
    """Steps [kb, ke) of a panel in format WF as float32, k-major from
    dst (each weight widened exactly, as the tiles widen it on load)."""
    var k0 = kb
    while k0 < ke:
        var k1 = min(k0 + KSEG, ke)
        var scale = _wscale[WF](panel, k0)
        comptime for h in range(_parts[WF]()):
            for kk in range(_part_start[WF, h](k0, k1), _part_end[WF, h](k0, k1)):
                dst.unsafe_store((kk - kb) * NR, _wload[WF, h](panel, kk, k0, scale))
        k0 = k1


def _rows_slabs[WF: Int](
    x: F32Ptr, ldx: Int, r0: Int, r1: Int, wp: F32Ptr, k: Int, m: Int, p0: Int, p1: Int,
    y: F32Ptr, ldy: Int,
):
    """A prefill row block (more than MANY_ROWS rows; AVX2, the KSEG order)
    over panels [p0, p1): per panel and KSLAB-step slab, every 6-row tile
    in turn over the slab, its segments added to y as they end. A packed
    format's slab is widened once into a float32 slab on the stack and the
    tiles run the float32 kernel on it (the tiles widened it once per 6
    rows); a float32 slab would be read in place (matmul_block sends
    float32 panels to its own pass: slabs of them were slower). Each
    output's segments still run in ascending k from +0.0, so the bits are
    the segmented order's."""
    var buf = F32Ptr(unsafe_from_address=Int(stack_allocation[KSLAB * NR, Float32,
                                                              alignment=64]()))
    var full = r0 + (r1 - r0) // MR * MR
    var ps = panel_floats[WF](k)
    for p in range(p0, p1):
        var panel = wp.unsafe_offset(p * ps)
        var col = p * NR
        var ncols = min(NR, m - col)
        var kb = 0
        while True:  # k = 0: one empty slab, the tiles store +0.0
            var ke = min(k, kb + KSLAB)
            var src = panel
            comptime if WF != WF_F32:
                _expand_slab[WF](panel, kb, ke, buf)
                src = buf.unsafe_offset(-kb * NR)  # step kk at (kk - kb) * NR
            var r = r0
            while r < full:
                _tile[MR, WF_F32, KSEG](x.unsafe_offset(r * ldx), ldx, src, ke,
                                        y.unsafe_offset(r * ldy + col), ldy, ncols, kb)
                r += MR
            kb = ke
            if kb >= k:
                break
    _rows_left[WF, KSEG](x, ldx, full, r1, wp, k, m, p0, p1, y, ldy)


# Task grid for one matmul phase: row blocks x panel blocks. A task runs its
# panels over all its row tiles, so a panel (k x 16 floats, 48-96 KB at
# d = 768: larger than L1) is fetched from L3 once per row block and then
# served by L2 to the block's other tiles. 192 rows (32 tiles) instead of 48
# made the AVX2 binary's d = 768 projections 1.10x faster (single thread,
# 256- and 1024-row chunks: in_proj 80 -> 88-91 GFLOP/s; AVX-512 within
# noise): its 6 x 16 tile issues a load per 1.5 fmas and stalls more on
# panels that come from L3. The grid never decides bits.
comptime ROW_BLOCK = 192
comptime PANEL_BLOCK = 4


def matmul_ntasks(rows: Int, m: Int) -> Int:
    return ceil_div(rows, ROW_BLOCK) * ceil_div(ceil_div(m, NR), PANEL_BLOCK)


@always_inline
def _row_block[WF: Int](rows: Int) -> Int:
    """Rows of each row block but the last. Packed formats with the widened
    slabs: the ceil(rows / ROW_BLOCK) blocks of nearly equal size, a
    multiple of MR (256 rows: 132 + 124, not 192 + 64, whose 64-row block
    took the decode pass and widened its weights once per row group);
    float32: ROW_BLOCK (the balanced blocks measured 0.94-1.08x on one
    thread, not shown better)."""
    comptime if WF != WF_F32 and SLABS:
        return round_up(ceil_div(rows, ceil_div(rows, ROW_BLOCK)), MR)
    return ROW_BLOCK


struct TileRange(ImplicitlyCopyable):
    """Rows [r0, r1) and output columns [c0, c1) one matmul task covers."""
    var r0: Int
    var r1: Int
    var c0: Int
    var c1: Int

    def __init__(out self, r0: Int, r1: Int, c0: Int, c1: Int):
        self.r0 = r0
        self.r1 = r1
        self.c0 = c0
        self.c1 = c1


def matmul_task[WF: Int = WF_F32, SEG: Int = ONE_CHAIN](
    task: Int, x: F32Ptr, ldx: Int, rows: Int, wp: F32Ptr, k: Int, m: Int,
    y: F32Ptr, ldy: Int,
) -> TileRange:
    """Run task `task` of the (row block, panel block) grid. SEG defaults to
    ONE_CHAIN, the backward passes' activation products (transposed panels);
    a forward product (or its recompute) passes KSEG or calls
    matmul_task_wf."""
    var npanels = ceil_div(m, NR)
    var npb = ceil_div(npanels, PANEL_BLOCK)
    var rb = _row_block[WF](rows)
    var r0 = min(rows, (task // npb) * rb)
    var r1 = min(rows, r0 + rb)
    var p0 = (task % npb) * PANEL_BLOCK
    var p1 = min(npanels, p0 + PANEL_BLOCK)
    matmul_block[WF, SEG](x, ldx, r0, r1, wp, k, m, p0, p1, y, ldy)
    return TileRange(r0, r1, p0 * NR, min(m, p1 * NR))


def matmul_task_wf(
    wf: Int, task: Int, x: F32Ptr, ldx: Int, rows: Int, wp: F32Ptr, k: Int, m: Int,
    y: F32Ptr, ldy: Int,
) -> TileRange:
    """A forward product (canonical order, KSEG segments) on panels in the
    run-time weight format wf."""
    if wf == WF_BF16:
        return matmul_task[WF_BF16, KSEG](task, x, ldx, rows, wp, k, m, y, ldy)
    if wf == WF_INT8:
        return matmul_task[WF_INT8, KSEG](task, x, ldx, rows, wp, k, m, y, ldy)
    if wf == WF_Q4_0:
        return matmul_task[WF_Q4_0, KSEG](task, x, ldx, rows, wp, k, m, y, ldy)
    if wf == WF_Q8_0:
        return matmul_task[WF_Q8_0, KSEG](task, x, ldx, rows, wp, k, m, y, ldy)
    return matmul_task[WF_F32, KSEG](task, x, ldx, rows, wp, k, m, y, ldy)
