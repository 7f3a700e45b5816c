"""Projection weights in a block's prepared blob, kept in the format they
were given in (mojolearn.lowbit): float32, bfloat16 or int8 panels.

Every blob starts with a header of ALIGN_FLOATS int32 words: word 0 is the
weight format (a WF_* id), word 1 + i the float offset of projection i's
panels (i in the slot order of the prepare op's *_EXP slots). So a blob
describes itself: the forward ops read the format from the blob they are
given and pick the matching micro-kernel instantiation
(linear.matmul_task_wf); nothing in the call arguments can disagree with
the blob. OP_PANELS_EXTRACT copies the weights (float32 values or packed
codes) back out of the panels, so a block need not keep a second copy of
them (get_params, backward).

The prepare ops copy the packed codes into panels (linear.mojo's layout):
a copy, not a conversion, so the panels hold exactly the given values:
  bf16: uint16 bits, panel[p][k][j] = bits[p * NR + j, k]
  int8: per panel NR float32 scales 2^e[p * NR + j] (1.0 past the last
        row), then int8 codes [k][j]; rows past the last are code 0.
"""
from std.memory import Pointer, bitcast
from .abi import F32Ptr, I64Ptr, PLAN_WORKSPACE, PHASE_END, arg_int, arg_f32, ceil_div
from .linear import NR, WF_F32, WF_BF16, WF_INT8, panel_floats, pack_panels

comptime U16Ptr = Pointer[UInt16, MutUntrackedOrigin]
comptime I8Ptr = Pointer[Int8, MutUntrackedOrigin]
comptime I32Ptr = Pointer[Int32, MutUntrackedOrigin]


@always_inline
def pow2_f32(e: Int) -> Float32:
    """2^e exactly for e in [-149, 127] (through float64: no rounding)."""
    return Float32(bitcast[DType.float64, 1](UInt64(e + 1023) << 52))

comptime O_FORMAT = 0  # blob word holding the weight format
comptime O_SECTIONS = 1  # blob words 1 + i: float offset of projection i
# The last header word: a block option the prepare op records, so every op
# on the blob sees the same value (Mamba-1: the float32 eps of the B/C/dt
# norms, +0.0 for none). Zero in every blob that has no option.
comptime O_OPTION = 15

# OP_PANELS_EXTRACT slots
comptime EX_BLOB = 0  # a prepared blob (any weight format)
comptime EX_SECTION = 1  # projection index i (header word 1 + i)
comptime EX_ROWS = 2
comptime EX_COLS = 3
comptime EX_DST = 4  # float32 values, uint16 bfloat16 bits or int8 codes (rows, cols)
comptime EX_EXP = 5  # int8: int32 exponents (rows,)


@always_inline
def _word(blob: F32Ptr, i: Int) -> Int:
    return Int(bitcast[DType.int32, 1](blob[unsafe_offset=i]))


@always_inline
def _set_word(blob: F32Ptr, i: Int, v: Int):
    blob[unsafe_offset=i] = bitcast[DType.float32, 1](Int32(v))


def set_blob_format(blob: F32Ptr, wf: Int):
    _set_word(blob, O_FORMAT, wf)


def set_blob_section(blob: F32Ptr, i: Int, offset: Int):
    _set_word(blob, O_SECTIONS + i, offset)


def set_blob_option(blob: F32Ptr, bits: Int):
    """Record the block option (its 32 bits) in the header."""
    _set_word(blob, O_OPTION, bits)


def blob_option_f32(blob: F32Ptr) -> Float32:
    """The block option a prepare op recorded, as a float32 (+0.0 for a
    null blob or none)."""
    if Int(blob) == 0:
        return 0.0
    return blob[unsafe_offset=O_OPTION]


def blob_option_int(blob: F32Ptr) -> Int:
    """The block option a prepare op recorded, as an int32 (0 for a null
    blob or none)."""
    if Int(blob) == 0:
        return 0
    return _word(blob, O_OPTION)


def blob_format(blob: F32Ptr) -> Int:
    """The weight format a prepare op wrote into blob (float32 for none)."""
    if Int(blob) == 0:
        return WF_F32
    return _word(blob, O_FORMAT)


def valid_format(wf: Int) -> Bool:
    return wf == WF_F32 or wf == WF_BF16 or wf == WF_INT8


