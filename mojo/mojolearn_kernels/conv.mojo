"""Causal depthwise convolution (kernel 4, with bias) followed by SiLU.

Tap k = 0..3 reads position t-3+k (oldest first); the four rows before the
first new token come from the carried window. Canonical order per channel:
    acc = bias; for k in 0..3: acc = fma(w_k, s_k, acc); dst = silu(acc)
Vectorized across channels only, so the bits do not depend on the width.
"""
from .abi import F32Ptr
from .numerics import silu_f32


@always_inline
def _conv_lanes[W: Int](
    window: F32Ptr, ldw: Int, inp: F32Ptr, ldi: Int, n: Int,
    wt: F32Ptr, ldt: Int, bias: F32Ptr, dst: F32Ptr, ldo: Int,
):
    comptime V = SIMD[DType.float32, W]
    var s0 = window.unsafe_load[width=W](0)
    var s1 = window.unsafe_load[width=W](ldw)
    var s2 = window.unsafe_load[width=W](2 * ldw)
    var s3 = window.unsafe_load[width=W](3 * ldw)
    var w0 = wt.unsafe_load[width=W](0)
    var w1 = wt.unsafe_load[width=W](ldt)
    var w2 = wt.unsafe_load[width=W](2 * ldt)
    var w3 = wt.unsafe_load[width=W](3 * ldt)
    var b = bias.unsafe_load[width=W](0)
    for j in range(n):
        s0 = s1
        s1 = s2
        s2 = s3
        s3 = inp.unsafe_load[width=W](j * ldi)
        var acc = w0.fma(s0, b)
        acc = w1.fma(s1, acc)
        acc = w2.fma(s2, acc)
        acc = w3.fma(s3, acc)
        dst.unsafe_store(j * ldo, silu_f32[W](acc))
    window.unsafe_store(0, s0)
    window.unsafe_store(ldw, s1)
    window.unsafe_store(2 * ldw, s2)
    window.unsafe_store(3 * ldw, s3)


def causal_conv_silu(
    window: F32Ptr, ldw: Int, inp: F32Ptr, ldi: Int, n: Int,
    wt: F32Ptr, ldt: Int, bias: F32Ptr, c0: Int, c1: Int,
    dst: F32Ptr, ldo: Int,
):
    """Channels [c0, c1) of n new rows; updates the window in place.

    window: 4 rows (oldest first) of stride ldw; inp: n rows of stride ldi;
    wt: 4 tap rows of stride ldt; dst: n rows of stride ldo. All pointers
    are at channel 0.
    """
    comptime W = 16
    var c = c0
    while c + W <= c1:
        _conv_lanes[W](window.unsafe_offset(c), ldw, inp.unsafe_offset(c), ldi,
                       n, wt.unsafe_offset(c), ldt, bias.unsafe_offset(c),
                       dst.unsafe_offset(c), ldo)
        c += W
    while c < c1:
        _conv_lanes[1](window.unsafe_offset(c), ldw, inp.unsafe_offset(c), ldi,
                       n, wt.unsafe_offset(c), ldt, bias.unsafe_offset(c),
                       dst.unsafe_offset(c), ldo)
        c += 1
