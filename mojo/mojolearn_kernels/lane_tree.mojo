"""The fixed 16-lane halving tree: a 16-lane partial-sum vector reduced as
lane l + lane l+8 (l < 8), then + 4, + 2, + 1 (tree16), and the same tree
for 4, 8 or 16 vectors at once with shuffles that add exactly the same
pairs (reduce_many). Used by the dot products that are split over 16
lanes: Mamba-3's 128-term dots (dot128.mojo), the backward's 64-term dots
(mamba3/backward_scan.mojo) and Mamba-1's dB/dC sums
(mamba1/backward_stages.mojo). The matrix products use linear.mojo's
segmented order instead (docs/numerics.md).
"""
from std.collections import Array

comptime KL = 16  # lanes
comptime VK = SIMD[DType.float32, KL]


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
