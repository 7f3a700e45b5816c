"""Mamba-3 SISO scan: one (batch row, head) over the tokens of a pass (the
canonical per-token formula of mamba3/forward.mojo's docstring, in segments
that batch the dot products; a task runs one head, or in a long pass a few
heads of its row in turn), the per-row gates every head reads, and the lazy
reports."""
from std.sys.intrinsics import prefetch, PrefetchOptions
from ..abi import F32Ptr, I64Ptr, arg_int, arg_f32, arg_i64
from ..dot128 import dots128_grid, GRID_T
from ..numerics import exp_f32, softplus_f32, sigmoid_f32, tanh_f32
from .layout import (
    M3Dims, NST, HP, NANG, QC, PI_F32, V16, FWD_B, FWD_L, FWD_LENGTHS, FWD_N0,
    FWD_PENDING, FWD_THETA, FWD_H, FWD_BQ, FWD_BK, FWD_BV, FWD_BDT, FWD_BSG, FWD_BADT,
    FWD_PK, FWD_PV, FWD_RH, FWD_RK, FWD_RV, FWD_RTHETA, FWD_WORK,
    S_QU, S_KU, S_W, S_SC, S_DIAG, S_HQ, S_WT, SEG_G, S_QK, S_CHUNK, COPY_TOKENS, FOLD_SCR,
    count_after, n0_of,
)
from ..lanes import copy_floats
from .stages import phi_a, rotate_token, fold_into, out_token, out_token_wq

comptime ROWS_AHEAD = 4  # rows (tokens, chunk rows) a prefetch runs ahead
comptime HEAD_STATE = HP * NST + QC * (2 * NST + HP)  # floats of a head's h and rows
# A decode step prefetches h too when the state is larger than this (8 MB):
# d = 768 B = 1 (2.8 MB) ran 15% slower with it, B = 8 (22 MB) 10-20% faster
comptime FETCH_H_FLOATS = 2 * 1024 * 1024


struct HeadState(ImplicitlyCopyable):
    """Pointers to one (row, head) slice of a Mamba3State."""
    var theta: F32Ptr  # (32,)
    var h: F32Ptr  # (P, N)
    var bq: F32Ptr  # row j at j * qs
    var bk: F32Ptr  # row j at j * rs
    var bv: F32Ptr  # row j at j * vs
    var bdt: F32Ptr  # row j at j * ss
    var bsg: F32Ptr
    var badt: F32Ptr
    var pk: F32Ptr
    var pv: F32Ptr
    var qs: Int
    var rs: Int
    var vs: Int
    var ss: Int

    def __init__(out self, args: I64Ptr, dims: M3Dims, bb: Int, hh: Int):
        var nh = dims.nh
        self.theta = arg_f32(args, FWD_THETA).unsafe_offset((bb * nh + hh) * NANG)
        self.h = arg_f32(args, FWD_H).unsafe_offset((bb * nh + hh) * HP * NST)
        self.qs = nh * NST
        self.rs = nh * NST
        self.vs = nh * HP
        self.ss = nh
        self.bq = arg_f32(args, FWD_BQ).unsafe_offset(bb * QC * nh * NST + hh * NST)
        self.bk = arg_f32(args, FWD_BK).unsafe_offset(bb * QC * nh * NST + hh * NST)
        self.bv = arg_f32(args, FWD_BV).unsafe_offset(bb * QC * nh * HP + hh * HP)
        self.bdt = arg_f32(args, FWD_BDT).unsafe_offset(bb * QC * nh + hh)
        self.bsg = arg_f32(args, FWD_BSG).unsafe_offset(bb * QC * nh + hh)
        self.badt = arg_f32(args, FWD_BADT).unsafe_offset(bb * QC * nh + hh)
        self.pk = arg_f32(args, FWD_PK).unsafe_offset((bb * nh + hh) * NST)
        self.pv = arg_f32(args, FWD_PV).unsafe_offset((bb * nh + hh) * HP)

    def on_chunk_copy(mut self, c: F32Ptr):
        """Point the working-chunk rows but q's at a contiguous copy at c
        (layout.CHUNK_COPY floats); q rows stay in the state (only the
        current segment's are read)."""
        self.bk = c
        self.bv = c.unsafe_offset(QC * NST)
        self.bdt = c.unsafe_offset(QC * NST + QC * HP)
        self.bsg = self.bdt.unsafe_offset(QC)
        self.badt = self.bdt.unsafe_offset(2 * QC)
        self.rs = NST
        self.vs = HP
        self.ss = 1

    @always_inline
    def dt(self, j: Int) -> Float32:
        return self.bdt[unsafe_offset=j * self.ss]

    @always_inline
    def sg(self, j: Int) -> Float32:
        return self.bsg[unsafe_offset=j * self.ss]

    @always_inline
    def adt(self, j: Int) -> Float32:
        return self.badt[unsafe_offset=j * self.ss]

    @always_inline
    def scale(self, j: Int, last: Int, beta_last: Float32) -> Float32:
        """gamma_j + beta_j; beta_j = dt_{j+1} (1 - sg_{j+1}), or beta_last for j = last."""
        var gamma = self.dt(j) * self.sg(j)
        var beta = beta_last
        if j < last:
            beta = self.dt(j + 1) * (Float32(1.0) - self.sg(j + 1))
        return gamma + beta


