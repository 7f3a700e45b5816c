"""Mamba-1 backward (vector-Jacobian product of a prefill).

Two passes over chunks of TC = 32 tokens (B rows x TC tokens of workspace):
  pass A (chunks 0 .. n-2, forward order): the forward, keeping only the
         SSM state h and the conv window at every chunk start (checkpoints);
  pass B (chunks n-1 .. 0, backward order): recompute the chunk's forward
         from its checkpoints, keep h after every token of the chunk, then
         run the chunk's VJP.
Both passes run the forward op's own stage code (mamba1/stages.mojo), so
the recomputed activations have the forward's bits
(tests/test_recompute_bits.py).
Gradients flowing back in time (dh of the scan, the conv's look-ahead of 3
rows of d(pre-activation)) are carried between chunks per row.

Through the state (all optional slots): the forward starts from a given
(conv_window, h) (chunk 0's checkpoints); the final state's cotangents enter
as the scan's dh carry (h) and as the start of the dhid chains of the last
four conv inputs (conv_window); a ragged row ends at its own length (its
padded tokens contribute exact zeros everywhere and the carries pass them
unchanged). After chunk 0, the dh carry is d h0 and the dhid chains of the
three window positions before token 0 give d conv_window0.

Canonical orders (see docs/backward.md for the full list):
  * activation gradients: per token, one fma chain per element over the
    reduction index, ascending, from +0.0 (linear.mojo on transposed panels);
  * every weight gradient element: ONE sequential chain over all (row,
    token) contributions, visiting chunks from last to first and, inside a
    chunk, rows b ascending then tokens t ascending; the chain continues in
    the output array between chunks (fma for products, + for sums);
  * dB, dC (sums over channels): per block of 16 channels a pairwise tree
    (lane j + lane j+8, then +4, +2, +1; missing channels are +0.0), then
    the block partials in ascending block order.
Threads only split independent outputs, so no bit depends on the thread
count; a row's x gradient depends only on that row.
Reference: torch autograd of transformers' MambaBlock run in float64
(tests/reference/hf_mamba.py), whose forward equals mojolearn.reference.mamba1
(float64 NumPy) to 1e-10.
"""
from ..abi import F32Ptr, I64Ptr, PHASE_END, PLAN_WORKSPACE, arg_int, arg_f32, ceil_div
from ..linear import matmul_ntasks, matmul_task, NR
from ..weight_panels import blob_formats, ALL_F32
from ..linear_grad import gemm_ntasks, gemm_task, pack_panels_t
from ..numerics import silu_grad_f32
from ..lanes import ld16, st16
from ..block_backward import BackwardPhase, linear_vjp_task
from .forward import M1Dims, NSTATE, KCONV, dims_of_blob
from ..norms import NORM_ROWS_PER_TASK
from .stages import M1Chunk, m1_stage, m1_stage_ntasks, RUN_A, RUN_B
from .backward_layout import (
    BW_B, BW_L, BW_D, BW_X, BW_G, BW_BLOB, BW_WORK, BW_W_IN, BW_W_X, BW_W_DT, BW_W_OUT,
    BW_G_NORM, BW_G_IN, BW_G_X, BW_G_DT, BW_G_ALOG, BW_G_OUT, LANES, ROWS_PER_TASK,
    CH_PER_TASK, F_NORM, NF, B_OUT, B_SCAN, B_RED, B_BCDT, B_XPROJ, B_CONV, B_INPROJ, B_NORM,
    B_NORMW, NB, BWork, BW_CONV_WINDOW, BW_H, BW_GS_CONV, BW_GS_H, BW_LENGTHS,
    BW_G_CONV0, BW_G_H0, row_length,
)
from .backward_stages import (
    scan_backward, reduce_bc, column_sums, conv_backward, window_cotangent,
    norm_backward, bcdt_backward,
)


# ------------------------------------------------------------ plan


