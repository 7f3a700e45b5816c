"""Mamba-2 backward: the forward recompute of one chunk from its checkpoint
(norm rows, conv, dt rows, CB, the SSD outputs and the fold). The conv, CB,
SSD outputs and fold run the forward's own functions (conv.mojo,
mamba2/ssd.mojo) on the backward's rows, and dt its clamp, so the
recomputed activations have the forward's bits
(tests/test_recompute_bits.py)."""
from ..abi import (
    F32Ptr, I64Ptr, ALIGN_FLOATS, PHASE_END, PLAN_WORKSPACE,
    arg_int, arg_f32, round_up, ceil_div,
)
from ..weight_panels import blob_formats
from ..linear_grad import gemm_ntasks, gemm_task, TPanels
from ..norms import rmsnorm_row, rms_scale
from ..numerics import softplus_f32, softplus_grad_f32
from .layout import P, N, Q, KCONV, M2Dims
from .ssd import dt_clamp, cb_row_direct, fold_chunk
from .ssd_tiles import ssd_rows
from .layout import XRows
from ..conv import conv_silu
from .backward_layout import (
    BW_X, BW_G, BW_BLOB, BW_WORK, BW_S_BD, LV, ROWS_PER_TASK, CH_PER_TASK, SCR, BW2,
)
from .backward_state import state_rows_in


# ------------------------------------------------------------ forward recompute


