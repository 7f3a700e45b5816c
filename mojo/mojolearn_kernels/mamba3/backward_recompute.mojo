"""Mamba-3 backward: the per (row, head) recompute of a chunk's forward from
its checkpoint (projections' slices, angles and rotation, segment scales,
the scan's pass A state and forward outputs), the pieces pass B's VJP
(backward.mojo, backward_scan.mojo) reads. It calls the forward's own stage
code (stages.mojo), so it recomputes the forward's bits.
"""
from ..abi import F32Ptr, I64Ptr, arg_int, arg_f32
from ..numerics import exp_f32, softplus_f32, sigmoid_f32, tanh_f32
from .layout import M3Dims, NST, HP, NANG, QC, PI_F32
from ..dot128 import dot128, dots128x4, dots128_block
from ..lanes import copy_floats
from .stages import phi_a, rotate_token, fold_into, out_token
from .backward_layout import (
    BW_BLOB, BW_WORK, V16, BW_PENDING, BW_S_BK, BW_S_BV,
    BW_S_BDT, BW_S_BSG, BW_S_BADT, SV, TB, QK,
    CSW, M_G, M_L, M_C, M_HQ, M_DG,
    V_DT, V_SG, V_ADT, V_A, V_SCALE, V_E,
    V_QK, V_TMP, SCR, BW3, HeadChunk,
)
from .backward_scan import apply_pending, V4


