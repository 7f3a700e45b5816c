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
"""
from std.collections import Array
from .abi import (
    F32Ptr, I64Ptr, ALIGN_FLOATS, PHASE_END, PLAN_WORKSPACE,
    arg_int, arg_f32, arg_i64, round_up, ceil_div,
)
from .linear import WF_F32, packed_floats, matmul_ntasks, matmul_task_wf
from .linear_split import reduce_many, tree16
from .weight_panels import (
    pack_weight_panels, set_blob_format, set_blob_section, blob_format, valid_format,
)
from .norms import rmsnorm_row
from .numerics import (
    exp_f32, softplus_f32, sigmoid_f32, silu_f32, tanh_f32, sin_f32, cos_f32,
    mod2pi_f32,
)

comptime NST = 128  # N, q/k head dimension
comptime HP = 64  # P, v head dimension
comptime NANG = 32  # rotary angles
comptime QC = 64  # chunk size
comptime A_FLOOR: Float32 = 1e-4
comptime PI_F32: Float32 = 3.1415927410125732

# OP_M3_PREPARE argument slots.
comptime PREP_D = 0
comptime PREP_NORM = 1
comptime PREP_IN = 2
comptime PREP_DTB = 3
comptime PREP_BNW = 4
comptime PREP_CNW = 5
comptime PREP_BB = 6
comptime PREP_CB = 7
comptime PREP_DSKIP = 8
comptime PREP_OUT = 9
comptime PREP_BLOB = 10
comptime PREP_WFMT = 11  # projection weight format (linear.WF_*); 0 if absent
comptime PREP_IN_EXP = 12  # int8: int32 exponents, one per row
comptime PREP_OUT_EXP = 13

# OP_M3_FORWARD argument slots.
comptime FWD_B = 0
comptime FWD_L = 1
comptime FWD_D = 2
comptime FWD_X = 3
comptime FWD_Y = 4
comptime FWD_BLOB = 5
comptime FWD_LENGTHS = 6  # 0: every row has length L
comptime FWD_WORK = 7
comptime FWD_N0 = 8  # buffered_tokens on entry
comptime FWD_PENDING = 9  # 1: input states pending
comptime FWD_MODE = 10  # 0: forward; 1: reports only
comptime FWD_THETA = 11
comptime FWD_H = 12
comptime FWD_BQ = 13
comptime FWD_BK = 14
comptime FWD_BV = 15
comptime FWD_BDT = 16
comptime FWD_BSG = 17
comptime FWD_BADT = 18
comptime FWD_PK = 19
comptime FWD_PV = 20
comptime FWD_RH = 21  # reports (mode 1): h_last (B,H,P,N)
comptime FWD_RK = 22  # k_last (B,H,N)
comptime FWD_RV = 23  # v_last (B,H,P)
comptime FWD_RTHETA = 24  # theta_last (B,H,R)

comptime ST_NORM = 0
comptime ST_INPROJ = 1
comptime ST_BCNORM = 2
comptime ST_SCAN = 3
comptime ST_OUTPROJ = 4
comptime NSTAGES = 5

comptime NORM_ROWS_PER_TASK = 16
comptime MAX_CHUNK_ROWS = 256
comptime SCR = 1024  # scratch floats per (row, head) scan task

comptime V16 = SIMD[DType.float32, 16]


struct M3Dims(ImplicitlyCopyable):
    var d: Int
    var di: Int
    var nh: Int
    var np: Int  # d_in_proj
    var c_v: Int
    var c_b: Int
    var c_c: Int
    var c_dt: Int
    var c_a: Int
    var c_tr: Int
    var c_ang: Int
    var o_norm: Int
    var o_in: Int
    var o_out: Int
    var o_dtb: Int
    var o_bnw: Int
    var o_cnw: Int
    var o_bb: Int
    var o_cb: Int
    var o_dskip: Int
    var blob: Int
    var wf: Int  # format of the projection panels (linear.WF_*)

    def __init__(out self, d: Int, wf: Int = WF_F32):
        self.d = d
        self.wf = wf
        self.di = 2 * d
        self.nh = self.di // HP
        self.np = 2 * self.di + 2 * NST + 3 * self.nh + NANG
        self.c_v = self.di
        self.c_b = 2 * self.di
        self.c_c = self.c_b + NST
        self.c_dt = self.c_c + NST
        self.c_a = self.c_dt + self.nh
        self.c_tr = self.c_a + self.nh
        self.c_ang = self.c_tr + self.nh
        var o = ALIGN_FLOATS  # header: the weight format (weight_panels.mojo)
        self.o_norm = o
        o += round_up(d, ALIGN_FLOATS)
        self.o_in = o
        o += packed_floats(self.np, d, wf)
        self.o_out = o
        o += packed_floats(d, self.di, wf)
        self.o_dtb = o
        o += round_up(self.nh, ALIGN_FLOATS)
        self.o_bnw = o
        o += NST
        self.o_cnw = o
        o += NST
        self.o_bb = o
        o += self.nh * NST
        self.o_cb = o
        o += self.nh * NST
        self.o_dskip = o
        o += round_up(self.nh, ALIGN_FLOATS)
        self.blob = o


struct M3Work(ImplicitlyCopyable):
    var b: Int
    var l: Int
    var tc: Int
    var nchunks: Int
    var o_xn: Int  # (rows, d), reused for the out_proj result
    var o_proj: Int  # (rows, np)
    var o_o: Int  # (rows, di)
    var o_scr: Int  # (B * H, SCR)
    var floats: Int

    def __init__(out self, dims: M3Dims, b: Int, l: Int):
        self.b = b
        self.l = l
        self.tc = max(1, min(l, MAX_CHUNK_ROWS // b))
        self.nchunks = ceil_div(l, self.tc)
        var rows = b * self.tc
        var o = 0
        self.o_xn = o
        o += round_up(rows * dims.d, ALIGN_FLOATS)
        self.o_proj = o
        o += round_up(rows * dims.np, ALIGN_FLOATS)
        self.o_o = o
        o += round_up(rows * dims.di, ALIGN_FLOATS)
        self.o_scr = o
        o += b * dims.nh * SCR
        self.floats = o

    def chunk_tokens(self, c: Int) -> Int:
        return min(self.tc, self.l - c * self.tc)


# ---------------------------------------------------------------- prepare


def m3_prepare_plan(args: I64Ptr, phase: Int) -> Int:
    var wf = arg_int(args, PREP_WFMT)
    if not valid_format(wf):
        return -3
    if phase == PLAN_WORKSPACE:
        return M3Dims(arg_int(args, PREP_D), wf).blob * 4
    if phase == 0:
        return 3
    return PHASE_END


def m3_prepare_task(args: I64Ptr, phase: Int, task: Int):
    var wf = arg_int(args, PREP_WFMT)
    var dims = M3Dims(arg_int(args, PREP_D), wf)
    var blob = arg_f32(args, PREP_BLOB)
    if task == 0:
        pack_weight_panels(wf, arg_int(args, PREP_IN), arg_int(args, PREP_IN_EXP),
                           dims.np, dims.d, blob.unsafe_offset(dims.o_in))
    elif task == 1:
        pack_weight_panels(wf, arg_int(args, PREP_OUT), arg_int(args, PREP_OUT_EXP),
                           dims.d, dims.di, blob.unsafe_offset(dims.o_out))
    else:
        set_blob_format(blob, wf)
        set_blob_section(blob, 0, dims.o_in)  # in the order of the *_EXP slots
        set_blob_section(blob, 1, dims.o_out)
        _copy(arg_f32(args, PREP_NORM), blob.unsafe_offset(dims.o_norm), dims.d)
        _copy(arg_f32(args, PREP_DTB), blob.unsafe_offset(dims.o_dtb), dims.nh)
        _copy(arg_f32(args, PREP_BNW), blob.unsafe_offset(dims.o_bnw), NST)
        _copy(arg_f32(args, PREP_CNW), blob.unsafe_offset(dims.o_cnw), NST)
        _copy(arg_f32(args, PREP_BB), blob.unsafe_offset(dims.o_bb), dims.nh * NST)
        _copy(arg_f32(args, PREP_CB), blob.unsafe_offset(dims.o_cb), dims.nh * NST)
        _copy(arg_f32(args, PREP_DSKIP), blob.unsafe_offset(dims.o_dskip), dims.nh)


@always_inline
def _copy(src: F32Ptr, dst: F32Ptr, n: Int):
    for i in range(n):
        dst[unsafe_offset=i] = src[unsafe_offset=i]


# ---------------------------------------------------------------- numerics


@always_inline
def dot128_many[M: Int](a: F32Ptr, b: F32Ptr, stride: Int) -> SIMD[DType.float32, M]:
    """Lane m = dot128(a, b + m * stride), M in {4, 8, 16}: the same chains,
    reduced M at a time by the same tree (linear_split.reduce_many)."""
    var acc = Array[V16, M](fill=V16(0.0))
    comptime for c in range(8):
        var av = a.unsafe_load[width=16](c * 16)
        comptime for m in range(M):
            acc[m] = av.fma(b.unsafe_load[width=16](m * stride + c * 16), acc[m])
    return reduce_many[M](acc)


def dot128_into(a: F32Ptr, b: F32Ptr, stride: Int, n: Int, dst: F32Ptr):
    """dst[m] = dot128(a, b + m * stride) for m < n, 16, 4, then 1 at a time."""
    var m = 0
    while m + 16 <= n:
        dst.unsafe_store(m, dot128_many[16](a, b.unsafe_offset(m * stride), stride))
        m += 16
    while m + 4 <= n:
        dst.unsafe_store(m, dot128_many[4](a, b.unsafe_offset(m * stride), stride))
        m += 4
    while m < n:
        dst[unsafe_offset=m] = dot128(a, b.unsafe_offset(m * stride))
        m += 1


@always_inline
def dot128(a: F32Ptr, b: F32Ptr) -> Float32:
    """Canonical 128-long dot product: lane l = fma chain over n = l + 16 c,
    c = 0..7 ascending, then tree16."""
    var acc = V16(0.0)
    comptime for c in range(8):
        acc = a.unsafe_load[width=16](c * 16).fma(b.unsafe_load[width=16](c * 16), acc)
    return tree16(acc)


@always_inline
def _phi_a(u: Float32) -> Float32:
    """A = min(-phi(u), -1e-4); phi(u) = 1 + u (u >= 0), 1 / (1 - u) (u < 0)."""
    var ph: Float32
    if u >= 0.0:
        ph = Float32(1.0) + u
    else:
        ph = Float32(1.0) / (Float32(1.0) - u)
    return min(-ph, -A_FLOOR)


def _count_after(n0: Int, k: Int) -> Int:
    """buffered_tokens after k more tokens from n0."""
    if k == 0:
        return n0
    return (n0 + k - 1) % QC + 1


# ---------------------------------------------------------------- forward


def forward_dims(args: I64Ptr) -> M3Dims:
    """The block's sizes and blob layout, in the format its blob records."""
    return M3Dims(arg_int(args, FWD_D), blob_format(arg_f32(args, FWD_BLOB)))