@always_inline
def _fetch[L2: Bool = False](p: F32Ptr):
    """Prefetch p's line (into L2 only with L2: for data wanted later)."""
    comptime if L2:
        prefetch[PrefetchOptions().for_read().medium_locality()](p)
    else:
        prefetch[PrefetchOptions().for_read().high_locality()](p)


def _copy_rows[FETCH: Bool](a: HeadState, b: HeadState, n: Int):
    """Working-chunk k, v, dt, sg and adt rows 0 .. n - 1 of a into b (the
    ones on_chunk_copy moves); FETCH: a is the state (rows 12 KB apart, no
    hardware prefetcher follows them), ask for its rows ahead."""
    for j in range(n):
        if FETCH and j + ROWS_AHEAD < n:
            _fetch_row(a, j + ROWS_AHEAD)
        copy_floats(a.bk.unsafe_offset(j * a.rs), b.bk.unsafe_offset(j * b.rs), NST)
        copy_floats(a.bv.unsafe_offset(j * a.vs), b.bv.unsafe_offset(j * b.vs), HP)
        b.bdt[unsafe_offset=j * b.ss] = a.bdt[unsafe_offset=j * a.ss]
        b.bsg[unsafe_offset=j * b.ss] = a.bsg[unsafe_offset=j * a.ss]
        b.badt[unsafe_offset=j * b.ss] = a.badt[unsafe_offset=j * a.ss]


def _weights(hs: HeadState, last: Int, beta_last: Float32, sc: F32Ptr, w: F32Ptr) -> Float32:
    """w[j] = exp(seg(last, j)) * scale_j for j <= last; returns exp(cum_last).

    seg is summed downwards from +0.0: s = 0; for j = last..0: seg_j = s;
    s = s + adt_j. The final s is cum_last. scale_j = sc[j] (gamma_j + beta_j)
    for j < last, gamma_last + beta_last for j = last. The exps and products
    are lane-wise (the own exp gives the same bits at any SIMD width). w
    needs room for 64 floats; its lanes past last are left undefined."""
    var s: Float32 = 0.0
    var j = last
    while j >= 0:
        w[unsafe_offset=j] = s
        s = s + hs.adt(j)
        j -= 1
    var c = 0
    while c <= last:
        w.unsafe_store(c, exp_f32[16](w.unsafe_load[width=16](c)))
        c += 16
    var e_last = w[unsafe_offset=last]
    c = 0
    while c < last:
        w.unsafe_store(c, w.unsafe_load[width=16](c) * sc.unsafe_load[width=16](c))
        c += 16
    w[unsafe_offset=last] = e_last * (hs.dt(last) * hs.sg(last) + beta_last)
    return exp_f32[1](s)


