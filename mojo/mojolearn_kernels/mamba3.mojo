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
from .linear import WF_F32, WIDE, packed_floats, matmul_ntasks, matmul_task_wf
from .dot128 import dot128, dots128_grid, GRID_T
from .weight_panels import (
    pack_weight_panels, set_blob_format, set_blob_section, blob_format, valid_format,
)
from .norms import rmsnorm_row
from .numerics import (
    exp_f32, softplus_f32, sigmoid_f32, silu_f32, tanh_f32, sincos_f32, mod2pi_f32,
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
comptime MAX_CHUNK_ROWS = 512
comptime MAX_PASS_ROWS = 1024
# Scratch of one (row, head) scan task, in floats.
comptime S_QU = 0  # (128) unrotated q of one token
comptime S_KU = S_QU + NST  # (128) unrotated k
comptime S_W = S_KU + NST  # (64) chunk weights of one token
comptime S_SC = S_W + QC  # (64) scale_j = gamma_j + beta_j of the rows j < last
comptime S_DIAG = S_SC + QC  # (64) (q . k) gamma per token of a segment
comptime S_HQ = S_DIAG + QC  # (64, 64) q_u . h[p]; the fold's w_j v_j[p]
comptime S_QK = S_HQ + QC * HP  # (64, 64) q_u . k_j
comptime SCR = S_QK + QC * QC
comptime FOLD_SCR = S_HQ + QC * HP  # what a fold alone needs (reports)

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
        # MAX_CHUNK_ROWS rows per pass, but a whole chunk of tokens where
        # that stays within MAX_PASS_ROWS: the scan batches its dot products
        # over the tokens of a chunk
        self.tc = max(1, min(l, max(MAX_CHUNK_ROWS // b, min(QC, MAX_PASS_ROWS // b))))
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
            return b * dims.nh * FOLD_SCR * 4
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
            _row_gates(pr, dims, blob)
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


def _init_scales(hs: HeadState, cnt: Int, sc: F32Ptr):
    """sc[j] = gamma_j + beta_j for the buffered rows j < cnt - 1."""
    for j in range(cnt - 1):
        sc[unsafe_offset=j] = hs.scale(j, cnt - 1, Float32(0.0))


comptime FOLD_P = 4 if WIDE else 1  # rows p of h per register block


def _fold(hs: HeadState, count: Int, beta_last: Float32, sc: F32Ptr, u: F32Ptr,
          w: F32Ptr, dst: F32Ptr):
    """dst[p, n] = exp(cum) h[p, n], then fma((w_j * v_j[p]), k_j[n], .) for
    j = 0..count-1 ascending. dst may be hs.h; u is (64, 64) scratch that
    holds the products w_j * v_j[p], FOLD_P rows of h in flight at once."""
    var hdec = _weights(hs, count - 1, beta_last, sc, w)
    for j in range(count):
        var wj = V16(w[unsafe_offset=j])
        var vr = hs.bv.unsafe_offset(j * hs.vs)
        comptime for c in range(4):
            u.unsafe_store(j * HP + c * 16, wj * vr.unsafe_load[width=16](c * 16))
    for p0 in range(0, HP, FOLD_P):
        comptime for half in range(2):
            var acc = Array[V16, FOLD_P * 4](fill=V16(0.0))
            comptime for pp in range(FOLD_P):
                comptime for c in range(4):
                    acc[pp * 4 + c] = V16(hdec) * hs.h.unsafe_load[width=16](
                        (p0 + pp) * NST + half * 64 + c * 16)
            for j in range(count):
                var kr = hs.bk.unsafe_offset(j * hs.rs + half * 64)
                var kv = Array[V16, 4](fill=V16(0.0))
                comptime for c in range(4):
                    kv[c] = kr.unsafe_load[width=16](c * 16)
                comptime for pp in range(FOLD_P):
                    var uv = V16(u[unsafe_offset=j * HP + p0 + pp])
                    comptime for c in range(4):
                        acc[pp * 4 + c] = uv.fma(kv[c], acc[pp * 4 + c])
            comptime for pp in range(FOLD_P):
                comptime for c in range(4):
                    dst.unsafe_store((p0 + pp) * NST + half * 64 + c * 16, acc[pp * 4 + c])


@always_inline
def _rotate16(u: V16, cd: V16, sd: V16) -> V16:
    """Pairs (2r, 2r+1) of u rotated by angles whose cos / sin sit in lanes
    2r and 2r+1 of cd / sd: (u0 c - u1 s, u0 s + u1 c), each product rounded,
    then one add, as the scalar form does (a - b = a + (-b) exactly)."""
    var sw = u.shuffle[1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14]()
    var sgn = V16(-1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0,
                  -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0)
    return u * cd + sw * (sd * sgn)


@always_inline
def _dup_half[HALF: Int](v: V16) -> V16:
    """Lanes 8 HALF .. 8 HALF + 7 of v, each twice."""
    comptime o = 8 * HALF
    return v.shuffle[o, o, o + 1, o + 1, o + 2, o + 2, o + 3, o + 3,
                     o + 4, o + 4, o + 5, o + 5, o + 6, o + 6, o + 7, o + 7]()


def _append_row(hs: HeadState, dims: M3Dims, hh: Int, pr: F32Ptr, cbias: F32Ptr,
                bbias: F32Ptr, qu: F32Ptr, ku: F32Ptr, i: Int) -> Float32:
    """One token into working-chunk row i: the angles advance, then rotated
    q, k, and v, dt, sg, adt are stored. Returns its diagonal weight
    (q . k) gamma on the unrotated q, k. pr is the token's row after
    _row_gates."""
    var dt = pr[unsafe_offset=dims.c_dt + hh]
    var sg = pr[unsafe_offset=dims.c_tr + hh]
    comptime for c in range(8):
        qu.unsafe_store(c * 16, pr.unsafe_load[width=16](dims.c_c + c * 16)
                        + cbias.unsafe_load[width=16](c * 16))
        ku.unsafe_store(c * 16, pr.unsafe_load[width=16](dims.c_b + c * 16)
                        + bbias.unsafe_load[width=16](c * 16))
    var qrow = hs.bq.unsafe_offset(i * hs.rs)
    var krow = hs.bk.unsafe_offset(i * hs.rs)
    comptime for c in range(2):  # angles 16 c .. 16 c + 15 rotate lanes 32 c .. 32 c + 31
        var ang = pr.unsafe_load[width=16](dims.c_ang + c * 16)
        var th = mod2pi_f32[16](ang.fma(V16(dt), hs.theta.unsafe_load[width=16](c * 16)))
        hs.theta.unsafe_store(c * 16, th)
        var sc2 = sincos_f32[16](th)
        var sn = sc2[0]
        var cs = sc2[1]
        comptime for half in range(2):
            comptime o = c * 32 + half * 16
            var cd = _dup_half[half](cs)
            var sd = _dup_half[half](sn)
            qrow.unsafe_store(o, _rotate16(qu.unsafe_load[width=16](o), cd, sd))
            krow.unsafe_store(o, _rotate16(ku.unsafe_load[width=16](o), cd, sd))
    comptime for c in range(4, 8):
        qrow.unsafe_store(c * 16, qu.unsafe_load[width=16](c * 16))
        krow.unsafe_store(c * 16, ku.unsafe_load[width=16](c * 16))
    var vsrc = pr.unsafe_offset(dims.c_v + hh * HP)
    var vrow = hs.bv.unsafe_offset(i * hs.vs)
    comptime for c in range(4):
        vrow.unsafe_store(c * 16, vsrc.unsafe_load[width=16](c * 16))
    hs.bdt[unsafe_offset=i * hs.ss] = dt
    hs.bsg[unsafe_offset=i * hs.ss] = sg
    hs.badt[unsafe_offset=i * hs.ss] = pr[unsafe_offset=dims.c_a + hh]
    return dot128(qu, ku) * (dt * sg)


def _scan_task(args: I64Ptr, dims: M3Dims, blob: F32Ptr, proj: F32Ptr, o: F32Ptr,
               scr: F32Ptr, bb: Int, hh: Int, t0: Int, nc: Int):
    """Tokens t0 .. t0 + nc - 1 of row bb, head hh, in segments that lie
    within one working chunk: append every row of the segment, then its
    q . h[p] and q . k_j as dot grids (h only changes at a fold), then each
    token's output. Every number is the one the token-at-a-time order gives."""
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
    var qu = scr.unsafe_offset(S_QU)
    var ku = scr.unsafe_offset(S_KU)
    var w = scr.unsafe_offset(S_W)
    var sc = scr.unsafe_offset(S_SC)
    var diag = scr.unsafe_offset(S_DIAG)
    var hqs = scr.unsafe_offset(S_HQ)
    var qks = scr.unsafe_offset(S_QK)
    var dsk = blob[unsafe_offset=dims.o_dskip + hh]
    var bbias = blob.unsafe_offset(dims.o_bb + hh * NST)
    var cbias = blob.unsafe_offset(dims.o_cb + hh * NST)
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
            diag[unsafe_offset=u] = _append_row(hs, dims, hh, pr0.unsafe_offset(u * dims.np),
                                                cbias, bbias, qu, ku, i)
            if i > 0:
                sc[unsafe_offset=i - 1] = hs.scale(i - 1, i, Float32(0.0))
        var q0 = hs.bq.unsafe_offset(i0 * hs.rs)
        dots128_grid(q0, hs.rs, ns, hs.h, NST, HP, hqs, HP)
        var u = 0
        while u < ns:  # q_u . k_j for j < i0 + u (GRID_T tokens share the loads)
            var nt = min(GRID_T, ns - u)
            dots128_grid(q0.unsafe_offset(u * hs.rs), hs.rs, nt, hs.bk, hs.rs, i0 + u + nt - 1,
                         qks.unsafe_offset(u * QC), QC)
            u += nt
        for uu in range(ns):
            var i = i0 + uu
            var r = r0 + uu
            var pr = pr0.unsafe_offset(uu * dims.np)
            var hdec = _weights(hs, i, Float32(0.0), sc, w)
            var qk = qks.unsafe_offset(uu * QC)
            var c = 0
            while c < i:  # lanes at or past i are not read below
                w.unsafe_store(c, w.unsafe_load[width=16](c) * qk.unsafe_load[width=16](c))
                c += 16
            var hq = hqs.unsafe_offset(uu * HP)
            var y = Array[V16, 4](fill=V16(0.0))
            comptime for cc in range(4):
                y[cc] = V16(hdec) * hq.unsafe_load[width=16](cc * 16)
            for j in range(i):
                var wj = V16(w[unsafe_offset=j])
                var vj = hs.bv.unsafe_offset(j * hs.vs)
                comptime for cc in range(4):
                    y[cc] = wj.fma(vj.unsafe_load[width=16](cc * 16), y[cc])
            var vrow = hs.bv.unsafe_offset(i * hs.vs)
            var dg = diag[unsafe_offset=uu]
            var zrow = pr.unsafe_offset(hh * HP)
            var orow = o.unsafe_offset(r * dims.di + hh * HP)
            comptime for cc in range(4):
                var vi = vrow.unsafe_load[width=16](cc * 16)
                var yy = V16(dg).fma(vi, y[cc])
                yy = V16(dsk).fma(vi, yy)
                orow.unsafe_store(cc * 16, yy * silu_f32[16](zrow.unsafe_load[width=16](cc * 16)))
        cnt = i0 + ns
        t += ns


def _row_gates(pr: F32Ptr, dims: M3Dims, blob: F32Ptr):
    """The per-token values every head's scan reads, once per row and in
    place of their raw projections: dt = softplus(dd_dt + dt_bias),
    adt = A dt, sg = sigmoid(trap) per head, tanh(ang) pi per angle (shared
    by the heads). The functions are lane-wise: the same bits as one head
    at a time."""
    var nh = dims.nh
    var dtb = blob.unsafe_offset(dims.o_dtb)
    var h = 0
    while h + 16 <= nh:
        pr.unsafe_store(dims.c_dt + h, softplus_f32[16](
            pr.unsafe_load[width=16](dims.c_dt + h) + dtb.unsafe_load[width=16](h)))
        pr.unsafe_store(dims.c_tr + h, sigmoid_f32[16](pr.unsafe_load[width=16](dims.c_tr + h)))
        h += 16
    while h < nh:
        pr[unsafe_offset=dims.c_dt + h] = softplus_f32[1](
            pr[unsafe_offset=dims.c_dt + h] + dtb[unsafe_offset=h])
        pr[unsafe_offset=dims.c_tr + h] = sigmoid_f32[1](pr[unsafe_offset=dims.c_tr + h])
        h += 1
    for hh in range(nh):
        pr[unsafe_offset=dims.c_a + hh] = (_phi_a(pr[unsafe_offset=dims.c_a + hh])
                                           * pr[unsafe_offset=dims.c_dt + hh])
    comptime for c in range(2):
        pr.unsafe_store(dims.c_ang + c * 16, tanh_f32[16](
            pr.unsafe_load[width=16](dims.c_ang + c * 16)) * V16(PI_F32))


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
    var scr = arg_f32(args, FWD_WORK).unsafe_offset(task * FOLD_SCR)
    var sc = scr.unsafe_offset(S_SC)
    _init_scales(hs, cnt, sc)
    _fold(hs, cnt, Float32(0.0), sc, scr.unsafe_offset(S_HQ), scr.unsafe_offset(S_W), rh)
    _copy(hs.bk.unsafe_offset((cnt - 1) * hs.rs), rk, NST)
    _copy(hs.bv.unsafe_offset((cnt - 1) * hs.vs), rv, HP)