def m3_forward_plan(args: I64Ptr, phase: Int) -> Int:
    var dims = forward_dims(args)
    var b = arg_int(args, FWD_B)
    if arg_int(args, FWD_MODE) == 1:
        if phase == PLAN_WORKSPACE:
            return b * dims.nh * QC * 4
        if phase == 0:
            return b * dims.nh
        return PHASE_END
    var wk = M3Work(dims, b, arg_int(args, FWD_L))
    if phase == PLAN_WORKSPACE:
        return wk.floats * 4
    if phase >= wk.nchunks * NSTAGES:
        return PHASE_END
    var c = phase // NSTAGES
    var stage = phase % NSTAGES
    var rows = b * wk.chunk_tokens(c)
    if stage == ST_NORM or stage == ST_BCNORM:
        return ceil_div(rows, NORM_ROWS_PER_TASK)
    if stage == ST_INPROJ:
        return matmul_ntasks(rows, dims.np)
    if stage == ST_SCAN:
        return b * dims.nh
    return matmul_ntasks(rows, dims.d)


def m3_forward_task(args: I64Ptr, phase: Int, task: Int):
    var dims = forward_dims(args)
    var b = arg_int(args, FWD_B)
    if arg_int(args, FWD_MODE) == 1:
        _report_task(args, dims, task)
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
    var o = work.unsafe_offset(wk.o_o)
    if stage == ST_NORM:
        _norm_rows(args, dims, t0, nc, task, blob.unsafe_offset(dims.o_norm), xn)
    elif stage == ST_INPROJ:
        _ = matmul_task_wf(dims.wf, task, xn, d, rows, blob.unsafe_offset(dims.o_in), d,
                           dims.np, proj, dims.np)
    elif stage == ST_BCNORM:
        var r0 = task * NORM_ROWS_PER_TASK
        var r1 = min(rows, r0 + NORM_ROWS_PER_TASK)
        for r in range(r0, r1):
            var pr = proj.unsafe_offset(r * dims.np)
            rmsnorm_row(pr.unsafe_offset(dims.c_b), NST, blob.unsafe_offset(dims.o_bnw),
                        pr.unsafe_offset(dims.c_b))
            rmsnorm_row(pr.unsafe_offset(dims.c_c), NST, blob.unsafe_offset(dims.o_cnw),
                        pr.unsafe_offset(dims.c_c))
    elif stage == ST_SCAN:
        var bb = task // dims.nh
        var hh = task % dims.nh
        _scan_task(args, dims, blob, proj, o, work.unsafe_offset(wk.o_scr + task * SCR),
                   bb, hh, t0, nc)
    else:
        var t = matmul_task_wf(dims.wf, task, o, dims.di, rows,
                               blob.unsafe_offset(dims.o_out), dims.di, d, xn, d)
        _residual(args, dims, t0, nc, t.r0, t.r1, t.c0, t.c1, xn)