def _seg_table(hs: HeadState, ib: Int, sc: F32Ptr, wt: F32Ptr) -> SIMD[DType.float32, SEG_G]:
    """_weights of the SEG_G tokens at rows ib .. ib + SEG_G - 1 side by side
    (lane g: row ib + g): wt[j SEG_G + g] = exp(seg(ib + g, j)) * sc[j] for
    j < ib + g; returns the lanes' exp(cum). Every lane runs _weights' own
    chain (s = 0; s = s + adt_j from its row down), the rows in step: above
    its row a lane holds +0.0 and adds +0.0 (exactly +0.0). One chain at a
    time waited on every add; the exps and products are lane-wise."""
    comptime VG = SIMD[DType.float32, SEG_G]
    var lane = VG(0.0)
    comptime for g in range(SEG_G):
        lane[g] = Float32(g)
    var s = VG(0.0)
    var j = ib + SEG_G - 1
    while j > ib:  # rows above the first token: the lanes at or below them
        wt.unsafe_store(j * SEG_G, s)
        s = s + lane.ge(VG(Float32(j - ib))).select(VG(hs.adt(j)), VG(0.0))
        j -= 1
    while j >= 0:
        wt.unsafe_store(j * SEG_G, s)
        s = s + VG(hs.adt(j))
        j -= 1
    for jj in range(ib + SEG_G - 1):  # a lane reads the rows below its own
        wt.unsafe_store(jj * SEG_G, exp_f32[SEG_G](wt.unsafe_load[width=SEG_G](jj * SEG_G))
                        * VG(sc[unsafe_offset=jj]))
    return exp_f32[SEG_G](s)


def _init_scales(hs: HeadState, cnt: Int, sc: F32Ptr):
    """sc[j] = gamma_j + beta_j for the buffered rows j < cnt - 1."""
    for j in range(cnt - 1):
        sc[unsafe_offset=j] = hs.scale(j, cnt - 1, Float32(0.0))


def _fold(hs: HeadState, count: Int, beta_last: Float32, sc: F32Ptr, u: F32Ptr,
          w: F32Ptr, dst: F32Ptr):
    """dst = the fold of the working chunk's count rows into h
    (stages.fold_into, with _weights' w and exp(cum)); dst may be
    hs.h; u is (64, 64) scratch."""
    var hdec = _weights(hs, count - 1, beta_last, sc, w)
    fold_into(hs.bv, hs.vs, hs.bk, hs.rs, w, count, hdec, hs.h, dst, u)


def _fetch_rows[L2: Bool = False](hs: HeadState, cnt: Int, with_h: Bool = False):
    """Ask for the cnt chunk rows of k and v (and h with with_h): a decode
    step finds them evicted by the weight stream, and rows 12 KB apart are
    nothing a hardware prefetcher follows; the task's own work overlaps the
    wait. h is contiguous, streamed by the hardware prefetcher: asking for
    its 512 lines too paid only where the state does not stay in the last
    level cache between steps (FETCH_H_FLOATS)."""
    if with_h:
        for off in range(0, HP * NST, 16):
            _fetch[L2](hs.h.unsafe_offset(off))
    for j in range(cnt):
        _fetch_row[L2](hs, j)


@always_inline
def _fetch_row[L2: Bool = False](hs: HeadState, j: Int):
    """Ask for chunk row j's k and v lines."""
    comptime for c in range(0, NST, 16):
        _fetch[L2](hs.bk.unsafe_offset(j * hs.rs + c))
    comptime for c in range(0, HP, 16):
        _fetch[L2](hs.bv.unsafe_offset(j * hs.vs + c))


def _fetch_token(pr: F32Ptr, dims: M3Dims, hh: Int):
    """Ask for a token's own columns of head hh (z, v, dt, sg, adt): its
    proj row was written a whole pass ago and rows are 13 KB apart."""
    comptime for c in range(0, HP, 16):
        _fetch(pr.unsafe_offset(hh * HP + c))
        _fetch(pr.unsafe_offset(dims.c_v + hh * HP + c))
    _fetch(pr.unsafe_offset(dims.c_dt + hh))
    _fetch(pr.unsafe_offset(dims.c_a + hh))
    _fetch(pr.unsafe_offset(dims.c_tr + hh))