def _pack_bf16(src: U16Ptr, m: Int, k: Int, dst: F32Ptr):
    var ps = panel_floats[WF_BF16](k)
    for p in range(ceil_div(m, NR)):
        var d16 = dst.unsafe_offset(p * ps).unsafe_bitcast[UInt16]()
        for kk in range(k):
            for j in range(NR):
                var row = p * NR + j
                var v: UInt16 = 0
                if row < m:
                    v = src[unsafe_offset=row * k + kk]
                d16[unsafe_offset=kk * NR + j] = v


def _pack_int8(src: I8Ptr, exps: I32Ptr, m: Int, k: Int, dst: F32Ptr):
    var ps = panel_floats[WF_INT8](k)
    for p in range(ceil_div(m, NR)):
        var panel = dst.unsafe_offset(p * ps)
        var codes = panel.unsafe_offset(NR).unsafe_bitcast[Int8]()
        for j in range(NR):
            var row = p * NR + j
            var s: Float32 = 1.0
            if row < m:
                s = pow2_f32(Int(exps[unsafe_offset=row]))
            panel[unsafe_offset=j] = s
        for kk in range(k):
            for j in range(NR):
                var row = p * NR + j
                var v: Int8 = 0
                if row < m:
                    v = src[unsafe_offset=row * k + kk]
                codes[unsafe_offset=kk * NR + j] = v


def pack_weight_panels(wf: Int, src: Int, exps: Int, m: Int, k: Int, dst: F32Ptr):
    """Panels of the (m, k) weight at address src in format wf: float32
    values, bfloat16 bits (uint16) or int8 codes with int32 exponents (one
    per row, at address exps)."""
    if wf == WF_BF16:
        _pack_bf16(U16Ptr(unsafe_from_address=src), m, k, dst)
    elif wf == WF_INT8:
        _pack_int8(I8Ptr(unsafe_from_address=src), I32Ptr(unsafe_from_address=exps), m, k, dst)
    else:
        pack_panels(F32Ptr(unsafe_from_address=src), m, k, dst)


# ---------------------------------------------------------------- extract


def panels_extract_plan(args: I64Ptr, phase: Int) -> Int:
    if not valid_format(blob_format(arg_f32(args, EX_BLOB))):
        return -3
    if phase == PLAN_WORKSPACE:
        return 0
    if phase == 0:
        return ceil_div(arg_int(args, EX_ROWS), NR)
    return PHASE_END


def panels_extract_task(args: I64Ptr, phase: Int, task: Int):
    """Panel `task` back to rows: the values or codes as the prepare op got them."""
    var blob = arg_f32(args, EX_BLOB)
    var wf = blob_format(blob)
    var m = arg_int(args, EX_ROWS)
    var k = arg_int(args, EX_COLS)
    var sec = blob.unsafe_offset(_word(blob, O_SECTIONS + arg_int(args, EX_SECTION)))
    var r0 = task * NR
    var nr = min(NR, m - r0)
    if wf == WF_F32:
        _rows_from_panel[DType.float32](Int(sec.unsafe_offset(task * panel_floats[WF_F32](k))),
                                        arg_int(args, EX_DST), r0, nr, k)
    elif wf == WF_BF16:
        _rows_from_panel[DType.uint16](Int(sec.unsafe_offset(task * panel_floats[WF_BF16](k))),
                                       arg_int(args, EX_DST), r0, nr, k)
    else:
        var panel = sec.unsafe_offset(task * panel_floats[WF_INT8](k))
        var exps = I32Ptr(unsafe_from_address=arg_int(args, EX_EXP))
        for j in range(nr):
            # the scale is 2^e exactly; float64 keeps it normal, so e is its exponent field
            var b = bitcast[DType.uint64, 1](Float64(panel[unsafe_offset=j]))
            exps[unsafe_offset=r0 + j] = Int32(Int((b >> 52) & 0x7FF) - 1023)
        _rows_from_panel[DType.int8](Int(panel.unsafe_offset(NR)), arg_int(args, EX_DST),
                                     r0, nr, k)


def _rows_from_panel[T: DType](src: Int, dst: Int, r0: Int, nr: Int, k: Int):
    """Rows r0 .. r0 + nr - 1 of a row-major (., k) matrix of T at dst, from
    one panel's elements [kk][j] at src (values or codes, copied as they are)."""
    var s = Pointer[Scalar[T], MutUntrackedOrigin](unsafe_from_address=src)
    var d = Pointer[Scalar[T], MutUntrackedOrigin](unsafe_from_address=dst)
    for j in range(nr):
        for kk in range(k):
            d[unsafe_offset=(r0 + j) * k + kk] = s[unsafe_offset=kk * NR + j]
