"""Mamba-3 backward: the VJP of the chunked scan for one (row, head) and
one chunk (_scan_bwd), with its dot-product helpers. Canonical order in
mamba3/backward.mojo and docs/backward.md."""
from std.collections import Array
from ..lane_tree import tree16  # the one fixed 16-lane halving tree
from ..abi import F32Ptr, I64Ptr, arg_int, arg_f32
from ..numerics import sigmoid_f32, silu_f32, tanh_f32
from .layout import M3Dims, NST, HP, NANG, QC, A_FLOOR, PI_F32
from ..dot128 import V4, dot128, dots128x4, lane_dot, lane_dots_x4

from ..lanes import copy_floats
from .backward_layout import (
    BW_BLOB, BW_WORK, BW_PENDING, BW_S_PK, BW_S_PV, BW_C_H, BW_C_BQ, BW_C_BK, BW_C_BV,
    BW_C_BDT, BW_C_BSG, BW_C_BADT, BW_C_PK, BW_C_PV, BW_GS_THETA, BW_GS_H, BW_GS_BQ,
    BW_GS_BK, BW_GS_BV, BW_GS_BDT, BW_GS_BSG, BW_GS_BADT, BW_GS_PK, BW_GS_PV, SV,
    V16, NHF, HW, HO, TB, QK, CSW, M_G, M_L, M_C, M_HQ, M_DY, M_DG,
    V_DT, V_SG, V_A, V_SCALE, V_E, V_QK, V_DCUM, V_DSCALE, V_DGAM, V_DVV, V_DDT, V_TMP,
    SCR, BW3, HeadChunk,
)


# ------------------------------------------------------------ small helpers


@always_inline
def _dphi_a(u: Float32) -> Float32:
    """dA/du of A = min(-phi(u), -1e-4): -phi'(u) where -phi < -1e-4, half of
    it at an exact tie (torch.minimum's convention), 0 on the floor.
    phi' = 1 (u >= 0), phi^2 = 1 / (1 - u)^2 (u < 0)."""
    var ph: Float32
    var dph: Float32
    if u >= 0.0:
        ph = Float32(1.0) + u
        dph = 1.0
    else:
        ph = Float32(1.0) / (Float32(1.0) - u)
        dph = ph * ph
    var a = -ph
    if a < -A_FLOOR:
        return -dph
    if a == -A_FLOOR:
        return Float32(-0.5) * dph
    return 0.0


# ------------------------------------------------------------ scan VJP