def _norm_rows(args: I64Ptr, dims: M3Dims, t0: Int, nc: Int, task: Int,
               w: F32Ptr, xn: F32Ptr):
    var b = arg_int(args, FWD_B)
    var l = arg_int(args, FWD_L)
    var x = arg_f32(args, FWD_X)
    var lens = arg_i64(args, FWD_LENGTHS)
    var ragged = arg_int(args, FWD_LENGTHS) != 0
    var d = dims.d
    var r0 = task * NORM_ROWS_PER_TASK
    var r1 = min(b * nc, r0 + NORM_ROWS_PER_TASK)
    for r in range(r0, r1):
        var bb = r // nc
        var t = t0 + r % nc
        var dst = xn.unsafe_offset(r * d)
        if ragged and t >= Int(lens[unsafe_offset=bb]):
            for j in range(d):
                dst[unsafe_offset=j] = 0.0
        else:
            rmsnorm_row(x.unsafe_offset((bb * l + t) * d), d, w, dst)


def _residual(args: I64Ptr, dims: M3Dims, t0: Int, nc: Int,
              r0: Int, r1: Int, c0: Int, c1: Int, proj: F32Ptr):
    var l = arg_int(args, FWD_L)
    var x = arg_f32(args, FWD_X)
    var y = arg_f32(args, FWD_Y)
    var lens = arg_i64(args, FWD_LENGTHS)
    var ragged = arg_int(args, FWD_LENGTHS) != 0
    var d = dims.d
    for r in range(r0, r1):
        var bb = r // nc
        var t = t0 + r % nc
        var off = (bb * l + t) * d
        if ragged and t >= Int(lens[unsafe_offset=bb]):
            for col in range(c0, c1):
                y[unsafe_offset=off + col] = 0.0
        else:
            comptime W = 16
            var col = c0
            while col + W <= c1:
                y.unsafe_store(off + col, x.unsafe_load[width=W](off + col)
                               + proj.unsafe_load[width=W](r * d + col))
                col += W
            while col < c1:
                y[unsafe_offset=off + col] = x[unsafe_offset=off + col] + proj[unsafe_offset=r * d + col]
                col += 1