def _counts(dims: M1Dims, wk: BWork, stage: Int, nc: Int) -> Int:
    var b = wk.b
    var rows = b * nc
    var di = dims.di
    var d = dims.d
    if stage < NF:
        return m1_stage_ntasks(dims, stage, b, nc)
    if stage == B_OUT:
        return matmul_ntasks(rows, di) + gemm_ntasks(d, di)
    if stage == B_SCAN:
        return b * wk.nblk
    if stage == B_RED:
        return (ceil_div(rows, ROWS_PER_TASK) + matmul_ntasks(rows, dims.r)
                + gemm_ntasks(di, dims.r) + wk.nblk)
    if stage == B_BCDT:
        return 0 if dims.bcdt_eps == 0.0 else ceil_div(rows, ROWS_PER_TASK)
    if stage == B_XPROJ:
        return matmul_ntasks(rows, di) + gemm_ntasks(dims.nx, di)
    if stage == B_CONV:
        return ceil_div(di, CH_PER_TASK)
    if stage == B_INPROJ:
        return matmul_ntasks(rows, d) + gemm_ntasks(2 * di, d)
    if stage == B_NORM:
        return ceil_div(rows, ROWS_PER_TASK)
    return ceil_div(d, LANES)  # B_NORMW


def m1_backward_plan(args: I64Ptr, phase: Int) -> Int:
    if blob_formats(arg_f32(args, BW_BLOB)) != ALL_F32:
        return -3  # backward reads float32 panels; blocks on packed weights expand them
    var dims = dims_of_blob(arg_int(args, BW_D), arg_f32(args, BW_BLOB))
    var b = arg_int(args, BW_B)
    var wk = BWork(dims, b, arg_int(args, BW_L))
    if phase == PLAN_WORKSPACE:
        return wk.floats * 4
    var ph = BackwardPhase(phase, wk.nchunks, NF, NB, 1)
    if ph.init:
        return b + 4  # per-row init, and the four transposed weight packs
    if ph.pass_a or ph.pass_b:
        return _counts(dims, wk, ph.stage, wk.chunk_tokens(ph.chunk))
    if ph.finish:  # dA_log = dA * A; the start state's gradients per row
        return wk.nblk + (b if _wants_state_grads(args) else 0)
    return PHASE_END


@always_inline
def _wants_state_grads(args: I64Ptr) -> Bool:
    return arg_int(args, BW_G_CONV0) != 0 or arg_int(args, BW_G_H0) != 0


# ------------------------------------------------------------ tasks


def m1_backward_task(args: I64Ptr, phase: Int, task: Int):
    var dims = dims_of_blob(arg_int(args, BW_D), arg_f32(args, BW_BLOB))
    var b = arg_int(args, BW_B)
    var wk = BWork(dims, b, arg_int(args, BW_L))
    var work = arg_f32(args, BW_WORK)
    var ph = BackwardPhase(phase, wk.nchunks, NF, NB, 1)
    if ph.init:
        if task < b:
            _init_row(args, dims, wk, work, task)
        else:
            _pack_transposed(args, dims, wk, work, task - b)
        return
    if ph.pass_a:
        _forward_stage(args, dims, wk, ph.chunk, ph.stage, task, False)
        return
    if ph.pass_b:
        if ph.stage < NF:
            _forward_stage(args, dims, wk, ph.chunk, ph.stage, task, True)
        else:
            _backward_stage(args, dims, wk, ph.chunk, ph.stage, task)
        return
    if task < wk.nblk:
        _finish_alog(args, dims, wk, task)
    else:
        _state_grads(args, dims, wk, work, task - wk.nblk)


def _init_row(args: I64Ptr, dims: M1Dims, wk: BWork, work: F32Ptr, bb: Int):
    """Row bb's chunk-0 checkpoints: the start state (zeros if none given),
    transposed into the kernel's layouts; its dh carry: the final h's
    cotangent (zeros if none); its dpre look-ahead: zeros (no token
    follows the last one)."""
    var di = dims.di
    _load_t(arg_int(args, BW_H), bb, di, NSTATE, work.unsafe_offset(wk.o_ckh + bb * NSTATE * di))
    _load_t(arg_int(args, BW_CONV_WINDOW), bb, di, KCONV,
            work.unsafe_offset(wk.o_ckw + bb * KCONV * di))
    _load_t(arg_int(args, BW_GS_H), bb, di, NSTATE, work.unsafe_offset(wk.o_dh + bb * NSTATE * di))
    for i in range(3 * di):
        work[unsafe_offset=wk.o_dpc + bb * 3 * di + i] = 0.0


