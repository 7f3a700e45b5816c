"""Projection weights in a block's prepared blob, kept in the format they
were given in (mojolearn.lowbit): float32, bfloat16, int8, q4_0 or q8_0
panels.

Every blob starts with a header of ALIGN_FLOATS int32 words: word 0 holds
the weight formats, one 4-bit WF_* id per projection (bits 4 i .. 4 i + 3:
projection i's format), word 1 + i the float offset of projection i's
panels (i in the slot order of the prepare op's *_EXP slots). The prepare
ops take that same word (their wfmt slot), so each projection keeps the
format it was given in (llama.cpp's files mix them: q4_0 in_proj next to
float32 x_proj). So a blob describes itself: the forward ops read each
projection's format from the blob they are given and pick the matching
micro-kernel instantiation per product (linear.matmul_task_wf); nothing in
the call arguments can disagree with the blob. A block in one format runs
the very code it ran when word 0 held a single format. OP_PANELS_EXTRACT
copies the weights (float32 values or packed codes) back out of the
panels, in each section's format, so a block need not keep a second copy
of them (get_params, backward).

The prepare ops copy the packed codes into panels (linear.mojo's layout):
a copy, not a conversion, so the panels hold exactly the given values:
  bf16: uint16 bits, panel[p][k][j] = bits[p * NR + j, k]
  int8: per panel NR float32 scales 2^e[p * NR + j] (1.0 past the last
        row), then int8 codes [k][j]; rows past the last are code 0.
  q4_0, q8_0: per panel and block of 32 k steps, the NR rows' float16 scale
        bits, then the block's code bytes in linear.mojo's order (rows past
        the last: scale 0 and zero bytes). The bytes of a ggml block move
        as they are: byte t of a q4_0 block's nibbles goes to [t][j], code
        t of a q8_0 block to [t][j].
"""
from std.memory import Pointer, bitcast
from .abi import F32Ptr, I64Ptr, arg_int, arg_f32, ceil_div, one_phase_plan
from .linear import (
    NR, WF_F32, WF_BF16, WF_INT8, WF_Q4_0, WF_Q8_0, QBLOCK, panel_floats, panel_floats_wf,
    pack_panels, pack_panel,
)

comptime U8Ptr = Pointer[UInt8, MutUntrackedOrigin]
comptime U16Ptr = Pointer[UInt16, MutUntrackedOrigin]
comptime I8Ptr = Pointer[Int8, MutUntrackedOrigin]
comptime I32Ptr = Pointer[Int32, MutUntrackedOrigin]


@always_inline
def pow2_f32(e: Int) -> Float32:
    """2^e exactly for e in [-149, 127] (through float64: no rounding)."""
    return Float32(bitcast[DType.float64, 1](UInt64(e + 1023) << 52))

comptime O_FORMAT = 0  # blob word holding the weight formats (FMT_BITS per projection)
comptime FMT_BITS = 4
comptime FMT_MASK = (1 << FMT_BITS) - 1
comptime ALL_F32 = 0  # the formats word of a block whose projections are all float32
comptime MAX_PROJECTIONS = 7  # formats in the (int32, non-negative) word
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
comptime EX_DST = 4  # float32 values, uint16 bfloat16 bits or int8 codes (rows, cols), or blocks' bytes
comptime EX_EXP = 5  # int8: int32 exponents (rows,)


@always_inline
def _word(blob: F32Ptr, i: Int) -> Int:
    return Int(bitcast[DType.int32, 1](blob[unsafe_offset=i]))


@always_inline
def _set_word(blob: F32Ptr, i: Int, v: Int):
    blob[unsafe_offset=i] = bitcast[DType.float32, 1](Int32(v))


def set_blob_formats(blob: F32Ptr, wfs: Int):
    """Record the formats word (a prepare op's wfmt argument)."""
    _set_word(blob, O_FORMAT, wfs)


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


def blob_formats(blob: F32Ptr) -> Int:
    """The formats word a prepare op wrote into blob (all float32 for a
    null blob)."""
    if Int(blob) == 0:
        return ALL_F32
    return _word(blob, O_FORMAT)


@always_inline
def section_format(wfs: Int, i: Int) -> Int:
    """Projection i's format in a formats word."""
    return (wfs >> (FMT_BITS * i)) & FMT_MASK


def valid_format(wf: Int) -> Bool:
    return wf == WF_F32 or wf == WF_BF16 or wf == WF_INT8 or wf == WF_Q4_0 or wf == WF_Q8_0


def valid_formats(wfs: Int, n: Int) -> Bool:
    """Whether wfs is a formats word of n projections: each a valid format,
    nothing above them."""
    if wfs < 0 or n > MAX_PROJECTIONS or (wfs >> (FMT_BITS * n)) != 0:
        return False
    for i in range(n):
        if not valid_format(section_format(wfs, i)):
            return False
    return True


@always_inline
def _block_code_bytes(wf: Int) -> Int:
    """Code bytes of one ggml block (its float16 scale excluded)."""
    return QBLOCK // 2 if wf == WF_Q4_0 else QBLOCK


