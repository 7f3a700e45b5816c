"""Mamba-2 backward: the forward recompute of one chunk from its checkpoint
(norm rows, conv, dt rows, CB, the SSD outputs and the fold), in the
forward's formulas and order (mamba2_ssd.mojo), so o and y have the
forward's bits."""
from std.collections import Array
from .abi import (
    F32Ptr, I64Ptr, ALIGN_FLOATS, PHASE_END, PLAN_WORKSPACE,
    arg_int, arg_f32, round_up, ceil_div,
)
from .linear import WF_F32, matmul_ntasks, matmul_task
from .linear_split import split_matmul_ntasks, split_matmul_task, split_ld
from .weight_panels import blob_format
from .linear_grad import gemm_ntasks, gemm_task, TPanels
from .norms import rmsnorm_row, rms_scale
from .numerics import exp_f32, softplus_f32, silu_f32, sigmoid_f32
from .mamba2_layout import P, N, Q, KCONV, M2Dims
from .mamba2_ssd import seg_row
from .mamba2_backward_layout import (
    BW_X, BW_G, BW_BLOB, BW_WORK, LANES, LV, ROWS_PER_TASK, CH_PER_TASK, SCR, BW2,
)


@always_inline
def _softplus_grad(v: Float32) -> Float32:
    """1 where softplus is the identity (v > 20, PyTorch's threshold), else sigmoid(v)."""
    if v > 20.0:
        return 1.0
    return sigmoid_f32[1](v)


# ------------------------------------------------------------ forward recompute


