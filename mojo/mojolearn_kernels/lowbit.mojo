"""Packed projection weights (mojolearn.lowbit, docs/checkpoints.md).

Two ops over a row-major (rows, cols) matrix, one phase, each task a block
of whole rows (a pure function of its rows: the bits never depend on the
thread count or the task split):

OP_LOWBIT_PACK   float32 -> bfloat16 bit patterns (uint16), int8 codes
                 plus one power-of-two exponent per row (int32), or the
                 bytes of llama.cpp's q4_0 / q8_0 blocks.
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

q4_0 / q8_0 (llama.cpp's block formats): each row is cut into blocks of
QK = 32 consecutive columns (the last one short when cols is not a multiple
of 32: quantised as if padded with zeros, its padding codes those of zero).
A block is BLOCK_BYTES[fmt] bytes, the rows' blocks one after the other:
  q4_0: float16 d (little-endian), then 16 bytes: byte j holds element j
        in its low nibble and element j + 16 in its high nibble; value =
        (q - 8) * d.
  q8_0: float16 d, then 32 int8 codes; value = q * d.
Both values are exact in float32 (an 11-bit significand times an integer of
at most 8 bits). The quantisers follow ggml's reference ones in float32
arithmetic (no contraction): q4_0 takes the block's first value m of
largest magnitude, d = m / -8, id = 1 / d (0 when d is 0 or 1 / d is not
finite), q = min(15, trunc(x * id + 8.5)); q8_0 takes d = absmax / 127 and
q = round_half_away(x * id). d is stored rounded to float16 (nearest, ties
to even); a scale that rounds to infinity sets aux[row] to the column of
the block's largest value (else -1), so the caller can refuse it.
"""
from std.memory import Pointer, bitcast
from .linear import f16_widen
from .abi import F32Ptr, I64Ptr, arg_int, arg_f32, ceil_div, one_phase_plan

comptime U16Ptr = Pointer[UInt16, MutUntrackedOrigin]
comptime I8Ptr = Pointer[Int8, MutUntrackedOrigin]
comptime I32Ptr = Pointer[Int32, MutUntrackedOrigin]

comptime U8Ptr = Pointer[UInt8, MutUntrackedOrigin]

comptime FMT_BF16 = 1
comptime FMT_INT8 = 2
comptime FMT_Q4_0 = 3
comptime FMT_Q8_0 = 4
comptime QK = 32  # values per block of the block formats

# OP_LOWBIT_PACK slots
comptime PK_FMT = 0
comptime PK_SRC = 1  # float32 (rows, cols)
comptime PK_ROWS = 2
comptime PK_COLS = 3
comptime PK_DST = 4  # uint16 or int8 (rows, cols), or the blocks' bytes
comptime PK_AUX = 5  # int32 (rows,): int8 exponent / bf16, q4_0, q8_0: an overflow column or -1

# OP_LOWBIT_UNPACK slots
comptime UP_FMT = 0
comptime UP_SRC = 1  # uint16 or int8 (rows, cols), or the blocks' bytes
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


def is_block_format(fmt: Int) -> Bool:
    return fmt == FMT_Q4_0 or fmt == FMT_Q8_0


@always_inline
def block_bytes(fmt: Int) -> Int:
    """Bytes of one block of a block format (2 for the float16 scale)."""
    return 2 + QK // 2 if fmt == FMT_Q4_0 else 2 + QK


def code_bytes(fmt: Int, rows: Int, cols: Int) -> Int:
    """Bytes of the packed codes of a (rows, cols) weight in format fmt
    (float32, format 0: its values)."""
    if is_block_format(fmt):
        return rows * ceil_div(cols, QK) * block_bytes(fmt)
    if fmt == FMT_BF16:
        return rows * cols * 2
    if fmt == FMT_INT8:
        return rows * cols
    return rows * cols * 4


@always_inline
def f16_bits(x: Float32) -> UInt16:
    """float32 -> float16 bits: round to nearest, ties to even, subnormals
    kept; an overflow gives infinity (finite inputs only)."""
    var u = bitcast[DType.uint32, 1](x)
    var sign = (u >> 16) & 0x8000
    var a = u & 0x7FFFFFFF
    var e = Int(a >> 23) - 127
    if e > 15:
        return UInt16(sign | 0x7C00)
    if (a >> 23) == 0:
        return UInt16(sign)  # a float32 subnormal is far below half the least float16
    var m = (a & 0x7FFFFF) | 0x800000  # the significand with its hidden bit
    var shift: Int  # bits of m below the float16 result's last place
    var h: UInt32
    if e >= -14:
        shift = 13
        h = (UInt32(e + 15) << 10) | ((m >> 13) & 0x3FF)
    else:
        shift = -1 - e  # units of 2^-24: m * 2^(e - 23 + 24)
        if shift > 24:
            return UInt16(sign)
        h = m >> UInt32(shift)
    var rem = m & ((UInt32(1) << UInt32(shift)) - 1)
    var half = UInt32(1) << UInt32(shift - 1)
    if rem > half or (rem == half and (h & 1) == 1):
        h += 1  # a carry runs into the exponent: the next binade, or infinity
    return UInt16(sign | h)


@always_inline
def _recip_or_zero(d: Float32) -> Float32:
    """1 / d, or 0 for d = 0 or a 1 / d that is not finite (ggml leaves
    that case undefined; every value of such a block expands to zero)."""
    if d == 0.0:
        return 0.0
    var r = Float32(1.0) / d
    if abs(r) > Float32(3.4028234663852886e38):
        return 0.0
    return r


