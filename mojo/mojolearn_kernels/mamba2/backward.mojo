"""Mamba-2 backward (vector-Jacobian product of a forward, from a zero state
or from a given state): the plan, the stages and their order. The SSD VJP
per head and chunk is in backward_ssd.mojo, the state's parts in
backward_state.mojo, the forward recompute in backward_recompute.mojo.

Chunks of Q = 256 tokens (the forward's chunks), two passes:
  pass A (chunks 0 .. n-2, forward order): norm, in_proj, conv + dt and the
         fold, keeping only the SSM state h at every chunk start
         (checkpoints, B * H * 64 * 128 floats per chunk);
  pass B (chunks n-1 .. 0): recompute the chunk's forward from its
         checkpoint (the conv window is recomputed from the 3 tokens before
         the chunk), then the chunk's VJP. dh (gradient of the state at the
         chunk end) and the conv's 3-row look-ahead of d(pre-activation) are
         carried to the previous chunk.

Per head and chunk (rows i, j from the chunk start, S_i(j) the decay sum of
docs/mamba2.md, L_ij = exp(S_i(j)), w_ij = CB_ij L_ij, u_ij = w_ij dt_j,
G_ij = dy_i . x_j, e_i = exp(S_i(-1)), el_j = exp(S_last(j))):
    dx_j    = sum_{i>=j} u_ij dy_i + el_j dt_j (dh_end B_j) + D dy_j
    d dt_j  = sum_{i>=j} w_ij G_ij + el_j x_j.(dh_end B_j) + A d(dA_j)
    d(dA_k) = sum over (i, j) with j < k <= i of T_ij   (T_ij = u_ij G_ij,
              T_i,-1 = e_i dy_i.(C_i h0); likewise the h_end terms)
    dCB_ij  = sum over heads of G_ij L_ij dt_j  (B, C are shared by heads)
    dC_i    = sum_j dCB_ij B_j + sum_h e_i (dy_i h0)
    dB_j    = sum_i dCB_ij C_i + sum_h el_j dt_j (dh_end^T x_j)
    dh0     = exp(S_last(-1)) dh_end + sum_i e_i dy_i C_i^T
Canonical orders: docs/backward.md ("Mamba-2"). Every weight gradient
element is ONE sequential chain over all (row, token) contributions,
chunks last to first, inside a chunk rows b ascending then tokens ascending
(the chain continues in the output array between chunks). Threads only
split independent outputs, so no bit depends on the thread count, and a
row's x gradient depends only on that row.
Reference: torch autograd of transformers' Mamba2Block run in float64
(tests/reference/hf_mamba.py), whose forward equals mojolearn.reference.mamba2
(float64 NumPy) to 1e-10.
"""
from std.collections import Array
from ..abi import F32Ptr, I64Ptr, PHASE_END, PLAN_WORKSPACE, arg_f32, ceil_div
from ..linear import NR, KSEG, WF_F32, matmul_ntasks, matmul_task, panel_floats
from ..weight_panels import blob_formats, ALL_F32
from ..linear_grad import gemm_ntasks, TPanels
from ..norms import rmsnorm_row, rms_vjp_coef
from ..block_backward import BackwardPhase, norm_backward_rows, linear_vjp_task
from ..numerics import silu_f32, silu_grad_f32
from .layout import P, N, Q, KCONV
from .backward_layout import (
    BW_BLOB, BW_WORK, BW_G_NORM, BW_G_IN, BW_G_CONVW, BW_G_CONVB, BW_G_DTB, BW_G_ALOG, BW_G_D,
    BW_G_GNORM, BW_G_OUT, BW_PANELS, BW_C_BX, LANES, LV, ROWS_PER_TASK, CH_PER_TASK, S_NORM,
    S_INPROJ, S_CONV, S_CB, S_SSD, S_GNORM, S_OUT, S_GATE, S_SSD1, S_SSD3, S_CONVB, S_INB, S_NORMB,
    S_COLS, NBS, NAS, BW2,
)
from .backward_recompute import (
    _norm_rows, _conv_fwd, _dt_rows, _cb_rows, _ssd_fwd, _fold,
)
from .backward_ssd import ssd_head_backward, dcb_rows, dbc_rows
from .backward_state import (
    init_state_row, window_cot, start_window_grads, open_cot, state_xbc_grads,
)

