"""Input checks done in the binary, so the Python layer needs no NumPy."""
from std.memory import bitcast
from .abi import F32Ptr, I64Ptr, arg_int, arg_f32, arg_i64

# OP_FIRST_NONFINITE argument slots: the array is (B, L, inner); with
# lengths, only rows' real positions t < lengths[b] are checked.
comptime NF_PTR = 0
comptime NF_B = 1
comptime NF_L = 2
comptime NF_INNER = 3
comptime NF_LENGTHS = 4
comptime NF_OUT = 5  # Int64: first flat index of a NaN or inf, or -1


@always_inline
def first_nonfinite(p: F32Ptr, n: Int) -> Int:
    comptime W = 16
    comptime EXP = SIMD[DType.uint32, W](0x7F800000)
    var i = 0
    while i + W <= n:
        var bits = bitcast[DType.uint32, W](p.unsafe_load[width=W](i))
        if (bits & EXP).eq(EXP).reduce_or():
            break
        i += W
    while i < n:
        var bits = bitcast[DType.uint32, 1](p[unsafe_offset=i])
        if (bits & 0x7F800000) == 0x7F800000:
            return i
        i += 1
    return -1


def first_nonfinite_task(args: I64Ptr):
    var p = arg_f32(args, NF_PTR)
    var b = arg_int(args, NF_B)
    var l = arg_int(args, NF_L)
    var inner = arg_int(args, NF_INNER)
    var ragged = arg_int(args, NF_LENGTHS) != 0
    var lens = arg_i64(args, NF_LENGTHS)
    var dst = arg_i64(args, NF_OUT)
    dst[unsafe_offset=0] = -1
    for bb in range(b):
        var n = l
        if ragged:
            n = Int(lens[unsafe_offset=bb])
        var base = bb * l * inner
        var i = first_nonfinite(p.unsafe_offset(base), n * inner)
        if i >= 0:
            dst[unsafe_offset=0] = Int64(base + i)
            return