def _load_t(addr: Int, bb: Int, di: Int, k: Int, dst: F32Ptr):
    """dst (k, di) = row bb of the (B, di, k) array at addr, transposed;
    zeros if addr is 0 (an absent state or cotangent)."""
    if addr == 0:
        for i in range(k * di):
            dst[unsafe_offset=i] = 0.0
        return
    var src = F32Ptr(unsafe_from_address=addr).unsafe_offset(bb * di * k)
    for c in range(di):
        for n in range(k):
            dst[unsafe_offset=n * di + c] = src[unsafe_offset=c * k + n]


def _pack_t(w: F32Ptr, k: Int, n: Int, dst: F32Ptr):
    """Row-major W (k, n) as the panels of W^T (n outputs, k inputs) that
    linear.matmul_task reads: dst[p, kk, j] = W[kk, p * NR + j] (zero past n)."""
    for p in range(ceil_div(n, NR)):
        pack_panels_t(w, k, n, dst, p)


def _pack_transposed(args: I64Ptr, dims: M1Dims, wk: BWork, work: F32Ptr, which: Int):
    var d = dims.d
    var di = dims.di
    if which == 0:
        _pack_t(arg_f32(args, BW_W_IN), 2 * di, d, work.unsafe_offset(wk.o_tin))
    elif which == 1:
        _pack_t(arg_f32(args, BW_W_OUT), d, di, work.unsafe_offset(wk.o_tout))
    elif which == 2:
        _pack_t(arg_f32(args, BW_W_X), dims.nx, di, work.unsafe_offset(wk.o_tx))
    else:
        _pack_t(arg_f32(args, BW_W_DT), di, dims.r, work.unsafe_offset(wk.o_tdt))


# ------------------------------------------------------------ forward recompute


