"""Exports of a GPU binary (libmojolearn_<vendor>_<arch>.so).

Build (see docs/gpu.md): mojo build --emit shared-lib --fp-mode contract=off
  --target-accelerator sm_90 -D GPU_API=cuda -D ML_ARCH=sm_90 -I mojo ...
GPU_API is cuda, hip or metal. The binary exports the CPU binary's identity
and plan symbols plus ml_device_count and ml_gpu_run, which runs a whole op
on the device: each phase is one kernel launch in which GPU thread t runs
task t through `op_task`, the very formula code of the CPU binary (only the
scheduling differs). Buffers are staged per call from the table the host
layer builds out of ml_buffers (python/native/device.h). Nothing here may
raise across the C ABI: errors become a status and a message.
"""
from std.memory import Pointer
from std.sys import get_defined_string
from max.gpu import global_idx
from max.gpu.host import DeviceContext
from mojolearn_kernels.abi import F32Ptr, I64Ptr, ABI_VERSION, PHASE_END, ceil_div, round_up
from mojolearn_kernels.dispatch import op_plan, op_task, device_op_task, is_host_op
from mojolearn_kernels.buffers import op_buffers
from mojolearn_kernels.opspec import BUF_IN, BUF_OUT
from mojolearn_kernels.slot_text import op_spec_text
from mojolearn_kernels.constants import op_table_text, constants_text
from mojolearn_kernels.checks import first_nonfinite
from mojolearn_kernels.describe import U8Ptr, put_str

comptime API = get_defined_string["GPU_API", "cuda"]()
comptime ARCH = get_defined_string["ML_ARCH", "sm_90"]()
comptime MODE_IDENTICAL = 0
comptime THREADS_PER_BLOCK = 32  # tasks are large; spread them over the SMs
comptime STAGE_ALIGN = 256  # bytes between staged buffers
comptime GPU_ROW = 4  # table rows from the host: slot, bytes, flags, alias


comptime VENDOR_ID = 1 if API == "cuda" else (2 if API == "hip" else 3)  # _abi.VENDORS


@export("ml_abi_version")
def ml_abi_version() abi("C") -> Int64:
    return ABI_VERSION


@export("ml_vendor")
def ml_vendor() abi("C") -> Int64:
    comptime assert API == "cuda" or API == "hip" or API == "metal", "GPU_API must be cuda, hip or metal"
    return Int64(VENDOR_ID)


@export("ml_numeric_mode")
def ml_numeric_mode() abi("C") -> Int64:
    return MODE_IDENTICAL


@export("ml_describe")
def ml_describe(buf: U8Ptr, cap: Int64) abi("C") -> Int64:
    var c = Int(cap)
    var n = put_str(buf, c, 0, "vendor=")
    n = put_str(buf, c, n, API)
    n = put_str(buf, c, n, ";arch=")
    n = put_str(buf, c, n, ARCH)
    n = put_str(buf, c, n, ";features=;mode=identical")
    return Int64(n)


@export("ml_device_count")
def ml_device_count() abi("C") -> Int64:
    """Devices of this vendor (0 when the driver is missing; never raises)."""
    return Int64(DeviceContext.number_of_devices(api=String(API)))


@export("ml_device_arch")
def ml_device_arch(buf: U8Ptr, cap: Int64) abi("C") -> Int64:
    """The first device's architecture name into buf (its length; 0 when
    there is no device or it cannot be opened)."""
    if DeviceContext.number_of_devices(api=String(API)) <= 0:
        return 0
    try:
        var ctx = DeviceContext(api=String(API))
        return Int64(put_str(buf, Int(cap), 0, ctx.arch_name()))
    except:
        return 0


@export("ml_plan")
def ml_plan(op: Int64, args: I64Ptr, phase: Int64) abi("C") -> Int64:
    return Int64(op_plan(Int(op), args, Int(phase)))