def _append_row(hs: HeadState, dims: M3Dims, hh: Int, pr: F32Ptr, cbias: F32Ptr,
                bbias: F32Ptr, qu: F32Ptr, ku: F32Ptr, i: Int) -> Float32:
    """One token into working-chunk row i: the angles advance, then rotated
    q, k, and v, dt, sg, adt are stored. Returns its diagonal weight
    (q . k) gamma on the unrotated q, k. pr is the token's row after
    row_gates."""
    var dt = pr[unsafe_offset=dims.c_dt + hh]
    var sg = pr[unsafe_offset=dims.c_tr + hh]
    var qk = rotate_token[False](
        pr.unsafe_offset(dims.c_b), pr.unsafe_offset(dims.c_c), bbias, cbias,
        pr.unsafe_load[width=16](dims.c_ang), pr.unsafe_load[width=16](dims.c_ang + 16), dt,
        hs.theta, qu, ku, hs.bq.unsafe_offset(i * hs.qs), hs.bk.unsafe_offset(i * hs.rs), qu)
    var vsrc = pr.unsafe_offset(dims.c_v + hh * HP)
    var vrow = hs.bv.unsafe_offset(i * hs.vs)
    comptime for c in range(4):
        vrow.unsafe_store(c * 16, vsrc.unsafe_load[width=16](c * 16))
    hs.bdt[unsafe_offset=i * hs.ss] = dt
    hs.bsg[unsafe_offset=i * hs.ss] = sg
    hs.badt[unsafe_offset=i * hs.ss] = pr[unsafe_offset=dims.c_a + hh]
    return qk * (dt * sg)