# ------------------------------------------------------------ helpers


def _counts(bw: BW2, c: Int, stage: Int, is_b: Bool) -> Int:
    var dims = bw.dims
    var b = bw.b
    var nc = bw.nc(c)
    var rows = b * bw.nt(c)  # token rows
    var nrb = ceil_div(nc, ROWS_PER_TASK)
    if stage == S_NORM:
        return ceil_div(rows + 3 * b, ROWS_PER_TASK)
    if stage == S_INPROJ:
        var m = dims.npj if is_b else dims.npj - dims.di  # pass A: no z
        return matmul_ntasks(rows, m) + matmul_ntasks(3 * b, m)
    if stage == S_CONV:
        return dims.cd // CH_PER_TASK + b * dims.nh
    if stage == S_CB:
        return b * nrb
    if stage == S_SSD:
        return b * dims.nh
    if stage == S_GNORM or stage == S_GATE or stage == S_NORMB:
        return ceil_div(rows, ROWS_PER_TASK)
    if stage == S_OUT:
        return matmul_ntasks(rows, dims.di) + gemm_ntasks(dims.d, dims.di)
    if stage == S_SSD1:
        return b * dims.nh + b * nrb
    if stage == S_SSD3:
        return b * nrb
    if stage == S_CONVB:
        return dims.cd // CH_PER_TASK
    if stage == S_INB:
        return matmul_ntasks(rows, dims.d) + gemm_ntasks(dims.npj, dims.d)
    # S_COLS
    return ceil_div(dims.d, LANES) + ceil_div(dims.di, LANES) + dims.nh


# ------------------------------------------------------------ plan / task


def m2_backward_plan(args: I64Ptr, phase: Int) -> Int:
    if blob_formats(arg_f32(args, BW_BLOB)) != ALL_F32:
        return -3  # backward reads float32 panels; blocks on packed weights expand them
    var bw = BW2(args)
    if bw.n0 < 0 or bw.n0 >= Q or (bw.n0 != 0 and not bw.stated):
        return -3
    if bw.stated and bw.lens != 0:
        return -3  # ragged rows only without a state
    if phase == PLAN_WORKSPACE:
        return bw.floats * 4
    var ph = BackwardPhase(phase, bw.nch, NAS, NBS, 1)
    if ph.init:
        return bw.b
    if ph.pass_a:
        if ph.stage == NAS - 1:
            return bw.b * bw.dims.nh  # fold
        return _counts(bw, ph.chunk, ph.stage, False)
    if ph.pass_b:
        return _counts(bw, ph.chunk, ph.stage, True)
    if ph.finish:
        return 1  # d A_log = dA * A
    return PHASE_END


