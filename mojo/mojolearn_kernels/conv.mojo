"""Causal depthwise convolution (kernel 4, with bias) followed by SiLU.

Tap k = 0..3 reads position t-3+k (oldest first); the rows before the
first new token come from the carried window. Canonical order per channel:
    acc = bias; for k in 0..3: acc = fma(w_k, s_k, acc); dst = silu(acc)
Vectorized across channels only, so the bits do not depend on the width.
The forward ops and the backwards' recomputes all run conv_silu.
"""
from .abi import F32Ptr
from .numerics import silu_f32


@always_inline
def _conv_lanes[W: Int, KEEP_PRE: Bool](
    window: F32Ptr, ldw: Int, inp: F32Ptr, ldi: Int, n: Int,
    wt: F32Ptr, ldt: Int, bias: F32Ptr, dst: F32Ptr, ldo: Int,
    win_out: F32Ptr, save: Bool, pre: F32Ptr,
):
    comptime V = SIMD[DType.float32, W]
    var s0 = V(0.0)  # window row 0: the first token shifts it out unread
    if n == 0:
        s0 = window.unsafe_load[width=W](0)
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
        comptime if KEEP_PRE:
            pre.unsafe_store(j * ldo, acc)
        dst.unsafe_store(j * ldo, silu_f32[W](acc))
    if save:
        win_out.unsafe_store(0, s0)
        win_out.unsafe_store(ldw, s1)
        win_out.unsafe_store(2 * ldw, s2)
        win_out.unsafe_store(3 * ldw, s3)


def conv_silu[KEEP_PRE: Bool = False](
    window: F32Ptr, ldw: Int, inp: F32Ptr, ldi: Int, n: Int,
    wt: F32Ptr, ldt: Int, bias: F32Ptr, c0: Int, c1: Int,
    dst: F32Ptr, ldo: Int, win_out: F32Ptr, save: Bool, pre: F32Ptr,
):
    """Channels [c0, c1) of n new rows.

    window: 4 rows (oldest first) of stride ldw before the first new row
    (row 0 is read only if n = 0: the first token shifts it out, so a
    caller may point window one row before 3 rows it has); inp: n rows of
    stride ldi; wt: 4 tap rows of stride ldt; dst (and pre, the output
    before the SiLU, if KEEP_PRE): n rows of stride ldo. If save, the last
    4 rows go to win_out (stride ldw; may be window: every load comes first).
    All pointers are at channel 0.
    """
    comptime W = 16
    var c = c0
    while c + W <= c1:
        _conv_lanes[W, KEEP_PRE](
            window.unsafe_offset(c), ldw, inp.unsafe_offset(c), ldi, n,
            wt.unsafe_offset(c), ldt, bias.unsafe_offset(c), dst.unsafe_offset(c), ldo,
            win_out.unsafe_offset(c), save, pre.unsafe_offset(c))
        c += W
    while c < c1:
        _conv_lanes[1, KEEP_PRE](
            window.unsafe_offset(c), ldw, inp.unsafe_offset(c), ldi, n,
            wt.unsafe_offset(c), ldt, bias.unsafe_offset(c), dst.unsafe_offset(c), ldo,
            win_out.unsafe_offset(c), save, pre.unsafe_offset(c))
        c += 1


def causal_conv_silu(
    window: F32Ptr, ldw: Int, inp: F32Ptr, ldi: Int, n: Int,
    wt: F32Ptr, ldt: Int, bias: F32Ptr, c0: Int, c1: Int,
    dst: F32Ptr, ldo: Int,
):
    """conv_silu updating the window in place."""
    conv_silu(window, ldw, inp, ldi, n, wt, ldt, bias, c0, c1, dst, ldo, window, True, dst)
