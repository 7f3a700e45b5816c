"""Mamba-3 backward (vector-Jacobian product of a zero-state prefill).

Two passes over chunks of Q = 64 tokens (aligned to absolute positions, the
forward's chunks), B rows x 64 tokens of workspace at a time:
  pass A (chunks 0 .. n-2, forward order): norm, in_proj, B/C norms for the
         chunk's tokens plus the next chunk's first token (its dt and sg give
         the last row's trapezoid beta), then per (row, head) the angles, the
         rotated k and the fold of the chunk into h. Checkpoints kept at every
         chunk start: h, theta, and the previous chunk's last rotated k and v.
  pass B (chunks n-1 .. 0, backward order): recompute the chunk's forward from
         its checkpoint, then the VJP of out_proj, of the chunked scan (per
         row and head), the head reductions, in_proj and the RMSNorms.
Both passes run the forward's own pieces (mamba3/stages.mojo: the norms,
the angles and rotation, the fold, each token's output), so o, y and the
checkpoints have the forward's bits (tests/test_recompute_bits.py). Only
the loops around them differ: the recompute keeps whole-chunk matrices
(G, L, C, q . h) for the VJP where the forward streams token by token.
Carried between chunks (per row and head): dh (the cotangent of the state
entering the later chunk), the running angle cotangent, and the beta of the
later chunk's first token.

Canonical orders (docs/backward.md, section Mamba-3):
  * activations: per (row, head) scan VJP in a fixed loop order (below); per
    token fma chains of linear_grad for the projections;
  * every weight gradient element: ONE sequential chain over all (row, token)
    contributions, chunks from last to first and, inside a chunk, rows b
    ascending then tokens ascending, continuing in the output array;
  * sums over heads (dBn, dCn, d angle per token): heads ascending.
Threads only split independent outputs, so no bit depends on the thread
count; a row's x gradient depends only on that row.
Modules: this one holds the plan, the tasks and the row stages; the per
(row, head) recompute is backward_recompute.mojo, the scan's VJP
backward_scan.mojo, the slots and workspace backward_layout.mojo.
Reference: torch autograd of the float64 recurrence of
tests/reference/torch_mamba3.py, whose forward equals mojolearn.reference.mamba3
(float64 NumPy) to 1e-12.
"""
from ..abi import I64Ptr, PHASE_END, PLAN_WORKSPACE, arg_int, arg_f32, ceil_div
from ..linear import matmul_ntasks, matmul_task, NR, WF_F32, KSEG
from ..weight_panels import blob_formats, ALL_F32
from ..linear_grad import gemm_ntasks, gemm_task, TPanels
from ..norms import rmsnorm_row_vjp
from ..block_backward import BackwardPhase, norm_backward_rows
from .layout import M3Dims, NST, HP, NANG, QC
from ..lanes import copy_floats
from .stages import norm_rows, bc_norm_rows
from .backward_layout import (
    BW_B, BW_L, BW_D, BW_X, BW_G, BW_BLOB, BW_WORK, BW_G_NORM, BW_G_IN, BW_G_DTB, BW_G_BNW,
    BW_G_CNW, BW_G_BB, BW_G_CB, BW_G_D, BW_G_OUT, BW_PANELS, BW_N0, BW_PENDING, BW_STATED,
    BW_LENGTHS, BW_S_THETA, BW_S_H, BW_S_PK, BW_S_PV, BW_C_THETA, ROWS_PER_TASK, task_rows,
    A_NORM, A_INPROJ,
    A_BCNORM, A_SCAN, A_KEEP, NA, F_NORM, F_INPROJ, F_BCNORM, S_FWD, B_OUT, B_SCAN, B_RED, B_INPROJ,
    B_NORM, B_NORMW, NB, BW3,
)
from .backward_scan import apply_pending
from .backward_scan import _scan_bwd
from .backward_recompute import recompute_scan_a, recompute_scan_fwd


# ------------------------------------------------------------ transposed panels


@always_inline
def _panels(dims: M3Dims) -> TPanels:
    """W_in^T (d, np) and W_out^T (di, d) in linear.mojo's panels, packed once
    per block by OP_PACK_TRANSPOSED (the Python layer keeps them), so dxn =
    dproj @ W_in and do = g @ W_out run on the forward's matmul kernel
    instead of a strided one: the same fma chains."""
    return TPanels(dims.np, dims.d, dims.d, dims.di)


