"""Exports of the host CPU binary (libmojolearn_cpu.so).

Build: mojo build --emit shared-lib --fp-mode contract=off
       --target-cpu x86-64-v3 -I mojo -D ML_ARCH=x86-64-v3 ...
The binary says what it is (vendor, numeric mode, ABI version, target) so the
loader reads it back instead of trusting file names.
"""
from std.memory import Pointer
from std.sys import get_defined_string
from mojolearn_kernels.abi import F32Ptr, I64Ptr, ABI_VERSION
from mojolearn_kernels.dispatch import op_plan, op_task, is_host_op
from mojolearn_kernels.buffers import op_buffers
from mojolearn_kernels.slot_text import op_spec_text
from mojolearn_kernels.constants import op_table_text, constants_text
from mojolearn_kernels.checks import first_nonfinite
from mojolearn_kernels.math_eval import math_eval
from mojolearn_kernels.describe import U8Ptr, put_str
from mojolearn_kernels.probe import workspace_offset

comptime ARCH = get_defined_string["ML_ARCH", "x86-64-v3"]()
comptime FEATURES = get_defined_string["ML_FEATURES", "avx2,fma,bmi2,f16c"]()
comptime VENDOR_CPU = 0
comptime MODE_IDENTICAL = 0


@export("ml_abi_version")
def ml_abi_version() abi("C") -> Int64:
    return ABI_VERSION


@export("ml_vendor")
def ml_vendor() abi("C") -> Int64:
    return VENDOR_CPU


@export("ml_numeric_mode")
def ml_numeric_mode() abi("C") -> Int64:
    return MODE_IDENTICAL


@export("ml_describe")
def ml_describe(buf: U8Ptr, cap: Int64) abi("C") -> Int64:
    """Writes 'key=value;...' (vendor, arch, features, mode) into buf and
    returns its full length. No heap use: the binary needs no Mojo runtime."""
    var c = Int(cap)
    var n = put_str(buf, c, 0, "vendor=cpu;arch=")
    n = put_str(buf, c, n, ARCH)
    n = put_str(buf, c, n, ";features=")
    n = put_str(buf, c, n, FEATURES)
    n = put_str(buf, c, n, ";mode=identical")
    return Int64(n)


@export("ml_plan")
def ml_plan(op: Int64, args: I64Ptr, phase: Int64) abi("C") -> Int64:
    """Tasks in `phase` of `op` (PHASE_END past the last; workspace bytes
    for PLAN_WORKSPACE)."""
    return Int64(op_plan(Int(op), args, Int(phase)))


@export("ml_task")
def ml_task(op: Int64, args: I64Ptr, phase: Int64, task: Int64) abi("C") -> Int64:
    return Int64(op_task(Int(op), args, Int(phase), Int(task)))


@export("ml_host_op")
def ml_host_op(op: Int64) abi("C") -> Int64:
    """1 if a device binary runs op on the host (dispatch.is_host_op)."""
    return 1 if is_host_op(Int(op)) else 0


@export("ml_op_spec")
def ml_op_spec(op: Int64, buf: U8Ptr, cap: Int64) abi("C") -> Int64:
    """Every argument slot of op as text (slot_text.mojo): name, slot, kind,
    direction. Returns the full length (write again with a larger buf if it
    exceeds cap), or -2 for an unknown op."""
    return Int64(op_spec_text(Int(op), buf, Int(cap)))


@export("ml_op_table")
def ml_op_table(buf: U8Ptr, cap: Int64) abi("C") -> Int64:
    """The op table as text (constants.mojo): `name=id,host|device;` per op.
    Returns the full length (write again with a larger buf if it exceeds cap)."""
    return Int64(op_table_text(buf, Int(cap)))


@export("ml_constants")
def ml_constants(buf: U8Ptr, cap: Int64) abi("C") -> Int64:
    """Every number shared with the Python layer as `NAME=value;` text
    (constants.mojo); the full length, as ml_op_table."""
    return Int64(constants_text(buf, Int(cap)))


@export("ml_buffers")
def ml_buffers(op: Int64, args: I64Ptr, rows: I64Ptr, cap: Int64) abi("C") -> Int64:
    """The op's buffer slots as rows (slot, bytes, flags); see buffers.mojo.
    The host layer uses it to stage buffers like a GPU binary does."""
    return Int64(op_buffers(Int(op), args, rows, Int(cap)))


@export("ml_math_eval")
def ml_math_eval(fn_id: Int64, src: F32Ptr, dst: F32Ptr, n: Int64, width: Int64) abi("C") -> Int64:
    """Elementwise own transcendental `fn_id` (for accuracy tests)."""
    math_eval(Int(fn_id), src, dst, Int(n), Int(width))
    return 0


@export("ml_first_nonfinite")
def ml_first_nonfinite(p: F32Ptr, n: Int64) abi("C") -> Int64:
    """First flat index of a NaN or infinity in p[0:n], or -1 (direct call:
    the per-step input check costs no task launch)."""
    return Int64(first_nonfinite(p, Int(n)))


@export("ml_workspace_offset")
def ml_workspace_offset(op: Int64, args: I64Ptr, which: Int64) abi("C") -> Int64:
    """Test hook (probe.mojo): the float offset of activation `which` in the
    workspace of op called with args; -1 if op has none."""
    return Int64(workspace_offset(Int(op), args, Int(which)))