def _pack_block(fmt: Int, x: F32Ptr, n: Int, dst: U8Ptr) -> Int:
    """One block of n <= QK values at x into dst; returns the index of the
    block's largest value if its scale overflows float16, else -1."""
    var amax: Float32 = 0.0
    var m: Float32 = 0.0
    var at = 0
    for j in range(n):
        var v = x[unsafe_offset=j]
        if amax < abs(v):  # the first value of the largest magnitude
            amax = abs(v)
            m = v
            at = j
    var d: Float32
    if fmt == FMT_Q4_0:
        d = m / Float32(-8.0)
    else:
        d = amax / Float32(127.0)
    var id = _recip_or_zero(d)
    var h = f16_bits(d)
    dst[unsafe_offset=0] = UInt8(h & 0xFF)
    dst[unsafe_offset=1] = UInt8(h >> 8)
    if fmt == FMT_Q4_0:
        for j in range(QK // 2):
            var lo: Int = 8  # padding past n: the code of zero
            var hi: Int = 8
            if j < n:
                var t = x[unsafe_offset=j] * id
                lo = min(15, Int(t + Float32(8.5)))  # t + 8.5 >= 0: Int truncates
            if j + QK // 2 < n:
                var t = x[unsafe_offset=j + QK // 2] * id
                hi = min(15, Int(t + Float32(8.5)))
            dst[unsafe_offset=2 + j] = UInt8(lo | (hi << 4))
    else:
        for j in range(QK):
            var q = 0
            if j < n:
                var t = x[unsafe_offset=j] * id
                var a = abs(t)
                var r = Int(a)
                if a - Float32(r) >= 0.5:  # exact: half away from zero
                    r += 1
                q = -r if t < 0.0 else r
            dst[unsafe_offset=2 + j] = bitcast[DType.uint8, 1](Int8(q))
    return at if (h & 0x7C00) == 0x7C00 else -1


@always_inline
def block_scale(blk: U8Ptr) -> Float32:
    """A block's float16 scale, widened."""
    var h = UInt16(blk[unsafe_offset=0]) | (UInt16(blk[unsafe_offset=1]) << 8)
    return f16_widen[1](SIMD[DType.uint16, 1](h))[0]


@always_inline
def block_value(fmt: Int, blk: U8Ptr, d: Float32, j: Int) -> Float32:
    """Value j of a block with widened scale d, exactly."""
    if fmt == FMT_Q4_0:
        var b = Int(blk[unsafe_offset=2 + j % (QK // 2)])
        var q = (b >> 4) if j >= QK // 2 else (b & 0xF)
        return Float32(q - 8) * d
    return Float32(Int(bitcast[DType.int8, 1](blk[unsafe_offset=2 + j]))) * d


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
    if is_block_format(fmt):
        var dst = U8Ptr(unsafe_from_address=arg_int(args, PK_DST))
        var nb = ceil_div(cols, QK)
        var bb = block_bytes(fmt)
        for r in range(r0, r1):
            var first = -1
            for b in range(nb):
                var c0 = b * QK
                var at = _pack_block(fmt, src.unsafe_offset(r * cols + c0), min(QK, cols - c0),
                                     dst.unsafe_offset((r * nb + b) * bb))
                if at >= 0 and first < 0:
                    first = c0 + at
            aux[unsafe_offset=r] = Int32(first)
    elif fmt == FMT_BF16:
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
    if is_block_format(fmt):
        var src = U8Ptr(unsafe_from_address=arg_int(args, UP_SRC))
        var nb = ceil_div(cols, QK)
        var bb = block_bytes(fmt)
        for r in range(r0, r1):
            for b in range(nb):
                var blk = src.unsafe_offset((r * nb + b) * bb)
                var d = block_scale(blk)
                for j in range(min(QK, cols - b * QK)):
                    dst[unsafe_offset=r * cols + b * QK + j] = block_value(fmt, blk, d, j)
    elif fmt == FMT_BF16:
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


def _rows_plan(args: I64Ptr, phase: Int, fmt_slot: Int, rows_slot: Int, cols_slot: Int) -> Int:
    """The plan of OP_LOWBIT_PACK / _UNPACK: one phase of row blocks."""
    var fmt = arg_int(args, fmt_slot)
    var ntasks = ceil_div(arg_int(args, rows_slot), _rows_per_task(arg_int(args, cols_slot)))
    if fmt != FMT_BF16 and fmt != FMT_INT8 and not is_block_format(fmt):
        ntasks = -3
    return one_phase_plan(phase, ntasks)


@always_inline
def _task_rows(args: I64Ptr, task: Int, rows_slot: Int, cols_slot: Int) -> Tuple[Int, Int]:
    """Rows [r0, r1) of task `task` (_rows_plan's blocks)."""
    var rows = arg_int(args, rows_slot)
    var rpt = _rows_per_task(arg_int(args, cols_slot))
    var r0 = task * rpt
    return (r0, r0 + rpt if r0 + rpt < rows else rows)


def lowbit_pack_plan(args: I64Ptr, phase: Int) -> Int:
    return _rows_plan(args, phase, PK_FMT, PK_ROWS, PK_COLS)


def lowbit_pack_task(args: I64Ptr, phase: Int, task: Int):
    var r = _task_rows(args, task, PK_ROWS, PK_COLS)
    _pack_rows(args, r[0], r[1])


def lowbit_unpack_plan(args: I64Ptr, phase: Int) -> Int:
    return _rows_plan(args, phase, UP_FMT, UP_ROWS, UP_COLS)


def lowbit_unpack_task(args: I64Ptr, phase: Int, task: Int):
    var r = _task_rows(args, task, UP_ROWS, UP_COLS)
    _unpack_rows(args, r[0], r[1])
