"""The parts of a block's backward op that Mamba-1, -2 and -3 share: the
phase schedule (BackwardPhase), a projection's backward as tasks
(linear_vjp_task) and the block norm's backward over a task's token rows
(norm_backward_rows).

Every block backward checkpoints its state by running the forward again:
phase 0 prepares (per-row init), pass A runs chunks 0 .. n-2 in order to
write the state at each chunk's start, pass B runs every chunk from the
last to the first (its forward stages again, then their VJP), and a few
finishing phases follow.
"""
from .abi import F32Ptr, I64Ptr, arg_f32
from .block_slots import BW_X, BW_G, BW_DX
from .norms import block_norm_vjp_row
from .linear import matmul_ntasks, matmul_task
from .linear_grad import gemm_task

struct BackwardPhase(ImplicitlyCopyable):
    """Where phase `phase` falls in the schedule of a backward over
    `nchunks` chunks with na stages per chunk in pass A, nb in pass B and
    nfinish finishing phases: which part of the schedule it is in (none
    past the last phase), its chunk and its stage (in a finishing phase,
    the index of that phase)."""
    var init: Bool  # phase 0
    var pass_a: Bool
    var pass_b: Bool
    var finish: Bool
    var chunk: Int
    var stage: Int

    def __init__(out self, phase: Int, nchunks: Int, na: Int, nb: Int, nfinish: Int):
        self.init = phase == 0
        self.pass_a = False
        self.pass_b = False
        self.finish = False
        self.chunk = 0
        self.stage = 0
        if self.init:
            return
        var p = phase - 1
        var pa = (nchunks - 1) * na
        if p < pa:
            self.pass_a = True
            self.chunk = p // na
            self.stage = p % na
            return
        p -= pa
        if p < nchunks * nb:
            self.pass_b = True
            self.chunk = nchunks - 1 - p // nb
            self.stage = p % nb
            return
        p -= nchunks * nb
        self.finish = p < nfinish
        self.stage = p


def norm_backward_rows(args: I64Ptr, l: Int, d: Int, t0: Int, nt: Int, lens: Int,
                       r0: Int, r1: Int, w: F32Ptr, dxn: F32Ptr, pn: F32Ptr):
    """The block norm's backward for token rows r0 .. r1-1 of a chunk of nt
    tokens per batch row from token t0 (row r: batch row r // nt, token
    t0 + r % nt): dx = grad_output + the RMSNorm VJP of dxn, and the norm
    weight's terms pn (norms.block_norm_vjp_row; w the weight, dxn and pn
    (rows, d) arrays). lens: the address of the ragged row lengths, or 0;
    a padding token gets dx = pn = +0.0."""
    var x = arg_f32(args, BW_X)
    var g = arg_f32(args, BW_G)
    var dx = arg_f32(args, BW_DX)
    for r in range(r0, r1):
        var bb = r // nt
        var t = t0 + r % nt
        var off = (bb * l + t) * d
        var pad = lens != 0 and t >= Int(I64Ptr(unsafe_from_address=lens)[unsafe_offset=bb])
        block_norm_vjp_row(x.unsafe_offset(off), g.unsafe_offset(off), dx.unsafe_offset(off), w,
                           dxn.unsafe_offset(r * d), pn.unsafe_offset(r * d), d, pad)


@always_inline
def linear_vjp_task(task: Int, dy: F32Ptr, ny: Int, rows: Int, wt: F32Ptr, nx: Int,
                    dx: F32Ptr, ldx: Int, x: F32Ptr, ld_x: Int, gw: F32Ptr, accumulate: Bool):
    """Task `task` of the backward of a projection y = W x (W (ny, nx)) over
    `rows` rows of dy (ny apart): the first matmul_ntasks(rows, nx) tasks
    dx = dy W on W^T's panels wt (the forward's matmul kernel, so the same
    fma chain as a strided product), the others gw += dy^T x
    (linear_grad.gemm_task; from +0.0 unless accumulate)."""
    var n1 = matmul_ntasks(rows, nx)
    if task < n1:
        _ = matmul_task(task, dy, ny, rows, wt, ny, nx, dx, ldx)
    else:
        _ = gemm_task(task - n1, dy, 1, ny, x, ld_x, rows, gw, nx, ny, nx, accumulate)