struct HeadState(ImplicitlyCopyable):
    """Pointers to one (row, head) slice of a Mamba3State."""
    var theta: F32Ptr  # (32,)
    var h: F32Ptr  # (P, N)
    var bq: F32Ptr  # row j at j * rs
    var bk: F32Ptr
    var bv: F32Ptr  # row j at j * vs
    var bdt: F32Ptr  # row j at j * ss
    var bsg: F32Ptr
    var badt: F32Ptr
    var pk: F32Ptr
    var pv: F32Ptr
    var rs: Int
    var vs: Int
    var ss: Int

    def __init__(out self, args: I64Ptr, dims: M3Dims, bb: Int, hh: Int):
        var nh = dims.nh
        self.theta = arg_f32(args, FWD_THETA).unsafe_offset((bb * nh + hh) * NANG)
        self.h = arg_f32(args, FWD_H).unsafe_offset((bb * nh + hh) * HP * NST)
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


def _weights(hs: HeadState, last: Int, beta_last: Float32, w: F32Ptr) -> Float32:
    """w[j] = exp(seg(last, j)) * scale_j for j <= last; returns exp(cum_last).

    seg is summed downwards from +0.0: s = 0; for j = last..0: seg_j = s;
    s = s + adt_j. The final s is cum_last. The exps are lane-wise (the own
    exp gives the same bits at any SIMD width). w needs room for 64 floats."""
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
    for jj in range(last + 1):
        w[unsafe_offset=jj] = w[unsafe_offset=jj] * hs.scale(jj, last, beta_last)
    return exp_f32[1](s)