def _norm_rows(args: I64Ptr, bw: BW2, c: Int, task: Int, is_b: Bool):
    """Block RMSNorm of the chunk's tokens and of the 3 tokens before it
    (zeros before the sequence: the conv window there is zeros or the
    start state's, filled in by _conv_fwd); pass B also copies the chunk's
    grad_output rows. Padding tokens of ragged rows read as +0.0 (x and
    grad_output there are never read), as in the forward."""
    var d = bw.dims.d
    var l = bw.l
    var ck = bw.chunk(c)
    var rows = bw.b * ck.nt
    var x = arg_f32(args, BW_X)
    var g = arg_f32(args, BW_G)
    var work = arg_f32(args, BW_WORK)
    var w = arg_f32(args, BW_BLOB).unsafe_offset(bw.dims.o_norm)
    var r0 = task * ROWS_PER_TASK
    var r1 = min(rows + 3 * bw.b, r0 + ROWS_PER_TASK)
    for r in range(r0, r1):
        if r < rows:
            var t = ck.t0 + r % ck.nt
            var off = ((r // ck.nt) * l + t) * d
            var dst = work.unsafe_offset(bw.o_xn + r * d)
            var pad = bw.pad(r // ck.nt, t)
            if pad:
                for j in range(d):
                    dst[unsafe_offset=j] = 0.0
            else:
                rmsnorm_row(x.unsafe_offset(off), d, w, dst)
            if is_b:
                for j in range(d):
                    work[unsafe_offset=bw.o_gch + r * d + j] = 0.0 if pad else g[unsafe_offset=off + j]
        else:
            var q = r - rows
            var t = ck.t0 - 3 + q % 3
            var dst = work.unsafe_offset(bw.o_xnp + q * d)
            if t < 0 or bw.pad(q // 3, t):
                for j in range(d):
                    dst[unsafe_offset=j] = 0.0
            else:
                rmsnorm_row(x.unsafe_offset(((q // 3) * l + t) * d), d, w, dst)


def _conv_fwd(args: I64Ptr, bw: BW2, work: F32Ptr, blob: F32Ptr, c: Int, task: Int):
    """conv.mojo for 64 channels of the chunk's tokens (keeping the
    pre-activation); the window is the in_proj output of the 3 tokens
    before the chunk (conv_silu never reads the row before them), the start
    state's conv_window before the sequence. Chunk 0's state rows are the
    start state's buffer_xbc rows."""
    var dims = bw.dims
    var cd = dims.cd
    var npj = dims.npj
    var ck = bw.chunk(c)
    var c0 = task * CH_PER_TASK
    for bb in range(bw.b):
        state_rows_in(args, bw, work, c, bb, c0)
        var prev = work.unsafe_offset(bw.o_zxp + bb * 3 * npj + dims.di)
        conv_silu[True](prev.unsafe_offset(-npj), npj,
                        work.unsafe_offset(bw.o_zx + bb * ck.nt * npj + dims.di), npj, ck.nt,
                        blob.unsafe_offset(dims.o_convw), cd, blob.unsafe_offset(dims.o_convb),
                        c0, c0 + CH_PER_TASK, work.unsafe_offset(bw.o_cx + (bb * ck.nc + ck.s0) * cd), cd,
                        prev, False, work.unsafe_offset(bw.o_pre + (bb * ck.nc + ck.s0) * cd))


def _dt_rows(args: I64Ptr, bw: BW2, work: F32Ptr, blob: F32Ptr, c: Int, bb: Int, hh: Int):
    """dt = clamp(softplus(dtraw + dt_bias)) as in ssd.dt_rows (lane
    by lane, so the same bits), dA = dt * A, and sg = d dt / d v: softplus'
    where lo <= softplus(v) <= hi (PyTorch's clamp: inclusive), else 0.
    State rows read the start state's buffer_dtraw; rows past the chunk
    are zero."""
    var dims = bw.dims
    var ck = bw.chunk(c)
    var bd = arg_f32(args, BW_S_BD)
    var has_bd = bw.has(args, BW_S_BD)
    var a = blob[unsafe_offset=dims.o_a + hh]
    var bias = blob[unsafe_offset=dims.o_dtb + hh]
    var lo = blob[unsafe_offset=dims.o_lim]
    var hi = blob[unsafe_offset=dims.o_lim + 1]
    var o = bw.hq(bb, hh)
    for j in range(Q):
        var dt: Float32 = 0.0
        var sg: Float32 = 0.0
        if j < ck.nc:
            var raw: Float32 = 0.0
            if j >= ck.s0:
                raw = work[unsafe_offset=bw.o_zx + (bb * ck.nt + j - ck.s0) * dims.npj + dims.di
                           + dims.cd + hh]
            elif has_bd:
                raw = bd[unsafe_offset=(bb * Q + j) * dims.nh + hh]
            var v = raw + bias
            var sp = softplus_f32[1](v)
            dt = dt_clamp[1](sp, lo, hi)
            if sp >= lo and sp <= hi:
                sg = softplus_grad_f32[1](v)
        work[unsafe_offset=bw.o_dt + o + j] = dt
        work[unsafe_offset=bw.o_da + o + j] = dt * a
        work[unsafe_offset=bw.o_sg + o + j] = sg


@always_inline
def _cx(bw: BW2, work: F32Ptr, bb: Int, nc: Int, j: Int) -> F32Ptr:
    return work.unsafe_offset(bw.o_cx + (bb * nc + j) * bw.dims.cd)


@always_inline
def _xrows(bw: BW2, work: F32Ptr, bb: Int, nc: Int, g: Int) -> XRows:
    """Row bb's xBC rows of the chunk (B and C of group g), for ssd.mojo's
    functions."""
    var rows = _cx(bw, work, bb, nc, 0)
    return XRows(rows, 0, rows, 0, bw.dims, g)


def _cb_rows(bw: BW2, work: F32Ptr, c: Int, bb: Int, rb: Int):
    """CB_ij of every B/C group for the task's token rows i, j <= i
    (ssd.cb_row_direct; state rows have no output, so no CB row)."""
    var nc = bw.nc(c)
    for g in range(bw.dims.ng):
        var xr = _xrows(bw, work, bb, nc, g)
        var cb = work.unsafe_offset(bw.o_cb + bw.qq(g, bb))
        for i in range(max(bw.s0(c), rb * ROWS_PER_TASK),
                       min(nc, rb * ROWS_PER_TASK + ROWS_PER_TASK)):
            cb_row_direct(xr, i, xr.row(i).unsafe_offset(xr.co), cb.unsafe_offset(i * Q))


def _ssd_fwd(bw: BW2, work: F32Ptr, blob: F32Ptr, c: Int, bb: Int, hh: Int, task: Int):
    """Head hh of row bb: y (before the gate) and yg = y * silu(z) of the
    chunk's tokens (ssd_tiles.ssd_rows, from h^T of the checkpoint)."""
    var dims = bw.dims
    var di = dims.di
    var ck = bw.chunk(c)
    var scr = work.unsafe_offset(bw.o_scr + task * SCR)
    var ht = scr.unsafe_offset(2 * Q)
    var h0 = work.unsafe_offset(bw.o_ckh + ((c * bw.b + bb) * dims.nh + hh) * P * N)
    for p in range(P):
        for n in range(N):
            ht[unsafe_offset=n * P + p] = h0[unsafe_offset=p * N + n]
    var g = dims.group(hh)
    var xr = _xrows(bw, work, bb, ck.nc, g)
    var dskip = LV(blob[unsafe_offset=dims.o_dskip + hh])
    var r = bb * ck.nt  # token rows from s0 (state rows have no output)
    var o = r * di + hh * P
    ssd_rows[True](xr, di, hh, ck.s0, ck.nc, work.unsafe_offset(bw.o_da + bw.hq(bb, hh)),
                   work.unsafe_offset(bw.o_dt + bw.hq(bb, hh)),
                   work.unsafe_offset(bw.o_cb + bw.qq(g, bb) + ck.s0 * Q), ht, dskip,
                   work.unsafe_offset(bw.o_zx + r * dims.npj + hh * P), dims.npj,
                   work.unsafe_offset(bw.o_yg + o), work.unsafe_offset(bw.o_y + o),
                   scr.unsafe_offset(2 * Q + N * P))


def _fold(args: I64Ptr, bw: BW2, c: Int, bb: Int, hh: Int):
    """Pass A: h at the start of chunk c + 1 = the forward's fold of chunk c
    (ssd.fold_chunk)."""
    var dims = bw.dims
    var work = arg_f32(args, BW_WORK)
    var nc = bw.nc(c)
    var scr = work.unsafe_offset(bw.o_scr + (bb * dims.nh + hh) * SCR)
    fold_chunk(_xrows(bw, work, bb, nc, dims.group(hh)), dims.di, hh, work.unsafe_offset(bw.o_da + bw.hq(bb, hh)),
               work.unsafe_offset(bw.o_dt + bw.hq(bb, hh)), nc,
               work.unsafe_offset(bw.o_ckh + ((c * bw.b + bb) * dims.nh + hh) * P * N),
               work.unsafe_offset(bw.o_ckh + (((c + 1) * bw.b + bb) * dims.nh + hh) * P * N),
               scr, scr.unsafe_offset(Q), scr.unsafe_offset(2 * Q))
