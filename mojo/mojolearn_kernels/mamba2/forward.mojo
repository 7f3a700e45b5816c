"""Mamba-2 (SSD) block: prepare (pack weights) and forward (prefill,
continuation, ragged rows, the one-token decode step and the h_last report
are all this one operation). The canonical order is written out in
docs/mamba2.md; in short, per token:
    xn = RMSNorm(x);  [z | xBC | dtraw] = in_proj @ xn
    xBC = silu(conv(xBC)) = [x | B | C]
    dt  = min(max(softplus(dtraw + dt_bias), lo), hi);  dA = dt * A_h
and per head over the chunk of Q = 256 rows aligned to absolute positions
(rows i, j counted from the chunk start):
    S_i(i)  = 0;  S_i(j) = S_i(j+1) + dA_{j+1}  for j = i-1 down to -1
              (the decay sum from row j to row i, no cancellation)
    CB_ij   = fma chain over n of C_i[n] B_j[n]
    u_ij    = (CB_ij * exp(S_i(j))) * dt_j
    Ydiag_i = fma chain over j = 0..i of u_ij x_j
    Yoff_i  = (fma chain over n of C_i[n] h[p][n]) * exp(S_i(-1))
    y_i     = fma(x_i, D_h, Ydiag_i + Yoff_i);   yg = y * silu(z)
    g = RMSNorm(yg, norm.weight);  out = x + out_proj @ g
    fold (256th row; the h_last report on a partial chunk of nr rows,
    last = nr - 1):
      h[p][n] = exp(S_last(-1)) * h[p][n]
      for i = 0..nr-1: h[p][n] = fma((exp(S_last(i)) * dt_i) * x_i[p], B_i[n], h[p][n])
A call that continues a state re-runs the open chunk: its first `s`
(buffered) rows are read from the state buffers, only new rows produce
outputs, and every row goes through the same code as in a one-shot prefill.

Phases of OP_M2_FORWARD: 0 loads the state (one task per row); then per
group of a chunk's new rows (at most MAX_GROUP_ROWS rows in all): norm,
in_proj, conv (+ dt/dA rows and B transposed, per 64-channel block), CB
(per row and 16 new rows), SSD (per row and head: outputs; the fold and the
h_last report after the chunk's last group; mamba2/ssd.mojo), gated norm,
out_proj + residual; last, the state is saved (one task per row).
Reference: mojolearn.reference.mamba2 (float64 NumPy, the unchunked
recurrence); tests compare against transformers' Mamba2Block run in float64
(tests/reference/hf_mamba.py), itself checked equal to it to 1e-10.
"""
from std.memory import bitcast
from ..abi import I64Ptr, PHASE_END, PLAN_WORKSPACE, arg_int, arg_f32, ceil_div
from ..linear import matmul_ntasks, matmul_task_wf
from ..weight_panels import set_blob_option
from ..block_prepare import prepare_plan, pack_projection, set_blob_header
from ..norms import rms_scales_of, scale_row, NORM_ROWS_PER_TASK
from ..residual import add_residual_tile
from ..conv import causal_conv_silu
from ..numerics import exp_f32
from ..lanes import copy_floats, transpose_in, transpose_out
from .layout import (
    P, N, Q, KCONV, DIRECT_CB_MAX, CB_ROWS_PER_TASK, PREP_D, PREP_NORM, PREP_IN,
    PREP_CONVW, PREP_CONVB, PREP_DTB, PREP_ALOG, PREP_DSKIP, PREP_GNORM, PREP_OUT, PREP_LO, PREP_HI,
    PREP_BLOB, PREP_WFMT, PREP_IN_EXP, PREP_OUT_EXP, PREP_A_GIVEN, PREP_NGROUPS, NPROJ, ST_NORM,
    ST_INPROJ, ST_CONV, ST_CB, ST_SSD, ST_GNORM, NSTAGES, M2Dims, M2Call, M2Group, FWD_ROW_S,
)
from .ssd import dt_rows, cb_task, ssd_task


# ---------------------------------------------------------------- prepare


def _prep_dims(args: I64Ptr) -> M2Dims:
    return M2Dims(arg_int(args, PREP_D), arg_int(args, PREP_WFMT), arg_int(args, PREP_NGROUPS))


