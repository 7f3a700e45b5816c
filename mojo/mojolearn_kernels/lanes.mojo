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
