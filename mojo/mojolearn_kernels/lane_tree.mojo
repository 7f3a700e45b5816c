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
from std.utils import IndexList

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
def _level_mask[S: Int, HI: Bool]() -> IndexList[KL]:
    """Lanes of (a, b) (b's from KL on) holding the first (HI: second) S
    partial sums of each output: its groups of 2 S lanes, halved."""
    var m = IndexList[KL]()
    for i in range(KL):
        m[i] = 2 * S * (i // S) + i % S + (S if HI else 0)
    return m


@always_inline
def _level[S: Int](a: VK, b: VK) -> VK:
    """One tree level over a then b: outputs of 2 S partial sums each ->
    outputs of S, s_l + s_l+S (S = 8: a_l + a_l+8 (l < 8), then b's)."""
    return a.shuffle[_level_mask[S, False]()](b) + a.shuffle[_level_mask[S, True]()](b)


@always_inline
def reduce_many[M: Int](acc: Array[VK, M]) -> SIMD[DType.float32, M]:
    """Lane c = tree16(acc[c]) for M in {4, 8, 16}."""
    comptime assert M == 4 or M == 8 or M == 16, "M must be 4, 8 or 16"
    comptime if M == 16:
        var z0 = _level[2](_level[4](_level[8](acc[0], acc[1]), _level[8](acc[2], acc[3])),
                           _level[4](_level[8](acc[4], acc[5]), _level[8](acc[6], acc[7])))
        var z1 = _level[2](_level[4](_level[8](acc[8], acc[9]), _level[8](acc[10], acc[11])),
                           _level[4](_level[8](acc[12], acc[13]), _level[8](acc[14], acc[15])))
        return rebind[SIMD[DType.float32, M]](_level[1](z0, z1))
    elif M == 8:
        var z = _level[2](_level[4](_level[8](acc[0], acc[1]), _level[8](acc[2], acc[3])),
                          _level[4](_level[8](acc[4], acc[5]), _level[8](acc[6], acc[7])))
        return rebind[SIMD[DType.float32, M]](_level[1](z, z).slice[8, offset=0]())
    else:
        var w = _level[4](_level[8](acc[0], acc[1]), _level[8](acc[2], acc[3]))
        return rebind[SIMD[DType.float32, M]](_level[1](_level[2](w, w), w).slice[4, offset=0]())
