"""Exports of the host CPU binary (libmojolearn_cpu.so).

Build: mojo build --emit shared-lib --fp-mode contract=off
       --target-cpu x86-64-v3 -I mojo -D ML_ARCH=x86-64-v3 ...
The binary says what it is (vendor, numeric mode, ABI version, target) so the
loader reads it back instead of trusting file names.
"""
from std.memory import Pointer
from std.sys import get_defined_string
from mojolearn_kernels.abi import (
    F32Ptr, I64Ptr, ABI_VERSION, PHASE_END, PLAN_WORKSPACE,
    OP_FIRST_NONFINITE, OP_MATH_EVAL, OP_M1_PREPARE, OP_M1_FORWARD,
    OP_M2_PREPARE, OP_M2_FORWARD, OP_M3_PREPARE, OP_M3_FORWARD,
    OP_M1_BACKWARD, OP_M2_BACKWARD, OP_M3_BACKWARD, OP_LOWBIT_PACK, OP_LOWBIT_UNPACK,
    OP_PANELS_EXTRACT, OP_PACK_TRANSPOSED,
)
from mojolearn_kernels.checks import first_nonfinite_task, first_nonfinite
from mojolearn_kernels.math_eval import math_eval
from mojolearn_kernels.mamba1 import (
    m1_prepare_plan, m1_prepare_task, m1_forward_plan, m1_forward_task,
)
from mojolearn_kernels.mamba2 import (
    m2_prepare_plan, m2_prepare_task, m2_forward_plan, m2_forward_task,
)
from mojolearn_kernels.mamba1_backward import m1_backward_plan, m1_backward_task
from mojolearn_kernels.mamba2_backward import m2_backward_plan, m2_backward_task
from mojolearn_kernels.mamba3_backward import m3_backward_plan, m3_backward_task
from mojolearn_kernels.linear_grad import pack_transposed_plan, pack_transposed_task
from mojolearn_kernels.lowbit import (
    lowbit_pack_plan, lowbit_pack_task, lowbit_unpack_plan, lowbit_unpack_task,
)
from mojolearn_kernels.weight_panels import panels_extract_plan, panels_extract_task
from mojolearn_kernels.mamba3 import (
    m3_prepare_plan, m3_prepare_task, m3_forward_plan, m3_forward_task,
)

comptime U8Ptr = Pointer[UInt8, MutUntrackedOrigin]
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


def _put(buf: U8Ptr, cap: Int, pos: Int, s: StaticString) -> Int:
    """Copies s into buf at pos (as far as cap allows); returns the new pos."""
    var bytes = s.as_bytes()
    for i in range(len(bytes)):
        if pos + i < cap:
            buf[unsafe_offset=pos + i] = bytes[i]
    return pos + len(bytes)


@export("ml_describe")
def ml_describe(buf: U8Ptr, cap: Int64) abi("C") -> Int64:
    """Writes 'key=value;...' (vendor, arch, features, mode) into buf and
    returns its full length. No heap use: the binary needs no Mojo runtime."""
    var c = Int(cap)
    var n = _put(buf, c, 0, "vendor=cpu;arch=")
    n = _put(buf, c, n, ARCH)
    n = _put(buf, c, n, ";features=")
    n = _put(buf, c, n, FEATURES)
    n = _put(buf, c, n, ";mode=identical")
    return Int64(n)


@export("ml_plan")
def ml_plan(op: Int64, args: I64Ptr, phase: Int64) abi("C") -> Int64:
    """Tasks in `phase` of `op` (PHASE_END past the last; workspace bytes
    for PLAN_WORKSPACE)."""
    var p = Int(phase)
    if op == OP_M1_FORWARD:
        return Int64(m1_forward_plan(args, p))
    if op == OP_M1_PREPARE:
        return Int64(m1_prepare_plan(args, p))
    if op == OP_M2_FORWARD:
        return Int64(m2_forward_plan(args, p))
    if op == OP_M2_PREPARE:
        return Int64(m2_prepare_plan(args, p))
    if op == OP_M3_FORWARD:
        return Int64(m3_forward_plan(args, p))
    if op == OP_M3_PREPARE:
        return Int64(m3_prepare_plan(args, p))
    if op == OP_M1_BACKWARD:
        return Int64(m1_backward_plan(args, p))
    if op == OP_M2_BACKWARD:
        return Int64(m2_backward_plan(args, p))
    if op == OP_M3_BACKWARD:
        return Int64(m3_backward_plan(args, p))
    if op == OP_PACK_TRANSPOSED:
        return Int64(pack_transposed_plan(args, p))
    if op == OP_LOWBIT_PACK:
        return Int64(lowbit_pack_plan(args, p))
    if op == OP_LOWBIT_UNPACK:
        return Int64(lowbit_unpack_plan(args, p))
    if op == OP_PANELS_EXTRACT:
        return Int64(panels_extract_plan(args, p))
    if op == OP_FIRST_NONFINITE or op == OP_MATH_EVAL:
        if p == PLAN_WORKSPACE:
            return 0
        return 1 if p == 0 else PHASE_END
    return -2  # unknown op


@export("ml_task")
def ml_task(op: Int64, args: I64Ptr, phase: Int64, task: Int64) abi("C") -> Int64:
    var p = Int(phase)
    var t = Int(task)
    if op == OP_M1_FORWARD:
        m1_forward_task(args, p, t)
    elif op == OP_M1_PREPARE:
        m1_prepare_task(args, p, t)
    elif op == OP_M2_FORWARD:
        m2_forward_task(args, p, t)
    elif op == OP_M2_PREPARE:
        m2_prepare_task(args, p, t)
    elif op == OP_M3_FORWARD:
        m3_forward_task(args, p, t)
    elif op == OP_M3_PREPARE:
        m3_prepare_task(args, p, t)
    elif op == OP_M1_BACKWARD:
        m1_backward_task(args, p, t)
    elif op == OP_M2_BACKWARD:
        m2_backward_task(args, p, t)
    elif op == OP_M3_BACKWARD:
        m3_backward_task(args, p, t)
    elif op == OP_PACK_TRANSPOSED:
        pack_transposed_task(args, p, t)
    elif op == OP_LOWBIT_PACK:
        lowbit_pack_task(args, p, t)
    elif op == OP_LOWBIT_UNPACK:
        lowbit_unpack_task(args, p, t)
    elif op == OP_PANELS_EXTRACT:
        panels_extract_task(args, p, t)
    elif op == OP_FIRST_NONFINITE:
        first_nonfinite_task(args)
    elif op == OP_MATH_EVAL:
        math_eval(Int(args[unsafe_offset=0]),
                  F32Ptr(unsafe_from_address=Int(args[unsafe_offset=1])),
                  F32Ptr(unsafe_from_address=Int(args[unsafe_offset=2])),
                  Int(args[unsafe_offset=3]), Int(args[unsafe_offset=4]))
    else:
        return -2
    return 0


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
