"""Small memory helpers shared by the kernels.

ld16 / st16 (and ld_lanes / st_lanes, whose mask is a compile-time choice)
move 16 float32 lanes of a channel block whose last block may be partial:
past the nv valid lanes a load reads +0.0 and a store writes nothing. Each
lane is its own channel wherever they are used, so where a block ends
never changes a bit.
"""
from .abi import F32Ptr

comptime LANES = 16
comptime LV = SIMD[DType.float32, LANES]


@always_inline
def ld_lanes[MASKED: Bool](p: F32Ptr, off: Int, nv: Int) -> LV:
    """16 lanes from p[off:]; MASKED: lanes >= nv read as +0.0."""
    comptime if not MASKED:
        return p.unsafe_load[width=LANES](off)
    var v = LV(0.0)
    for j in range(nv):
        v[j] = p[unsafe_offset=off + j]
    return v


@always_inline
def st_lanes[MASKED: Bool](p: F32Ptr, off: Int, v: LV, nv: Int):
    """v into p[off:]; MASKED: only lanes < nv."""
    comptime if not MASKED:
        p.unsafe_store(off, v)
        return
    for j in range(nv):
        p[unsafe_offset=off + j] = v[j]


@always_inline
def ld16(p: F32Ptr, off: Int, nv: Int) -> LV:
    """16 lanes from p[off:], lanes >= nv read as +0.0."""
    if nv == LANES:
        return ld_lanes[False](p, off, nv)
    return ld_lanes[True](p, off, nv)


@always_inline
def st16(p: F32Ptr, off: Int, v: LV, nv: Int):
    """Lanes < nv of v into p[off:]."""
    if nv == LANES:
        st_lanes[False](p, off, v, nv)
    else:
        st_lanes[True](p, off, v, nv)


@always_inline
def copy_floats(src: F32Ptr, dst: F32Ptr, n: Int):
    """dst[i] = src[i] for i < n (no overlap), 16 at a time: the one copy
    helper of the kernels."""
    var j = 0
    while j + LANES <= n:
        dst.unsafe_store(j, src.unsafe_load[width=LANES](j))
        j += LANES
    while j < n:
        dst[unsafe_offset=j] = src[unsafe_offset=j]
        j += 1


# State <-> workspace layouts: a state keeps k values per channel together
# ((n, k) rows, channel-major: the conv window's taps, Mamba-1's h), the
# kernels want k rows of n channels. Pure copies: no bit can move.


def transpose_in(src: F32Ptr, k: Int, n: Int, dst: F32Ptr):
    """dst[j * n + c] = src[c * k + j] (c < n, j < k). k = 4 (the conv
    window): 8 channels per step by two deinterleaves; otherwise 16
    channels gathered per vector store."""
    var c = 0
    if k == 4:
        while c + 8 <= n:
            var v = src.unsafe_load[width=32](c * 4).deinterleave()
            var k02 = v[0].deinterleave()  # taps 0 and 2 of the 8 channels
            var k13 = v[1].deinterleave()
            dst.unsafe_store(c, k02[0])
            dst.unsafe_store(n + c, k13[0])
            dst.unsafe_store(2 * n + c, k02[1])
            dst.unsafe_store(3 * n + c, k13[1])
            c += 8
    else:
        while c + LANES <= n:
            for j in range(k):
                var v = LV(0.0)
                comptime for i in range(LANES):
                    v[i] = src[unsafe_offset=(c + i) * k + j]
                dst.unsafe_store(j * n + c, v)
            c += LANES
    for cc in range(c, n):
        for j in range(k):
            dst[unsafe_offset=j * n + cc] = src[unsafe_offset=cc * k + j]


def transpose_out(src: F32Ptr, k: Int, n: Int, dst: F32Ptr):
    """dst[c * k + j] = src[j * n + c]: the inverse of transpose_in (k = 4:
    8 channels per step by interleaves; otherwise 16 read per vector load)."""
    var c = 0
    if k == 4:
        while c + 8 <= n:
            var k0 = src.unsafe_load[width=8](c)
            var k1 = src.unsafe_load[width=8](n + c)
            var k2 = src.unsafe_load[width=8](2 * n + c)
            var k3 = src.unsafe_load[width=8](3 * n + c)
            dst.unsafe_store(c * 4, k0.interleave(k2).interleave(k1.interleave(k3)))
            c += 8
    else:
        while c + LANES <= n:
            for j in range(k):
                var v = src.unsafe_load[width=LANES](j * n + c)
                comptime for i in range(LANES):
                    dst[unsafe_offset=(c + i) * k + j] = v[i]
            c += LANES
    for cc in range(c, n):
        for j in range(k):
            dst[unsafe_offset=cc * k + j] = src[unsafe_offset=j * n + cc]