@always_inline
def _dqdk[T: Int](scr: F32Ptr, dy: F32Ptr, h: F32Ptr, qk: F32Ptr, dqk: F32Ptr,
                  n: Int, i0: Int):
    """Step 3's dq and dk of tokens i0 .. i0+T-1 (qk, dqk: this (row, head)'s
    token 0, rows QK apart). The T tokens share every loaded h row, k_j and
    q_i2; each token's chains are step 3's: dq over p, then j < i, then the
    diagonal; dk over i2 > i ascending, then the diagonal."""
    comptime for hf in range(NHF):
        comptime o = hf * HO
        var acc = Array[V16, T * HW](fill=V16(0.0))
        for p in range(HP):
            var ey = Array[V16, T](fill=V16(0.0))
            comptime for t in range(T):
                ey[t] = V16(scr[unsafe_offset=V_E + i0 + t] * dy[unsafe_offset=(i0 + t) * HP + p])
            comptime for cc in range(HW):
                var hv = h.unsafe_load[width=16](p * NST + o + cc * 16)
                comptime for t in range(T):
                    acc[t * HW + cc] = ey[t].fma(hv, acc[t * HW + cc])
        for j in range(i0):  # j < i0: every token of the block
            var kj = qk.unsafe_offset(j * QK + NST)
            var dg = Array[V16, T](fill=V16(0.0))
            comptime for t in range(T):
                dg[t] = V16(scr[unsafe_offset=M_DG + (i0 + t) * QC + j])
            comptime for cc in range(HW):
                var kv = kj.unsafe_load[width=16](o + cc * 16)
                comptime for t in range(T):
                    acc[t * HW + cc] = dg[t].fma(kv, acc[t * HW + cc])
        comptime for t in range(1, T):  # i0 <= j < i0 + t: token t only
            for j in range(i0, i0 + t):
                var dg = V16(scr[unsafe_offset=M_DG + (i0 + t) * QC + j])
                var kj = qk.unsafe_offset(j * QK + NST)
                comptime for cc in range(HW):
                    acc[t * HW + cc] = dg.fma(kj.unsafe_load[width=16](o + cc * 16), acc[t * HW + cc])
        var dd = Array[V16, T](fill=V16(0.0))
        comptime for t in range(T):
            var i = i0 + t
            dd[t] = V16(scr[unsafe_offset=V_DVV + i]
                        * (scr[unsafe_offset=V_DT + i] * scr[unsafe_offset=V_SG + i]))
            var krow = qk.unsafe_offset(i * QK + NST)
            var dq = dqk.unsafe_offset(i * QK)
            comptime for cc in range(HW):
                dq.unsafe_store(o + cc * 16, dd[t].fma(krow.unsafe_load[width=16](o + cc * 16),
                                                      acc[t * HW + cc]))
                acc[t * HW + cc] = V16(0.0)
        comptime for t in range(T - 1):  # i0 + t < i2 < i0 + T: token t only
            for i2 in range(i0 + t + 1, min(i0 + T, n)):
                var dg = V16(scr[unsafe_offset=M_DG + i2 * QC + i0 + t])
                var qi2 = qk.unsafe_offset(i2 * QK)
                comptime for cc in range(HW):
                    acc[t * HW + cc] = dg.fma(qi2.unsafe_load[width=16](o + cc * 16), acc[t * HW + cc])
        for i2 in range(i0 + T, n):  # every token of the block
            var qi2 = qk.unsafe_offset(i2 * QK)
            var dg = Array[V16, T](fill=V16(0.0))
            comptime for t in range(T):
                dg[t] = V16(scr[unsafe_offset=M_DG + i2 * QC + i0 + t])
            comptime for cc in range(HW):
                var qv = qi2.unsafe_load[width=16](o + cc * 16)
                comptime for t in range(T):
                    acc[t * HW + cc] = dg[t].fma(qv, acc[t * HW + cc])
        comptime for t in range(T):
            var qrow = qk.unsafe_offset((i0 + t) * QK)
            var dk = dqk.unsafe_offset((i0 + t) * QK + NST)
            comptime for cc in range(HW):
                dk.unsafe_store(o + cc * 16, dd[t].fma(qrow.unsafe_load[width=16](o + cc * 16),
                                                      acc[t * HW + cc]))


@always_inline
def _fold[T: Int](scr: F32Ptr, v: F32Ptr, ldv: Int, qk: F32Ptr, dqk: F32Ptr,
                  dv: F32Ptr, dH: F32Ptr, last: Int, j0: Int):
    """Step 4's fold for columns j0 .. j0+T-1 (v, dv: token 0's v row and
    its dproj row, ldv apart). The T columns share each loaded dH row;
    scalar updates run in j order; every chain is step 4's."""
    var u = scr.unsafe_offset(V_TMP)  # u_t at V_TMP + 64 t
    for p in range(0, HP, 4):  # dot128(dH[p+q], k_{j0+t}): 4 T chains in flight
        var acc = Array[V16, 4 * T](fill=V16(0.0))
        comptime for c in range(8):
            comptime for q in range(4):
                var hv = dH.unsafe_load[width=16]((p + q) * NST + c * 16)
                comptime for t in range(T):
                    acc[q * T + t] = hv.fma(
                        qk.unsafe_load[width=16]((j0 + t) * QK + NST + c * 16), acc[q * T + t])
        comptime for t in range(T):
            comptime for q in range(4):
                u[unsafe_offset=t * 64 + p + q] = tree16(acc[q * T + t])
    var fs = Array[Float32, T](fill=0.0)
    comptime for t in range(T):
        var j = j0 + t
        var vj = v.unsafe_offset(j * ldv)
        var ut = u.unsafe_offset(t * 64)
        var vdk = lane_dot[4](vj, ut)
        var f: Float32 = 1.0
        if j < last:
            f = scr[unsafe_offset=M_L + last * QC + j]
        var sc = scr[unsafe_offset=V_SCALE + j]
        scr[unsafe_offset=V_DSCALE + j] = scr[unsafe_offset=V_DSCALE + j] + f * vdk
        fs[t] = f * sc
        if j < last:
            var x = fs[t] * vdk
            scr[unsafe_offset=V_DCUM + last] = scr[unsafe_offset=V_DCUM + last] + x
            scr[unsafe_offset=V_DCUM + j] = scr[unsafe_offset=V_DCUM + j] - x
        var dvrow = dv.unsafe_offset(j * ldv)
        comptime for cc in range(4):
            dvrow.unsafe_store(cc * 16, V16(fs[t]).fma(ut.unsafe_load[width=16](cc * 16),
                                                       dvrow.unsafe_load[width=16](cc * 16)))
    comptime for hf in range(NHF):  # dk_j += (F scale_j) dH^T v_j
        comptime o = hf * HO
        var acc = Array[V16, T * HW](fill=V16(0.0))
        for p in range(HP):
            var vp = Array[V16, T](fill=V16(0.0))
            comptime for t in range(T):
                vp[t] = V16(v[unsafe_offset=(j0 + t) * ldv + p])
            comptime for cc in range(HW):
                var hv = dH.unsafe_load[width=16](p * NST + o + cc * 16)
                comptime for t in range(T):
                    acc[t * HW + cc] = vp[t].fma(hv, acc[t * HW + cc])
        comptime for t in range(T):
            var dk = dqk.unsafe_offset((j0 + t) * QK + NST)
            comptime for cc in range(HW):
                dk.unsafe_store(o + cc * 16, V16(fs[t]).fma(acc[t * HW + cc],
                                                            dk.unsafe_load[width=16](o + cc * 16)))


