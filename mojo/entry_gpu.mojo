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
from std.sys import get_defined_string
from max.gpu import global_idx
from max.gpu.host import DeviceContext
from mojolearn_kernels.abi import I64Ptr, PHASE_END, ceil_div, round_up
from mojolearn_kernels.exports import SHARED_EXPORTS
from mojolearn_kernels.dispatch import op_plan, device_op_task
from mojolearn_kernels.opspec import BUF_IN, BUF_OUT
from mojolearn_kernels.describe import U8Ptr, put_str, describe_text

# Naming the shared exports (exports.mojo) is what emits them into this binary.
comptime _EMIT_SHARED = SHARED_EXPORTS
comptime API = get_defined_string["GPU_API", "cuda"]()
comptime ARCH = get_defined_string["ML_ARCH", "sm_90"]()
comptime THREADS_PER_BLOCK = 32  # tasks are large; spread them over the SMs
comptime STAGE_ALIGN = 256  # bytes between staged buffers
comptime GPU_ROW = 4  # table rows from the host: slot, bytes, flags, alias


comptime VENDOR_ID = 1 if API == "cuda" else (2 if API == "hip" else 3)  # _abi.VENDORS


@export("ml_vendor")
def ml_vendor() abi("C") -> Int64:
    comptime assert API == "cuda" or API == "hip" or API == "metal", "GPU_API must be cuda, hip or metal"
    return Int64(VENDOR_ID)


@export("ml_describe")
def ml_describe(buf: U8Ptr, cap: Int64) abi("C") -> Int64:
    return Int64(describe_text(buf, Int(cap), API, ARCH, ""))


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