def _forward_stage(args: I64Ptr, dims: M1Dims, wk: BWork, c: Int, stage: Int,
                   task: Int, is_b: Bool):
    """Forward stage `stage` of chunk c (mamba1/stages.mojo, the forward's
    own code) from the chunk's checkpoints: pass A writes the checkpoints
    of chunk c + 1; pass B keeps what the VJP reads, and copies the chunk's
    grad_output rows."""
    var b = wk.b
    var di = dims.di
    var nc = wk.chunk_tokens(c)
    var work = arg_f32(args, BW_WORK)
    var nxt = c if is_b else c + 1  # pass B writes no state: its out is its in
    # pass A writes none of pass B's arrays (pre ... hs)
    var ch = M1Chunk(b=b, nc=nc, t0=c * wk.tc, l=wk.l, x=arg_f32(args, BW_X),
                     lens=arg_int(args, BW_LENGTHS),  # padding reads as +0.0, as in the forward
                     xn=work.unsafe_offset(wk.o_xn), hg=work.unsafe_offset(wk.o_hg),
                     u=work.unsafe_offset(wk.o_u), dbc=work.unsafe_offset(wk.o_dbc),
                     dl=work.unsafe_offset(wk.o_dl), yg=work.unsafe_offset(wk.o_yg),
                     win_in=work.unsafe_offset(wk.o_ckw + c * b * KCONV * di),
                     win_out=work.unsafe_offset(wk.o_ckw + nxt * b * KCONV * di),
                     h_in=work.unsafe_offset(wk.o_ckh + c * b * NSTATE * di),
                     h_out=work.unsafe_offset(wk.o_ckh + nxt * b * NSTATE * di),
                     pre=work.unsafe_offset(wk.o_pre), dbc_raw=work.unsafe_offset(wk.o_dbcr),
                     v=work.unsafe_offset(wk.o_v), y=work.unsafe_offset(wk.o_y),
                     hs=work.unsafe_offset(wk.o_hs), hs_tokens=wk.tc)
    if not is_b:
        m1_stage[RUN_A](dims, arg_f32(args, BW_BLOB), ch, stage, task)
        return
    m1_stage[RUN_B](dims, arg_f32(args, BW_BLOB), ch, stage, task)
    if stage == F_NORM:
        var g = arg_f32(args, BW_G)
        var gch = work.unsafe_offset(wk.o_gch)
        var d = dims.d
        var r0 = task * NORM_ROWS_PER_TASK
        for r in range(r0, min(b * nc, r0 + NORM_ROWS_PER_TASK)):
            var t = c * wk.tc + r % nc
            var off = ((r // nc) * wk.l + t) * d
            var pad = t >= row_length(args, r // nc)  # padding's grad_output is ignored
            for j in range(d):
                gch[unsafe_offset=r * d + j] = 0.0 if pad else g[unsafe_offset=off + j]


# ------------------------------------------------------------ backward stages


def _backward_stage(args: I64Ptr, dims: M1Dims, wk: BWork, c: Int, stage: Int,
                    task: Int):
    var b = wk.b
    var d = dims.d
    var di = dims.di
    var nx = dims.nx
    var r_ = dims.r
    var nc = wk.chunk_tokens(c)
    var rows = b * nc
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    if stage == B_OUT:
        # dyg = g W_out; dW_out += g^T yg
        linear_vjp_task(task, work.unsafe_offset(wk.o_gch), d, rows, work.unsafe_offset(wk.o_tout),
                        di, work.unsafe_offset(wk.o_dyg), di, work.unsafe_offset(wk.o_yg), di,
                        arg_f32(args, BW_G_OUT), True)
    elif stage == B_SCAN:
        var bb = task // wk.nblk
        var nreal = min(nc, max(0, row_length(args, bb) - c * wk.tc))
        scan_backward(dims, wk, work, blob, c, bb, task % wk.nblk, nreal)
    elif stage == B_RED:
        var n1 = ceil_div(rows, ROWS_PER_TASK)
        var n2 = matmul_ntasks(rows, r_)
        var n3 = gemm_ntasks(di, r_)
        if task < n1:
            reduce_bc(dims, wk, work, nc, task)
        elif task < n1 + n2 + n3:  # ddtr = dv W_dt (into ddbc's dt columns); dW_dt += dv^T dtr
            linear_vjp_task(task - n1, work.unsafe_offset(wk.o_dv), di, rows,
                            work.unsafe_offset(wk.o_tdt), r_, work.unsafe_offset(wk.o_ddbc), nx,
                            work.unsafe_offset(wk.o_dbc), nx, arg_f32(args, BW_G_DT), True)
        else:
            column_sums(args, dims, wk, work, nc, task - n1 - n2 - n3)
    elif stage == B_BCDT:
        bcdt_backward(dims, wk, work, nc, task)
    elif stage == B_XPROJ:
        var n1 = matmul_ntasks(rows, di)
        if task < n1:  # dpre = (du + ddbc @ W_x) * silu'(pre)
            var dpre = work.unsafe_offset(wk.o_dpre)
            var t = matmul_task(task, work.unsafe_offset(wk.o_ddbc), nx, rows,
                                work.unsafe_offset(wk.o_tx), nx, di, dpre, di)
            var du = work.unsafe_offset(wk.o_du)
            var pre = work.unsafe_offset(wk.o_pre)
            var ragged = arg_int(args, BW_LENGTHS) != 0
            for r in range(t.r0, t.r1):
                if ragged and c * wk.tc + r % nc >= row_length(args, r // nc):
                    for col in range(t.c0, t.c1):  # padding: exact +0.0
                        dpre[unsafe_offset=r * di + col] = 0.0
                    continue
                var col = t.c0
                while col < t.c1:
                    var nv = min(LANES, t.c1 - col)
                    var o = r * di + col
                    var s = ld16(du, o, nv) + ld16(dpre, o, nv)
                    st16(dpre, o, s * silu_grad_f32[LANES](ld16(pre, o, nv)), nv)
                    col += LANES
        else:  # dW_x[j, c] += sum_r ddbc[r, j] u[r, c]
            _ = gemm_task(task - n1, work.unsafe_offset(wk.o_ddbc), 1, nx,
                          work.unsafe_offset(wk.o_u), di, rows,
                          arg_f32(args, BW_G_X), di, nx, di, True)
    elif stage == B_CONV:
        conv_backward(args, dims, wk, work, blob, c, task)
    elif stage == B_INPROJ:
        # dxn = dhg W_in; dW_in += dhg^T xn
        linear_vjp_task(task, work.unsafe_offset(wk.o_dhg), 2 * di, rows,
                        work.unsafe_offset(wk.o_tin), d, work.unsafe_offset(wk.o_dxn), d,
                        work.unsafe_offset(wk.o_xn), d, arg_f32(args, BW_G_IN), True)
    elif stage == B_NORM:
        norm_backward(args, dims, wk, work, blob, c, task)
    else:  # B_NORMW: d norm.weight[j] += pn[r, j], r ascending
        var pn = work.unsafe_offset(wk.o_pn)
        var gn = arg_f32(args, BW_G_NORM)
        var j0 = task * LANES
        var nv = min(LANES, d - j0)
        var acc = ld16(gn, j0, nv)
        for r in range(rows):
            acc = acc + ld16(pn, r * d + j0, nv)
        st16(gn, j0, acc, nv)


def _finish_alog(args: I64Ptr, dims: M1Dims, wk: BWork, q: Int):
    """dA_log = (dA * A) + 0.0 (A = -exp(A_log), so dA/dA_log = A; the
    + 0.0 turns the -0.0 of a zero dA times a negative A into +0.0)."""
    var di = dims.di
    var blob = arg_f32(args, BW_BLOB)
    var ga = arg_f32(args, BW_G_ALOG)
    var c0 = q * LANES
    var c1 = min(di, c0 + LANES)
    for ch in range(c0, c1):
        for n in range(NSTATE):
            ga[unsafe_offset=ch * NSTATE + n] = (
                ga[unsafe_offset=ch * NSTATE + n] * blob[unsafe_offset=dims.o_a + n * di + ch]
                + Float32(0.0))


def _state_grads(args: I64Ptr, dims: M1Dims, wk: BWork, work: F32Ptr, bb: Int):
    """Row bb's start-state gradients, after chunk 0's pass B.
    d h0 = the dh carry (the cotangent of the state before token 0).
    d conv_window0[k] (input position p = k - 4): the dhid chain of p, the
    one of the conv VJP: from the final window's cotangent if p is among
    the row's last four inputs (rows shorter than 4 tokens), then
    fma(w[3 - m], dpre[p + m], acc) for m = 0..3 with 0 <= p + m; the dpre
    look-ahead carry holds dpre at positions 0..2 (+0.0 past the row).
    Slot 0 (p = -4) feeds no convolution: only the final window's term."""
    var di = dims.di
    var blob = arg_f32(args, BW_BLOB)
    var gh = arg_f32(args, BW_G_H0)
    if arg_int(args, BW_G_H0) != 0:
        var dh = work.unsafe_offset(wk.o_dh + bb * NSTATE * di)
        for c in range(di):
            for n in range(NSTATE):
                gh[unsafe_offset=(bb * di + c) * NSTATE + n] = dh[unsafe_offset=n * di + c]
    if arg_int(args, BW_G_CONV0) == 0:
        return
    var gw = arg_f32(args, BW_G_CONV0)
    var gs = arg_int(args, BW_GS_CONV)
    var carry = work.unsafe_offset(wk.o_dpc + bb * 3 * di)
    var f0 = -KCONV - (row_length(args, bb) - KCONV)  # final-window slot of p = -4
    var ch = 0
    while ch < di:
        var nv = min(LANES, di - ch)
        comptime for k in range(KCONV):
            var acc = window_cotangent(gs, bb, di, ch, nv, f0 + k)
            comptime for m in range(KCONV):
                comptime if k - KCONV + m >= 0:
                    acc = ld16(blob, dims.o_convw + (KCONV - 1 - m) * di + ch, nv).fma(
                        ld16(carry, (k - KCONV + m) * di + ch, nv), acc)
            for jl in range(nv):
                gw[unsafe_offset=(bb * di + ch + jl) * KCONV + k] = acc[jl]
        ch += LANES
