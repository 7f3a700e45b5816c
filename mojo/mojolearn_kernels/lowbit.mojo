"""Packed projection weights (mojolearn.lowbit, docs/checkpoints.md).

Two ops over a row-major (rows, cols) matrix, one phase, each task a block
of whole rows (a pure function of its rows: the bits never depend on the
thread count or the task split):

OP_LOWBIT_PACK   float32 -> bfloat16 bit patterns (uint16) or int8 codes
                 plus one power-of-two exponent per row (int32).
OP_LOWBIT_UNPACK the exact widening back to float32.

bfloat16: subnormal inputs (exponent bits 0) flush to a zero of the same
sign; otherwise round to nearest, ties to even, on the low 16 bits. A finite
input that rounds to infinity sets aux[row] to its column (else -1) so the
caller can refuse it; NaN and infinity are refused by the caller before.

int8: with m = absmax of the row, e = max(floor(log2(m)) - 6, -149) (e =
-149 for an all-zero row), code = clamp(round_half_even(x * 2^-e), -127,
127); aux[row] = e. The floor at -149 keeps `code * 2^e` exactly
representable in float32 (only rows whose absmax is below 2^-143 are
affected). All of it is integer bit arithmetic or exact float64 products.
"""
from std.memory import Pointer, bitcast
from .abi import I64Ptr, PLAN_WORKSPACE, PHASE_END, arg_int, arg_f32, ceil_div

comptime U16Ptr = Pointer[UInt16, MutUntrackedOrigin]
comptime I8Ptr = Pointer[Int8, MutUntrackedOrigin]
comptime I32Ptr = Pointer[Int32, MutUntrackedOrigin]

comptime FMT_BF16 = 1
comptime FMT_INT8 = 2

# OP_LOWBIT_PACK slots
comptime PK_FMT = 0
comptime PK_SRC = 1  # float32 (rows, cols)
comptime PK_ROWS = 2
comptime PK_COLS = 3
comptime PK_DST = 4  # uint16 or int8 (rows, cols)
comptime PK_AUX = 5  # int32 (rows,): int8 exponent / bf16 first overflow column or -1

# OP_LOWBIT_UNPACK slots
comptime UP_FMT = 0
comptime UP_SRC = 1  # uint16 or int8 (rows, cols)
comptime UP_AUX = 2  # int32 (rows,) exponents (int8 only)
comptime UP_ROWS = 3
comptime UP_COLS = 4
comptime UP_DST = 5  # float32 (rows, cols)

comptime TASK_ELEMS = 65536
comptime E_MIN = -149


@always_inline
def _rows_per_task(cols: Int) -> Int:
    var c = cols if cols > 0 else 1
    var r = TASK_ELEMS // c
    return r if r > 0 else 1


@always_inline
def _pow2_f64(e: Int) -> Float64:
    """2^e exactly, for e in [-1022, 1023]."""
    return bitcast[DType.float64, 1](UInt64(e + 1023) << 52)


@always_inline
def bf16_bits(u: UInt32) -> UInt32:
    """float32 bits -> bfloat16 bits (subnormals flushed, ties to even)."""
    if (u & 0x7F800000) == 0:
        return (u >> 16) & 0x8000
    var lsb = (u >> 16) & 1
    return (u + 0x7FFF + lsb) >> 16


@always_inline
def int8_exponent(amax_bits: UInt32) -> Int:
    """e = max(floor(log2(m)) - 6, -149) from the bits of m = |absmax|."""
    if amax_bits == 0:
        return E_MIN
    var be = Int(amax_bits >> 23)
    var fl: Int
    if be > 0:
        fl = be - 127
    else:
        var m = Int(amax_bits & 0x7FFFFF)
        var top = 0
        while (m >> (top + 1)) != 0:
            top += 1
        fl = top - 149
    var e = fl - 6
    return e if e > E_MIN else E_MIN