def _fold(hs: HeadState, count: Int, beta_last: Float32, w: F32Ptr, dst: F32Ptr):
    """dst[p, n] = exp(cum) h[p, n], then fma((w_j * v_j[p]), k_j[n], .) for
    j = 0..count-1 ascending. dst may be hs.h."""
    var hdec = _weights(hs, count - 1, beta_last, w)
    for p in range(HP):
        var acc = Array[V16, 8](fill=V16(0.0))
        comptime for c in range(8):
            acc[c] = V16(hdec) * hs.h.unsafe_load[width=16](p * NST + c * 16)
        for j in range(count):
            var wv = V16(w[unsafe_offset=j] * hs.bv[unsafe_offset=j * hs.vs + p])
            var kr = hs.bk.unsafe_offset(j * hs.rs)
            comptime for c in range(8):
                acc[c] = wv.fma(kr.unsafe_load[width=16](c * 16), acc[c])
        comptime for c in range(8):
            dst.unsafe_store(p * NST + c * 16, acc[c])


def _scan_task(args: I64Ptr, dims: M3Dims, blob: F32Ptr, proj: F32Ptr, o: F32Ptr,
               scr: F32Ptr, bb: Int, hh: Int, t0: Int, nc: Int):
    var l = arg_int(args, FWD_L)
    var lens = arg_i64(args, FWD_LENGTHS)
    var len_b = l
    if arg_int(args, FWD_LENGTHS) != 0:
        len_b = Int(lens[unsafe_offset=bb])
    var t_end = min(t0 + nc, len_b)
    if t_end <= t0:
        return
    var n0 = arg_int(args, FWD_N0)
    var pending = arg_int(args, FWD_PENDING) != 0
    var cnt = _count_after(n0, t0)
    var hs = HeadState(args, dims, bb, hh)
    var qu = scr  # unrotated q (128)
    var ku = scr.unsafe_offset(NST)  # unrotated k (128)
    var w = scr.unsafe_offset(2 * NST)  # (64) chunk weights
    var hq = scr.unsafe_offset(2 * NST + QC)  # (64) q . h[p]
    var dtb = blob[unsafe_offset=dims.o_dtb + hh]
    var dsk = blob[unsafe_offset=dims.o_dskip + hh]
    var bbias = blob.unsafe_offset(dims.o_bb + hh * NST)
    var cbias = blob.unsafe_offset(dims.o_cb + hh * NST)
    for t in range(t0, t_end):
        var r = bb * nc + (t - t0)
        var pr = proj.unsafe_offset(r * dims.np)
        var dt = softplus_f32[1](pr[unsafe_offset=dims.c_dt + hh] + dtb)
        var a = _phi_a(pr[unsafe_offset=dims.c_a + hh])
        var adt = a * dt
        var sg = sigmoid_f32[1](pr[unsafe_offset=dims.c_tr + hh])
        # fold the full working chunk now that its successor exists
        if cnt == QC:
            _fold(hs, QC, dt * (Float32(1.0) - sg), w, hs.h)
            cnt = 0
        if pending and t == 0 and n0 == 0:
            var scal = dt * (Float32(1.0) - sg)
            for p in range(HP):
                var vv = V16(hs.pv[unsafe_offset=p] * scal)
                comptime for c in range(8):
                    var hp = hs.h.unsafe_offset(p * NST + c * 16)
                    hp.unsafe_store(0, vv.fma(hs.pk.unsafe_load[width=16](c * 16),
                                              hp.unsafe_load[width=16](0)))
        var i = cnt
        # q, k (bias added, unrotated) and the angle update
        comptime for c in range(8):
            qu.unsafe_store(c * 16, pr.unsafe_load[width=16](dims.c_c + c * 16)
                            + cbias.unsafe_load[width=16](c * 16))
            ku.unsafe_store(c * 16, pr.unsafe_load[width=16](dims.c_b + c * 16)
                            + bbias.unsafe_load[width=16](c * 16))
        var qrow = hs.bq.unsafe_offset(i * hs.rs)
        var krow = hs.bk.unsafe_offset(i * hs.rs)
        comptime for c in range(2):
            var ang = tanh_f32[16](pr.unsafe_load[width=16](dims.c_ang + c * 16)) * V16(PI_F32)
            var th = mod2pi_f32[16](ang.fma(V16(dt), hs.theta.unsafe_load[width=16](c * 16)))
            hs.theta.unsafe_store(c * 16, th)
            var cs = cos_f32[16](th)
            var sn = sin_f32[16](th)
            comptime for l2 in range(16):
                var rr = c * 16 + l2
                var q0 = qu[unsafe_offset=2 * rr]
                var q1 = qu[unsafe_offset=2 * rr + 1]
                var k0 = ku[unsafe_offset=2 * rr]
                var k1 = ku[unsafe_offset=2 * rr + 1]
                var cc = cs[l2]
                var ss = sn[l2]
                qrow[unsafe_offset=2 * rr] = q0 * cc - q1 * ss
                qrow[unsafe_offset=2 * rr + 1] = q0 * ss + q1 * cc
                krow[unsafe_offset=2 * rr] = k0 * cc - k1 * ss
                krow[unsafe_offset=2 * rr + 1] = k0 * ss + k1 * cc
        comptime for c in range(4, 8):
            qrow.unsafe_store(c * 16, qu.unsafe_load[width=16](c * 16))
            krow.unsafe_store(c * 16, ku.unsafe_load[width=16](c * 16))
        var vsrc = pr.unsafe_offset(dims.c_v + hh * HP)
        var vrow = hs.bv.unsafe_offset(i * hs.vs)
        comptime for c in range(4):
            vrow.unsafe_store(c * 16, vsrc.unsafe_load[width=16](c * 16))
        hs.bdt[unsafe_offset=i * hs.ss] = dt
        hs.bsg[unsafe_offset=i * hs.ss] = sg
        hs.badt[unsafe_offset=i * hs.ss] = adt
        # output of row i
        var gamma = dt * sg
        var diag = dot128(qu, ku) * gamma
        var hdec = _weights(hs, i, Float32(0.0), w)
        var qk = hq  # q . k_j for j < i, then q . h[p] (dots batched per tree)
        dot128_into(qrow, hs.bk, hs.rs, i, qk)
        for j in range(i):
            w[unsafe_offset=j] = w[unsafe_offset=j] * qk[unsafe_offset=j]
        dot128_into(qrow, hs.h, NST, HP, hq)
        var zrow = pr.unsafe_offset(hh * HP)
        var orow = o.unsafe_offset(r * dims.di + hh * HP)
        comptime for c in range(4):
            var y = V16(hdec) * hq.unsafe_load[width=16](c * 16)
            for j in range(i):
                y = V16(w[unsafe_offset=j]).fma(hs.bv.unsafe_load[width=16](j * hs.vs + c * 16), y)
            var vi = vrow.unsafe_load[width=16](c * 16)
            y = V16(diag).fma(vi, y)
            y = V16(dsk).fma(vi, y)
            orow.unsafe_store(c * 16, y * silu_f32[16](zrow.unsafe_load[width=16](c * 16)))
        cnt = i + 1