def _f32_bits(v: Int) -> Float32:
    return bitcast[DType.float32, 1](Int32(v))


def m2_prepare_plan(args: I64Ptr, phase: Int) -> Int:
    var ng = arg_int(args, PREP_NGROUPS)
    var nh = 2 * arg_int(args, PREP_D) // P
    if ng < 0 or (ng > 1 and nh % ng != 0):
        return -3  # heads split evenly over the groups
    return prepare_plan(phase, arg_int(args, PREP_WFMT), NPROJ, _prep_dims(args).blob, NPROJ + 2)


def m2_prepare_task(args: I64Ptr, phase: Int, task: Int):
    var wfs = arg_int(args, PREP_WFMT)
    var dims = _prep_dims(args)
    var blob = arg_f32(args, PREP_BLOB)
    var d = dims.d
    if task < NPROJ:
        pack_projection(args, dims, task, blob)
    elif task == NPROJ:
        var cw = arg_f32(args, PREP_CONVW)
        for c in range(dims.cd):
            for k in range(KCONV):
                blob[unsafe_offset=dims.o_convw + k * dims.cd + c] = cw[unsafe_offset=c * KCONV + k]
    else:
        set_blob_header(blob, wfs, dims, NPROJ)
        set_blob_option(blob, arg_int(args, PREP_NGROUPS))
        copy_floats(arg_f32(args, PREP_NORM), blob.unsafe_offset(dims.o_norm), d)
        copy_floats(arg_f32(args, PREP_CONVB), blob.unsafe_offset(dims.o_convb), dims.cd)
        copy_floats(arg_f32(args, PREP_DTB), blob.unsafe_offset(dims.o_dtb), dims.nh)
        copy_floats(arg_f32(args, PREP_DSKIP), blob.unsafe_offset(dims.o_dskip), dims.nh)
        copy_floats(arg_f32(args, PREP_GNORM), blob.unsafe_offset(dims.o_gnorm), dims.di)
        var alog = arg_f32(args, PREP_ALOG)
        var given = arg_int(args, PREP_A_GIVEN) != 0
        for hh in range(dims.nh):
            var v = alog[unsafe_offset=hh]
            blob[unsafe_offset=dims.o_a + hh] = v if given else -exp_f32[1](v)
        blob[unsafe_offset=dims.o_lim] = _f32_bits(arg_int(args, PREP_LO))
        blob[unsafe_offset=dims.o_lim + 1] = _f32_bits(arg_int(args, PREP_HI))


# ---------------------------------------------------------------- forward