def _prep(args: I64Ptr, dims: M3Dims, wk: BW3, bb: Int, hh: Int, c: Int, nr: Int,
          theta: F32Ptr, scr: F32Ptr):
    """Rows 0..n-1 of chunk c for (bb, hh), n = s0 + nt: first the s0 state
    rows (chunk 0 of the state path: dt, sg, adt as stored, the stored
    rotated k, q and the unrotated q . k +0.0: a state row's own output is
    not part of this call), then the nt tokens: dt, sg, adt, A, qk
    (unrotated q . k) into the vectors; the angles advanced from theta
    (updated in place); cos | sin, and the rotated q | k rows (bias added)
    written to cs and qkr (scan rows bb (s0 + nr) + i). The forward op's
    formulas and order. nr: proj rows per batch row."""
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    var proj = work.unsafe_offset(wk.o_proj)
    var bcn = work.unsafe_offset(wk.o_bcn)
    var s0 = wk.s0(c)
    var nt = wk.chunk_tokens(c)
    var n = s0 + nt
    var ns = s0 + nr
    var dtb = blob[unsafe_offset=dims.o_dtb + hh]
    var bbias = blob.unsafe_offset(dims.o_bb + hh * NST)
    var cbias = blob.unsafe_offset(dims.o_cb + hh * NST)
    var qu = scr.unsafe_offset(V_TMP)
    var ku = scr.unsafe_offset(V_TMP + NST)
    # dt, sg, A of 16 tokens at a time (gathered into their vectors; the
    # functions give the same bits at any width); lanes past n are unused,
    # state rows below s0 are written after
    for i in range(nt):
        var pr = proj.unsafe_offset((bb * nr + i) * dims.np)
        scr[unsafe_offset=V_DT + s0 + i] = pr[unsafe_offset=dims.c_dt + hh]
        scr[unsafe_offset=V_SG + s0 + i] = pr[unsafe_offset=dims.c_tr + hh]
        scr[unsafe_offset=V_A + s0 + i] = pr[unsafe_offset=dims.c_a + hh]
    var i0 = (s0 // 16) * 16
    while i0 < n:
        var dtv = softplus_f32[16](scr.unsafe_load[width=16](V_DT + i0) + V16(dtb))
        var av = phi_a[16](scr.unsafe_load[width=16](V_A + i0))
        scr.unsafe_store(V_DT + i0, dtv)
        scr.unsafe_store(V_SG + i0, sigmoid_f32[16](scr.unsafe_load[width=16](V_SG + i0)))
        scr.unsafe_store(V_ADT + i0, av * dtv)
        scr.unsafe_store(V_A + i0, av)
        i0 += 16
    if s0 > 0:
        var nh = dims.nh
        var sdt = arg_f32(args, BW_S_BDT)
        var ssg = arg_f32(args, BW_S_BSG)
        var sadt = arg_f32(args, BW_S_BADT)
        var sbk = arg_f32(args, BW_S_BK)
        for j in range(s0):
            var so = (bb * QC + j) * nh + hh
            scr[unsafe_offset=V_DT + j] = sdt[unsafe_offset=so]
            scr[unsafe_offset=V_SG + j] = ssg[unsafe_offset=so]
            scr[unsafe_offset=V_ADT + j] = sadt[unsafe_offset=so]
            scr[unsafe_offset=V_A + j] = 0.0
            scr[unsafe_offset=V_QK + j] = 0.0
            var qrow = work.unsafe_offset(wk.o_qkr + wk.qk_row(bb * ns + j, hh))
            for k in range(NST):
                qrow[unsafe_offset=k] = 0.0
            copy_floats(sbk.unsafe_offset(so * NST), qrow.unsafe_offset(NST), NST)
    for i in range(nt):  # the forward's rotation (stages.rotate_token)
        var r = bb * nr + i
        var sr = bb * ns + s0 + i
        var pr = proj.unsafe_offset(r * dims.np)
        var bc = bcn.unsafe_offset(r * 2 * NST)
        var qrow = work.unsafe_offset(wk.o_qkr + wk.qk_row(sr, hh))
        scr[unsafe_offset=V_QK + s0 + i] = rotate_token[True](
            bc, bc.unsafe_offset(NST), bbias, cbias,
            tanh_f32[16](pr.unsafe_load[width=16](dims.c_ang)) * V16(PI_F32),
            tanh_f32[16](pr.unsafe_load[width=16](dims.c_ang + 16)) * V16(PI_F32),
            scr[unsafe_offset=V_DT + s0 + i], theta, qu, ku, qrow, qrow.unsafe_offset(NST),
            work.unsafe_offset(wk.o_cs + (hh * wk.rmax + sr) * CSW))


def _v_rows(args: I64Ptr, dims: M3Dims, wk: BW3, bb: Int, hh: Int, c: Int,
            nr: Int) -> Tuple[F32Ptr, Int]:
    """(row 0, row stride) of chunk c's v rows for (bb, hh): the proj rows,
    or with state rows in front a contiguous copy (state rows, then the
    tokens) in the (row, head)'s o_sv matrix."""
    var work = arg_f32(args, BW_WORK)
    var s0 = wk.s0(c)
    var vo = dims.c_v + hh * HP
    var proj = work.unsafe_offset(wk.o_proj)
    if s0 == 0:
        return (proj.unsafe_offset(bb * nr * dims.np + vo), dims.np)
    var vm = work.unsafe_offset(wk.o_sv + (bb * dims.nh + hh) * SV)
    var sbv = arg_f32(args, BW_S_BV)
    for j in range(s0):
        copy_floats(sbv.unsafe_offset(((bb * QC + j) * dims.nh + hh) * HP),
                    vm.unsafe_offset(j * HP), HP)
    for i in range(wk.chunk_tokens(c)):
        copy_floats(proj.unsafe_offset((bb * nr + i) * dims.np + vo),
                    vm.unsafe_offset((s0 + i) * HP), HP)
    return (vm, HP)


@always_inline
def _scales(scr: F32Ptr, n: Int, beta_last: Float32):
    """scale_j = dt_j sg_j + beta_j; beta_j = dt_{j+1} (1 - sg_{j+1}), beta_last for j = n-1."""
    for j in range(n):
        var beta = beta_last
        if j < n - 1:
            beta = scr[unsafe_offset=V_DT + j + 1] * (Float32(1.0) - scr[unsafe_offset=V_SG + j + 1])
        scr[unsafe_offset=V_SCALE + j] = scr[unsafe_offset=V_DT + j] * scr[unsafe_offset=V_SG + j] + beta


@always_inline
def _segs(scr: F32Ptr, i: Int, dst: F32Ptr) -> Float32:
    """dst[j] = exp(seg(i, j)) for j <= i (seg summed downwards from +0.0, the
    forward's _weights order); returns exp(cum_i)."""
    var s: Float32 = 0.0
    var j = i
    while j >= 0:
        dst[unsafe_offset=j] = s
        s = s + scr[unsafe_offset=V_ADT + j]
        j -= 1
    var c = 0
    while c <= i:  # lane-wise exps (same bits at any width); dst has 64 floats
        dst.unsafe_store(c, exp_f32[16](dst.unsafe_load[width=16](c)))
        c += 16
    return exp_f32[1](s)


def recompute_scan_a(args: I64Ptr, dims: M3Dims, wk: BW3, c: Int, bb: Int, hh: Int):
    """Pass A for (bb, hh) over chunk c: fold the chunk into h (the forward's
    Fold(64, beta) with beta from the next chunk's first token) and write
    chunk c+1's checkpoints."""
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    var hc = HeadChunk(wk, c, bb, hh)
    var nr = hc.nt + 1
    var ns = hc.s0 + nr
    var scr = work.unsafe_offset(wk.o_scr + hc.bh * SCR)
    var th = work.unsafe_offset(wk.o_ckt + hc.ckpt(c + 1) * NANG)
    var th0 = work.unsafe_offset(wk.o_ckt + hc.ckpt(c) * NANG)
    for i in range(NANG):
        th[unsafe_offset=i] = th0[unsafe_offset=i]
    _prep(args, dims, wk, bb, hh, c, nr, th, scr)
    var h0 = work.unsafe_offset(wk.o_ckh + hc.ckpt(c) * HP * NST)
    if c == 0 and wk.stated and arg_int(args, BW_PENDING) != 0:
        apply_pending(args, dims, hc.bh, scr, h0)  # the forward's step 7
    # beta of the next chunk's first token (row nt of this stage)
    var pr = work.unsafe_offset(wk.o_proj + (bb * nr + hc.nt) * dims.np)
    var dtn = softplus_f32[1](pr[unsafe_offset=dims.c_dt + hh] + blob[unsafe_offset=dims.o_dtb + hh])
    var sgn = sigmoid_f32[1](pr[unsafe_offset=dims.c_tr + hh])
    _scales(scr, hc.n, dtn * (Float32(1.0) - sgn))
    var w = scr.unsafe_offset(V_TMP)
    var hdec = _segs(scr, hc.n - 1, w)
    for j in range(hc.n):
        w[unsafe_offset=j] = w[unsafe_offset=j] * scr[unsafe_offset=V_SCALE + j]
    var h1 = work.unsafe_offset(wk.o_ckh + hc.ckpt(c + 1) * HP * NST)
    var qkr = work.unsafe_offset(wk.o_qkr)
    var vr = _v_rows(args, dims, wk, bb, hh, c, nr)
    var v0 = vr[0]
    var ldv = vr[1]
    fold_into(v0, ldv, qkr.unsafe_offset(wk.qk_row(bb * ns, hh) + NST), QK, w, hc.n, hdec, h0, h1,
              scr.unsafe_offset(M_G))  # the forward's fold (M_G is free in pass A)
    var kv = work.unsafe_offset(wk.o_ckv + hc.ckpt(c + 1) * HP)
    var kk = work.unsafe_offset(wk.o_ckk + hc.ckpt(c + 1) * NST)
    for p in range(HP):
        kv[unsafe_offset=p] = v0[unsafe_offset=(hc.n - 1) * ldv + p]
    for k in range(NST):
        kk[unsafe_offset=k] = qkr[unsafe_offset=wk.qk_row(bb * ns + hc.n - 1, hh) + NST + k]


def recompute_scan_fwd(args: I64Ptr, dims: M3Dims, wk: BW3, c: Int, bb: Int, hh: Int):
    """Pass B recompute for (bb, hh) over chunk c: the forward op's outputs
    y (before the gate) and o, plus the matrices the VJP reuses (state rows:
    their L rows and e; G, C and q . h rows +0.0)."""
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    var hc = HeadChunk(wk, c, bb, hh)
    var ns = hc.n
    var scr = work.unsafe_offset(wk.o_scr + hc.bh * SCR)
    var th = scr.unsafe_offset(M_DG)  # angles: M_DG is free until the VJP
    var th0 = work.unsafe_offset(wk.o_ckt + hc.ckpt(c) * NANG)
    for i in range(NANG):
        th[unsafe_offset=i] = th0[unsafe_offset=i]
    _prep(args, dims, wk, bb, hh, c, hc.nt, th, scr)
    var h = work.unsafe_offset(wk.o_ckh + hc.ckpt(c) * HP * NST)
    if c == 0 and wk.nchunks == 1 and wk.stated and arg_int(args, BW_PENDING) != 0:
        apply_pending(args, dims, hc.bh, scr, h)  # (pass A did it when it ran)
    var cb = work.unsafe_offset(wk.o_cbeta + hc.bh)
    var beta_next = cb[unsafe_offset=0]
    cb[unsafe_offset=0] = scr[unsafe_offset=V_DT] * (Float32(1.0) - scr[unsafe_offset=V_SG])
    _scales(scr, hc.n, beta_next)
    var proj = work.unsafe_offset(wk.o_proj)
    var qkr = work.unsafe_offset(wk.o_qkr)
    var dsk = blob[unsafe_offset=dims.o_dskip + hh]
    var rs = QK  # row stride inside one head's block
    var hb = hh * wk.rmax
    for i in range(hc.n):  # per row: L row, e_i, G and C rows
        var r = bb * ns + i
        var qrow = qkr.unsafe_offset(wk.qk_row(r, hh))
        var lrow = scr.unsafe_offset(M_L + i * QC)
        var grow = scr.unsafe_offset(M_G + i * QC)
        var crow = scr.unsafe_offset(M_C + i * QC)
        var e = _segs(scr, i, lrow)
        scr[unsafe_offset=V_E + i] = e
        if i < hc.s0:  # a state row: no output here
            for j in range(0, QC, 16):
                grow.unsafe_store(j, V16(0.0))
                crow.unsafe_store(j, V16(0.0))
                scr.unsafe_store(M_HQ + i * HP + j, V16(0.0))
            continue
        var j = 0
        while j < i:
            var g4: V4
            if j + 4 <= i:
                g4 = dots128x4(qrow, 0, qkr.unsafe_offset((bb * ns + j) * rs + hb * QK + NST), rs)
            else:
                g4 = V4(0.0)
                for q in range(i - j):
                    g4[q] = dot128(qrow, qkr.unsafe_offset((bb * ns + j + q) * rs + hb * QK + NST))
            for q in range(min(4, i - j)):
                grow[unsafe_offset=j + q] = g4[q]
                crow[unsafe_offset=j + q] = (lrow[unsafe_offset=j + q]
                                             * scr[unsafe_offset=V_SCALE + j + q]) * g4[q]
            j += 4
    # hq_i = h q_i, TB tokens at a time (they share each loaded h row)
    var i0 = hc.s0
    while i0 < hc.n:
        var q0 = qkr.unsafe_offset(wk.qk_row(bb * ns + i0, hh))
        if TB == 2 and i0 + 1 < hc.n:
            for p in range(0, HP, 4):
                dots128_block[TB](q0, QK, h.unsafe_offset(p * NST), NST,
                                   scr.unsafe_offset(M_HQ + i0 * HP + p), HP)
            i0 += TB
        else:
            for p in range(0, HP, 4):
                dots128_block[1](q0, QK, h.unsafe_offset(p * NST), NST,
                                  scr.unsafe_offset(M_HQ + i0 * HP + p), HP)
            i0 += 1
    var vr = _v_rows(args, dims, wk, bb, hh, c, hc.nt)
    var v0 = vr[0]
    var ldv = vr[1]
    for i in range(hc.s0, hc.n):  # y and o: the forward's out_token
        var r = bb * hc.nt + i - hc.s0
        var diag = scr[unsafe_offset=V_QK + i] * (scr[unsafe_offset=V_DT + i] * scr[unsafe_offset=V_SG + i])
        out_token[True](scr.unsafe_offset(M_C + i * QC), i, scr[unsafe_offset=V_E + i],
                        scr.unsafe_offset(M_HQ + i * HP), v0, ldv, diag, dsk,
                        proj.unsafe_offset(r * dims.np + hh * HP),
                        work.unsafe_offset(wk.o_o + r * dims.di + hh * HP),
                        work.unsafe_offset(wk.o_y + r * dims.di + hh * HP))


# ------------------------------------------------------------ out_proj VJP
