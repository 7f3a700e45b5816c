"""Mamba-3 SISO block: prepare (pack weights) and forward (prefill,
continuation, ragged rows, the one-token decode step and the lazy reports are
all this one operation).

Every token is pushed through the SAME per-token evaluation of the chunked
(Q = 64) formula, whatever the call it arrives in, so prefill, continuation
and decode agree bit for bit by construction (docs/mamba3.md gives the
canonical order in full):
    xn   = RMSNorm(x);  proj = in_proj @ xn   [z | v | Bp | Cp | dd_dt | dd_A | trap | ang]
    Bn, Cn = RMSNorm(Bp), RMSNorm(Cp);  k = Bn + B_bias[h], q = Cn + C_bias[h]
    per row b, head h, token (sequential):
        dt = softplus(dd_dt + dt_bias); A = min(-phi(dd_A), -1e-4); adt = A * dt
        sg = sigmoid(trap); theta = mod2pi(fma(tanh(ang) * pi, dt, theta))
        rotate q, k pairs (2r, 2r+1), r < 32
        if the working chunk holds 64 rows: fold it into h (beta_63 from this token)
        if pending (input states): h += (v_in * (dt (1 - sg))) k_in^T
        append the row to the working-chunk buffers (row i)
        y = exp(cum_i) (q_rot . h) + sum_{j<i} (exp(seg(i,j)) scale_j (q_rot . k_rot_j)) v_j
            + ((q . k) gamma_i) v_i + D v_i
        o = y * silu(z)
    out = x + out_proj @ o
Dot products over N = 128 use a fixed 16-lane split (lane l sums n = l, l+16,
... in order) and a fixed halving tree, the same on every target.
Reference: mojolearn.reference.mamba3 (float64 NumPy, the unchunked
recurrence); tests/test_mamba3_forward.py compares against it.
"""
from ..abi import I64Ptr, PHASE_END, PLAN_WORKSPACE, arg_int, arg_f32, arg_i64, ceil_div
from ..residual import add_residual_tile
from ..linear import matmul_ntasks, matmul_task_wf
from ..weight_panels import blob_formats
from ..block_prepare import prepare_plan, pack_projection, set_blob_header
from .stages import norm_rows, bc_norm_rows
from .layout import *
from ..norms import NORM_ROWS_PER_TASK
from ..lanes import copy_floats
from .scan import scan_task, row_gates, report_task


# ---------------------------------------------------------------- prepare


def m3_prepare_plan(args: I64Ptr, phase: Int) -> Int:
    var wfs = arg_int(args, PREP_WFMT)
    return prepare_plan(phase, wfs, NPROJ, M3Dims(arg_int(args, PREP_D), wfs).blob, NPROJ + 1)


def m3_prepare_task(args: I64Ptr, phase: Int, task: Int):
    var wfs = arg_int(args, PREP_WFMT)
    var dims = M3Dims(arg_int(args, PREP_D), wfs)
    var blob = arg_f32(args, PREP_BLOB)
    if task < NPROJ:
        pack_projection(args, dims, task, blob)
    else:
        set_blob_header(blob, wfs, dims, NPROJ)
        copy_floats(arg_f32(args, PREP_NORM), blob.unsafe_offset(dims.o_norm), dims.d)
        copy_floats(arg_f32(args, PREP_DTB), blob.unsafe_offset(dims.o_dtb), dims.nh)
        copy_floats(arg_f32(args, PREP_BNW), blob.unsafe_offset(dims.o_bnw), NST)
        copy_floats(arg_f32(args, PREP_CNW), blob.unsafe_offset(dims.o_cnw), NST)
        copy_floats(arg_f32(args, PREP_BB), blob.unsafe_offset(dims.o_bb), dims.nh * NST)
        copy_floats(arg_f32(args, PREP_CB), blob.unsafe_offset(dims.o_cb), dims.nh * NST)
        copy_floats(arg_f32(args, PREP_DSKIP), blob.unsafe_offset(dims.o_dskip), dims.nh)


# ---------------------------------------------------------------- forward


def forward_dims(args: I64Ptr) -> M3Dims:
    """The block's sizes and blob layout, in the format its blob records."""
    return M3Dims(arg_int(args, FWD_D), blob_formats(arg_f32(args, FWD_BLOB)))


