"""Exports of the host CPU binary (libmojolearn_cpu.so).

Build: mojo build --emit shared-lib --fp-mode contract=off
       --target-cpu x86-64-v3 -I mojo -D ML_ARCH=x86-64-v3 ...
The binary says what it is (vendor, numeric mode, ABI version, target) so the
loader reads it back instead of trusting file names.
"""
from std.sys import get_defined_string
from mojolearn_kernels.abi import F32Ptr, I64Ptr
from mojolearn_kernels.exports import SHARED_EXPORTS
from mojolearn_kernels.math_eval import math_eval
from mojolearn_kernels.describe import U8Ptr, describe_text
from mojolearn_kernels.probe import workspace_offset

# Naming the shared exports (exports.mojo) is what emits them into this binary.
comptime _EMIT_SHARED = SHARED_EXPORTS
comptime ARCH = get_defined_string["ML_ARCH", "x86-64-v3"]()
comptime FEATURES = get_defined_string["ML_FEATURES", "avx2,fma,bmi2,f16c"]()
comptime VENDOR_CPU = 0


@export("ml_vendor")
def ml_vendor() abi("C") -> Int64:
    return VENDOR_CPU


@export("ml_describe")
def ml_describe(buf: U8Ptr, cap: Int64) abi("C") -> Int64:
    """Writes 'key=value;...' (vendor, arch, features, mode) into buf and
    returns its full length. No heap use: the binary needs no Mojo runtime."""
    return Int64(describe_text(buf, Int(cap), "cpu", ARCH, FEATURES))


@export("ml_math_eval")
def ml_math_eval(fn_id: Int64, src: F32Ptr, dst: F32Ptr, n: Int64, width: Int64) abi("C") -> Int64:
    """Elementwise own transcendental `fn_id` (for accuracy tests)."""
    math_eval(Int(fn_id), src, dst, Int(n), Int(width))
    return 0


@export("ml_workspace_offset")
def ml_workspace_offset(op: Int64, args: I64Ptr, which: Int64) abi("C") -> Int64:
    """Test hook (probe.mojo): the float offset of activation `which` in the
    workspace of op called with args; -1 if op has none."""
    return Int64(workspace_offset(Int(op), args, Int(which)))