@always_inline
def _dh_in[T: Int](scr: F32Ptr, dy: F32Ptr, qk: F32Ptr, dH: F32Ptr, n: Int,
                   elast: Float32, p0: Int):
    """State rows p0 .. p0+T-1 of dh_in = e_last dH + sum_i (e_i dy_i[p]) q_i
    (i ascending), in place; the rows share each loaded q_i."""
    comptime for hf in range(NHF):
        comptime o = hf * HO
        var acc = Array[V16, T * HW](fill=V16(0.0))
        comptime for t in range(T):
            comptime for cc in range(HW):
                acc[t * HW + cc] = V16(elast) * dH.unsafe_load[width=16]((p0 + t) * NST + o + cc * 16)
        for i in range(n):
            var ey = Array[V16, T](fill=V16(0.0))
            comptime for t in range(T):
                ey[t] = V16(scr[unsafe_offset=V_E + i] * dy[unsafe_offset=i * HP + p0 + t])
            var qi = qk.unsafe_offset(i * QK)
            comptime for cc in range(HW):
                var qv = qi.unsafe_load[width=16](o + cc * 16)
                comptime for t in range(T):
                    acc[t * HW + cc] = ey[t].fma(qv, acc[t * HW + cc])
        comptime for t in range(T):
            comptime for cc in range(HW):
                dH.unsafe_store((p0 + t) * NST + o + cc * 16, acc[t * HW + cc])


def apply_pending(args: I64Ptr, dims: M3Dims, bh: Int, scr: F32Ptr, h: F32Ptr):
    """The forward's input-state step (scan.scan_task) on chunk 0's
    checkpoint h of (row, head) bh: h[p, n] = fma(v_in[p] scal, k_in[n], h)
    with scal = dt_0 (1 - sg_0) of token 0 (in the scan vectors)."""
    var pk = arg_f32(args, BW_S_PK).unsafe_offset(bh * NST)
    var pv = arg_f32(args, BW_S_PV).unsafe_offset(bh * HP)
    var scal = scr[unsafe_offset=V_DT] * (Float32(1.0) - scr[unsafe_offset=V_SG])
    for p in range(HP):
        var vv = V16(pv[unsafe_offset=p] * scal)
        comptime for c in range(8):
            var hp = h.unsafe_offset(p * NST + c * 16)
            hp.unsafe_store(0, vv.fma(pk.unsafe_load[width=16](c * 16), hp.unsafe_load[width=16](0)))