def _blocks_panels(wf: Int, src: U8Ptr, m: Int, k: Int, dst: F32Ptr, to_panels: Bool):
    """Copy the ggml blocks of the (m, k) weight at src (rows of ceil(k/32)
    blocks, each a float16 scale and its code bytes) into panels at dst, or
    (to_panels False) back: the same bytes, moved."""
    var nb = (k + QBLOCK - 1) // QBLOCK
    var cb = _block_code_bytes(wf)
    var bb = 2 + cb
    var ps = panel_floats_wf(wf, k)
    var bs = panel_floats_wf(wf, QBLOCK)  # floats per panel block
    for p in range((m + NR - 1) // NR):
        for b in range(nb):
            var pb = dst.unsafe_offset(p * ps + b * bs).unsafe_bitcast[UInt8]()
            for j in range(NR):
                var row = p * NR + j
                var blk = src.unsafe_offset((row * nb + b) * bb)
                if row < m:
                    if to_panels:
                        pb[unsafe_offset=2 * j] = blk[unsafe_offset=0]
                        pb[unsafe_offset=2 * j + 1] = blk[unsafe_offset=1]
                        for t in range(cb):
                            pb[unsafe_offset=2 * NR + t * NR + j] = blk[unsafe_offset=2 + t]
                    else:
                        blk[unsafe_offset=0] = pb[unsafe_offset=2 * j]
                        blk[unsafe_offset=1] = pb[unsafe_offset=2 * j + 1]
                        for t in range(cb):
                            blk[unsafe_offset=2 + t] = pb[unsafe_offset=2 * NR + t * NR + j]
                elif to_panels:
                    pb[unsafe_offset=2 * j] = 0
                    pb[unsafe_offset=2 * j + 1] = 0
                    for t in range(cb):
                        pb[unsafe_offset=2 * NR + t * NR + j] = 0


def _pack_bf16(src: U16Ptr, m: Int, k: Int, dst: F32Ptr):
    var ps = panel_floats[WF_BF16](k)
    for p in range(ceil_div(m, NR)):
        pack_panel(src, m, k, k, 1, p, dst.unsafe_offset(p * ps).unsafe_bitcast[UInt16]())


def _pack_int8(src: I8Ptr, exps: I32Ptr, m: Int, k: Int, dst: F32Ptr):
    var ps = panel_floats[WF_INT8](k)
    for p in range(ceil_div(m, NR)):
        var panel = dst.unsafe_offset(p * ps)
        for j in range(NR):
            var row = p * NR + j
            var s: Float32 = 1.0
            if row < m:
                s = pow2_f32(Int(exps[unsafe_offset=row]))
            panel[unsafe_offset=j] = s
        pack_panel(src, m, k, k, 1, p, panel.unsafe_offset(NR).unsafe_bitcast[Int8]())


def pack_weight_panels(wf: Int, src: Int, exps: Int, m: Int, k: Int, dst: F32Ptr):
    """Panels of the (m, k) weight at address src in format wf: float32
    values, bfloat16 bits (uint16), int8 codes with int32 exponents (one
    per row, at address exps) or the bytes of q4_0 / q8_0 blocks."""
    if wf == WF_BF16:
        _pack_bf16(U16Ptr(unsafe_from_address=src), m, k, dst)
    elif wf == WF_INT8:
        _pack_int8(I8Ptr(unsafe_from_address=src), I32Ptr(unsafe_from_address=exps), m, k, dst)
    elif wf == WF_Q4_0 or wf == WF_Q8_0:
        _blocks_panels(wf, U8Ptr(unsafe_from_address=src), m, k, dst, True)
    else:
        pack_panels(F32Ptr(unsafe_from_address=src), m, k, dst)


# ---------------------------------------------------------------- extract


def extract_format(args: I64Ptr) -> Int:
    """The format of the section OP_PANELS_EXTRACT reads."""
    return section_format(blob_formats(arg_f32(args, EX_BLOB)), arg_int(args, EX_SECTION))


def panels_extract_plan(args: I64Ptr, phase: Int) -> Int:
    var sec = arg_int(args, EX_SECTION)
    if sec < 0 or sec >= MAX_PROJECTIONS or not valid_format(extract_format(args)):
        return -3
    return one_phase_plan(phase, ceil_div(arg_int(args, EX_ROWS), NR))


def panels_extract_task(args: I64Ptr, phase: Int, task: Int):
    """Panel `task` back to rows: the values or codes as the prepare op got them."""
    var blob = arg_f32(args, EX_BLOB)
    var wf = extract_format(args)
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
    elif wf == WF_Q4_0 or wf == WF_Q8_0:
        var nb = (k + QBLOCK - 1) // QBLOCK
        var dst = U8Ptr(unsafe_from_address=arg_int(args, EX_DST))
        # this task's panel, as the panels of rows r0 .. r0 + nr - 1 alone
        _blocks_panels(wf, dst.unsafe_offset(r0 * nb * (2 + _block_code_bytes(wf))), nr, k,
                       sec.unsafe_offset(task * panel_floats_wf(wf, k)), False)
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