def _pack_rows(args: I64Ptr, r0: Int, r1: Int):
    var fmt = arg_int(args, PK_FMT)
    var src = arg_f32(args, PK_SRC)
    var cols = arg_int(args, PK_COLS)
    var aux = I32Ptr(unsafe_from_address=arg_int(args, PK_AUX))
    comptime MAGIC = 6755399441055744.0  # 1.5 * 2^52: adding it rounds to an integer, ties to even
    if fmt == FMT_BF16:
        var dst = U16Ptr(unsafe_from_address=arg_int(args, PK_DST))
        for r in range(r0, r1):
            var first = -1
            for c in range(cols):
                var u = bitcast[DType.uint32, 1](src[unsafe_offset=r * cols + c])
                var b = bf16_bits(u)
                if (b & 0x7FFF) == 0x7F80 and first < 0:
                    first = c
                dst[unsafe_offset=r * cols + c] = UInt16(b)
            aux[unsafe_offset=r] = Int32(first)
    else:
        var dst = I8Ptr(unsafe_from_address=arg_int(args, PK_DST))
        for r in range(r0, r1):
            var amax: UInt32 = 0
            for c in range(cols):
                var u = bitcast[DType.uint32, 1](src[unsafe_offset=r * cols + c]) & 0x7FFFFFFF
                if u > amax:
                    amax = u
            var e = int8_exponent(amax)
            var scale = _pow2_f64(-e)
            for c in range(cols):
                var v = Float64(src[unsafe_offset=r * cols + c]) * scale  # exact
                var q = (v + MAGIC) - MAGIC
                if q > 127.0:
                    q = 127.0
                if q < -127.0:
                    q = -127.0
                dst[unsafe_offset=r * cols + c] = Int8(Int(q))
            aux[unsafe_offset=r] = Int32(e)


def _unpack_rows(args: I64Ptr, r0: Int, r1: Int):
    var fmt = arg_int(args, UP_FMT)
    var cols = arg_int(args, UP_COLS)
    var dst = arg_f32(args, UP_DST)
    if fmt == FMT_BF16:
        var src = U16Ptr(unsafe_from_address=arg_int(args, UP_SRC))
        for i in range(r0 * cols, r1 * cols):
            dst[unsafe_offset=i] = bitcast[DType.float32, 1](UInt32(src[unsafe_offset=i]) << 16)
    else:
        var src = I8Ptr(unsafe_from_address=arg_int(args, UP_SRC))
        var aux = I32Ptr(unsafe_from_address=arg_int(args, UP_AUX))
        for r in range(r0, r1):
            var s = _pow2_f64(Int(aux[unsafe_offset=r]))
            for c in range(cols):
                var v = Float64(Int(src[unsafe_offset=r * cols + c])) * s  # exact
                dst[unsafe_offset=r * cols + c] = Float32(v)  # representable: exact


def lowbit_pack_plan(args: I64Ptr, phase: Int) -> Int:
    if phase == PLAN_WORKSPACE:
        return 0
    if phase == 0:
        var fmt = arg_int(args, PK_FMT)
        if fmt != FMT_BF16 and fmt != FMT_INT8:
            return -3
        return ceil_div(arg_int(args, PK_ROWS), _rows_per_task(arg_int(args, PK_COLS)))
    return PHASE_END


def lowbit_pack_task(args: I64Ptr, phase: Int, task: Int):
    var rows = arg_int(args, PK_ROWS)
    var rpt = _rows_per_task(arg_int(args, PK_COLS))
    var r0 = task * rpt
    var r1 = r0 + rpt if r0 + rpt < rows else rows
    _pack_rows(args, r0, r1)


def lowbit_unpack_plan(args: I64Ptr, phase: Int) -> Int:
    if phase == PLAN_WORKSPACE:
        return 0
    if phase == 0:
        var fmt = arg_int(args, UP_FMT)
        if fmt != FMT_BF16 and fmt != FMT_INT8:
            return -3
        return ceil_div(arg_int(args, UP_ROWS), _rows_per_task(arg_int(args, UP_COLS)))
    return PHASE_END


def lowbit_unpack_task(args: I64Ptr, phase: Int, task: Int):
    var rows = arg_int(args, UP_ROWS)
    var rpt = _rows_per_task(arg_int(args, UP_COLS))
    var r0 = task * rpt
    var r1 = r0 + rpt if r0 + rpt < rows else rows
    _unpack_rows(args, r0, r1)