def _final_cotangents(args: I64Ptr, dims: M3Dims, wk: BW3, bb: Int, hh: Int, n: Int,
                      scr: F32Ptr, dqk0: F32Ptr, dvb: F32Ptr, ldv: Int):
    """The last chunk of the state path: the final state's buffer rows
    0..n-1 are this chunk's rows, so their cotangents join the rows'
    (rotated q, k and v here, one add each; dt, sg, adt in step 7)."""
    var nh = dims.nh
    var cq = arg_f32(args, BW_C_BQ)
    var ck = arg_f32(args, BW_C_BK)
    var cv = arg_f32(args, BW_C_BV)
    for j in range(n):
        var so = (bb * QC + j) * nh + hh
        var dq = dqk0.unsafe_offset(j * QK)
        comptime for cc in range(8):
            dq.unsafe_store(cc * 16, dq.unsafe_load[width=16](cc * 16)
                            + cq.unsafe_load[width=16](so * NST + cc * 16))
            dq.unsafe_store(NST + cc * 16, dq.unsafe_load[width=16](NST + cc * 16)
                            + ck.unsafe_load[width=16](so * NST + cc * 16))
        var dv = dvb.unsafe_offset(j * ldv)
        comptime for cc in range(4):
            dv.unsafe_store(cc * 16, dv.unsafe_load[width=16](cc * 16)
                            + cv.unsafe_load[width=16](so * HP + cc * 16))


def _state_grads(args: I64Ptr, dims: M3Dims, wk: BW3, bb: Int, hh: Int, fin: Bool,
                 dqk0: F32Ptr, dvb: F32Ptr, ldv: Int, dH: F32Ptr, tcar: F32Ptr,
                 dbeta_prev: Float32, scr: F32Ptr):
    """Chunk 0 of the state path: the initial state's gradients of (bb, hh).
    theta: the angle carry; h: dh_in; buffer rows j < n0: the rows' dk, dv
    (and dq: the final cotangent only, the forward never reads a buffered
    q), their dt, sg, adt (written by step 7); rows past n0 +0.0; pending_k,
    pending_v: the input-state step's VJP (pending) plus the final state's
    cotangents (the forward leaves these arrays as they are)."""
    var nh = dims.nh
    var bh = bb * nh + hh
    var s0 = wk.n0
    copy_floats(tcar, arg_f32(args, BW_GS_THETA).unsafe_offset(bh * NANG), NANG)
    copy_floats(dH, arg_f32(args, BW_GS_H).unsafe_offset(bh * HP * NST), HP * NST)
    var gq = arg_f32(args, BW_GS_BQ)
    var gk = arg_f32(args, BW_GS_BK)
    var gv = arg_f32(args, BW_GS_BV)
    var cq = arg_f32(args, BW_C_BQ)
    for j in range(QC):
        var so = (bb * QC + j) * nh + hh
        if j < s0:
            if fin:
                copy_floats(cq.unsafe_offset(so * NST), gq.unsafe_offset(so * NST), NST)
            else:
                for k in range(NST):
                    gq[unsafe_offset=so * NST + k] = 0.0
            copy_floats(dqk0.unsafe_offset(j * QK + NST), gk.unsafe_offset(so * NST), NST)
            copy_floats(dvb.unsafe_offset(j * ldv), gv.unsafe_offset(so * HP), HP)
        else:
            for k in range(NST):
                gq[unsafe_offset=so * NST + k] = 0.0
                gk[unsafe_offset=so * NST + k] = 0.0
            for p in range(HP):
                gv[unsafe_offset=so * HP + p] = 0.0
            arg_f32(args, BW_GS_BDT)[unsafe_offset=so] = 0.0
            arg_f32(args, BW_GS_BSG)[unsafe_offset=so] = 0.0
            arg_f32(args, BW_GS_BADT)[unsafe_offset=so] = 0.0
    var gpk = arg_f32(args, BW_GS_PK).unsafe_offset(bh * NST)
    var gpv = arg_f32(args, BW_GS_PV).unsafe_offset(bh * HP)
    var cpk = arg_f32(args, BW_C_PK).unsafe_offset(bh * NST)
    var cpv = arg_f32(args, BW_C_PV).unsafe_offset(bh * HP)
    if arg_int(args, BW_PENDING) == 0:
        copy_floats(cpk, gpk, NST)
        copy_floats(cpv, gpv, HP)
        return
    # h += (v_in scal) k_in^T: d v_in = (dh k_in) scal, d k_in = dh^T (v_in scal)
    var pv = arg_f32(args, BW_S_PV).unsafe_offset(bh * HP)
    var scal = scr[unsafe_offset=V_DT] * (Float32(1.0) - scr[unsafe_offset=V_SG])
    var u = scr.unsafe_offset(V_TMP)  # dh_in k_in (step 4's dbeta)
    for p in range(HP):
        gpv[unsafe_offset=p] = u[unsafe_offset=p] * scal + cpv[unsafe_offset=p]
    comptime for cc in range(8):
        var acc = V16(0.0)
        for p in range(HP):
            acc = V16(pv[unsafe_offset=p] * scal).fma(dH.unsafe_load[width=16](p * NST + cc * 16), acc)
        gpk.unsafe_store(cc * 16, acc + cpk.unsafe_load[width=16](cc * 16))