def scan_task(args: I64Ptr, dims: M3Dims, blob: F32Ptr, proj: F32Ptr, o: F32Ptr,
               scr: F32Ptr, bb: Int, hh: Int, t0: Int, nc: Int, then_hh: Int = -1):
    """Tokens t0 .. t0 + nc - 1 of row bb, head hh, in segments that lie
    within one working chunk: append every row of the segment, then its
    q . h[p] and q . k_j as dot grids (h only changes at a fold), then each
    token's output (their weights SEG_G tokens at a time). Every number is
    the one the token-at-a-time order gives. then_hh: the head of row bb
    this task runs next on scr, or -1."""
    var l = arg_int(args, FWD_L)
    var lens = arg_i64(args, FWD_LENGTHS)
    var len_b = l
    if arg_int(args, FWD_LENGTHS) != 0:
        len_b = Int(lens[unsafe_offset=bb])
    var t_end = min(t0 + nc, len_b)
    if t_end <= t0:
        return
    var n0 = n0_of(args, bb)
    var pending = arg_int(args, FWD_PENDING) != 0
    var cnt = count_after(n0, t0)
    var hs = HeadState(args, dims, bb, hh)
    var st = hs  # the state's own rows
    var copied = nc >= COPY_TOKENS  # M3Work sized the scratch for it
    for u in range(min(ROWS_AHEAD, t_end - t0)):
        _fetch_token(proj.unsafe_offset((bb * nc + u) * dims.np), dims, hh)
    var folded = False
    if copied:
        hs.on_chunk_copy(scr.unsafe_offset(S_CHUNK))
        _copy_rows[True](st, hs, cnt)
        if then_hh >= 0:  # the next head's rows into L2 meanwhile, for its copy
            _fetch_rows[True](HeadState(args, dims, bb, then_hh), cnt)
    var qu = scr.unsafe_offset(S_QU)
    var ku = scr.unsafe_offset(S_KU)
    var w = scr.unsafe_offset(S_W)
    var sc = scr.unsafe_offset(S_SC)
    var diag = scr.unsafe_offset(S_DIAG)
    var hqs = scr.unsafe_offset(S_HQ)
    var wt = scr.unsafe_offset(S_WT)
    var qks = scr.unsafe_offset(S_QK)
    var dsk = blob[unsafe_offset=dims.o_dskip + hh]
    var bbias = blob.unsafe_offset(dims.o_bb + hh * NST)
    var cbias = blob.unsafe_offset(dims.o_cb + hh * NST)
    if not copied:
        _fetch_rows(hs, cnt, arg_int(args, FWD_B) * dims.nh * HEAD_STATE > FETCH_H_FLOATS)
    _init_scales(hs, cnt, sc)
    var t = t0
    while t < t_end:
        var r0 = bb * nc + (t - t0)
        var pr0 = proj.unsafe_offset(r0 * dims.np)
        var dt0 = pr0[unsafe_offset=dims.c_dt + hh]
        var sg0 = pr0[unsafe_offset=dims.c_tr + hh]
        # fold the full working chunk now that its successor exists
        if cnt == QC:
            _fold(hs, QC, dt0 * (Float32(1.0) - sg0), sc, hqs, w, hs.h)
            cnt = 0
            folded = True
        if pending and t == 0 and n0 == 0:
            var scal = dt0 * (Float32(1.0) - sg0)
            for p in range(HP):
                var vv = V16(hs.pv[unsafe_offset=p] * scal)
                comptime for c in range(8):
                    var hp = hs.h.unsafe_offset(p * NST + c * 16)
                    hp.unsafe_store(0, vv.fma(hs.pk.unsafe_load[width=16](c * 16),
                                              hp.unsafe_load[width=16](0)))
        var i0 = cnt
        var ns = min(t_end - t, QC - i0)
        for u in range(ns):
            var i = i0 + u
            if t + u + ROWS_AHEAD < t_end:
                _fetch_token(pr0.unsafe_offset((u + ROWS_AHEAD) * dims.np), dims, hh)
            diag[unsafe_offset=u] = _append_row(hs, dims, hh, pr0.unsafe_offset(u * dims.np),
                                                cbias, bbias, qu, ku, i)
            if i > 0:
                sc[unsafe_offset=i - 1] = hs.scale(i - 1, i, Float32(0.0))
        var q0 = hs.bq.unsafe_offset(i0 * hs.qs)
        dots128_grid(q0, hs.qs, ns, hs.h, NST, HP, hqs, HP)
        var u = 0
        while u < ns:  # q_u . k_j for j < i0 + u (GRID_T tokens share the loads)
            var nt = min(GRID_T, ns - u)
            dots128_grid(q0.unsafe_offset(u * hs.qs), hs.qs, nt, hs.bk, hs.rs, i0 + u + nt - 1,
                         qks.unsafe_offset(u * QC), QC)
            u += nt
        var uu = 0
        while uu < ns:
            if uu + SEG_G <= ns:  # SEG_G tokens' weights side by side
                var hdec = _seg_table(hs, i0 + uu, sc, wt)
                for g in range(SEG_G):
                    var pr = pr0.unsafe_offset((uu + g) * dims.np)
                    out_token_wq(wt.unsafe_offset(g), SEG_G, qks.unsafe_offset((uu + g) * QC),
                                 i0 + uu + g, hdec[g], hqs.unsafe_offset((uu + g) * HP), hs.bv,
                                 hs.vs, diag[unsafe_offset=uu + g], dsk,
                                 pr.unsafe_offset(hh * HP),
                                 o.unsafe_offset((r0 + uu + g) * dims.np + hh * HP))
                uu += SEG_G
                continue
            var i = i0 + uu
            var pr = pr0.unsafe_offset(uu * dims.np)
            var hdec = _weights(hs, i, Float32(0.0), sc, w)
            var qk = qks.unsafe_offset(uu * QC)
            var c = 0
            while c < i:  # lanes at or past i are not read below
                w.unsafe_store(c, w.unsafe_load[width=16](c) * qk.unsafe_load[width=16](c))
                c += 16
            out_token[False](w, i, hdec, hqs.unsafe_offset(uu * HP), hs.bv, hs.vs,
                             diag[unsafe_offset=uu], dsk, pr.unsafe_offset(hh * HP),
                             o.unsafe_offset((r0 + uu) * dims.np + hh * HP), w)  # o in place of z
            uu += 1
        cnt = i0 + ns
        t += ns
    if copied:  # after a fold every row holds what the in-place scan leaves
        _copy_rows[False](hs, st, QC if folded else cnt)


