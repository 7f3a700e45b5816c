"""The C ABI exports every binary shares (CPU and GPU entries alike).

An `@export` in an imported module is emitted only when the entry file
names it, so each entry lists these functions in its own `SHARED_EXPORTS`
tuple; the symbols then exist once here, with the same bodies in every
binary. What differs per binary (vendor, describe, device launch, test
hooks) stays in the entry file.
"""
from .abi import F32Ptr, I64Ptr, ABI_VERSION
from .dispatch import op_plan, op_task, is_host_op
from .buffers import op_buffers
from .slot_text import op_spec_text
from .constants import op_table_text, constants_text
from .checks import first_nonfinite
from .describe import U8Ptr

comptime MODE_IDENTICAL = 0  # the only numeric mode built so far


@export("ml_abi_version")
def ml_abi_version() abi("C") -> Int64:
    return ABI_VERSION


@export("ml_numeric_mode")
def ml_numeric_mode() abi("C") -> Int64:
    return MODE_IDENTICAL


@export("ml_plan")
def ml_plan(op: Int64, args: I64Ptr, phase: Int64) abi("C") -> Int64:
    """Tasks in `phase` of `op` (PHASE_END past the last; workspace bytes
    for PLAN_WORKSPACE)."""
    return Int64(op_plan(Int(op), args, Int(phase)))


@export("ml_task")
def ml_task(op: Int64, args: I64Ptr, phase: Int64, task: Int64) abi("C") -> Int64:
    """Runs one task on the host (a GPU binary runs its host ops and input
    checks this way)."""
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


@export("ml_first_nonfinite")
def ml_first_nonfinite(p: F32Ptr, n: Int64) abi("C") -> Int64:
    """First flat index of a NaN or infinity in p[0:n], or -1 (direct call:
    the per-step input check costs no task launch)."""
    return Int64(first_nonfinite(p, Int(n)))


# What an entry file names (`comptime _EMIT_SHARED = SHARED_EXPORTS`).
comptime SHARED_EXPORTS = (
    ml_abi_version, ml_numeric_mode, ml_plan, ml_task, ml_host_op, ml_op_spec, ml_op_table,
    ml_constants, ml_buffers, ml_first_nonfinite,
)