def _scan_bwd(args: I64Ptr, dims: M3Dims, wk: BW3, c: Int, bb: Int, hh: Int):
    """VJP of chunk c for (bb, hh). Order (each sum in the loop order written):
    1. per token i: dy = do * silu(z); dz = (do * y) * silu'(z); dvv_i = dy_i . v_i.
    2. i ascending, j < i ascending: DV = dy_i . v_j; dscale_j += (DV L) G;
       X = DV C; dcum_i += X; dcum_j -= X; dG = (DV L) scale_j.
    3. dq_i = e_i h^T dy_i (p ascending), then + dG_ij kr_j (j ascending), then
       + (dvv_i gamma_i) kr_i; dk_j = dG_ij qr_i (i > j ascending) then
       + (dvv_j gamma_j) qr_j; dv_j = C_ij dy_i (i > j ascending) then
       + (gamma_j qk_j + D) dy_j; dcum_i += e_i (dy_i . hq_i); dgamma_i = dvv_i qk_i.
    4. fold (dH carried in): dcum_last += e_last <dH, h>; for j ascending:
       u = dH kr_j, vdk = v_j . u, F = L[last, j] (1 for j = last),
       dscale_j += F vdk, X = F scale_j vdk (j < last: dcum_last += X,
       dcum_j -= X), dv_j += (F scale_j) u, dk_j += (F scale_j) dH^T v_j.
       dh_in = e_last dH + sum_i (e_i dy_i) qr_i^T (i ascending) -> carried;
       dbeta_prev = vprev . (dh_in kprev).
    5. dadt = reverse cumulative sum of dcum.
    6. tokens descending: angle cotangent T += d theta_j; dq, dk unrotated;
       d angle partial = T pi dt (1 - tanh^2); ddt_theta = sum_r T tanh pi.
    7. scalars: d dd_dt, d dd_A, d trap (see the code).
    State path (BW_STATED): chunk 0's first n0 rows are the state's buffered
    rows (no output here: dy +0.0, q, G, C, q . h rows +0.0, so every sum
    above runs over them unchanged and adds nothing of theirs); the last
    chunk adds the final state's cotangents (h to dh_in, rows after step 4,
    adt after step 5, dt and sg in step 7); chunk 0 writes the initial
    state's gradients (_state_grads)."""
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    var hc = HeadChunk(wk, c, bb, hh)
    var ns = hc.n  # scan rows per batch row
    var last = hc.n - 1
    var fin = wk.stated and c == wk.nchunks - 1
    var scr = work.unsafe_offset(wk.o_scr + hc.bh * SCR)
    var proj = work.unsafe_offset(wk.o_proj)
    var dproj = work.unsafe_offset(wk.o_dproj)
    var qkr = work.unsafe_offset(wk.o_qkr)
    var dqk = work.unsafe_offset(wk.o_dqk)
    var npj = dims.np
    var rs = QK  # row stride inside one head's block of qkr / dqk
    var hb = hh * wk.rmax
    var h = work.unsafe_offset(wk.o_ckh + hc.ckpt(c) * HP * NST)
    var dH = work.unsafe_offset(wk.o_cdh + hc.bh * HP * NST)
    var dsk = blob[unsafe_offset=dims.o_dskip + hh]
    var vo = dims.c_v + hh * HP
    var dy = scr.unsafe_offset(M_DY)
    # v rows and their gradients: the proj / dproj rows, or with state rows
    # in front the (row, head)'s contiguous copy (_scan_fwd filled it)
    var vb = proj.unsafe_offset((bb * hc.nt) * npj + vo)
    var dvb = dproj.unsafe_offset((bb * hc.nt) * npj + vo)
    var ldv = npj
    if hc.s0 > 0:
        vb = work.unsafe_offset(wk.o_sv + hc.bh * SV)
        dvb = vb.unsafe_offset(QC * HP)
        ldv = HP
    # 1.
    for i in range(hc.n):
        if i < hc.s0:
            comptime for cc in range(4):
                dy.unsafe_store(i * HP + cc * 16, V16(0.0))
            scr[unsafe_offset=V_DVV + i] = 0.0
            scr[unsafe_offset=V_DCUM + i] = 0.0
            scr[unsafe_offset=V_DSCALE + i] = 0.0
            continue
        var r = bb * hc.nt + i - hc.s0
        var dorow = work.unsafe_offset(wk.o_do + r * dims.di + hh * HP)
        var yrow = work.unsafe_offset(wk.o_y + r * dims.di + hh * HP)
        var pr = proj.unsafe_offset(r * npj)
        var dpr = dproj.unsafe_offset(r * npj)
        comptime for cc in range(4):
            var z = pr.unsafe_load[width=16](hh * HP + cc * 16)
            var g = dorow.unsafe_load[width=16](cc * 16)
            dy.unsafe_store(i * HP + cc * 16, g * silu_f32[16](z))
            var sz = sigmoid_f32[16](z)
            var sgrad = sz * z.fma(V16(1.0) - sz, V16(1.0))
            dpr.unsafe_store(hh * HP + cc * 16, (g * yrow.unsafe_load[width=16](cc * 16)) * sgrad)
        var dvv = lane_dot[4](dy.unsafe_offset(i * HP), vb.unsafe_offset(i * ldv))
        scr[unsafe_offset=V_DVV + i] = dvv
        work[unsafe_offset=wk.o_dd + r * dims.nh + hh] = dvv
        scr[unsafe_offset=V_DCUM + i] = 0.0
        scr[unsafe_offset=V_DSCALE + i] = 0.0
    # 2.
    for i in range(hc.n):
        var dyi = dy.unsafe_offset(i * HP)
        var j0 = 0
        while j0 < i:  # four dots at a time, then the updates in j order
            var d4: V4
            if j0 + 4 <= i:
                d4 = lane_dots_x4[4](dyi, 0, vb.unsafe_offset(j0 * ldv), ldv)
            else:
                d4 = V4(0.0)
                for q in range(i - j0):
                    d4[q] = lane_dot[4](dyi, vb.unsafe_offset((j0 + q) * ldv))
            for q in range(min(4, i - j0)):
                var j = j0 + q
                var dv_ = d4[q]
                var lij = scr[unsafe_offset=M_L + i * QC + j]
                var dl = dv_ * lij
                scr[unsafe_offset=V_DSCALE + j] = scr[unsafe_offset=V_DSCALE + j] + dl * scr[unsafe_offset=M_G + i * QC + j]
                var x = dv_ * scr[unsafe_offset=M_C + i * QC + j]
                scr[unsafe_offset=V_DCUM + i] = scr[unsafe_offset=V_DCUM + i] + x
                scr[unsafe_offset=V_DCUM + j] = scr[unsafe_offset=V_DCUM + j] - x
                scr[unsafe_offset=M_DG + i * QC + j] = dl * scr[unsafe_offset=V_SCALE + j]
            j0 += 4
    # 3. dq, dk of TB tokens at a time (_dqdk), then dv, dcum, dgam per token
    var qk0 = qkr.unsafe_offset((bb * ns) * rs + hb * QK)  # row 0, rows QK apart
    var dqk0 = dqk.unsafe_offset((bb * ns) * rs + hb * QK)
    var i0 = 0
    while i0 < hc.n:
        if TB == 2 and i0 + 1 < hc.n:
            _dqdk[TB](scr, dy, h, qk0, dqk0, hc.n, i0)
            i0 += TB
        else:
            _dqdk[1](scr, dy, h, qk0, dqk0, hc.n, i0)
            i0 += 1
    for i in range(hc.n):
        var e = scr[unsafe_offset=V_E + i]
        var gam = scr[unsafe_offset=V_DT + i] * scr[unsafe_offset=V_SG + i]
        var dvv = scr[unsafe_offset=V_DVV + i]
        # dv_i
        var va = Array[V16, 4](fill=V16(0.0))
        for i2 in range(i + 1, hc.n):
            var cm = V16(scr[unsafe_offset=M_C + i2 * QC + i])
            comptime for cc in range(4):
                va[cc] = cm.fma(dy.unsafe_load[width=16](i2 * HP + cc * 16), va[cc])
        var self_c = V16(gam * scr[unsafe_offset=V_QK + i] + dsk)
        var dvrow = dvb.unsafe_offset(i * ldv)
        comptime for cc in range(4):
            dvrow.unsafe_store(cc * 16, self_c.fma(dy.unsafe_load[width=16](i * HP + cc * 16), va[cc]))
        scr[unsafe_offset=V_DCUM + i] = scr[unsafe_offset=V_DCUM + i] + e * lane_dot[4](
            dy.unsafe_offset(i * HP), scr.unsafe_offset(M_HQ + i * HP))
        scr[unsafe_offset=V_DGAM + i] = dvv * scr[unsafe_offset=V_QK + i]
    # 4. fold
    var elast = scr[unsafe_offset=V_E + last]
    var hd: Float32 = 0.0
    for p in range(0, HP, 4):  # four dots at a time, summed in p order
        var h4 = dots128x4(dH.unsafe_offset(p * NST), NST, h.unsafe_offset(p * NST), NST)
        comptime for q in range(4):
            hd = hd + h4[q]
    scr[unsafe_offset=V_DCUM + last] = scr[unsafe_offset=V_DCUM + last] + elast * hd
    var u = scr.unsafe_offset(V_TMP)
    var j0 = 0
    while j0 < hc.n:
        if TB == 2 and j0 + 1 < hc.n:
            _fold[TB](scr, vb, ldv, qk0, dqk0, dvb, dH, last, j0)
            j0 += TB
        else:
            _fold[1](scr, vb, ldv, qk0, dqk0, dvb, dH, last, j0)
            j0 += 1
    # dh_in, in place over the carry, TB state rows at a time
    for p in range(0, HP, TB):
        _dh_in[TB](scr, dy, qk0, dH, hc.n, elast, p)
    if fin:  # the final state's h is the state entering this chunk
        var ch = arg_f32(args, BW_C_H).unsafe_offset(hc.bh * HP * NST)
        for k in range(0, HP * NST, 16):
            dH.unsafe_store(k, dH.unsafe_load[width=16](k) + ch.unsafe_load[width=16](k))
        _final_cotangents(args, dims, wk, bb, hh, hc.n, scr, dqk0, dvb, ldv)
    var dbeta_prev: Float32 = 0.0
    if c > 0 or (wk.stated and arg_int(args, BW_PENDING) != 0):
        var kp = work.unsafe_offset(wk.o_ckk + hc.ckpt(c) * NST)
        var vp = work.unsafe_offset(wk.o_ckv + hc.ckpt(c) * HP)
        for p in range(0, HP, 4):
            u.unsafe_store(p, dots128x4(dH.unsafe_offset(p * NST), NST, kp, 0))
        dbeta_prev = lane_dot[4](vp, u)
    # 5.
    var acc_c: Float32 = 0.0
    var m = last
    while m >= 0:
        acc_c = acc_c + scr[unsafe_offset=V_DCUM + m]
        scr[unsafe_offset=V_DCUM + m] = acc_c  # now dadt_m
        m -= 1
    var cdt = arg_f32(args, BW_C_BDT)
    var csg = arg_f32(args, BW_C_BSG)
    if fin:
        var cadt = arg_f32(args, BW_C_BADT)
        for jj in range(hc.n):
            scr[unsafe_offset=V_DCUM + jj] = (scr[unsafe_offset=V_DCUM + jj]
                                              + cadt[unsafe_offset=(bb * QC + jj) * dims.nh + hh])
    # 6. angles, tokens descending
    var tcar = work.unsafe_offset(wk.o_cdt + hc.bh * NANG)
    var j = last
    while j >= hc.s0:
        var r = bb * hc.nt + j - hc.s0
        var sr = bb * ns + j
        var qrow = qkr.unsafe_offset(sr * rs + hb * QK)
        var krow = qrow.unsafe_offset(NST)
        var dq = dqk.unsafe_offset(sr * rs + hb * QK)
        var dk = dq.unsafe_offset(NST)
        var csr = work.unsafe_offset(wk.o_cs + (hh * wk.rmax + sr) * CSW)
        var pr = proj.unsafe_offset(r * npj)
        var dap = work.unsafe_offset(wk.o_dang + (r * dims.nh + hh) * NANG)
        var dt = scr[unsafe_offset=V_DT + j]
        var ddt_th: Float32 = 0.0
        var tt = scr.unsafe_offset(V_TMP + 160)  # t * tanh per angle
        # 16 angles at a time (pairs split into even | odd lanes); every
        # lane is the scalar formula's own operations.
        comptime for hc in range(2):
            var th = tanh_f32[16](pr.unsafe_load[width=16](dims.c_ang + hc * 16))
            var q = qrow.unsafe_load[width=32](hc * 32).deinterleave()
            var k = krow.unsafe_load[width=32](hc * 32).deinterleave()
            var g = dq.unsafe_load[width=32](hc * 32).deinterleave()
            var f = dk.unsafe_load[width=32](hc * 32).deinterleave()
            var q0 = q[0]
            var q1 = q[1]
            var k0 = k[0]
            var k1 = k[1]
            var g0 = g[0]
            var g1 = g[1]
            var f0 = f[0]
            var f1 = f[1]
            var dth = ((g1 * q0 - g0 * q1) + f1 * k0) - f0 * k1
            var t = tcar.unsafe_load[width=16](hc * 16) + dth
            tcar.unsafe_store(hc * 16, t)
            var cs = csr.unsafe_load[width=16](hc * 16)
            var sn = csr.unsafe_load[width=16](NANG + hc * 16)
            dq.unsafe_store(hc * 32, (g0 * cs + g1 * sn).interleave(g1 * cs - g0 * sn))
            dk.unsafe_store(hc * 32, (f0 * cs + f1 * sn).interleave(f1 * cs - f0 * sn))
            tt.unsafe_store(hc * 16, t * th)
            dap.unsafe_store(hc * 16, ((t * V16(PI_F32)) * V16(dt)) * (V16(1.0) - th * th))
        for rr in range(NANG):  # one fma chain over the angles, ascending
            ddt_th = tt[unsafe_offset=rr].fma(PI_F32, ddt_th)
        scr[unsafe_offset=V_DDT + j] = ddt_th
        j -= 1
    # 7. scalars
    var dtb = blob[unsafe_offset=dims.o_dtb + hh]
    for jj in range(hc.n):
        var dt = scr[unsafe_offset=V_DT + jj]
        var sg = scr[unsafe_offset=V_SG + jj]
        var dadt = scr[unsafe_offset=V_DCUM + jj]
        var dgs = scr[unsafe_offset=V_DSCALE + jj] + scr[unsafe_offset=V_DGAM + jj]
        var bco = dbeta_prev
        if jj > 0:
            bco = scr[unsafe_offset=V_DSCALE + jj - 1]
        var so = (bb * QC + jj) * dims.nh + hh  # the jj-th buffer row (final / initial state)
        if jj < hc.s0:  # a state row: dt, sg, adt are the state's own values
            var sdt = dgs * sg + bco * (Float32(1.0) - sg)
            var ssg = dgs * dt - bco * dt
            if fin:
                sdt = sdt + cdt[unsafe_offset=so]
                ssg = ssg + csg[unsafe_offset=so]
            arg_f32(args, BW_GS_BDT)[unsafe_offset=so] = sdt
            arg_f32(args, BW_GS_BSG)[unsafe_offset=so] = ssg
            arg_f32(args, BW_GS_BADT)[unsafe_offset=so] = dadt
            continue
        var r = bb * hc.nt + jj - hc.s0
        var pr = proj.unsafe_offset(r * npj)
        var dpr = dproj.unsafe_offset(r * npj)
        var ddt = dadt * scr[unsafe_offset=V_A + jj] + dgs * sg
        ddt = ddt + scr[unsafe_offset=V_DDT + jj]
        ddt = ddt + bco * (Float32(1.0) - sg)
        var dsg = dgs * dt - bco * dt
        if fin:
            ddt = ddt + cdt[unsafe_offset=so]
            dsg = dsg + csg[unsafe_offset=so]
        var vdt = pr[unsafe_offset=dims.c_dt + hh] + dtb
        var spg: Float32 = 1.0
        if not (vdt > 20.0):
            spg = sigmoid_f32[1](vdt)
        dpr[unsafe_offset=dims.c_dt + hh] = ddt * spg
        dpr[unsafe_offset=dims.c_a + hh] = (dadt * dt) * _dphi_a(pr[unsafe_offset=dims.c_a + hh])
        dpr[unsafe_offset=dims.c_tr + hh] = dsg * (sg * (Float32(1.0) - sg))
    if hc.s0 > 0:  # the tokens' v gradients back into their dproj rows
        for i in range(hc.s0, hc.n):
            copy_floats(dvb.unsafe_offset(i * ldv),
                        dproj.unsafe_offset((bb * hc.nt + i - hc.s0) * npj + vo), HP)
    if wk.stated and c == 0:
        _state_grads(args, dims, wk, bb, hh, fin, dqk0, dvb, ldv, dH, tcar, dbeta_prev, scr)