# ------------------------------------------------------------ plan


def _counts(dims: M3Dims, wk: BW3, c: Int, stage: Int, nr: Int, is_b: Bool) -> Int:
    var rows = wk.b * nr
    var bh = wk.b * dims.nh
    if not is_b:
        if stage == A_NORM or stage == A_BCNORM:
            return ceil_div(rows, ROWS_PER_TASK)
        if stage == A_INPROJ:
            if wk.kept(c):
                return matmul_ntasks(rows, dims.np)
            return matmul_ntasks(rows, dims.np - dims.di)  # z is not needed
        if stage == A_KEEP:
            if wk.kept(c):
                return ceil_div(wk.b * wk.chunk_tokens(c), ROWS_PER_TASK)
            return 0
        return bh
    if nr == 0 and stage != S_FWD and stage != B_SCAN and not (
            wk.defer and (stage == B_OUT or stage == B_INPROJ)):
        return 0  # chunk 0 of state rows only (a full buffered chunk): no token rows
    if (stage == F_INPROJ or stage == F_BCNORM) and wk.kept(c):
        return 0  # pass A's rows are reused
    if stage == F_NORM or stage == F_BCNORM or stage == B_NORM:
        return ceil_div(rows, ROWS_PER_TASK)
    if stage == F_INPROJ:
        return matmul_ntasks(rows, dims.np)
    if stage == S_FWD or stage == B_SCAN:
        return bh
    if stage == B_OUT:
        if not wk.dw_now(c):
            return matmul_ntasks(rows, dims.di)
        return matmul_ntasks(rows, dims.di) + gemm_ntasks(dims.d, dims.di)
    if stage == B_RED:
        return ceil_div(rows, ROWS_PER_TASK) + dims.nh
    if stage == B_INPROJ:
        var ndw = gemm_ntasks(dims.np, dims.d) if wk.dw_now(c) else 0
        return matmul_ntasks(rows, dims.d) + ndw + 2 * NST // 16
    return ceil_div(dims.d, 16)  # B_NORMW


def bw3_of(args: I64Ptr, dims: M3Dims) -> BW3:
    """The call's layout: with a state (BW_STATED), chunk 0 starts with its
    BW_N0 buffered rows."""
    return BW3(dims, arg_int(args, BW_B), arg_int(args, BW_L), arg_int(args, BW_N0),
               arg_int(args, BW_STATED) != 0)


def m3_backward_plan(args: I64Ptr, phase: Int) -> Int:
    if blob_formats(arg_f32(args, BW_BLOB)) != ALL_F32:
        return -3  # backward reads float32 panels; blocks on packed weights expand them
    var n0 = arg_int(args, BW_N0)
    var stated = arg_int(args, BW_STATED) != 0
    if n0 < 0 or n0 > QC or (n0 != 0 and not stated):
        return -3
    if stated and (arg_int(args, BW_LENGTHS) != 0
                   or (arg_int(args, BW_PENDING) != 0 and n0 != 0)):
        return -3  # ragged rows only without a state; input states only on a fresh state
    var dims = M3Dims(arg_int(args, BW_D))
    var b = arg_int(args, BW_B)
    var wk = bw3_of(args, dims)
    if phase == PLAN_WORKSPACE:
        return wk.floats * 4
    var ph = BackwardPhase(phase, wk.nchunks, NA, NB, 0)
    if ph.init:
        return b * dims.nh
    if ph.pass_a:
        return _counts(dims, wk, ph.chunk, ph.stage, wk.chunk_tokens(ph.chunk) + 1, False)
    if ph.pass_b:
        return _counts(dims, wk, ph.chunk, ph.stage, wk.chunk_tokens(ph.chunk), True)
    return PHASE_END


# ------------------------------------------------------------ tasks