def m3_forward_plan(args: I64Ptr, phase: Int) -> Int:
    var dims = forward_dims(args)
    var b = arg_int(args, FWD_B)
    if arg_int(args, FWD_MODE) == 1:
        if phase == PLAN_WORKSPACE:
            return b * dims.nh * FOLD_SCR * 4
        if phase == 0:
            return b * dims.nh
        return PHASE_END
    var wk = M3Work(dims, b, arg_int(args, FWD_L))
    if arg_int(args, FWD_ROW_N0) != 0 and (wk.l != 1 or arg_int(args, FWD_N0) != 0
                                          or arg_int(args, FWD_PENDING) != 0):
        return -3  # per-row positions: one-token steps, nothing pending
    if phase == PLAN_WORKSPACE:
        return wk.floats * 4
    if phase >= wk.nchunks * NSTAGES:
        return PHASE_END
    var c = phase // NSTAGES
    var stage = phase % NSTAGES
    var rows = b * wk.chunk_tokens(c)
    if stage == ST_NORM:
        return ceil_div(rows, NORM_ROWS_PER_TASK)
    if stage == ST_BCNORM:
        return ceil_div(rows, BC_ROWS_PER_TASK)
    if stage == ST_INPROJ:
        return matmul_ntasks(rows, dims.np)
    if stage == ST_SCAN:
        return wk.scan_tasks
    return matmul_ntasks(rows, dims.d)


def m3_forward_task(args: I64Ptr, phase: Int, task: Int):
    var dims = forward_dims(args)
    var b = arg_int(args, FWD_B)
    if arg_int(args, FWD_MODE) == 1:
        report_task(args, dims, task)
        return
    var wk = M3Work(dims, b, arg_int(args, FWD_L))
    var work = arg_f32(args, FWD_WORK)
    var c = phase // NSTAGES
    var stage = phase % NSTAGES
    var t0 = c * wk.tc
    var nc = wk.chunk_tokens(c)
    var rows = b * nc
    var blob = arg_f32(args, FWD_BLOB)
    var d = dims.d
    var xn = work.unsafe_offset(wk.o_xn)
    var proj = work.unsafe_offset(wk.o_proj)
    # o (rows, di) overwrites the z columns of proj (row stride np): a
    # head's scan reads its z block, then writes its o block in its place
    var o = proj
    if stage == ST_NORM:
        var r0 = task * NORM_ROWS_PER_TASK
        norm_rows(arg_f32(args, FWD_X), arg_int(args, FWD_L), d, t0, nc, r0,
                  min(rows, r0 + NORM_ROWS_PER_TASK), blob.unsafe_offset(dims.o_norm), xn,
                  arg_int(args, FWD_LENGTHS))
    elif stage == ST_INPROJ:
        _ = matmul_task_wf(dims.wf_in, task, xn, d, rows, blob.unsafe_offset(dims.o_in), d,
                           dims.np, proj, dims.np)
    elif stage == ST_BCNORM:
        var r0 = task * BC_ROWS_PER_TASK
        var r1 = min(rows, r0 + BC_ROWS_PER_TASK)
        bc_norm_rows(proj, dims.np, dims.c_b, dims.c_c, r0, r1, blob.unsafe_offset(dims.o_bnw),
                     blob.unsafe_offset(dims.o_cnw), proj, dims.np, dims.c_b, dims.c_c)
        for r in range(r0, r1):
            row_gates(proj.unsafe_offset(r * dims.np), dims, blob)
    elif stage == ST_SCAN:
        var per_row = wk.scan_tasks // b
        var bb = task // per_row
        var h0 = (task % per_row) * wk.scan_heads
        var h1 = min(h0 + wk.scan_heads, dims.nh)
        for hh in range(h0, h1):  # one scratch, in turn
            scan_task(args, dims, blob, proj, o, work.unsafe_offset(wk.o_scr + task * wk.scr),
                      bb, hh, t0, nc, hh + 1 if hh + 1 < h1 else -1)
    else:
        var t = matmul_task_wf(dims.wf_out, task, o, dims.np, rows,
                               blob.unsafe_offset(dims.o_out), dims.di, d, xn, d)
        add_residual_tile(arg_f32(args, FWD_X), arg_f32(args, FWD_Y), xn, arg_int(args, FWD_L),
                          dims.d, arg_i64(args, FWD_LENGTHS), arg_int(args, FWD_LENGTHS) != 0,
                          t0, nc, t.r0, t.r1, t.c0, t.c1)