def _report_task(args: I64Ptr, dims: M3Dims, task: Int):
    """Reports of one (row, head): h_last (fold of the working chunk with the
    last row at gamma only), k_last, v_last, theta_last."""
    var bb = task // dims.nh
    var hh = task % dims.nh
    var n0 = arg_int(args, FWD_N0)
    var cnt = n0
    if arg_int(args, FWD_LENGTHS) != 0:
        cnt = _count_after(0, Int(arg_i64(args, FWD_LENGTHS)[unsafe_offset=bb]))
    var hs = HeadState(args, dims, bb, hh)
    var rh = arg_f32(args, FWD_RH).unsafe_offset(task * HP * NST)
    var rk = arg_f32(args, FWD_RK).unsafe_offset(task * NST)
    var rv = arg_f32(args, FWD_RV).unsafe_offset(task * HP)
    var rt = arg_f32(args, FWD_RTHETA).unsafe_offset(task * NANG)
    _copy(hs.theta, rt, NANG)
    if cnt == 0:
        _copy(hs.h, rh, HP * NST)
        for n in range(NST):
            rk[unsafe_offset=n] = 0.0
        for p in range(HP):
            rv[unsafe_offset=p] = 0.0
        return
    var w = arg_f32(args, FWD_WORK).unsafe_offset(task * QC)
    _fold(hs, cnt, Float32(0.0), w, rh)
    _copy(hs.bk.unsafe_offset((cnt - 1) * hs.rs), rk, NST)
    _copy(hs.bv.unsafe_offset((cnt - 1) * hs.vs), rv, HP)
