"""Exports for bench/linear_micro.py: the forward matrix product of
mojo/mojolearn_kernels/linear.mojo on one thread, nothing else.

Built by the script (mojo build --emit shared-lib, the same flags as the
CPU binaries) so a tile or task-grid change can be timed on its own."""
from mojolearn_kernels.abi import F32Ptr
from mojolearn_kernels.linear import (matmul_ntasks, matmul_task, matmul_task_wf, pack_panels,
                                      KSEG, WF_F32)


@export("lm_pack")
def lm_pack(w: Int, m: Int, k: Int, dst: Int) abi("C"):
    """Pack row-major W (m, k) into the kernel's panels at dst."""
    pack_panels(F32Ptr(unsafe_from_address=w), m, k, F32Ptr(unsafe_from_address=dst))


@export("lm_run")
def lm_run(x: Int, rows: Int, wp: Int, k: Int, m: Int, y: Int) abi("C"):
    """Product y (rows, m) = x (rows, k) @ W^T, every task of the grid in turn."""
    var xp = F32Ptr(unsafe_from_address=x)
    var wpp = F32Ptr(unsafe_from_address=wp)
    var yp = F32Ptr(unsafe_from_address=y)
    for t in range(matmul_ntasks(rows, m)):
        _ = matmul_task[WF_F32, KSEG](t, xp, k, rows, wpp, k, m, yp, m)


@export("lm_run_wf")
def lm_run_wf(wf: Int, x: Int, rows: Int, wp: Int, k: Int, m: Int, y: Int) abi("C"):
    """The same product on panels in weight format wf (linear.mojo's WF_*),
    in the canonical forward order."""
    var xp = F32Ptr(unsafe_from_address=x)
    var wpp = F32Ptr(unsafe_from_address=wp)
    var yp = F32Ptr(unsafe_from_address=y)
    for t in range(matmul_ntasks(rows, m)):
        _ = matmul_task_wf(wf, t, xp, k, rows, wpp, k, m, yp, m)