def m2_backward_task(args: I64Ptr, phase: Int, task: Int):
    var bw = BW2(args)
    var ph = BackwardPhase(phase, bw.nch, NAS, NBS, 1)
    if ph.init:
        _init_row(args, bw, task)
    elif ph.pass_a:
        if ph.stage == NAS - 1:
            _fold(args, bw, ph.chunk, task // bw.dims.nh, task % bw.dims.nh)
        else:
            _stage(args, bw, ph.chunk, ph.stage, task, False)
    elif ph.pass_b:
        _stage(args, bw, ph.chunk, ph.stage, task, True)
    else:
        _finish_alog(args, bw)


def _init_row(args: I64Ptr, bw: BW2, bb: Int):
    """Zero row bb's carries and its chunk-0 checkpoint."""
    var work = arg_f32(args, BW_WORK)
    var hs = bw.dims.nh * P * N
    var tot = bw.b * hs
    for i in range(hs):
        work[unsafe_offset=bw.o_ckh + bb * hs + i] = 0.0
        work[unsafe_offset=bw.o_dh + bb * hs + i] = 0.0
        work[unsafe_offset=bw.o_dh + tot + bb * hs + i] = 0.0
    for i in range(3 * bw.dims.cd):
        work[unsafe_offset=bw.o_dpc + bb * 3 * bw.dims.cd + i] = 0.0
    if bw.stated:
        init_state_row(args, bw, bb)


@always_inline
def _proj_vjp(args: I64Ptr, bw: BW2, work: F32Ptr, c: Int, task: Int, rows: Int, o_dy: Int,
              ny: Int, o_panels: Int, o_dx: Int, o_x: Int, nx: Int, gw_slot: Int):
    """Task `task` of one projection's backward over the chunk's token rows:
    dy, dx and x (nx wide) in the workspace, W^T's panels at o_panels in
    BW_PANELS, dW in argument slot gw_slot (from +0.0 in the first chunk
    pass B runs, the last one; accumulated in the others)."""
    linear_vjp_task(task, work.unsafe_offset(o_dy), ny, rows,
                    arg_f32(args, BW_PANELS).unsafe_offset(o_panels), nx,
                    work.unsafe_offset(o_dx), nx, work.unsafe_offset(o_x), nx,
                    arg_f32(args, gw_slot), c < bw.nch - 1)


def _stage(args: I64Ptr, bw: BW2, c: Int, stage: Int, task: Int, is_b: Bool):
    var dims = bw.dims
    var b = bw.b
    var d = dims.d
    var di = dims.di
    var npj = dims.npj
    var nc = bw.nc(c)
    var rows = b * bw.nt(c)  # token rows
    var nrb = ceil_div(nc, ROWS_PER_TASK)
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    if stage == S_NORM:
        _norm_rows(args, bw, c, task, is_b)
    elif stage == S_INPROJ:
        # pass A needs no z: outputs from di on (di is a multiple of 64:
        # whole float32 panels, so the panels from di // NR on are that matrix)
        var c0 = 0 if is_b else di
        var m = npj - c0
        var wp = blob.unsafe_offset(dims.o_in + (c0 // NR) * panel_floats[WF_F32](d))
        var n1 = matmul_ntasks(rows, m)
        if task < n1:
            # the forward's order (segmented k), so the forward's bits
            _ = matmul_task[WF_F32, KSEG](task, work.unsafe_offset(bw.o_xn), d, rows, wp, d, m,
                                          work.unsafe_offset(bw.o_zx + c0), npj)
        else:
            _ = matmul_task[WF_F32, KSEG](task - n1, work.unsafe_offset(bw.o_xnp), d, 3 * b,
                                          wp, d, m, work.unsafe_offset(bw.o_zxp + c0), npj)
    elif stage == S_CONV:
        var nct = dims.cd // CH_PER_TASK
        if task < nct:
            _conv_fwd(args, bw, work, blob, c, task)
        else:
            _dt_rows(args, bw, work, blob, c, (task - nct) // dims.nh, (task - nct) % dims.nh)
    elif stage == S_CB:
        _cb_rows(bw, work, c, task // nrb, task % nrb)
    elif stage == S_SSD:
        _ssd_fwd(bw, work, blob, c, task // dims.nh, task % dims.nh, task)
    elif stage == S_GNORM:
        var r0 = task * ROWS_PER_TASK
        var gs = dims.gs
        for r in range(r0, min(rows, r0 + ROWS_PER_TASK)):
            for g in range(dims.ng):  # one norm per B/C group's channels
                var o = r * di + g * gs
                rmsnorm_row(work.unsafe_offset(bw.o_yg + o), gs,
                            blob.unsafe_offset(dims.o_gnorm + g * gs), work.unsafe_offset(bw.o_g + o))
    elif stage == S_OUT:
        # dg = gout W_out on W_out^T's panels (made once per block); dW_out += gout^T g
        _proj_vjp(args, bw, work, c, task, rows, bw.o_gch, d, TPanels(npj, d, d, di).o2,
                  bw.o_dg, bw.o_g, di, BW_G_OUT)
    elif stage == S_GATE:
        _gate_backward(bw, work, blob, c, task)
    elif stage == S_SSD1:
        var nht = b * dims.nh
        if task < nht:
            ssd_head_backward(args, bw, work, blob, c, task // dims.nh, task % dims.nh, task)
        else:
            var t = task - nht
            dcb_rows(bw, work, c, t // nrb, t % nrb, t)
    elif stage == S_SSD3:
        dbc_rows(args, bw, work, c, task // nrb, task % nrb)
    elif stage == S_CONVB:
        _conv_backward(args, bw, work, blob, c, task)
    elif stage == S_INB:
        # dxn = dzx W_in on W_in^T's panels (the first, at 0); dW_in += dzx^T xn
        _proj_vjp(args, bw, work, c, task, rows, bw.o_dzx, npj, 0, bw.o_dxn, bw.o_xn, d,
                  BW_G_IN)
    elif stage == S_NORMB:
        _norm_backward(args, bw, work, blob, c, task)
    else:
        _column_sums(args, bw, work, c, task)


# ------------------------------------------------------------ backward stages


def _gate_backward(bw: BW2, work: F32Ptr, blob: F32Ptr, c: Int, task: Int):
    """Gated RMSNorm VJP (g = w * (yg * r)), per B/C group's gs channels
    (all of d_inner for one group): per row and group gx_j = dg_j w_j;
    dot = fma chain over the group's j of gx_j yg_j; coef = (dot * ((r * r)
    * r)) / gs; dyg_j = fma(-yg_j, coef, r * gx_j); pgn_j = dg_j * (yg_j *
    r). Then dy = dyg * silu(z), dz = (dyg * y) * silu'(z)."""
    var dims = bw.dims
    var di = dims.di
    var gs = dims.gs
    var npj = dims.npj
    var rows = bw.b * bw.nt(c)
    var r0 = task * ROWS_PER_TASK
    for r in range(r0, min(rows, r0 + ROWS_PER_TASK)):
        for g in range(dims.ng):
            var o = r * di + g * gs
            var w = blob.unsafe_offset(dims.o_gnorm + g * gs)
            var v = work.unsafe_offset(bw.o_yg + o)
            var dg = work.unsafe_offset(bw.o_dg + o)
            var rc = rms_vjp_coef(v, gs, w, dg)
            var rs = rc[0]
            var coef = rc[1]
            var j = 0
            while j < gs:
                var vj = v.unsafe_load[width=LANES](j)
                var gj = dg.unsafe_load[width=LANES](j)
                var gx = gj * w.unsafe_load[width=LANES](j)
                var dyg = (-vj).fma(LV(coef), LV(rs) * gx)
                work.unsafe_store(bw.o_pgn + o + j, gj * (vj * LV(rs)))
                var zo = r * npj + g * gs + j
                var z = work.unsafe_load[width=LANES](bw.o_zx + zo)
                var y = work.unsafe_load[width=LANES](bw.o_y + o + j)
                work.unsafe_store(bw.o_dy + o + j, dyg * silu_f32[LANES](z))
                work.unsafe_store(bw.o_dzx + zo, (dyg * y) * silu_grad_f32[LANES](z))
                j += LANES


def _conv_backward(args: I64Ptr, bw: BW2, work: F32Ptr, blob: F32Ptr, c: Int, task: Int):
    """64 channels: dpre = d cx * silu'(pre) (in place; the open last
    chunk's d cx plus the final buffer_xbc's cotangent, one add), d
    xBC_raw[t] = fma chain over m = 0..3 of w[3 - m] dpre[t + m] (rows past
    the chunk from the carry), from the final conv_window's cotangent for
    the last four inputs, else from +0.0; weight terms gw[k] =
    fma(dpre[t], in[t - 3 + k], gw[k]) and bias + dpre[t], rows b ascending
    then tokens ascending. Chunk 0 of a stated call then writes
    state.conv_window and state.buffer_xbc."""
    var dims = bw.dims
    var cd = dims.cd
    var di = dims.di
    var npj = dims.npj
    var b = bw.b
    var ck = bw.chunk(c)
    var gcw = arg_f32(args, BW_G_CONVW)
    var gcb = arg_f32(args, BW_G_CONVB)
    var c0 = task * CH_PER_TASK
    var cot_bx = bw.last_open(c) and bw.has(args, BW_C_BX)
    var ch = c0
    while ch < c0 + CH_PER_TASK:
        for r in range(b * ck.nt):  # token rows
            var o = bw.o_dcx + ((r // ck.nt) * ck.nc + ck.s0 + r % ck.nt) * cd + ch
            var op = bw.o_pre + ((r // ck.nt) * ck.nc + ck.s0 + r % ck.nt) * cd + ch
            var dc = work.unsafe_load[width=LANES](o)
            if cot_bx:
                dc = dc + open_cot(args, bw, c, r // ck.nt, ck.s0 + r % ck.nt, ch)
            work.unsafe_store(o, dc * silu_grad_f32[LANES](work.unsafe_load[width=LANES](op)))
        var w = Array[LV, KCONV](fill=LV(0.0))
        var gw = Array[LV, KCONV](fill=LV(0.0))
        comptime for k in range(KCONV):
            w[k] = blob.unsafe_load[width=LANES](dims.o_convw + k * cd + ch)
            for jl in range(LANES):
                gw[k][jl] = gcw[unsafe_offset=(ch + jl) * KCONV + k]
        var gb = gcb.unsafe_load[width=LANES](ch)
        for bb in range(b):
            var carry = work.unsafe_offset(bw.o_dpc + bb * 3 * cd + ch)
            var base = bb * ck.nc + ck.s0  # dpre of token j: scan row base + j
            var tbase = bb * ck.nt  # token rows
            for j in range(ck.nt):
                var acc = window_cot(args, bw, bb, ch, ck.t0 + j)
                comptime for m in range(KCONV):
                    var src: LV
                    if j + m < ck.nt:
                        src = work.unsafe_load[width=LANES](bw.o_dcx + (base + j + m) * cd + ch)
                    else:
                        src = carry.unsafe_load[width=LANES]((j + m - ck.nt) * cd)
                    acc = w[KCONV - 1 - m].fma(src, acc)
                work.unsafe_store(bw.o_dzx + (tbase + j) * npj + di + ch, acc)
                var g = work.unsafe_load[width=LANES](bw.o_dcx + (base + j) * cd + ch)
                comptime for k in range(KCONV):
                    var pos = j - 3 + k
                    var inp: LV
                    if pos >= 0:
                        inp = work.unsafe_load[width=LANES](bw.o_zx + (tbase + pos) * npj + di + ch)
                    else:
                        inp = work.unsafe_load[width=LANES](bw.o_zxp + (bb * 3 + 3 + pos) * npj + di + ch)
                    gw[k] = g.fma(inp, gw[k])
                gb = gb + g
            var nw = Array[LV, 3](fill=LV(0.0))
            comptime for m in range(3):
                if m < ck.nt:
                    nw[m] = work.unsafe_load[width=LANES](bw.o_dcx + (base + m) * cd + ch)
                else:
                    nw[m] = carry.unsafe_load[width=LANES]((m - ck.nt) * cd)
            comptime for m in range(3):
                carry.unsafe_store(m * cd, nw[m])
            if c == 0 and bw.stated:
                start_window_grads(args, bw, bb, ch, w, nw)
                state_xbc_grads(args, bw, work, bb, ch)
        comptime for k in range(KCONV):
            for jl in range(LANES):
                gcw[unsafe_offset=(ch + jl) * KCONV + k] = gw[k][jl]
        gcb.unsafe_store(ch, gb)
        ch += LANES


def _norm_backward(args: I64Ptr, bw: BW2, work: F32Ptr, blob: F32Ptr, c: Int, task: Int):
    """dx = grad_out + RMSNorm VJP of dxn; pn = the norm weight's terms
    (norms.rmsnorm_row_vjp). Padding tokens of ragged rows: dx = +0.0 and
    no norm weight terms (x there is never read)."""
    var nt = bw.nt(c)
    var r0 = task * ROWS_PER_TASK
    norm_backward_rows(args, bw.l, bw.dims.d, bw.tok0(c), nt, bw.lens, r0,
                       min(bw.b * nt, r0 + ROWS_PER_TASK), blob.unsafe_offset(bw.dims.o_norm),
                       work.unsafe_offset(bw.o_dxn), work.unsafe_offset(bw.o_pn))


def _column_sums(args: I64Ptr, bw: BW2, work: F32Ptr, c: Int, task: Int):
    """block_norm.weight += pn, norm.weight += pgn (16 columns per task):
    rows b ascending then tokens ascending, one + chain per element; per
    head dt_bias, dA, D += the chunk partial (pairwise over tokens) of each
    row, rows b ascending."""
    var dims = bw.dims
    var d = dims.d
    var di = dims.di
    var rows = bw.b * bw.nt(c)  # token rows
    var nd = ceil_div(d, LANES)
    var ng = ceil_div(di, LANES)
    if task < nd + ng:
        var gw: F32Ptr
        var src: F32Ptr
        var width: Int
        var j0: Int
        if task < nd:
            gw = arg_f32(args, BW_G_NORM)
            src = work.unsafe_offset(bw.o_pn)
            width = d
            j0 = task * LANES
        else:
            gw = arg_f32(args, BW_G_GNORM)
            src = work.unsafe_offset(bw.o_pgn)
            width = di
            j0 = (task - nd) * LANES
        var acc = gw.unsafe_load[width=LANES](j0)
        for r in range(rows):
            acc = acc + src.unsafe_load[width=LANES](r * width + j0)
        gw.unsafe_store(j0, acc)
        return
    var hh = task - nd - ng
    var gdtb = arg_f32(args, BW_G_DTB)
    var ga = arg_f32(args, BW_G_ALOG)
    var gd = arg_f32(args, BW_G_D)
    var s1 = gdtb[unsafe_offset=hh]
    var s2 = ga[unsafe_offset=hh]
    var s3 = gd[unsafe_offset=hh]
    for bb in range(bw.b):  # the chunk's pairwise partial of each row
        var o = bw.hq(bb, hh)
        s1 = s1 + work[unsafe_offset=bw.o_pdtb + o]
        s2 = s2 + work[unsafe_offset=bw.o_pa + o]
        s3 = s3 + work[unsafe_offset=bw.o_pd + o]
    gdtb[unsafe_offset=hh] = s1
    ga[unsafe_offset=hh] = s2
    gd[unsafe_offset=hh] = s3


def _finish_alog(args: I64Ptr, bw: BW2):
    """d A_log = (dA * A) + 0.0 (A = -exp(A_log); + 0.0 turns -0.0 into +0.0)."""
    var blob = arg_f32(args, BW_BLOB)
    var ga = arg_f32(args, BW_G_ALOG)
    for hh in range(bw.dims.nh):
        ga[unsafe_offset=hh] = ga[unsafe_offset=hh] * blob[unsafe_offset=bw.dims.o_a + hh] + Float32(0.0)