def m2_forward_plan(args: I64Ptr, phase: Int) -> Int:
    var cl = M2Call(args)
    var wk = cl.wk
    var dims = cl.dims
    if arg_int(args, FWD_ROW_S) != 0 and (wk.l != 1 or not cl.has_state or wk.s != 0):
        return -3  # per-row positions: one-token steps of a state only
    if phase == PLAN_WORKSPACE:
        return wk.floats * 4
    if phase == 0:
        return wk.b
    var last = 1 + wk.ngroups_total() * NSTAGES
    if phase == last:
        return wk.b if cl.save else 0
    if phase > last:
        return PHASE_END
    var gp = wk.group((phase - 1) // NSTAGES)
    var stage = (phase - 1) % NSTAGES
    var rows = wk.b * gp.gn
    if stage == ST_NORM or stage == ST_GNORM:
        return ceil_div(rows, NORM_ROWS_PER_TASK)
    if stage == ST_INPROJ:
        return matmul_ntasks(rows, dims.npj)
    if stage == ST_CONV:
        return dims.cd // P  # 64-channel blocks: nh + 4 ng
    if stage == ST_CB:
        return wk.b * ceil_div(gp.gn, CB_ROWS_PER_TASK)
    if stage == ST_SSD:
        return wk.b * dims.nh
    return matmul_ntasks(rows, dims.d)


def m2_forward_task(args: I64Ptr, phase: Int, task: Int):
    var cl = M2Call(args)
    var wk = cl.wk
    var dims = cl.dims
    if phase == 0:
        _load_state(cl, task)
        return
    var ng = wk.ngroups_total()
    if phase == 1 + ng * NSTAGES:
        _save_state(cl, task)
        return
    var gp = wk.group((phase - 1) // NSTAGES)
    var stage = (phase - 1) % NSTAGES
    var rows = wk.b * gp.gn
    var work = cl.work
    var blob = cl.blob
    if stage == ST_NORM:
        _norm_rows[False](cl, gp, task)
    elif stage == ST_INPROJ:
        _ = matmul_task_wf(dims.wf_in, task, work.unsafe_offset(wk.o_xn), dims.d, rows,
                           blob.unsafe_offset(dims.o_in), dims.d, dims.npj,
                           work.unsafe_offset(wk.o_zx), dims.npj)
    elif stage == ST_CONV:
        _conv_task(cl, gp, task)
    elif stage == ST_CB:
        cb_task(cl, gp, task)
    elif stage == ST_SSD:
        ssd_task(cl, gp, task // dims.nh, task % dims.nh, task)
    elif stage == ST_GNORM:
        _norm_rows[True](cl, gp, task)
    else:
        var t = matmul_task_wf(dims.wf_out, task, work.unsafe_offset(wk.o_yg), dims.di, rows,
                               blob.unsafe_offset(dims.o_out), dims.di, dims.d,
                               work.unsafe_offset(wk.o_xn), dims.d)
        _residual(cl, gp, t.r0, t.r1, t.c0, t.c1)


def _is_pad(cl: M2Call, bb: Int, t: Int) -> Bool:
    return cl.ragged and t >= Int(cl.lens[unsafe_offset=bb])


# Rows whose RMSNorm sums of squares run side by side (norms.rms_scales):
# one row's sequential chain is bound by the fma latency.
comptime NORM_SIDE = 8


def _norm_rows[GATED: Bool](cl: M2Call, gp: M2Group, task: Int):
    """RMSNorm of the task's rows of the group: the block norm (x -> xn,
    padding rows +0.0 whatever x holds) or, GATED, the gated norm of yg in
    place, over each B/C group's gs channels of d_inner on its own (one
    norm over d_inner for one group; padding rows stay +0.0). Up to
    NORM_SIDE rows of one batch row at a time: their chains side by side,
    each the same chain as alone."""
    var gn = gp.gn
    var r0 = task * NORM_ROWS_PER_TASK
    var r1 = min(cl.wk.b * gn, r0 + NORM_ROWS_PER_TASK)
    var r = r0
    while r < r1:
        var bb = r // gn
        var nr = min(NORM_SIDE, min(r1, (bb + 1) * gn) - r)
        var t0 = gp.t0 + r % gn
        comptime if GATED:
            var gs = cl.dims.gs
            var di = cl.dims.di
            var w = cl.blob.unsafe_offset(cl.dims.o_gnorm)
            for g in range(cl.dims.ng):
                var rows = cl.work.unsafe_offset(cl.wk.o_yg + r * di + g * gs)
                var sc = rms_scales_of[NORM_SIDE](rows, di, gs, nr)
                for k in range(nr):
                    if not _is_pad(cl, bb, t0 + k):
                        var row = rows.unsafe_offset(k * di)
                        scale_row(row, gs, sc[k], w.unsafe_offset(g * gs), row)
        else:
            var d = cl.dims.d
            var src = cl.x.unsafe_offset((bb * cl.wk.l + t0) * d)
            var sc = rms_scales_of[NORM_SIDE](src, d, d, nr)
            for k in range(nr):
                var dst = cl.work.unsafe_offset(cl.wk.o_xn + (r + k) * d)
                if _is_pad(cl, bb, t0 + k):
                    for j in range(d):
                        dst[unsafe_offset=j] = 0.0
                else:
                    scale_row(src.unsafe_offset(k * d), d, sc[k],
                              cl.blob.unsafe_offset(cl.dims.o_norm), dst)
        r += nr


def _residual(cl: M2Call, gp: M2Group, r0: Int, r1: Int, c0: Int, c1: Int):
    add_residual_tile(cl.x, cl.y, cl.work.unsafe_offset(cl.wk.o_xn), cl.wk.l, cl.dims.d,
                      cl.lens, cl.ragged, gp.t0, gp.gn, r0, r1, c0, c1)


def _conv_task(cl: M2Call, gp: M2Group, task: Int):
    """Channel block `task` (64 channels) of the conv for the group's rows;
    then for a head block: the raw dt of the group's rows, dt and dA of
    chunk rows [lo, hi) (a session's one-token step: only those not yet in
    its cache); for a B block: B transposed for those rows (only when the
    chunk's CB uses the transposed form)."""
    var dims = cl.dims
    var wk = cl.wk
    var cd = dims.cd
    var di = dims.di
    var nh = dims.nh
    var work = cl.work
    var blob = cl.blob
    var gn = gp.gn
    var c0 = task * P
    for bb in range(wk.b):
        var rg = cl.row_group(gp, bb)  # (rows with their own positions)
        if gn > 0:
            causal_conv_silu(
                work.unsafe_offset(wk.o_win + bb * KCONV * cd), cd,
                work.unsafe_offset(wk.o_zx + bb * gn * dims.npj + di), dims.npj, gn,
                blob.unsafe_offset(dims.o_convw), cd,
                blob.unsafe_offset(dims.o_convb), c0, c0 + P,
                work.unsafe_offset(wk.o_cx + (bb * wk.nn + gp.gs) * cd), cd,
            )
        if task < nh:
            var hh = task
            var draw = work.unsafe_offset(wk.o_draw + (bb * nh + hh) * Q)
            for r in range(gn):
                draw[unsafe_offset=rg.i0 + rg.gs + r] = work[
                    unsafe_offset=wk.o_zx + (bb * gn + r) * dims.npj + di + cd + hh]
            dt_rows(cl, rg.c, bb, hh, rg.lo, rg.hi, cl.dt_cached(rg))
        elif task < nh + 2 * dims.ng and rg.nnew > DIRECT_CB_MAX:
            var n0 = (task - nh) * P  # over the ng N B columns, group-major
            var bt = work.unsafe_offset(wk.o_bt + bb * dims.ng * N * Q)
            for i in range(rg.lo, rg.hi):
                var br = cl.xbc_row(bb, rg.c, i).unsafe_offset(di)
                for n in range(n0, n0 + P):
                    bt[unsafe_offset=n * Q + i] = br[unsafe_offset=n]


def _load_state(cl: M2Call, bb: Int):
    var cd = cl.dims.cd
    var win = cl.work.unsafe_offset(cl.wk.o_win + bb * KCONV * cd)
    if cl.has_state:
        transpose_in(cl.cw.unsafe_offset(bb * cd * KCONV), KCONV, cd, win)
    else:
        for k in range(KCONV * cd):
            win[unsafe_offset=k] = 0.0
        var hw = cl.work.unsafe_offset(cl.wk.o_h + bb * cl.dims.nh * P * N)
        for k in range(cl.dims.nh * P * N):
            hw[unsafe_offset=k] = 0.0


def _save_state(cl: M2Call, bb: Int):
    """Conv window back; the open chunk's new rows into the buffers; rows
    past the open chunk cleared once a chunk completed in this call."""
    var dims = cl.dims
    var wk = cl.row_work(bb)
    var cd = dims.cd
    var nh = dims.nh
    transpose_out(cl.work.unsafe_offset(wk.o_win + bb * KCONV * cd), KCONV, cd,
                  cl.cw.unsafe_offset(bb * cd * KCONV))
    var cl_last = wk.nch - 1
    var n_last = wk.rows(cl_last)
    var i0 = wk.i0(cl_last)
    var open_end = 0
    if n_last < Q:
        open_end = n_last
        for i in range(i0, n_last):
            var src = cl.xbc_row(bb, cl_last, i)
            copy_floats(src, cl.bufx.unsafe_offset((bb * Q + i) * cd), cd)
            for hh in range(nh):
                cl.bufd[unsafe_offset=(bb * Q + i) * nh + hh] = cl.dtraw(bb, cl_last, i, hh)
    if wk.s + wk.l >= Q:
        for i in range(open_end, Q):
            var dst = cl.bufx.unsafe_offset((bb * Q + i) * cd)
            for ch in range(cd):
                dst[unsafe_offset=ch] = 0.0
            for hh in range(nh):
                cl.bufd[unsafe_offset=(bb * Q + i) * nh + hh] = 0.0