@export("ml_task")
def ml_task(op: Int64, args: I64Ptr, phase: Int64, task: Int64) abi("C") -> Int64:
    """A task on the host (the input checks run there)."""
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
    return Int64(op_buffers(Int(op), args, rows, Int(cap)))


@export("ml_first_nonfinite")
def ml_first_nonfinite(p: F32Ptr, n: Int64) abi("C") -> Int64:
    return Int64(first_nonfinite(p, Int(n)))


def task_kernel(op: Int64, args: I64Ptr, phase: Int64, ntasks: Int64):
    """One GPU thread = one task of the phase."""
    var t = Int(global_idx.x)
    if t < Int(ntasks):
        _ = device_op_task(Int(op), args, Int(phase), t)


def _row(rows: I64Ptr, i: Int, k: Int) -> Int:
    return Int(rows[unsafe_offset=i * GPU_ROW + k])


def _run(op: Int, args: I64Ptr, nargs: Int, rows: I64Ptr, nrows: Int) raises:
    var ctx = DeviceContext(api=String(API))
    # One device allocation holds every staged buffer.
    var offs = List[Int](capacity=nrows)
    var total = 0
    for i in range(nrows):
        offs.append(total)
        if _row(rows, i, 3) < 0:
            total += round_up(_row(rows, i, 1), STAGE_ALIGN)
    var pool = ctx.enqueue_create_buffer[DType.uint8](max(total, STAGE_ALIGN))
    # The device's args: the host's with buffer slots pointing at the copies.
    var dargs_host = List[Int64](capacity=nargs)
    for s in range(nargs):
        dargs_host.append(args[unsafe_offset=s])
    for i in range(nrows):
        var slot = _row(rows, i, 0)
        var alias = _row(rows, i, 3)
        if alias >= 0:
            dargs_host[slot] = dargs_host[_row(rows, alias, 0)]
            continue
        var sub = pool.create_sub_buffer[DType.uint8](offs[i], _row(rows, i, 1))
        if (_row(rows, i, 2) & BUF_IN) != 0:
            ctx.enqueue_copy(sub, U8Ptr(unsafe_from_address=Int(args[unsafe_offset=slot])))
        dargs_host[slot] = Int64(Int(sub.unsafe_ptr()))
    var dargs = ctx.enqueue_create_buffer[DType.int64](max(nargs, 1))
    ctx.enqueue_copy(dargs, dargs_host.unsafe_ptr())
    # Phases in order on one stream: a launch starts after the previous ends.
    var phase = 0
    while True:
        var n = op_plan(op, args, phase)  # planned on the host's args
        if n == PHASE_END:
            break
        if n < 0:
            raise Error("op ", op, " phase ", phase, " has no plan (", n, ")")
        if n > 0:
            ctx.enqueue_function[task_kernel](
                Int64(op), dargs.unsafe_ptr(), Int64(phase), Int64(n),
                grid_dim=ceil_div(n, THREADS_PER_BLOCK), block_dim=THREADS_PER_BLOCK)
        phase += 1
    for i in range(nrows):
        if _row(rows, i, 3) < 0 and (_row(rows, i, 2) & BUF_OUT) != 0:
            var sub = pool.create_sub_buffer[DType.uint8](offs[i], _row(rows, i, 1))
            var slot = _row(rows, i, 0)
            ctx.enqueue_copy(U8Ptr(unsafe_from_address=Int(args[unsafe_offset=slot])), sub)
    ctx.synchronize()


@export("ml_gpu_run")
def ml_gpu_run(op: Int64, args: I64Ptr, nargs: Int64, rows: I64Ptr, nrows: Int64,
               err: U8Ptr, errcap: Int64) abi("C") -> Int64:
    """Runs op on the device; 0, or 1 with a message in err (NUL-terminated)."""
    try:
        _run(Int(op), args, Int(nargs), rows, Int(nrows))
        return 0
    except e:
        var n = put_str(err, Int(errcap), 0, String(e))
        err[unsafe_offset=min(n, Int(errcap))] = 0
        return 1