def _norm_rows(args: I64Ptr, bw: BW2, c: Int, task: Int, is_b: Bool):
    """Block RMSNorm of the chunk's rows and of the 3 tokens before it
    (zeros before the sequence: the conv window starts at zeros); pass B
    also copies the chunk's grad_output rows."""
    var d = bw.dims.d
    var l = bw.l
    var nc = bw.nc(c)
    var rows = bw.b * nc
    var x = arg_f32(args, BW_X)
    var g = arg_f32(args, BW_G)
    var work = arg_f32(args, BW_WORK)
    var w = arg_f32(args, BW_BLOB).unsafe_offset(bw.dims.o_norm)
    var r0 = task * ROWS_PER_TASK
    var r1 = min(rows + 3 * bw.b, r0 + ROWS_PER_TASK)
    for r in range(r0, r1):
        if r < rows:
            var off = ((r // nc) * l + c * Q + r % nc) * d
            rmsnorm_row(x.unsafe_offset(off), d, w, work.unsafe_offset(bw.o_xn + r * d))
            if is_b:
                for j in range(d):
                    work[unsafe_offset=bw.o_gch + r * d + j] = g[unsafe_offset=off + j]
        else:
            var q = r - rows
            var t = c * Q - 3 + q % 3
            var dst = work.unsafe_offset(bw.o_xnp + q * d)
            if t < 0:
                for j in range(d):
                    dst[unsafe_offset=j] = 0.0
            else:
                rmsnorm_row(x.unsafe_offset(((q // 3) * l + t) * d), d, w, dst)


def _conv_fwd(bw: BW2, work: F32Ptr, blob: F32Ptr, c: Int, task: Int):
    """conv.mojo's formula for 64 channels of every row of the chunk; the
    window is the xBC of the 3 tokens before the chunk. Keeps pre and cx."""
    var dims = bw.dims
    var cd = dims.cd
    var npj = dims.npj
    var di = dims.di
    var nc = bw.nc(c)
    var c0 = task * CH_PER_TASK
    for bb in range(bw.b):
        var ch = c0
        while ch < c0 + CH_PER_TASK:
            var w0 = blob.unsafe_load[width=LANES](dims.o_convw + ch)
            var w1 = blob.unsafe_load[width=LANES](dims.o_convw + cd + ch)
            var w2 = blob.unsafe_load[width=LANES](dims.o_convw + 2 * cd + ch)
            var w3 = blob.unsafe_load[width=LANES](dims.o_convw + 3 * cd + ch)
            var bias = blob.unsafe_load[width=LANES](dims.o_convb + ch)
            var zp = work.unsafe_offset(bw.o_zxp + bb * 3 * npj + di + ch)
            var s1 = zp.unsafe_load[width=LANES](0)
            var s2 = zp.unsafe_load[width=LANES](npj)
            var s3 = zp.unsafe_load[width=LANES](2 * npj)
            for j in range(nc):
                var r = bb * nc + j
                var s0 = s1
                s1 = s2
                s2 = s3
                s3 = work.unsafe_load[width=LANES](bw.o_zx + r * npj + di + ch)
                var acc = w0.fma(s0, bias)
                acc = w1.fma(s1, acc)
                acc = w2.fma(s2, acc)
                acc = w3.fma(s3, acc)
                work.unsafe_store(bw.o_pre + r * cd + ch, acc)
                work.unsafe_store(bw.o_cx + r * cd + ch, silu_f32[LANES](acc))
            ch += LANES


def _dt_rows(bw: BW2, work: F32Ptr, blob: F32Ptr, c: Int, bb: Int, hh: Int):
    """dt = clamp(softplus(dtraw + dt_bias)) as in mamba2_ssd.dt_rows (lane
    by lane, so the same bits), dA = dt * A, and sg = d dt / d v: softplus'
    where lo <= softplus(v) <= hi (PyTorch's clamp: inclusive), else 0.
    Rows past the chunk are zero."""
    var dims = bw.dims
    var nc = bw.nc(c)
    var a = blob[unsafe_offset=dims.o_a + hh]
    var bias = blob[unsafe_offset=dims.o_dtb + hh]
    var lo = blob[unsafe_offset=dims.o_lim]
    var hi = blob[unsafe_offset=dims.o_lim + 1]
    var o = bw.hq(bb, hh)
    for j in range(Q):
        var dt: Float32 = 0.0
        var sg: Float32 = 0.0
        if j < nc:
            var v = work[unsafe_offset=bw.o_zx + (bb * nc + j) * dims.npj + dims.di + dims.cd + hh] + bias
            var sp = softplus_f32[1](v)
            dt = lo if sp < lo else sp
            dt = hi if dt > hi else dt
            if sp >= lo and sp <= hi:
                sg = _softplus_grad(v)
        work[unsafe_offset=bw.o_dt + o + j] = dt
        work[unsafe_offset=bw.o_da + o + j] = dt * a
        work[unsafe_offset=bw.o_sg + o + j] = sg


@always_inline
def _cx(bw: BW2, work: F32Ptr, bb: Int, nc: Int, j: Int) -> F32Ptr:
    return work.unsafe_offset(bw.o_cx + (bb * nc + j) * bw.dims.cd)


def _cb_rows(bw: BW2, work: F32Ptr, c: Int, bb: Int, rb: Int):
    """CB_ij = fma chain over n of C_i[n] B_j[n], j <= i (the forward's chain)."""
    var di = bw.dims.di
    var nc = bw.nc(c)
    var cb = work.unsafe_offset(bw.o_cb + bb * Q * Q)
    for i in range(rb * ROWS_PER_TASK, min(nc, rb * ROWS_PER_TASK + ROWS_PER_TASK)):
        var crow = _cx(bw, work, bb, nc, i).unsafe_offset(di + N)
        for j in range(i + 1):
            var brow = _cx(bw, work, bb, nc, j).unsafe_offset(di)
            var acc: Float32 = 0.0
            for n in range(N):
                acc = crow[unsafe_offset=n].fma(brow[unsafe_offset=n], acc)
            cb[unsafe_offset=i * Q + j] = acc


def _ssd_fwd(bw: BW2, work: F32Ptr, blob: F32Ptr, c: Int, bb: Int, hh: Int, task: Int):
    """Head hh of row bb: y (before the gate) and yg = y * silu(z) of the
    chunk's rows, in the forward's order (docs/mamba2.md steps 4-9)."""
    var dims = bw.dims
    var di = dims.di
    var nc = bw.nc(c)
    var scr = work.unsafe_offset(bw.o_scr + task * SCR)
    var seg = scr
    var urow = scr.unsafe_offset(Q)
    var ht = scr.unsafe_offset(2 * Q)
    var h0 = work.unsafe_offset(bw.o_ckh + ((c * bw.b + bb) * dims.nh + hh) * P * N)
    var cb = work.unsafe_offset(bw.o_cb + bb * Q * Q)
    var dts = work.unsafe_offset(bw.o_dt + bw.hq(bb, hh))
    var da = work.unsafe_offset(bw.o_da + bw.hq(bb, hh))
    var dskip = LV(blob[unsafe_offset=dims.o_dskip + hh])
    for p in range(P):
        for n in range(N):
            ht[unsafe_offset=n * P + p] = h0[unsafe_offset=p * N + n]
    for i in range(nc):
        var r = bb * nc + i
        var ci = seg_row(da, i, seg)
        var jv = 0
        while jv <= i:
            var e = exp_f32[LANES](seg.unsafe_load[width=LANES](jv))
            var w = cb.unsafe_load[width=LANES](i * Q + jv) * e
            urow.unsafe_store(jv, w * dts.unsafe_load[width=LANES](jv))
            jv += LANES
        var acc = Array[LV, 4](fill=LV(0.0))
        for j in range(i + 1):
            var uj = LV(urow[unsafe_offset=j])
            var xp = _cx(bw, work, bb, nc, j).unsafe_offset(hh * P)
            comptime for q in range(4):
                acc[q] = uj.fma(xp.unsafe_load[width=LANES](q * LANES), acc[q])
        var row = _cx(bw, work, bb, nc, i)
        var crow = row.unsafe_offset(di + N)
        var yo = Array[LV, 4](fill=LV(0.0))
        for n in range(N):
            var cn = LV(crow[unsafe_offset=n])
            comptime for q in range(4):
                yo[q] = cn.fma(ht.unsafe_load[width=LANES](n * P + q * LANES), yo[q])
        var ec = LV(exp_f32[1](ci))
        comptime for q in range(4):
            var y = acc[q] + yo[q] * ec
            y = row.unsafe_load[width=LANES](hh * P + q * LANES).fma(dskip, y)
            var z = work.unsafe_load[width=LANES](bw.o_zx + r * dims.npj + hh * P + q * LANES)
            work.unsafe_store(bw.o_y + r * di + hh * P + q * LANES, y)
            work.unsafe_store(bw.o_yg + r * di + hh * P + q * LANES, y * silu_f32[LANES](z))


def _fold(args: I64Ptr, bw: BW2, c: Int, bb: Int, hh: Int):
    """Pass A: h at the start of chunk c + 1 = the forward's fold of chunk c."""
    var dims = bw.dims
    var di = dims.di
    var work = arg_f32(args, BW_WORK)
    var nc = bw.nc(c)
    var scr = work.unsafe_offset(bw.o_scr + (bb * dims.nh + hh) * SCR)
    var seg = scr
    var wrow = scr.unsafe_offset(Q)
    var src = work.unsafe_offset(bw.o_ckh + ((c * bw.b + bb) * dims.nh + hh) * P * N)
    var dst = work.unsafe_offset(bw.o_ckh + (((c + 1) * bw.b + bb) * dims.nh + hh) * P * N)
    var da = work.unsafe_offset(bw.o_da + bw.hq(bb, hh))
    var dts = work.unsafe_offset(bw.o_dt + bw.hq(bb, hh))
    var total = seg_row(da, nc - 1, seg)
    var el = LV(exp_f32[1](total))
    var k = 0
    while k < P * N:
        dst.unsafe_store(k, el * src.unsafe_load[width=LANES](k))
        k += LANES
    var jv = 0
    while jv < nc:
        var e = exp_f32[LANES](seg.unsafe_load[width=LANES](jv))
        wrow.unsafe_store(jv, e * dts.unsafe_load[width=LANES](jv))
        jv += LANES
    for i in range(nc):
        var row = _cx(bw, work, bb, nc, i)
        var br = row.unsafe_offset(di)
        var si = wrow[unsafe_offset=i]
        for p in range(P):
            var coef = LV(si * row[unsafe_offset=hh * P + p])
            var tp = dst.unsafe_offset(p * N)
            comptime for q in range(N // LANES):
                tp.unsafe_store(q * LANES, coef.fma(br.unsafe_load[width=LANES](q * LANES),
                                                    tp.unsafe_load[width=LANES](q * LANES)))
