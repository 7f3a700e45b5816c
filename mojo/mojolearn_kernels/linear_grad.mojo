"""Strided matrix products for backward passes: out[i, j] (+)= sum_k a(i, k) M[k, j].

a(i, k) = A[i * sai + k * sak] (so A or A^T, any row stride), M row-major
with row stride ldm (read unpacked: row k, 16 contiguous columns at a time).

Canonical order (identical mode): every output element is one sequential
fma chain over k in ascending order, starting from +0.0, or, with
`accumulate`, from the value already in `out` (so successive calls over
consecutive k ranges continue one single chain):
    acc = 0 or out[i, j]; for k in 0..K-1: acc = fma(a(i, k), M[k, j], acc)
Vectorized across 16 output columns only; the k axis is never split or
reordered, so the bits do not depend on tile shapes or the thread split.
"""
from std.collections import Array
from std.sys.intrinsics import prefetch, PrefetchOptions
from .abi import (
    F32Ptr, I64Ptr, ALIGN_FLOATS, arg_int, arg_f32, ceil_div, round_up, one_phase_plan,
)
from .linear import TileRange, NR, WIDE, packed_floats, pack_panel

comptime GW = 16
comptime GV = SIMD[DType.float32, GW]
comptime GMR = 6
comptime G_ROW_BLOCK = 48
comptime G_COL_BLOCK = 64
# Panels per register tile: AVX2 has 16 vector registers (6 rows x 1 panel
# = 12 ymm; two panels would spill), AVX-512 has 32 (6 x 2 = 12 zmm, the
# forward's tile too). The tile never changes a chain, so never a bit.
comptime GNP = 2 if WIDE else 1


@always_inline
def _gtile[R: Int, NP: Int](
    a: F32Ptr, sai: Int, sak: Int, m: F32Ptr, ldm: Int, k: Int,
    dst: F32Ptr, ldo: Int, accumulate: Bool,
):
    """R rows x NP * 16 full columns; a, m, out at the tile origin."""
    var acc = Array[GV, R * NP](fill=GV(0.0))
    if accumulate:
        comptime for i in range(R):
            comptime for q in range(NP):
                acc[i * NP + q] = dst.unsafe_load[width=GW](i * ldo + q * GW)
    for kk in range(k):
        comptime for q in range(NP):
            var mv = m.unsafe_load[width=GW](kk * ldm + q * GW)
            comptime for i in range(R):
                acc[i * NP + q] = GV(a[unsafe_offset=i * sai + kk * sak]).fma(mv, acc[i * NP + q])
    comptime for i in range(R):
        comptime for q in range(NP):
            dst.unsafe_store(i * ldo + q * GW, acc[i * NP + q])


@always_inline
def _gcol(
    a: F32Ptr, sai: Int, sak: Int, m: F32Ptr, ldm: Int, k: Int,
    dst: F32Ptr, ldo: Int, accumulate: Bool, nrows: Int,
):
    """One column (scalar), nrows rows: the column tail."""
    for i in range(nrows):
        var acc: Float32 = 0.0
        if accumulate:
            acc = dst[unsafe_offset=i * ldo]
        for kk in range(k):
            acc = a[unsafe_offset=i * sai + kk * sak].fma(m[unsafe_offset=kk * ldm], acc)
        dst[unsafe_offset=i * ldo] = acc


@always_inline
def _gpanels[NP: Int](
    a: F32Ptr, sai: Int, sak: Int, m: F32Ptr, ldm: Int, k: Int,
    dst: F32Ptr, ldo: Int, accumulate: Bool, i0: Int, i1: Int, j: Int,
):
    var i = i0
    while i + GMR <= i1:
        # The next tile's output rows: with a short k (64 rows of a chunk at
        # B = 1) the accumulate loads are far from the tile's compute, and
        # the weight gradient is too big for the caches.
        var nx = dst.unsafe_offset((i + GMR) * ldo + j)
        for r in range(min(GMR, i1 - i - GMR)):
            comptime for q in range(NP):
                prefetch[PrefetchOptions().for_write().high_locality()](
                    nx.unsafe_offset(r * ldo + q * GW))
        _gtile[GMR, NP](a.unsafe_offset(i * sai), sai, sak, m.unsafe_offset(j), ldm, k,
                        dst.unsafe_offset(i * ldo + j), ldo, accumulate)
        i += GMR
    var rem = i1 - i
    var ap = a.unsafe_offset(i * sai)
    var mp = m.unsafe_offset(j)
    var op = dst.unsafe_offset(i * ldo + j)
    if rem == 5:
        _gtile[5, NP](ap, sai, sak, mp, ldm, k, op, ldo, accumulate)
    elif rem == 4:
        _gtile[4, NP](ap, sai, sak, mp, ldm, k, op, ldo, accumulate)
    elif rem == 3:
        _gtile[3, NP](ap, sai, sak, mp, ldm, k, op, ldo, accumulate)
    elif rem == 2:
        _gtile[2, NP](ap, sai, sak, mp, ldm, k, op, ldo, accumulate)
    elif rem == 1:
        _gtile[1, NP](ap, sai, sak, mp, ldm, k, op, ldo, accumulate)