def m3_backward_task(args: I64Ptr, phase: Int, task: Int):
    var dims = M3Dims(arg_int(args, BW_D))
    var wk = bw3_of(args, dims)
    var ph = BackwardPhase(phase, wk.nchunks, NA, NB, 0)
    if ph.init:
        _init(args, dims, wk, task)
        return
    var c = ph.chunk
    var stage = ph.stage
    if ph.pass_a:
        var nr = wk.chunk_tokens(c) + 1
        if stage == A_NORM:
            _norm_rows(args, dims, wk, c, nr, task, False, True)
        elif stage == A_INPROJ:
            if wk.kept(c):
                _inproj(args, dims, wk, nr, task)
            else:
                _inproj_no_z(args, dims, wk, nr, task)
        elif stage == A_BCNORM:
            _bcnorm(args, dims, wk, nr, task)
        elif stage == A_SCAN:
            recompute_scan_a(args, dims, wk, c, task // dims.nh, task % dims.nh)
        else:
            _keep_rows(args, dims, wk, c, task)
        return
    var nc = wk.chunk_tokens(c)
    var kept = wk.kept(c)
    if wk.defer:
        wk.use_store(c, dims.d, dims.np, dims.di)
    if kept:
        wk.use_kept(c, dims.d)
    if stage == F_NORM:
        _norm_rows(args, dims, wk, c, nc, task, True, not kept)
    elif stage == F_INPROJ:
        _inproj(args, dims, wk, nc, task)
    elif stage == F_BCNORM:
        _bcnorm(args, dims, wk, nc, task)
    elif stage == S_FWD:
        recompute_scan_fwd(args, dims, wk, c, task // dims.nh, task % dims.nh)
    elif stage == B_OUT:
        _out_backward(args, dims, wk, c, nc, task)
    elif stage == B_SCAN:
        _scan_bwd(args, dims, wk, c, task // dims.nh, task % dims.nh)
    elif stage == B_RED:
        _reduce(args, dims, wk, c, nc, task)
    elif stage == B_INPROJ:
        _inproj_backward(args, dims, wk, c, nc, task)
    elif stage == B_NORM:
        _norm_backward(args, dims, wk, c, nc, task)
    else:
        _normw(args, dims, wk, nc, task)


def _init(args: I64Ptr, dims: M3Dims, wk: BW3, task: Int):
    """Zero (row, head) task's carries and its chunk-0 checkpoints; with a
    state, chunk 0's checkpoints are the state's theta and h (the pending
    term is added once token 0's dt and sg are known: apply_pending), the
    previous k, v rows its pending_k, pending_v, and the angle carry starts
    from the final theta's cotangent."""
    var w = arg_f32(args, BW_WORK)
    for i in range(HP * NST):
        w[unsafe_offset=wk.o_cdh + task * HP * NST + i] = 0.0
        w[unsafe_offset=wk.o_ckh + task * HP * NST + i] = 0.0
    for i in range(NANG):
        w[unsafe_offset=wk.o_cdt + task * NANG + i] = 0.0
        w[unsafe_offset=wk.o_ckt + task * NANG + i] = 0.0
    for i in range(HP):
        w[unsafe_offset=wk.o_ckv + task * HP + i] = 0.0
    for i in range(NST):
        w[unsafe_offset=wk.o_ckk + task * NST + i] = 0.0
    w[unsafe_offset=wk.o_cbeta + task] = 0.0
    if not wk.stated:
        return
    copy_floats(arg_f32(args, BW_S_H).unsafe_offset(task * HP * NST),
                w.unsafe_offset(wk.o_ckh + task * HP * NST), HP * NST)
    copy_floats(arg_f32(args, BW_S_THETA).unsafe_offset(task * NANG),
                w.unsafe_offset(wk.o_ckt + task * NANG), NANG)
    copy_floats(arg_f32(args, BW_C_THETA).unsafe_offset(task * NANG),
                w.unsafe_offset(wk.o_cdt + task * NANG), NANG)
    if arg_int(args, BW_PENDING) != 0:
        copy_floats(arg_f32(args, BW_S_PV).unsafe_offset(task * HP),
                    w.unsafe_offset(wk.o_ckv + task * HP), HP)
        copy_floats(arg_f32(args, BW_S_PK).unsafe_offset(task * NST),
                    w.unsafe_offset(wk.o_ckk + task * NST), NST)


# ------------------------------------------------------------ row stages


def _norm_rows(args: I64Ptr, dims: M3Dims, wk: BW3, c: Int, nr: Int, task: Int,
               copy_g: Bool, norm: Bool):
    var l = wk.l
    var d = dims.d
    var x = arg_f32(args, BW_X)
    var g = arg_f32(args, BW_G)
    var blob = arg_f32(args, BW_BLOB)
    var work = arg_f32(args, BW_WORK)
    var xn = work.unsafe_offset(wk.o_xn)
    var gch = work.unsafe_offset(wk.o_gch)
    var rt = task_rows(task, wk.b * nr)
    var t0 = wk.tok0(c)
    var lens = arg_int(args, BW_LENGTHS)
    if norm:  # the forward's (stages.mojo; ragged: padding rows +0.0, as there)
        norm_rows(x, l, d, t0, nr, rt.r0, rt.r1, blob.unsafe_offset(dims.o_norm), xn, lens)
    if copy_g:
        for r in range(rt.r0, rt.r1):
            var bb = r // nr
            if lens != 0 and t0 + r % nr >= Int(I64Ptr(unsafe_from_address=lens)[
                    unsafe_offset=bb]):
                for j in range(d):  # padding: no cotangent enters
                    gch[unsafe_offset=r * d + j] = 0.0
            else:
                copy_floats(g.unsafe_offset((bb * l + t0 + r % nr) * d),
                            gch.unsafe_offset(r * d), d)


def _inproj(args: I64Ptr, dims: M3Dims, wk: BW3, nr: Int, task: Int):
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    _ = matmul_task[WF_F32, KSEG](task, work.unsafe_offset(wk.o_xn), dims.d, wk.b * nr,
                                  blob.unsafe_offset(dims.o_in), dims.d, dims.np,
                                  work.unsafe_offset(wk.o_proj), dims.np)


def _inproj_no_z(args: I64Ptr, dims: M3Dims, wk: BW3, nr: Int, task: Int):
    """in_proj without the z panels (the first di outputs): pass A's scan
    never reads z, and pass B recomputes this chunk in full."""
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    var zp = dims.di // NR  # di is a multiple of 64: whole panels
    _ = matmul_task[WF_F32, KSEG](task, work.unsafe_offset(wk.o_xn), dims.d, wk.b * nr,
                                  blob.unsafe_offset(dims.o_in + zp * dims.d * NR), dims.d,
                                  dims.np - dims.di, work.unsafe_offset(wk.o_proj + dims.di),
                                  dims.np)


def _keep_rows(args: I64Ptr, dims: M3Dims, wk: BW3, c: Int, task: Int):
    """Copy pass A's rows of chunk c (B x (nt + 1) layout) to its keep slot,
    in pass B's B x nt layout."""
    var work = arg_f32(args, BW_WORK)
    var d = dims.d
    var npj = dims.np
    var nt = wk.chunk_tokens(c)
    var rt = task_rows(task, wk.b * nt)
    var kx = wk.keep_xn(c, d)
    var kp = wk.keep_proj(c)
    var kb = wk.keep_bcn(c)
    for r in range(rt.r0, rt.r1):
        var src = (r // nt) * (nt + 1) + r % nt
        copy_floats(work.unsafe_offset(wk.o_xn + src * d), work.unsafe_offset(kx + r * d), d)
        copy_floats(work.unsafe_offset(wk.o_proj + src * npj),
                  work.unsafe_offset(kp + r * npj), npj)
        copy_floats(work.unsafe_offset(wk.o_bcn + src * 2 * NST),
                  work.unsafe_offset(kb + r * 2 * NST), 2 * NST)


def _bcnorm(args: I64Ptr, dims: M3Dims, wk: BW3, nr: Int, task: Int):
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    var proj = work.unsafe_offset(wk.o_proj)
    var bcn = work.unsafe_offset(wk.o_bcn)
    var rt = task_rows(task, wk.b * nr)
    bc_norm_rows(proj, dims.np, dims.c_b, dims.c_c, rt.r0, rt.r1,
                 blob.unsafe_offset(dims.o_bnw), blob.unsafe_offset(dims.o_cnw), bcn, 2 * NST, 0,
                 NST)  # the forward's


# ------------------------------------------------------------ per (row, head) recompute


@always_inline
def _proj_vjp(args: I64Ptr, wk: BW3, c: Int, rows: Int, task: Int, o_dy: Int, ny: Int,
              o_panels: Int, o_dx: Int, nx: Int, o_sdy: Int, o_sx: Int, o_x: Int, gw_slot: Int):
    """Task `task` of one projection's backward (y = W x, W (ny, nx)) over
    the chunk's rows: the first matmul_ntasks(rows, nx) tasks dx[r, i] =
    sum_j dy[r, j] W[j, i] on W^T's panels at o_panels in BW_PANELS; the
    others dW[j, i] += sum_r dy[r, j] x[r, i] into slot gw_slot, deferred:
    all B L rows at once from the store (o_sdy, o_sx; chunk 0, the last
    processed), else this chunk's rows (o_dy, o_x), from +0.0 in the first
    chunk pass B runs. dy, dx, x: workspace offsets."""
    var work = arg_f32(args, BW_WORK)
    var n1 = matmul_ntasks(rows, nx)
    if task < n1:
        var wt = arg_f32(args, BW_PANELS).unsafe_offset(o_panels)
        _ = matmul_task(task, work.unsafe_offset(o_dy), ny, rows, wt, ny, nx,
                        work.unsafe_offset(o_dx), nx)
    elif wk.defer:
        _ = gemm_task(task - n1, work.unsafe_offset(o_sdy), 1, ny,
                      work.unsafe_offset(o_sx), nx, wk.b * wk.l,
                      arg_f32(args, gw_slot), nx, ny, nx, False)
    else:
        _ = gemm_task(task - n1, work.unsafe_offset(o_dy), 1, ny,
                      work.unsafe_offset(o_x), nx, rows,
                      arg_f32(args, gw_slot), nx, ny, nx, c < wk.nchunks - 1)


def _out_backward(args: I64Ptr, dims: M3Dims, wk: BW3, c: Int, nc: Int, task: Int):
    # do = g W_out; dW_out += g^T o
    _proj_vjp(args, wk, c, wk.b * nc, task, wk.o_gch, dims.d, _panels(dims).o2, wk.o_do,
              dims.di, wk.o_sgc, wk.o_so, wk.o_o, BW_G_OUT)


# ------------------------------------------------------------ reductions


def _reduce(args: I64Ptr, dims: M3Dims, wk: BW3, c: Int, nc: Int, task: Int):
    """Row tasks: head sums (h ascending) of dk, dq, d angle; B/C norm VJPs.
    Head tasks: B_bias, C_bias, dt_bias, D chains (rows ascending)."""
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    var rows = wk.b * nc
    var nh = dims.nh
    var npj = dims.np
    var nrt = ceil_div(rows, ROWS_PER_TASK)
    var s0 = wk.s0(c)
    var dqk = work.unsafe_offset(wk.o_dqk)
    var dproj = work.unsafe_offset(wk.o_dproj)
    if task < nrt:
        var proj = work.unsafe_offset(wk.o_proj)
        var rt = task_rows(task, rows)
        for r in range(rt.r0, rt.r1):
            var dpr = dproj.unsafe_offset(r * npj)
            var pbc = work.unsafe_offset(wk.o_pbc + r * 2 * NST)
            var sr = wk.scan_row(r, nc, s0)
            # head sums (h ascending) into the B | C columns of dproj as dBn | dCn
            # (16 lanes = 16 independent sums, each the same + chain over heads)
            comptime for kc in range(0, NST, 16):
                var sb = dqk.unsafe_load[width=16](wk.qk_row(sr, 0) + NST + kc)
                var sc = dqk.unsafe_load[width=16](wk.qk_row(sr, 0) + kc)
                for hh in range(1, nh):
                    sb = sb + dqk.unsafe_load[width=16](wk.qk_row(sr, hh) + NST + kc)
                    sc = sc + dqk.unsafe_load[width=16](wk.qk_row(sr, hh) + kc)
                dpr.unsafe_store(dims.c_b + kc, sb)
                dpr.unsafe_store(dims.c_c + kc, sc)
            comptime for rc in range(0, NANG, 16):
                var sa = work.unsafe_load[width=16](wk.o_dang + (r * nh) * NANG + rc)
                for hh in range(1, nh):
                    sa = sa + work.unsafe_load[width=16](wk.o_dang + (r * nh + hh) * NANG + rc)
                dpr.unsafe_store(dims.c_ang + rc, sa)
            var pr = proj.unsafe_offset(r * npj)
            # in place: each dBn_j is read before dBp_j is written
            var db = dpr.unsafe_offset(dims.c_b)  # in place: dout_j is read first
            var dc = dpr.unsafe_offset(dims.c_c)
            rmsnorm_row_vjp[False](pr.unsafe_offset(dims.c_b), NST,
                                   blob.unsafe_offset(dims.o_bnw), db, db, db, pbc)
            rmsnorm_row_vjp[False](pr.unsafe_offset(dims.c_c), NST,
                                   blob.unsafe_offset(dims.o_cnw), dc, dc, dc,
                                   pbc.unsafe_offset(NST))
        return
    var hh = task - nrt
    var gbb = arg_f32(args, BW_G_BB).unsafe_offset(hh * NST)
    var gcb = arg_f32(args, BW_G_CB).unsafe_offset(hh * NST)
    comptime for cc in range(8):
        var ab = gbb.unsafe_load[width=16](cc * 16)
        var ac = gcb.unsafe_load[width=16](cc * 16)
        for r in range(rows):
            var sr = wk.scan_row(r, nc, s0)
            ab = ab + dqk.unsafe_load[width=16](wk.qk_row(sr, hh) + NST + cc * 16)
            ac = ac + dqk.unsafe_load[width=16](wk.qk_row(sr, hh) + cc * 16)
        gbb.unsafe_store(cc * 16, ab)
        gcb.unsafe_store(cc * 16, ac)
    var gdtb = arg_f32(args, BW_G_DTB)
    var gd = arg_f32(args, BW_G_D)
    var sdt = gdtb[unsafe_offset=hh]
    var sd = gd[unsafe_offset=hh]
    for r in range(rows):
        sdt = sdt + dproj[unsafe_offset=r * npj + dims.c_dt + hh]
        sd = sd + work[unsafe_offset=wk.o_dd + r * nh + hh]
    gdtb[unsafe_offset=hh] = sdt
    gd[unsafe_offset=hh] = sd


def _inproj_backward(args: I64Ptr, dims: M3Dims, wk: BW3, c: Int, nc: Int, task: Int):
    var work = arg_f32(args, BW_WORK)
    var rows = wk.b * nc
    var d = dims.d
    var npj = dims.np
    var n1 = matmul_ntasks(rows, d)
    var n2 = gemm_ntasks(npj, d) if wk.dw_now(c) else 0
    if task < n1 + n2:  # dxn = dproj W_in (W_in^T's panels first, at 0); dW_in += dproj^T xn
        _proj_vjp(args, wk, c, rows, task, wk.o_dproj, npj, 0, wk.o_dxn, d,
                  wk.o_sdp, wk.o_sxn, wk.o_xn, BW_G_IN)
    else:  # B_norm.weight | C_norm.weight += pbc rows, r ascending
        var q = task - n1 - n2
        var pbc = work.unsafe_offset(wk.o_pbc)
        var dst = arg_f32(args, BW_G_BNW)
        var col = q * 16
        if col >= NST:
            dst = arg_f32(args, BW_G_CNW)
            col -= NST
        var acc = dst.unsafe_load[width=16](col)
        for r in range(rows):
            acc = acc + pbc.unsafe_load[width=16](r * 2 * NST + q * 16)
        dst.unsafe_store(col, acc)


def _norm_backward(args: I64Ptr, dims: M3Dims, wk: BW3, c: Int, nc: Int, task: Int):
    """dx = g + RMSNorm VJP of dxn; pn = block norm weight terms."""
    var work = arg_f32(args, BW_WORK)
    var rt = task_rows(task, wk.b * nc)
    norm_backward_rows(args, wk.l, dims.d, wk.tok0(c), nc, arg_int(args, BW_LENGTHS), rt.r0,
                       rt.r1, arg_f32(args, BW_BLOB).unsafe_offset(dims.o_norm),
                       work.unsafe_offset(wk.o_dxn), work.unsafe_offset(wk.o_pn))


def _normw(args: I64Ptr, dims: M3Dims, wk: BW3, nc: Int, task: Int):
    var work = arg_f32(args, BW_WORK)
    var gn = arg_f32(args, BW_G_NORM)
    var pn = work.unsafe_offset(wk.o_pn)
    var d = dims.d
    var col = task * 16
    var acc = gn.unsafe_load[width=16](col)
    for r in range(wk.b * nc):
        acc = acc + pn.unsafe_load[width=16](r * d + col)
    gn.unsafe_store(col, acc)
