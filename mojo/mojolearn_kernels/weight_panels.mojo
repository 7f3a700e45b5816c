"""Projection weights in a block's prepared blob, kept in the format they
were given in (mojolearn.lowbit): float32, bfloat16 or int8 panels.

Every blob starts with a header of ALIGN_FLOATS floats whose first word is
the weight format (an int32 WF_* id), so a blob describes itself: the
forward ops read the format from the blob they are given and pick the
matching micro-kernel instantiation (linear.matmul_task_wf); nothing in the
call arguments can disagree with the blob.

The prepare ops copy the packed codes into panels (linear.mojo's layout):
a copy, not a conversion, so the panels hold exactly the given values:
  bf16: uint16 bits, panel[p][k][j] = bits[p * NR + j, k]
  int8: per panel NR float32 scales 2^e[p * NR + j] (1.0 past the last
        row), then int8 codes [k][j]; rows past the last are code 0.
"""
from std.memory import Pointer, bitcast
from .abi import F32Ptr, ceil_div
from .linear import NR, WF_F32, WF_BF16, WF_INT8, panel_floats, pack_panels

comptime U16Ptr = Pointer[UInt16, MutUntrackedOrigin]
comptime I8Ptr = Pointer[Int8, MutUntrackedOrigin]
comptime I32Ptr = Pointer[Int32, MutUntrackedOrigin]

comptime O_FORMAT = 0  # blob word holding the weight format


def set_blob_format(blob: F32Ptr, wf: Int):
    blob[unsafe_offset=O_FORMAT] = bitcast[DType.float32, 1](Int32(wf))


def blob_format(blob: F32Ptr) -> Int:
    """The weight format a prepare op wrote into blob (float32 for none)."""
    if Int(blob) == 0:
        return WF_F32
    return Int(bitcast[DType.int32, 1](blob[unsafe_offset=O_FORMAT]))


def valid_format(wf: Int) -> Bool:
    return wf == WF_F32 or wf == WF_BF16 or wf == WF_INT8


@always_inline
def _pow2_f32(e: Int) -> Float32:
    """2^e exactly for e in [-149, 127] (through float64: no rounding)."""
    return Float32(bitcast[DType.float64, 1](UInt64(e + 1023) << 52))


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
                s = _pow2_f32(Int(exps[unsafe_offset=row]))
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