def gemm_block(
    a: F32Ptr, sai: Int, sak: Int, m: F32Ptr, ldm: Int, k: Int,
    dst: F32Ptr, ldo: Int, accumulate: Bool, i0: Int, i1: Int, j0: Int, j1: Int,
):
    """Rows [i0, i1) x columns [j0, j1) of out (+)= a @ M."""
    var j = j0
    comptime if GNP > 1:
        while j + GNP * GW <= j1:
            _gpanels[GNP](a, sai, sak, m, ldm, k, dst, ldo, accumulate, i0, i1, j)
            j += GNP * GW
    while j + GW <= j1:
        _gpanels[1](a, sai, sak, m, ldm, k, dst, ldo, accumulate, i0, i1, j)
        j += GW
    while j < j1:
        _gcol(a.unsafe_offset(i0 * sai), sai, sak, m.unsafe_offset(j), ldm, k,
              dst.unsafe_offset(i0 * ldo + j), ldo, accumulate, i1 - i0)
        j += 1


def gemm_ntasks(nrows: Int, ncols: Int) -> Int:
    return ceil_div(nrows, G_ROW_BLOCK) * ceil_div(ncols, G_COL_BLOCK)


def gemm_task(
    task: Int, a: F32Ptr, sai: Int, sak: Int, m: F32Ptr, ldm: Int, k: Int,
    dst: F32Ptr, ldo: Int, nrows: Int, ncols: Int, accumulate: Bool,
) -> TileRange:
    """Task `task` of the (row block, column block) grid of out (nrows, ncols)."""
    var ncb = ceil_div(ncols, G_COL_BLOCK)
    var i0 = (task // ncb) * G_ROW_BLOCK
    var i1 = min(nrows, i0 + G_ROW_BLOCK)
    var j0 = (task % ncb) * G_COL_BLOCK
    var j1 = min(ncols, j0 + G_COL_BLOCK)
    gemm_block(a, sai, sak, m, ldm, k, dst, ldo, accumulate, i0, i1, j0, j1)
    return TileRange(i0, i1, j0, j1)


def pack_panels_t(w: F32Ptr, k: Int, m: Int, dst: F32Ptr, p: Int):
    """Panel p of W^T, for row-major W (k, m), in linear.mojo's packed form of
    the (m, k) matrix W^T: dst[p, kk, j] = W[kk, p * NR + j] (zero past m).
    Then x @ W runs on linear.matmul_block: per element the same fma chain
    over kk ascending from +0.0 as gemm_block's, at the forward's speed."""
    pack_panel(w, m, k, 1, m, p, dst.unsafe_offset(p * k * NR))


# OP_PACK_TRANSPOSED: the transposes of two row-major matrices W1 (k1, m1)
# and W2 (k2, m2) in linear.mojo's panels, for a backward's activation
# products x @ W (Mamba-2/3: W1 = in_proj.weight, W2 = out_proj.weight).
comptime PT_K1 = 0
comptime PT_M1 = 1
comptime PT_W1 = 2
comptime PT_K2 = 3
comptime PT_M2 = 4
comptime PT_W2 = 5
comptime PT_DST = 6


struct TPanels(ImplicitlyCopyable):
    """Offsets (floats) of W1^T (m1, k1) and W2^T (m2, k2) panels: W1^T's
    first (offset 0), W2^T's at o2; floats in all."""
    var o2: Int
    var floats: Int

    def __init__(out self, k1: Int, m1: Int, k2: Int, m2: Int):
        self.o2 = round_up(packed_floats(m1, k1), ALIGN_FLOATS)
        self.floats = self.o2 + packed_floats(m2, k2)


def pack_transposed_plan(args: I64Ptr, phase: Int) -> Int:
    var m1 = arg_int(args, PT_M1)
    var m2 = arg_int(args, PT_M2)
    var floats = TPanels(arg_int(args, PT_K1), m1, arg_int(args, PT_K2), m2).floats
    return one_phase_plan(phase, ceil_div(m1, NR) + ceil_div(m2, NR), floats * 4)  # a task a panel


def pack_transposed_task(args: I64Ptr, phase: Int, task: Int):
    var k1 = arg_int(args, PT_K1)
    var m1 = arg_int(args, PT_M1)
    var k2 = arg_int(args, PT_K2)
    var m2 = arg_int(args, PT_M2)
    var pl = TPanels(k1, m1, k2, m2)
    var dst = arg_f32(args, PT_DST)
    var n1 = ceil_div(m1, NR)
    if task < n1:
        pack_panels_t(arg_f32(args, PT_W1), k1, m1, dst, task)
    else:
        pack_panels_t(arg_f32(args, PT_W2), k2, m2, dst.unsafe_offset(pl.o2), task - n1)