@always_inline
def _gates[W: Int](pr: F32Ptr, dims: M3Dims, dtb: F32Ptr, h: Int):
    """dt and sg of heads h .. h + W - 1 (row_gates)."""
    pr.unsafe_store(dims.c_dt + h, softplus_f32[W](
        pr.unsafe_load[width=W](dims.c_dt + h) + dtb.unsafe_load[width=W](h)))
    pr.unsafe_store(dims.c_tr + h, sigmoid_f32[W](pr.unsafe_load[width=W](dims.c_tr + h)))


def row_gates(pr: F32Ptr, dims: M3Dims, blob: F32Ptr):
    """The per-token values every head's scan reads, once per row and in
    place of their raw projections: dt = softplus(dd_dt + dt_bias),
    adt = A dt, sg = sigmoid(trap) per head, tanh(ang) pi per angle (shared
    by the heads). The functions are lane-wise: the same bits as one head
    at a time."""
    var nh = dims.nh
    var dtb = blob.unsafe_offset(dims.o_dtb)
    var h = 0
    while h + 16 <= nh:
        _gates[16](pr, dims, dtb, h)
        h += 16
    if h + 8 <= nh:
        _gates[8](pr, dims, dtb, h)
        h += 8
    while h < nh:
        _gates[1](pr, dims, dtb, h)
        h += 1
    for hh in range(nh):
        pr[unsafe_offset=dims.c_a + hh] = (phi_a[1](pr[unsafe_offset=dims.c_a + hh])
                                           * pr[unsafe_offset=dims.c_dt + hh])
    comptime for c in range(2):
        pr.unsafe_store(dims.c_ang + c * 16, tanh_f32[16](
            pr.unsafe_load[width=16](dims.c_ang + c * 16)) * V16(PI_F32))


def report_task(args: I64Ptr, dims: M3Dims, task: Int):
    """Reports of one (row, head): h_last (fold of the working chunk with the
    last row at gamma only), k_last, v_last, theta_last."""
    var bb = task // dims.nh
    var hh = task % dims.nh
    var n0 = n0_of(args, bb)
    var cnt = n0
    if arg_int(args, FWD_LENGTHS) != 0:
        cnt = count_after(0, Int(arg_i64(args, FWD_LENGTHS)[unsafe_offset=bb]))
    var hs = HeadState(args, dims, bb, hh)
    var rh = arg_f32(args, FWD_RH).unsafe_offset(task * HP * NST)
    var rk = arg_f32(args, FWD_RK).unsafe_offset(task * NST)
    var rv = arg_f32(args, FWD_RV).unsafe_offset(task * HP)
    var rt = arg_f32(args, FWD_RTHETA).unsafe_offset(task * NANG)
    copy_floats(hs.theta, rt, NANG)
    if cnt == 0:
        copy_floats(hs.h, rh, HP * NST)
        for n in range(NST):
            rk[unsafe_offset=n] = 0.0
        for p in range(HP):
            rv[unsafe_offset=p] = 0.0
        return
    var scr = arg_f32(args, FWD_WORK).unsafe_offset(task * FOLD_SCR)
    var sc = scr.unsafe_offset(S_SC)
    _init_scales(hs, cnt, sc)
    _fold(hs, cnt, Float32(0.0), sc, scr.unsafe_offset(S_HQ), scr.unsafe_offset(S_W), rh)
    copy_floats(hs.bk.unsafe_offset((cnt - 1) * hs.rs), rk, NST)
    copy_floats(hs.bv.unsafe_offset((cnt - 1) * hs.vs), rv, HP)
