"""The canonical 128-long dot product of Mamba-3 (q . k, q . h rows) and the
batched forms the forward and backward use. Every form gives each result by
the same lane chains (lane l sums n = l, l + 16, ..., l + 112 in order with
fma) and the same halving tree (lane_tree.tree16): batching only decides
how many chains are in flight and how often a loaded vector is reused, never
an order. So one dot gives the same bits whichever function computed it."""
from std.collections import Array
from .abi import F32Ptr
from .linear import WIDE
from .lane_tree import reduce_many, tree16

comptime V16 = SIMD[DType.float32, 16]
comptime V4 = SIMD[DType.float32, 4]
# Rows of a per grid block: 4 x 4 chains of 16 lanes need 16 + 5 of the 32
# AVX-512 registers; with 16 AVX2 registers one row at a time.
comptime GRID_T = 4 if WIDE else 1


@always_inline
def lane_dot[C: Int](a: F32Ptr, b: F32Ptr) -> Float32:
    """Dot product of 16 C floats in the canonical order: lane l = fma chain
    over n = l + 16 c, c = 0..C-1 ascending, then tree16 (C = 8: dot128;
    C = 4: the 64-long dots of Mamba-3's head rows)."""
    var acc = V16(0.0)
    comptime for c in range(C):
        acc = a.unsafe_load[width=16](c * 16).fma(b.unsafe_load[width=16](c * 16), acc)
    return tree16(acc)


@always_inline
def dot128(a: F32Ptr, b: F32Ptr) -> Float32:
    """Canonical 128-long dot product (lane_dot over 8 chunks of 16)."""
    return lane_dot[8](a, b)


@always_inline
def dot128_many[M: Int](a: F32Ptr, b: F32Ptr, stride: Int) -> SIMD[DType.float32, M]:
    """Lane m = dot128(a, b + m * stride), M in {4, 8, 16}: the same chains,
    reduced M at a time by the same tree (lane_tree.reduce_many)."""
    var acc = Array[V16, M](fill=V16(0.0))
    comptime for c in range(8):
        var av = a.unsafe_load[width=16](c * 16)
        comptime for m in range(M):
            acc[m] = av.fma(b.unsafe_load[width=16](m * stride + c * 16), acc[m])
    return reduce_many[M](acc)


def dot128_into(a: F32Ptr, b: F32Ptr, stride: Int, n: Int, dst: F32Ptr):
    """dst[m] = dot128(a, b + m * stride) for m < n, 16, 4, then 1 at a time."""
    var m = 0
    while m + 16 <= n:
        dst.unsafe_store(m, dot128_many[16](a, b.unsafe_offset(m * stride), stride))
        m += 16
    while m + 4 <= n:
        dst.unsafe_store(m, dot128_many[4](a, b.unsafe_offset(m * stride), stride))
        m += 4
    while m < n:
        dst[unsafe_offset=m] = dot128(a, b.unsafe_offset(m * stride))
        m += 1


@always_inline
def dots128x4(a: F32Ptr, sa: Int, b: F32Ptr, sb: Int) -> V4:
    """dot128(a + q sa, b + q sb) for q = 0..3 (a stride may be 0)."""
    return lane_dots_x4[8](a, sa, b, sb)


@always_inline
def lane_dots_x4[C: Int](a: F32Ptr, sa: Int, b: F32Ptr, sb: Int) -> V4:
    """lane_dot[C](a + q sa, b + q sb) for q = 0..3 (a stride may be 0): four
    chains in flight, as one alone is fma-latency bound."""
    var acc = Array[V16, 4](fill=V16(0.0))
    comptime for c in range(C):
        comptime for q in range(4):
            acc[q] = a.unsafe_load[width=16](q * sa + c * 16).fma(
                b.unsafe_load[width=16](q * sb + c * 16), acc[q])
    var r = V4(0.0)
    comptime for q in range(4):
        r[q] = tree16(acc[q])
    return r


@always_inline
def dots128_block[T: Int](a: F32Ptr, sa: Int, b: F32Ptr, sb: Int, dst: F32Ptr, so: Int):
    """dst[t so + q] = dot128(a + t sa, b + q sb), t < T, q < 4: 4 T chains in
    flight, each loaded vector used T or 4 times."""
    var acc = Array[V16, 4 * T](fill=V16(0.0))
    comptime for c in range(8):
        var av = Array[V16, T](fill=V16(0.0))
        comptime for t in range(T):
            av[t] = a.unsafe_load[width=16](t * sa + c * 16)
        comptime for q in range(4):
            var bv = b.unsafe_load[width=16](q * sb + c * 16)
            comptime for t in range(T):
                acc[q * T + t] = av[t].fma(bv, acc[q * T + t])
    comptime for t in range(T):
        var row = Array[V16, 4](fill=V16(0.0))
        comptime for q in range(4):
            row[q] = acc[q * T + t]
        dst.unsafe_store(t * so, reduce_many[4](row))


def dots128_grid(a: F32Ptr, sa: Int, na: Int, b: F32Ptr, sb: Int, nb: Int,
                 dst: F32Ptr, ld: Int):
    """dst[t ld + m] = dot128(a + t sa, b + m sb) for t < na, m < nb: blocks
    of GRID_T x 4, then the edges one dot row at a time."""
    var t = 0
    while t + GRID_T <= na:
        var at = a.unsafe_offset(t * sa)
        var m = 0
        while m + 4 <= nb:
            dots128_block[GRID_T](at, sa, b.unsafe_offset(m * sb), sb,
                                  dst.unsafe_offset(t * ld + m), ld)
            m += 4
        for tt in range(GRID_T):
            for mm in range(m, nb):
                dst[unsafe_offset=(t + tt) * ld + mm] = dot128(
                    at.unsafe_offset(tt * sa), b.unsafe_offset(mm * sb))
        t += GRID_T
    while t < na:
        dot128_into(a.unsafe_offset(t * sa), b, sb, nb, dst.unsafe_offset(t * ld))
        t += 1
