"""Mamba-3 backward (vector-Jacobian product of a zero-state prefill).

Two passes over chunks of Q = 64 tokens (aligned to absolute positions, the
forward's chunks), B rows x 64 tokens of workspace at a time:
  pass A (chunks 0 .. n-2, forward order): norm, in_proj, B/C norms for the
         chunk's tokens plus the next chunk's first token (its dt and sg give
         the last row's trapezoid beta), then per (row, head) the angles, the
         rotated k and the fold of the chunk into h. Checkpoints kept at every
         chunk start: h, theta, and the previous chunk's last rotated k and v.
  pass B (chunks n-1 .. 0, backward order): recompute the chunk's forward from
         its checkpoint (the forward op's formulas and order, so o and y have
         the forward's bits), then the VJP of out_proj, of the chunked scan
         (per row and head), the head reductions, in_proj and the RMSNorms.
Carried between chunks (per row and head): dh (the cotangent of the state
entering the later chunk), the running angle cotangent, and the beta of the
later chunk's first token.

Canonical orders (docs/backward.md, section Mamba-3):
  * activations: per (row, head) scan VJP in a fixed loop order (below); per
    token fma chains of linear_grad for the projections;
  * every weight gradient element: ONE sequential chain over all (row, token)
    contributions, chunks from last to first and, inside a chunk, rows b
    ascending then tokens ascending, continuing in the output array;
  * sums over heads (dBn, dCn, d angle per token): heads ascending.
Threads only split independent outputs, so no bit depends on the thread
count; a row's x gradient depends only on that row.
"""
from std.collections import Array
from std.sys import get_defined_int
from .abi import (
    F32Ptr, I64Ptr, ALIGN_FLOATS, PHASE_END, PLAN_WORKSPACE,
    arg_int, arg_f32, round_up, ceil_div,
)
from .linear import matmul_ntasks, matmul_task, packed_floats, NR, WIDE, WF_F32
from .weight_panels import blob_format
from .linear_grad import gemm_ntasks, gemm_task, TPanels
from .norms import rmsnorm_row, rms_scale
from .numerics import (
    exp_f32, softplus_f32, sigmoid_f32, silu_f32, tanh_f32, sin_f32, cos_f32,
    mod2pi_f32,
)
from .mamba3 import M3Dims, NST, HP, NANG, QC, A_FLOOR, PI_F32, dot128

# OP_M3_BACKWARD argument slots.
comptime BW_B = 0
comptime BW_L = 1
comptime BW_D = 2
comptime BW_X = 3
comptime BW_G = 4  # grad_output (B, L, d)
comptime BW_BLOB = 5  # prepared forward blob (M3Dims layout)
comptime BW_WORK = 6
comptime BW_DX = 7
comptime BW_W_IN = 8  # row-major in_proj.weight (np, d)
comptime BW_W_OUT = 9  # row-major out_proj.weight (d, di)
comptime BW_G_NORM = 10  # gradient outputs, constructor layouts; zero on entry
# except BW_G_IN and BW_G_OUT: the first chunk of pass B (the last chunk)
# writes their chains' first terms (fma from +0.0, as accumulating onto
# zeros would), so the caller skips zeroing 4 (np + 2 d) d bytes.
comptime BW_G_IN = 11
comptime BW_G_DTB = 12
comptime BW_G_BNW = 13
comptime BW_G_CNW = 14
comptime BW_G_BB = 15
comptime BW_G_CB = 16
comptime BW_G_D = 17
comptime BW_G_OUT = 18
comptime BW_PANELS = 19  # W_in^T | W_out^T panels (OP_PACK_TRANSPOSED)
comptime BW_NARGS = 20


comptime V16 = SIMD[DType.float32, 16]
comptime ROWS_PER_TASK = 16
# Loops over 128 state columns run in NHF passes of HW V16 accumulators:
# on AVX2 eight V16 (16 ymm) would fill the register file and spill, so two
# passes of four; AVX-512 has 32 registers, one pass of eight. Per element
# the chain is the same either way.
comptime NHF = 1 if WIDE else 2
comptime HW = 8 // NHF
comptime HO = 128 // NHF
# Rows (tokens, state rows or fold columns) per register block of the scan
# VJP's matrix loops: with 32 AVX-512 registers two rows share each loaded
# vector (halving the L1/L2 traffic the per-(row, head) working set causes).
comptime TB = 2 if WIDE else 1
# Pass A keeps the norm / in_proj / B,C-norm rows of its last chunks, up to
# this many bytes, so pass B reuses them instead of recomputing (same bits:
# the same rows computed once). A constant, so the set of kept chunks is a
# function of (B, L, d) only (-D ML_M3_KEEP_BYTES=0 builds a test variant
# that keeps nothing).
comptime KEEP_MAX_BYTES = get_defined_int["ML_M3_KEEP_BYTES", 32 * 1024 * 1024]()
# When the whole call's dproj, xn, g and o rows fit in this many bytes, pass
# B keeps them all (in processing order: chunks last to first, rows b then t
# ascending, the canonical chain order) and the weight-gradient products run
# once over all B L rows at the end, instead of once per chunk over 64 B:
# the same chains, but each dW element is loaded and stored once, not once
# per chunk (at B = 1 that traffic bounds the product). -D
# ML_M3_DEFER_BYTES=0 builds a test variant that never defers.
comptime DEFER_MAX_BYTES = get_defined_int["ML_M3_DEFER_BYTES", 32 * 1024 * 1024]()
comptime QK = 2 * NST  # qr | kr (or dq | dk) per (row, head)
comptime CSW = 2 * NANG  # cos | sin per (row, head)

# pass A stages
comptime A_NORM = 0
comptime A_INPROJ = 1
comptime A_BCNORM = 2
comptime A_SCAN = 3
comptime A_KEEP = 4  # copy a kept chunk's rows (no tasks otherwise)
comptime NA = 5
# pass B stages
comptime F_NORM = 0
comptime F_INPROJ = 1
comptime F_BCNORM = 2
comptime S_FWD = 3
comptime B_OUT = 4
comptime B_SCAN = 5
comptime B_RED = 6
comptime B_INPROJ = 7
comptime B_NORM = 8
comptime B_NORMW = 9
comptime NB = 10

# per (row, head) scratch: matrices (64 x 64) and vectors (64)
comptime M_G = 0  # G[i, j] = qr_i . kr_j (j < i)
comptime M_L = 4096  # L[i, j] = exp(seg(i, j)) (j < i)
comptime M_C = 8192  # C[i, j] = (L scale_j) G
comptime M_HQ = 12288  # hq[i, p] = qr_i . h[p]
comptime M_DY = 16384  # dy[i, p]
comptime M_DG = 20480  # dG[i, j]
comptime V0 = 24576
comptime V_DT = V0
comptime V_SG = V0 + 64
comptime V_ADT = V0 + 128
comptime V_A = V0 + 192
comptime V_SCALE = V0 + 256
comptime V_E = V0 + 320
comptime V_QK = V0 + 384
comptime V_DCUM = V0 + 448
comptime V_DSCALE = V0 + 512
comptime V_DGAM = V0 + 576
comptime V_DVV = V0 + 640
comptime V_DDT = V0 + 704
comptime V_TMP = V0 + 768  # 256 floats
comptime SCR = V0 + 1024


struct BW3(ImplicitlyCopyable):
    """Workspace layout of one backward call (floats)."""
    var b: Int
    var l: Int
    var nh: Int
    var nchunks: Int
    var rmax: Int
    var o_ckh: Int  # (nchunks, B, H, P, N) h entering each chunk
    var o_ckt: Int  # (nchunks, B, H, 32) theta entering each chunk
    var o_ckv: Int  # (nchunks, B, H, 64) v of the previous chunk's last token
    var o_ckk: Int  # (nchunks, B, H, 128) rotated k of that token
    var o_cdh: Int  # (B, H, P, N) dh carried to the previous chunk
    var o_cdt: Int  # (B, H, 32) angle cotangent carried
    var o_cbeta: Int  # (B, H) beta of the later chunk's first token
    var o_xn: Int  # (rmax, d)
    var o_gch: Int  # (rmax, d)
    var o_proj: Int  # (rmax, np)
    var o_bcn: Int  # (rmax, 256) Bn | Cn
    var o_o: Int  # (rmax, di)
    var o_y: Int  # (rmax, di)
    var o_do: Int  # (rmax, di)
    var o_dproj: Int  # (rmax, np)
    var o_qkr: Int  # (H, rmax, 256): head-major, see qk_row
    var o_cs: Int  # (H, rmax, 64) cos | sin, head-major like qkr
    var o_dqk: Int  # (H, rmax, 256)
    var o_dang: Int  # (rmax, H, 32)
    var o_dd: Int  # (rmax, H)
    var o_pbc: Int  # (rmax, 256) B_norm | C_norm weight terms
    var o_pn: Int  # (rmax, d)
    var o_dxn: Int  # (rmax, d)
    var o_scr: Int  # (B, H, SCR)
    var nkeep: Int  # pass-A chunks n-1-nkeep .. n-2 are kept
    var keep_slot: Int  # floats per kept chunk: xn | proj | bcn, B * 64 rows each
    var o_keep: Int
    var defer: Bool  # weight gradients once at the end (DEFER_MAX_BYTES)
    var o_sdp: Int  # (B L, np) dproj rows, processing order (defer only)
    var o_sxn: Int  # (B L, d) xn rows
    var o_sgc: Int  # (B L, d) grad_output rows
    var o_so: Int  # (B L, di) o rows
    var floats: Int

    def __init__(out self, dims: M3Dims, b: Int, l: Int):
        self.b = b
        self.l = l
        self.nh = dims.nh
        self.nchunks = ceil_div(l, QC)
        self.rmax = b * (QC + 1)
        var bh = b * dims.nh
        var r = self.rmax
        var d = dims.d
        var di = dims.di
        var o = 0
        self.o_ckh = o
        o += round_up(self.nchunks * bh * HP * NST, ALIGN_FLOATS)
        self.o_ckt = o
        o += round_up(self.nchunks * bh * NANG, ALIGN_FLOATS)
        self.o_ckv = o
        o += round_up(self.nchunks * bh * HP, ALIGN_FLOATS)
        self.o_ckk = o
        o += round_up(self.nchunks * bh * NST, ALIGN_FLOATS)
        self.o_cdh = o
        o += round_up(bh * HP * NST, ALIGN_FLOATS)
        self.o_cdt = o
        o += round_up(bh * NANG, ALIGN_FLOATS)
        self.o_cbeta = o
        o += round_up(bh, ALIGN_FLOATS)
        self.o_xn = o
        o += round_up(r * d, ALIGN_FLOATS)
        self.o_gch = o
        o += round_up(r * d, ALIGN_FLOATS)
        self.o_proj = o
        o += round_up(r * dims.np, ALIGN_FLOATS)
        self.o_bcn = o
        o += round_up(r * 2 * NST, ALIGN_FLOATS)
        self.o_o = o
        o += round_up(r * di, ALIGN_FLOATS)
        self.o_y = o
        o += round_up(r * di, ALIGN_FLOATS)
        self.o_do = o
        o += round_up(r * di, ALIGN_FLOATS)
        self.o_dproj = o
        o += round_up(r * dims.np, ALIGN_FLOATS)
        self.o_qkr = o
        o += round_up(r * dims.nh * QK, ALIGN_FLOATS)
        self.o_cs = o
        o += round_up(r * dims.nh * CSW, ALIGN_FLOATS)
        self.o_dqk = o
        o += round_up(r * dims.nh * QK, ALIGN_FLOATS)
        self.o_dang = o
        o += round_up(r * dims.nh * NANG, ALIGN_FLOATS)
        self.o_dd = o
        o += round_up(r * dims.nh, ALIGN_FLOATS)
        self.o_pbc = o
        o += round_up(r * 2 * NST, ALIGN_FLOATS)
        self.o_pn = o
        o += round_up(r * d, ALIGN_FLOATS)
        self.o_dxn = o
        o += round_up(r * d, ALIGN_FLOATS)
        self.o_scr = o
        o += bh * SCR
        var kr = b * QC
        self.keep_slot = (round_up(kr * d, ALIGN_FLOATS) + round_up(kr * dims.np, ALIGN_FLOATS)
                          + round_up(kr * 2 * NST, ALIGN_FLOATS))
        self.nkeep = min(self.nchunks - 1, KEEP_MAX_BYTES // (4 * self.keep_slot))
        self.o_keep = o
        o += self.nkeep * self.keep_slot
        var tot = b * l
        var sfl = (round_up(tot * dims.np, ALIGN_FLOATS) + 2 * round_up(tot * d, ALIGN_FLOATS)
                   + round_up(tot * di, ALIGN_FLOATS))
        self.defer = sfl * 4 <= DEFER_MAX_BYTES
        self.o_sdp = o
        self.o_sxn = o
        self.o_sgc = o
        self.o_so = o
        if self.defer:
            self.o_sxn = self.o_sdp + round_up(tot * dims.np, ALIGN_FLOATS)
            self.o_sgc = self.o_sxn + round_up(tot * d, ALIGN_FLOATS)
            self.o_so = self.o_sgc + round_up(tot * d, ALIGN_FLOATS)
            o += sfl
        self.floats = o

    def chunk_tokens(self, c: Int) -> Int:
        return min(QC, self.l - c * QC)

    def qk_row(self, r: Int, hh: Int) -> Int:
        """Offset of row r, head hh in qkr / dqk. Head-major: a (row, head)
        task walks one head's rows 1 KiB apart; row-major rows were
        H KiB apart, a multiple of 4 KiB, so all landed in one L1 set."""
        return (hh * self.rmax + r) * QK

    def kept(self, c: Int) -> Bool:
        """Pass A keeps chunk c's rows for pass B (never the last chunk,
        which pass A does not see)."""
        return c < self.nchunks - 1 and c >= self.nchunks - 1 - self.nkeep

    def keep_base(self, c: Int) -> Int:
        return self.o_keep + (c - (self.nchunks - 1 - self.nkeep)) * self.keep_slot

    def keep_xn(self, c: Int, d: Int) -> Int:
        """Where a kept chunk's xn rows go: its keep slot, or, when deferring,
        straight into the all-rows store that the weight gradient reads."""
        if self.defer:
            return self.o_sxn + self.srow(c) * d
        return self.keep_base(c)

    def keep_proj(self, c: Int, d: Int) -> Int:
        return self.keep_base(c) + round_up(self.b * QC * d, ALIGN_FLOATS)

    def keep_bcn(self, c: Int, d: Int, np: Int) -> Int:
        return self.keep_proj(c, d) + round_up(self.b * QC * np, ALIGN_FLOATS)

    def srow(self, c: Int) -> Int:
        """Store rows before chunk c: B x the tokens of the chunks after it
        (pass B runs chunks last to first)."""
        return self.b * max(0, self.l - (c + 1) * QC)

    def dw_now(self, c: Int) -> Bool:
        """Does chunk c's pass B run the weight-gradient products?"""
        return not self.defer or c == 0

    def use_store(mut self, c: Int, d: Int, np: Int, di: Int):
        """Deferring: pass B of chunk c writes dproj, xn, g, o into the store."""
        var r = self.srow(c)
        self.o_dproj = self.o_sdp + r * np
        self.o_xn = self.o_sxn + r * d
        self.o_gch = self.o_sgc + r * d
        self.o_o = self.o_so + r * di

    def use_kept(mut self, c: Int, d: Int, np: Int):
        """Pass B of a kept chunk reads xn, proj, bcn where pass A left them."""
        var xn = self.keep_xn(c, d)
        var pj = self.keep_proj(c, d)
        var bc = self.keep_bcn(c, d, np)
        self.o_xn = xn
        self.o_proj = pj
        self.o_bcn = bc


# ------------------------------------------------------------ small helpers


@always_inline
def _tree16(acc: V16) -> Float32:
    var s8 = acc.slice[8, offset=0]() + acc.slice[8, offset=8]()
    var s4 = s8.slice[4, offset=0]() + s8.slice[4, offset=4]()
    var s2 = s4.slice[2, offset=0]() + s4.slice[2, offset=2]()
    return s2[0] + s2[1]


@always_inline
def _dot64(a: F32Ptr, b: F32Ptr) -> Float32:
    """64-long dot: lane l = fma chain over p = l + 16 c, c = 0..3, then _tree16."""
    var acc = V16(0.0)
    comptime for c in range(4):
        acc = a.unsafe_load[width=16](c * 16).fma(b.unsafe_load[width=16](c * 16), acc)
    return _tree16(acc)


comptime V4 = SIMD[DType.float32, 4]


@always_inline
def _dots128x4(a: F32Ptr, sa: Int, b: F32Ptr, sb: Int) -> V4:
    """dot128(a + q sa, b + q sb) for q = 0..3 (a stride may be 0): four
    chains in flight, as one alone is fma-latency bound. Each result is
    dot128's own lane chains and _tree16, so the same bits."""
    var acc = Array[V16, 4](fill=V16(0.0))
    comptime for c in range(8):
        comptime for q in range(4):
            acc[q] = a.unsafe_load[width=16](q * sa + c * 16).fma(
                b.unsafe_load[width=16](q * sb + c * 16), acc[q])
    var r = V4(0.0)
    comptime for q in range(4):
        r[q] = _tree16(acc[q])
    return r


@always_inline
def _dots128_block[T: Int](a: F32Ptr, sa: Int, b: F32Ptr, sb: Int, dst: F32Ptr, so: Int):
    """dst[t so + q] = dot128(a + t sa, b + q sb), t < T, q < 4: 4 T chains in
    flight, each loaded vector used T or 4 times; each result is dot128's own
    lane chains and _tree16."""
    var acc = Array[V16, 4 * T](fill=V16(0.0))
    comptime for c in range(8):
        var av = Array[V16, T](fill=V16(0.0))
        comptime for t in range(T):
            av[t] = a.unsafe_load[width=16](t * sa + c * 16)
        comptime for q in range(4):
            var bv = b.unsafe_load[width=16](q * sb + c * 16)
            comptime for t in range(T):
                acc[q * T + t] = av[t].fma(bv, acc[q * T + t])
    comptime for t in range(T):
        comptime for q in range(4):
            dst[unsafe_offset=t * so + q] = _tree16(acc[q * T + t])


@always_inline
def _dots64x4(a: F32Ptr, sa: Int, b: F32Ptr, sb: Int) -> V4:
    """_dot64(a + q sa, b + q sb) for q = 0..3, four chains in flight."""
    var acc = Array[V16, 4](fill=V16(0.0))
    comptime for c in range(4):
        comptime for q in range(4):
            acc[q] = a.unsafe_load[width=16](q * sa + c * 16).fma(
                b.unsafe_load[width=16](q * sb + c * 16), acc[q])
    var r = V4(0.0)
    comptime for q in range(4):
        r[q] = _tree16(acc[q])
    return r


@always_inline
def _phi_a_v(u: V16) -> V16:
    """A = min(-phi(u), -1e-4) (mamba3.mojo's _phi_a) on 16 lanes: both
    branches computed, one chosen per lane, so the same bits."""
    var ph = u.ge(V16(0.0)).select(V16(1.0) + u, V16(1.0) / (V16(1.0) - u))
    return min(-ph, V16(-A_FLOOR))


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


# ------------------------------------------------------------ transposed panels


@always_inline
def _panels(dims: M3Dims) -> TPanels:
    """W_in^T (d, np) and W_out^T (di, d) in linear.mojo's panels, packed once
    per block by OP_PACK_TRANSPOSED (the Python layer keeps them), so dxn =
    dproj @ W_in and do = g @ W_out run on the forward's matmul kernel
    instead of a strided one: the same fma chains."""
    return TPanels(dims.np, dims.d, dims.d, dims.di)


# ------------------------------------------------------------ plan


def _counts(dims: M3Dims, wk: BW3, c: Int, stage: Int, nr: Int, is_b: Bool) -> Int:
    var rows = wk.b * nr
    var bh = wk.b * dims.nh
    if not is_b:
        if stage == A_NORM or stage == A_BCNORM:
            return ceil_div(rows, ROWS_PER_TASK)
        if stage == A_INPROJ:
            if wk.kept(c):
                return matmul_ntasks(rows, dims.np)
            return matmul_ntasks(rows, dims.np - dims.di)  # z is not needed
        if stage == A_KEEP:
            if wk.kept(c):
                return ceil_div(wk.b * QC, ROWS_PER_TASK)
            return 0
        return bh
    if (stage == F_INPROJ or stage == F_BCNORM) and wk.kept(c):
        return 0  # pass A's rows are reused
    if stage == F_NORM or stage == F_BCNORM or stage == B_NORM:
        return ceil_div(rows, ROWS_PER_TASK)
    if stage == F_INPROJ:
        return matmul_ntasks(rows, dims.np)
    if stage == S_FWD or stage == B_SCAN:
        return bh
    if stage == B_OUT:
        if not wk.dw_now(c):
            return matmul_ntasks(rows, dims.di)
        return matmul_ntasks(rows, dims.di) + gemm_ntasks(dims.d, dims.di)
    if stage == B_RED:
        return ceil_div(rows, ROWS_PER_TASK) + dims.nh
    if stage == B_INPROJ:
        var ndw = gemm_ntasks(dims.np, dims.d) if wk.dw_now(c) else 0
        return matmul_ntasks(rows, dims.d) + ndw + 2 * NST // 16
    return ceil_div(dims.d, 16)  # B_NORMW


def m3_backward_plan(args: I64Ptr, phase: Int) -> Int:
    if blob_format(arg_f32(args, BW_BLOB)) != WF_F32:
        return -3  # backward reads float32 panels; blocks on packed weights expand them
    var dims = M3Dims(arg_int(args, BW_D))
    var b = arg_int(args, BW_B)
    var wk = BW3(dims, b, arg_int(args, BW_L))
    if phase == PLAN_WORKSPACE:
        return wk.floats * 4
    if phase == 0:
        return b * dims.nh
    var na = (wk.nchunks - 1) * NA
    var p = phase - 1
    if p < na:
        var c = p // NA
        return _counts(dims, wk, c, p % NA, wk.chunk_tokens(c) + 1, False)
    p -= na
    if p < wk.nchunks * NB:
        var c = wk.nchunks - 1 - p // NB
        return _counts(dims, wk, c, p % NB, wk.chunk_tokens(c), True)
    return PHASE_END


# ------------------------------------------------------------ tasks


def m3_backward_task(args: I64Ptr, phase: Int, task: Int):
    var dims = M3Dims(arg_int(args, BW_D))
    var b = arg_int(args, BW_B)
    var wk = BW3(dims, b, arg_int(args, BW_L))
    if phase == 0:
        _init(args, dims, wk, task)
        return
    var na = (wk.nchunks - 1) * NA
    var p = phase - 1
    if p < na:
        var c = p // NA
        var stage = p % NA
        var nr = wk.chunk_tokens(c) + 1
        if stage == A_NORM:
            _norm_rows(args, dims, wk, c, nr, task, False, True)
        elif stage == A_INPROJ:
            if wk.kept(c):
                _inproj(args, dims, wk, nr, task)
            else:
                _inproj_no_z(args, dims, wk, nr, task)
        elif stage == A_BCNORM:
            _bcnorm(args, dims, wk, nr, task)
        elif stage == A_SCAN:
            _scan_a(args, dims, wk, c, task // dims.nh, task % dims.nh)
        else:
            _keep_rows(args, dims, wk, c, task)
        return
    p -= na
    var c = wk.nchunks - 1 - p // NB
    var stage = p % NB
    var nc = wk.chunk_tokens(c)
    var kept = wk.kept(c)
    if wk.defer:
        wk.use_store(c, dims.d, dims.np, dims.di)
    if kept:
        wk.use_kept(c, dims.d, dims.np)
    if stage == F_NORM:
        _norm_rows(args, dims, wk, c, nc, task, True, not kept)
    elif stage == F_INPROJ:
        _inproj(args, dims, wk, nc, task)
    elif stage == F_BCNORM:
        _bcnorm(args, dims, wk, nc, task)
    elif stage == S_FWD:
        _scan_fwd(args, dims, wk, c, task // dims.nh, task % dims.nh)
    elif stage == B_OUT:
        _out_backward(args, dims, wk, c, nc, task)
    elif stage == B_SCAN:
        _scan_bwd(args, dims, wk, c, task // dims.nh, task % dims.nh)
    elif stage == B_RED:
        _reduce(args, dims, wk, nc, task)
    elif stage == B_INPROJ:
        _inproj_backward(args, dims, wk, c, nc, task)
    elif stage == B_NORM:
        _norm_backward(args, dims, wk, c, nc, task)
    else:
        _normw(args, dims, wk, nc, task)


def _init(args: I64Ptr, dims: M3Dims, wk: BW3, task: Int):
    """Zero (row, head) task's carries and its chunk-0 checkpoints."""
    var w = arg_f32(args, BW_WORK)
    for i in range(HP * NST):
        w[unsafe_offset=wk.o_cdh + task * HP * NST + i] = 0.0
        w[unsafe_offset=wk.o_ckh + task * HP * NST + i] = 0.0
    for i in range(NANG):
        w[unsafe_offset=wk.o_cdt + task * NANG + i] = 0.0
        w[unsafe_offset=wk.o_ckt + task * NANG + i] = 0.0
    for i in range(HP):
        w[unsafe_offset=wk.o_ckv + task * HP + i] = 0.0
    for i in range(NST):
        w[unsafe_offset=wk.o_ckk + task * NST + i] = 0.0
    w[unsafe_offset=wk.o_cbeta + task] = 0.0


# ------------------------------------------------------------ row stages


def _norm_rows(args: I64Ptr, dims: M3Dims, wk: BW3, c: Int, nr: Int, task: Int,
               copy_g: Bool, norm: Bool):
    var l = wk.l
    var d = dims.d
    var x = arg_f32(args, BW_X)
    var g = arg_f32(args, BW_G)
    var blob = arg_f32(args, BW_BLOB)
    var work = arg_f32(args, BW_WORK)
    var xn = work.unsafe_offset(wk.o_xn)
    var gch = work.unsafe_offset(wk.o_gch)
    var r0 = task * ROWS_PER_TASK
    var r1 = min(wk.b * nr, r0 + ROWS_PER_TASK)
    for r in range(r0, r1):
        var off = ((r // nr) * l + c * QC + r % nr) * d
        if norm:
            rmsnorm_row(x.unsafe_offset(off), d, blob.unsafe_offset(dims.o_norm),
                        xn.unsafe_offset(r * d))
        if copy_g:
            for j in range(d):
                gch[unsafe_offset=r * d + j] = g[unsafe_offset=off + j]


def _inproj(args: I64Ptr, dims: M3Dims, wk: BW3, nr: Int, task: Int):
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    _ = matmul_task(task, work.unsafe_offset(wk.o_xn), dims.d, wk.b * nr,
                    blob.unsafe_offset(dims.o_in), dims.d, dims.np,
                    work.unsafe_offset(wk.o_proj), dims.np)


def _inproj_no_z(args: I64Ptr, dims: M3Dims, wk: BW3, nr: Int, task: Int):
    """in_proj without the z panels (the first di outputs): pass A's scan
    never reads z, and pass B recomputes this chunk in full."""
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    var zp = dims.di // NR  # di is a multiple of 64: whole panels
    _ = matmul_task(task, work.unsafe_offset(wk.o_xn), dims.d, wk.b * nr,
                    blob.unsafe_offset(dims.o_in + zp * dims.d * NR), dims.d,
                    dims.np - dims.di, work.unsafe_offset(wk.o_proj + dims.di), dims.np)


def _keep_rows(args: I64Ptr, dims: M3Dims, wk: BW3, c: Int, task: Int):
    """Copy pass A's rows of chunk c (B x 65 layout) to its keep slot, in
    pass B's B x 64 layout."""
    var work = arg_f32(args, BW_WORK)
    var d = dims.d
    var npj = dims.np
    var r0 = task * ROWS_PER_TASK
    var r1 = min(wk.b * QC, r0 + ROWS_PER_TASK)
    var kx = wk.keep_xn(c, d)
    var kp = wk.keep_proj(c, d)
    var kb = wk.keep_bcn(c, d, npj)
    for r in range(r0, r1):
        var src = (r // QC) * (QC + 1) + r % QC
        _copy_row(work.unsafe_offset(wk.o_xn + src * d), work.unsafe_offset(kx + r * d), d)
        _copy_row(work.unsafe_offset(wk.o_proj + src * npj),
                  work.unsafe_offset(kp + r * npj), npj)
        _copy_row(work.unsafe_offset(wk.o_bcn + src * 2 * NST),
                  work.unsafe_offset(kb + r * 2 * NST), 2 * NST)


@always_inline
def _copy_row(src: F32Ptr, dst: F32Ptr, n: Int):
    var j = 0
    while j + 16 <= n:
        dst.unsafe_store(j, src.unsafe_load[width=16](j))
        j += 16
    while j < n:
        dst[unsafe_offset=j] = src[unsafe_offset=j]
        j += 1


def _bcnorm(args: I64Ptr, dims: M3Dims, wk: BW3, nr: Int, task: Int):
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    var proj = work.unsafe_offset(wk.o_proj)
    var bcn = work.unsafe_offset(wk.o_bcn)
    var r0 = task * ROWS_PER_TASK
    var r1 = min(wk.b * nr, r0 + ROWS_PER_TASK)
    for r in range(r0, r1):
        var pr = proj.unsafe_offset(r * dims.np)
        rmsnorm_row(pr.unsafe_offset(dims.c_b), NST, blob.unsafe_offset(dims.o_bnw),
                    bcn.unsafe_offset(r * 2 * NST))
        rmsnorm_row(pr.unsafe_offset(dims.c_c), NST, blob.unsafe_offset(dims.o_cnw),
                    bcn.unsafe_offset(r * 2 * NST + NST))


# ------------------------------------------------------------ per (row, head) recompute


def _prep(args: I64Ptr, dims: M3Dims, wk: BW3, bb: Int, hh: Int, nr: Int, n: Int,
          theta: F32Ptr, scr: F32Ptr):
    """Tokens 0..n-1 of the chunk for (bb, hh): dt, sg, adt, A, qk (unrotated
    q . k) into the vectors; the angles advanced from theta (updated in
    place); cos | sin, and the rotated q | k rows (bias added) written to
    cs and qkr. The forward op's formulas and order."""
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    var proj = work.unsafe_offset(wk.o_proj)
    var bcn = work.unsafe_offset(wk.o_bcn)
    var dtb = blob[unsafe_offset=dims.o_dtb + hh]
    var bbias = blob.unsafe_offset(dims.o_bb + hh * NST)
    var cbias = blob.unsafe_offset(dims.o_cb + hh * NST)
    var qu = scr.unsafe_offset(V_TMP)
    var ku = scr.unsafe_offset(V_TMP + NST)
    # dt, sg, A of 16 tokens at a time (gathered into their vectors; the
    # functions give the same bits at any width); lanes past n are unused
    for i in range(n):
        var pr = proj.unsafe_offset((bb * nr + i) * dims.np)
        scr[unsafe_offset=V_DT + i] = pr[unsafe_offset=dims.c_dt + hh]
        scr[unsafe_offset=V_SG + i] = pr[unsafe_offset=dims.c_tr + hh]
        scr[unsafe_offset=V_A + i] = pr[unsafe_offset=dims.c_a + hh]
    var i0 = 0
    while i0 < n:
        var dtv = softplus_f32[16](scr.unsafe_load[width=16](V_DT + i0) + V16(dtb))
        var av = _phi_a_v(scr.unsafe_load[width=16](V_A + i0))
        scr.unsafe_store(V_DT + i0, dtv)
        scr.unsafe_store(V_SG + i0, sigmoid_f32[16](scr.unsafe_load[width=16](V_SG + i0)))
        scr.unsafe_store(V_ADT + i0, av * dtv)
        scr.unsafe_store(V_A + i0, av)
        i0 += 16
    for i in range(n):
        var r = bb * nr + i
        var pr = proj.unsafe_offset(r * dims.np)
        var dt = scr[unsafe_offset=V_DT + i]
        var bc = bcn.unsafe_offset(r * 2 * NST)
        comptime for c in range(8):
            qu.unsafe_store(c * 16, bc.unsafe_load[width=16](NST + c * 16)
                            + cbias.unsafe_load[width=16](c * 16))
            ku.unsafe_store(c * 16, bc.unsafe_load[width=16](c * 16)
                            + bbias.unsafe_load[width=16](c * 16))
        scr[unsafe_offset=V_QK + i] = dot128(qu, ku)
        var qrow = work.unsafe_offset(wk.o_qkr + wk.qk_row(r, hh))
        var krow = qrow.unsafe_offset(NST)
        var csr = work.unsafe_offset(wk.o_cs + (hh * wk.rmax + r) * CSW)
        comptime for c in range(2):
            var ang = tanh_f32[16](pr.unsafe_load[width=16](dims.c_ang + c * 16)) * V16(PI_F32)
            var th = mod2pi_f32[16](ang.fma(V16(dt), theta.unsafe_load[width=16](c * 16)))
            theta.unsafe_store(c * 16, th)
            var cs = cos_f32[16](th)
            var sn = sin_f32[16](th)
            csr.unsafe_store(c * 16, cs)
            csr.unsafe_store(NANG + c * 16, sn)
            # rotate 16 pairs at once (split even | odd, same per-lane ops)
            var q = qu.unsafe_load[width=32](c * 32).deinterleave()
            var k = ku.unsafe_load[width=32](c * 32).deinterleave()
            qrow.unsafe_store(c * 32, (q[0] * cs - q[1] * sn).interleave(q[0] * sn + q[1] * cs))
            krow.unsafe_store(c * 32, (k[0] * cs - k[1] * sn).interleave(k[0] * sn + k[1] * cs))
        comptime for c in range(4, 8):
            qrow.unsafe_store(c * 16, qu.unsafe_load[width=16](c * 16))
            krow.unsafe_store(c * 16, ku.unsafe_load[width=16](c * 16))


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


def _scan_a(args: I64Ptr, dims: M3Dims, wk: BW3, c: Int, bb: Int, hh: Int):
    """Pass A for (bb, hh) over chunk c: fold the chunk into h (the forward's
    Fold(64, beta) with beta from the next chunk's first token) and write
    chunk c+1's checkpoints."""
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    var nh = dims.nh
    var bh = bb * nh + hh
    var n = wk.chunk_tokens(c)
    var nr = n + 1
    var scr = work.unsafe_offset(wk.o_scr + bh * SCR)
    var nbh = wk.b * nh
    var th = work.unsafe_offset(wk.o_ckt + ((c + 1) * nbh + bh) * NANG)
    var th0 = work.unsafe_offset(wk.o_ckt + (c * nbh + bh) * NANG)
    for i in range(NANG):
        th[unsafe_offset=i] = th0[unsafe_offset=i]
    _prep(args, dims, wk, bb, hh, nr, n, th, scr)
    # beta of the next chunk's first token (row n of this stage)
    var pr = work.unsafe_offset(wk.o_proj + (bb * nr + n) * dims.np)
    var dtn = softplus_f32[1](pr[unsafe_offset=dims.c_dt + hh] + blob[unsafe_offset=dims.o_dtb + hh])
    var sgn = sigmoid_f32[1](pr[unsafe_offset=dims.c_tr + hh])
    _scales(scr, n, dtn * (Float32(1.0) - sgn))
    var w = scr.unsafe_offset(V_TMP)
    var hdec = _segs(scr, n - 1, w)
    for j in range(n):
        w[unsafe_offset=j] = w[unsafe_offset=j] * scr[unsafe_offset=V_SCALE + j]
    var h0 = work.unsafe_offset(wk.o_ckh + (c * nbh + bh) * HP * NST)
    var h1 = work.unsafe_offset(wk.o_ckh + ((c + 1) * nbh + bh) * HP * NST)
    var proj = work.unsafe_offset(wk.o_proj)
    var qkr = work.unsafe_offset(wk.o_qkr)
    # 128 columns in NHF passes (no register spills); chains unchanged.
    for p0 in range(0, HP, TB):  # TB state rows share each loaded k row
        comptime for hf in range(NHF):
            var acc = Array[V16, TB * HW](fill=V16(0.0))
            comptime for t in range(TB):
                comptime for cc in range(HW):
                    acc[t * HW + cc] = V16(hdec) * h0.unsafe_load[width=16](
                        (p0 + t) * NST + (hf * HW + cc) * 16)
            for j in range(n):
                var vrow = proj.unsafe_offset((bb * nr + j) * dims.np + dims.c_v + hh * HP + p0)
                var wv = Array[V16, TB](fill=V16(0.0))
                comptime for t in range(TB):
                    wv[t] = V16(w[unsafe_offset=j] * vrow[unsafe_offset=t])
                var kr = qkr.unsafe_offset(wk.qk_row(bb * nr + j, hh) + NST)
                comptime for cc in range(HW):
                    var kv = kr.unsafe_load[width=16]((hf * HW + cc) * 16)
                    comptime for t in range(TB):
                        acc[t * HW + cc] = wv[t].fma(kv, acc[t * HW + cc])
            comptime for t in range(TB):
                comptime for cc in range(HW):
                    h1.unsafe_store((p0 + t) * NST + (hf * HW + cc) * 16, acc[t * HW + cc])
    var rl = bb * nr + n - 1
    var kv = work.unsafe_offset(wk.o_ckv + ((c + 1) * nbh + bh) * HP)
    var kk = work.unsafe_offset(wk.o_ckk + ((c + 1) * nbh + bh) * NST)
    for p in range(HP):
        kv[unsafe_offset=p] = proj[unsafe_offset=rl * dims.np + dims.c_v + hh * HP + p]
    for k in range(NST):
        kk[unsafe_offset=k] = qkr[unsafe_offset=wk.qk_row(rl, hh) + NST + k]


def _scan_fwd(args: I64Ptr, dims: M3Dims, wk: BW3, c: Int, bb: Int, hh: Int):
    """Pass B recompute for (bb, hh) over chunk c: the forward op's outputs
    y (before the gate) and o, plus the matrices the VJP reuses."""
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    var nh = dims.nh
    var bh = bb * nh + hh
    var n = wk.chunk_tokens(c)
    var nbh = wk.b * nh
    var scr = work.unsafe_offset(wk.o_scr + bh * SCR)
    var th = scr.unsafe_offset(M_DG)  # angles: M_DG is free until the VJP
    var th0 = work.unsafe_offset(wk.o_ckt + (c * nbh + bh) * NANG)
    for i in range(NANG):
        th[unsafe_offset=i] = th0[unsafe_offset=i]
    _prep(args, dims, wk, bb, hh, n, n, th, scr)
    var cb = work.unsafe_offset(wk.o_cbeta + bh)
    var beta_next = cb[unsafe_offset=0]
    cb[unsafe_offset=0] = scr[unsafe_offset=V_DT] * (Float32(1.0) - scr[unsafe_offset=V_SG])
    _scales(scr, n, beta_next)
    var h = work.unsafe_offset(wk.o_ckh + (c * nbh + bh) * HP * NST)
    var proj = work.unsafe_offset(wk.o_proj)
    var qkr = work.unsafe_offset(wk.o_qkr)
    var dsk = blob[unsafe_offset=dims.o_dskip + hh]
    var rs = QK  # row stride inside one head's block
    var hb = hh * wk.rmax
    for i in range(n):  # per token: L row, e_i, G and C rows
        var r = bb * n + i
        var qrow = qkr.unsafe_offset(wk.qk_row(r, hh))
        var lrow = scr.unsafe_offset(M_L + i * QC)
        var grow = scr.unsafe_offset(M_G + i * QC)
        var crow = scr.unsafe_offset(M_C + i * QC)
        var e = _segs(scr, i, lrow)
        scr[unsafe_offset=V_E + i] = e
        var j = 0
        while j < i:
            var g4: V4
            if j + 4 <= i:
                g4 = _dots128x4(qrow, 0, qkr.unsafe_offset((bb * n + j) * rs + hb * QK + NST), rs)
            else:
                g4 = V4(0.0)
                for q in range(i - j):
                    g4[q] = dot128(qrow, qkr.unsafe_offset((bb * n + j + q) * rs + hb * QK + NST))
            for q in range(min(4, i - j)):
                grow[unsafe_offset=j + q] = g4[q]
                crow[unsafe_offset=j + q] = (lrow[unsafe_offset=j + q]
                                             * scr[unsafe_offset=V_SCALE + j + q]) * g4[q]
            j += 4
    # hq_i = h q_i, TB tokens at a time (they share each loaded h row)
    var i0 = 0
    while i0 < n:
        var q0 = qkr.unsafe_offset(wk.qk_row(bb * n + i0, hh))
        if TB == 2 and i0 + 1 < n:
            for p in range(0, HP, 4):
                _dots128_block[TB](q0, QK, h.unsafe_offset(p * NST), NST,
                                   scr.unsafe_offset(M_HQ + i0 * HP + p), HP)
            i0 += TB
        else:
            for p in range(0, HP, 4):
                _dots128_block[1](q0, QK, h.unsafe_offset(p * NST), NST,
                                  scr.unsafe_offset(M_HQ + i0 * HP + p), HP)
            i0 += 1
    for i in range(n):  # y and o
        var r = bb * n + i
        var e = scr[unsafe_offset=V_E + i]
        var crow = scr.unsafe_offset(M_C + i * QC)
        var hq = scr.unsafe_offset(M_HQ + i * HP)
        var diag = scr[unsafe_offset=V_QK + i] * (scr[unsafe_offset=V_DT + i] * scr[unsafe_offset=V_SG + i])
        var pr = proj.unsafe_offset(r * dims.np)
        var vrow = pr.unsafe_offset(dims.c_v + hh * HP)
        var yrow = work.unsafe_offset(wk.o_y + r * dims.di + hh * HP)
        var orow = work.unsafe_offset(wk.o_o + r * dims.di + hh * HP)
        # the four column blocks' chains side by side (one alone is latency bound)
        var ys = Array[V16, 4](fill=V16(0.0))
        comptime for cc in range(4):
            ys[cc] = V16(e) * hq.unsafe_load[width=16](cc * 16)
        for jj in range(i):
            var cj = V16(crow[unsafe_offset=jj])
            var vj = proj.unsafe_offset((bb * n + jj) * dims.np + dims.c_v + hh * HP)
            comptime for cc in range(4):
                ys[cc] = cj.fma(vj.unsafe_load[width=16](cc * 16), ys[cc])
        comptime for cc in range(4):
            var vi = vrow.unsafe_load[width=16](cc * 16)
            var y = V16(diag).fma(vi, ys[cc])
            y = V16(dsk).fma(vi, y)
            yrow.unsafe_store(cc * 16, y)
            orow.unsafe_store(cc * 16, y * silu_f32[16](pr.unsafe_load[width=16](hh * HP + cc * 16)))


# ------------------------------------------------------------ out_proj VJP


def _out_backward(args: I64Ptr, dims: M3Dims, wk: BW3, c: Int, nc: Int, task: Int):
    var work = arg_f32(args, BW_WORK)
    var rows = wk.b * nc
    var d = dims.d
    var di = dims.di
    var n1 = matmul_ntasks(rows, di)
    if task < n1:  # do[r, c] = sum_o g[r, o] W_out[o, c]
        var wt = arg_f32(args, BW_PANELS).unsafe_offset(_panels(dims).o2)
        _ = matmul_task(task, work.unsafe_offset(wk.o_gch), d, rows, wt, d, di,
                        work.unsafe_offset(wk.o_do), di)
    elif wk.defer:  # all B L rows at once (chunk 0, the last processed)
        _ = gemm_task(task - n1, work.unsafe_offset(wk.o_sgc), 1, d,
                      work.unsafe_offset(wk.o_so), di, wk.b * wk.l,
                      arg_f32(args, BW_G_OUT), di, d, di, False)
    else:  # dW_out[o, c] += sum_r g[r, o] o[r, c]
        _ = gemm_task(task - n1, work.unsafe_offset(wk.o_gch), 1, d,
                      work.unsafe_offset(wk.o_o), di, rows,
                      arg_f32(args, BW_G_OUT), di, d, di, c < wk.nchunks - 1)


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
                u[unsafe_offset=t * 64 + p + q] = _tree16(acc[q * T + t])
    var fs = Array[Float32, T](fill=0.0)
    comptime for t in range(T):
        var j = j0 + t
        var vj = v.unsafe_offset(j * ldv)
        var ut = u.unsafe_offset(t * 64)
        var vdk = _dot64(vj, ut)
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
    7. scalars: d dd_dt, d dd_A, d trap (see the code)."""
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    var nh = dims.nh
    var bh = bb * nh + hh
    var n = wk.chunk_tokens(c)
    var nbh = wk.b * nh
    var last = n - 1
    var scr = work.unsafe_offset(wk.o_scr + bh * SCR)
    var proj = work.unsafe_offset(wk.o_proj)
    var dproj = work.unsafe_offset(wk.o_dproj)
    var qkr = work.unsafe_offset(wk.o_qkr)
    var dqk = work.unsafe_offset(wk.o_dqk)
    var npj = dims.np
    var rs = QK  # row stride inside one head's block of qkr / dqk
    var hb = hh * wk.rmax
    var h = work.unsafe_offset(wk.o_ckh + (c * nbh + bh) * HP * NST)
    var dH = work.unsafe_offset(wk.o_cdh + bh * HP * NST)
    var dsk = blob[unsafe_offset=dims.o_dskip + hh]
    var vo = dims.c_v + hh * HP
    var dy = scr.unsafe_offset(M_DY)
    # 1.
    for i in range(n):
        var r = bb * n + i
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
        var dvv = _dot64(dy.unsafe_offset(i * HP), pr.unsafe_offset(vo))
        scr[unsafe_offset=V_DVV + i] = dvv
        work[unsafe_offset=wk.o_dd + r * nh + hh] = dvv
        scr[unsafe_offset=V_DCUM + i] = 0.0
        scr[unsafe_offset=V_DSCALE + i] = 0.0
    # 2.
    for i in range(n):
        var dyi = dy.unsafe_offset(i * HP)
        var j0 = 0
        while j0 < i:  # four dots at a time, then the updates in j order
            var d4: V4
            if j0 + 4 <= i:
                d4 = _dots64x4(dyi, 0, proj.unsafe_offset((bb * n + j0) * npj + vo), npj)
            else:
                d4 = V4(0.0)
                for q in range(i - j0):
                    d4[q] = _dot64(dyi, proj.unsafe_offset((bb * n + j0 + q) * npj + vo))
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
    var qk0 = qkr.unsafe_offset((bb * n) * rs + hb * QK)  # token 0, rows QK apart
    var dqk0 = dqk.unsafe_offset((bb * n) * rs + hb * QK)
    var i0 = 0
    while i0 < n:
        if TB == 2 and i0 + 1 < n:
            _dqdk[TB](scr, dy, h, qk0, dqk0, n, i0)
            i0 += TB
        else:
            _dqdk[1](scr, dy, h, qk0, dqk0, n, i0)
            i0 += 1
    for i in range(n):
        var r = bb * n + i
        var e = scr[unsafe_offset=V_E + i]
        var gam = scr[unsafe_offset=V_DT + i] * scr[unsafe_offset=V_SG + i]
        var dvv = scr[unsafe_offset=V_DVV + i]
        # dv_i
        var va = Array[V16, 4](fill=V16(0.0))
        for i2 in range(i + 1, n):
            var cm = V16(scr[unsafe_offset=M_C + i2 * QC + i])
            comptime for cc in range(4):
                va[cc] = cm.fma(dy.unsafe_load[width=16](i2 * HP + cc * 16), va[cc])
        var self_c = V16(gam * scr[unsafe_offset=V_QK + i] + dsk)
        var dvrow = dproj.unsafe_offset(r * npj + vo)
        comptime for cc in range(4):
            dvrow.unsafe_store(cc * 16, self_c.fma(dy.unsafe_load[width=16](i * HP + cc * 16), va[cc]))
        scr[unsafe_offset=V_DCUM + i] = scr[unsafe_offset=V_DCUM + i] + e * _dot64(
            dy.unsafe_offset(i * HP), scr.unsafe_offset(M_HQ + i * HP))
        scr[unsafe_offset=V_DGAM + i] = dvv * scr[unsafe_offset=V_QK + i]
    # 4. fold
    var elast = scr[unsafe_offset=V_E + last]
    var hd: Float32 = 0.0
    for p in range(0, HP, 4):  # four dots at a time, summed in p order
        var h4 = _dots128x4(dH.unsafe_offset(p * NST), NST, h.unsafe_offset(p * NST), NST)
        comptime for q in range(4):
            hd = hd + h4[q]
    scr[unsafe_offset=V_DCUM + last] = scr[unsafe_offset=V_DCUM + last] + elast * hd
    var u = scr.unsafe_offset(V_TMP)
    var j0 = 0
    while j0 < n:
        if TB == 2 and j0 + 1 < n:
            _fold[TB](scr, proj.unsafe_offset((bb * n) * npj + vo), npj, qk0, dqk0,
                      dproj.unsafe_offset((bb * n) * npj + vo), dH, last, j0)
            j0 += TB
        else:
            _fold[1](scr, proj.unsafe_offset((bb * n) * npj + vo), npj, qk0, dqk0,
                     dproj.unsafe_offset((bb * n) * npj + vo), dH, last, j0)
            j0 += 1
    # dh_in, in place over the carry, TB state rows at a time
    for p in range(0, HP, TB):
        _dh_in[TB](scr, dy, qk0, dH, n, elast, p)
    var dbeta_prev: Float32 = 0.0
    if c > 0:
        var kp = work.unsafe_offset(wk.o_ckk + (c * nbh + bh) * NST)
        var vp = work.unsafe_offset(wk.o_ckv + (c * nbh + bh) * HP)
        for p in range(0, HP, 4):
            u.unsafe_store(p, _dots128x4(dH.unsafe_offset(p * NST), NST, kp, 0))
        dbeta_prev = _dot64(vp, u)
    # 5.
    var acc_c: Float32 = 0.0
    var m = last
    while m >= 0:
        acc_c = acc_c + scr[unsafe_offset=V_DCUM + m]
        scr[unsafe_offset=V_DCUM + m] = acc_c  # now dadt_m
        m -= 1
    # 6. angles, tokens descending
    var tcar = work.unsafe_offset(wk.o_cdt + bh * NANG)
    var j = last
    while j >= 0:
        var r = bb * n + j
        var qrow = qkr.unsafe_offset(r * rs + hb * QK)
        var krow = qrow.unsafe_offset(NST)
        var dq = dqk.unsafe_offset(r * rs + hb * QK)
        var dk = dq.unsafe_offset(NST)
        var csr = work.unsafe_offset(wk.o_cs + (hh * wk.rmax + r) * CSW)
        var pr = proj.unsafe_offset(r * npj)
        var dap = work.unsafe_offset(wk.o_dang + (r * nh + hh) * NANG)
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
    for jj in range(n):
        var r = bb * n + jj
        var pr = proj.unsafe_offset(r * npj)
        var dpr = dproj.unsafe_offset(r * npj)
        var dt = scr[unsafe_offset=V_DT + jj]
        var sg = scr[unsafe_offset=V_SG + jj]
        var dadt = scr[unsafe_offset=V_DCUM + jj]
        var dgs = scr[unsafe_offset=V_DSCALE + jj] + scr[unsafe_offset=V_DGAM + jj]
        var bco = dbeta_prev
        if jj > 0:
            bco = scr[unsafe_offset=V_DSCALE + jj - 1]
        var ddt = dadt * scr[unsafe_offset=V_A + jj] + dgs * sg
        ddt = ddt + scr[unsafe_offset=V_DDT + jj]
        ddt = ddt + bco * (Float32(1.0) - sg)
        var dsg = dgs * dt - bco * dt
        var vdt = pr[unsafe_offset=dims.c_dt + hh] + dtb
        var spg: Float32 = 1.0
        if not (vdt > 20.0):
            spg = sigmoid_f32[1](vdt)
        dpr[unsafe_offset=dims.c_dt + hh] = ddt * spg
        dpr[unsafe_offset=dims.c_a + hh] = (dadt * dt) * _dphi_a(pr[unsafe_offset=dims.c_a + hh])
        dpr[unsafe_offset=dims.c_tr + hh] = dsg * (sg * (Float32(1.0) - sg))


# ------------------------------------------------------------ reductions


def _norm_vjp(v: F32Ptr, n: Int, w: F32Ptr, dout: F32Ptr, dv: F32Ptr, pw: F32Ptr):
    """RMSNorm VJP of one row (norms.mojo's forward): gx_j = dout_j w_j;
    dot = fma chain over j of gx_j v_j; coef = (dot ((r r) r)) / n;
    dv_j = fma(-v_j, coef, r gx_j); pw_j = dout_j (v_j r)."""
    var rs = rms_scale(v, n)
    var dot: Float32 = 0.0
    for j in range(n):
        var gx = dout[unsafe_offset=j] * w[unsafe_offset=j]
        dot = gx.fma(v[unsafe_offset=j], dot)
    var coef = (dot * ((rs * rs) * rs)) / Float32(n)
    for j in range(n):
        var vj = v[unsafe_offset=j]
        var gxn = dout[unsafe_offset=j]
        dv[unsafe_offset=j] = (-vj).fma(coef, rs * (gxn * w[unsafe_offset=j]))
        pw[unsafe_offset=j] = gxn * (vj * rs)


def _reduce(args: I64Ptr, dims: M3Dims, wk: BW3, nc: Int, task: Int):
    """Row tasks: head sums (h ascending) of dk, dq, d angle; B/C norm VJPs.
    Head tasks: B_bias, C_bias, dt_bias, D chains (rows ascending)."""
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    var rows = wk.b * nc
    var nh = dims.nh
    var npj = dims.np
    var nrt = ceil_div(rows, ROWS_PER_TASK)
    var dqk = work.unsafe_offset(wk.o_dqk)
    var dproj = work.unsafe_offset(wk.o_dproj)
    if task < nrt:
        var proj = work.unsafe_offset(wk.o_proj)
        var r0 = task * ROWS_PER_TASK
        var r1 = min(rows, r0 + ROWS_PER_TASK)
        for r in range(r0, r1):
            var dpr = dproj.unsafe_offset(r * npj)
            var pbc = work.unsafe_offset(wk.o_pbc + r * 2 * NST)
            # head sums (h ascending) into the B | C columns of dproj as dBn | dCn
            # (16 lanes = 16 independent sums, each the same + chain over heads)
            comptime for kc in range(0, NST, 16):
                var sb = dqk.unsafe_load[width=16](wk.qk_row(r, 0) + NST + kc)
                var sc = dqk.unsafe_load[width=16](wk.qk_row(r, 0) + kc)
                for hh in range(1, nh):
                    sb = sb + dqk.unsafe_load[width=16](wk.qk_row(r, hh) + NST + kc)
                    sc = sc + dqk.unsafe_load[width=16](wk.qk_row(r, hh) + kc)
                dpr.unsafe_store(dims.c_b + kc, sb)
                dpr.unsafe_store(dims.c_c + kc, sc)
            comptime for rc in range(0, NANG, 16):
                var sa = work.unsafe_load[width=16](wk.o_dang + (r * nh) * NANG + rc)
                for hh in range(1, nh):
                    sa = sa + work.unsafe_load[width=16](wk.o_dang + (r * nh + hh) * NANG + rc)
                dpr.unsafe_store(dims.c_ang + rc, sa)
            var pr = proj.unsafe_offset(r * npj)
            # in place: each dBn_j is read before dBp_j is written
            _norm_vjp(pr.unsafe_offset(dims.c_b), NST, blob.unsafe_offset(dims.o_bnw),
                      dpr.unsafe_offset(dims.c_b), dpr.unsafe_offset(dims.c_b), pbc)
            _norm_vjp(pr.unsafe_offset(dims.c_c), NST, blob.unsafe_offset(dims.o_cnw),
                      dpr.unsafe_offset(dims.c_c), dpr.unsafe_offset(dims.c_c),
                      pbc.unsafe_offset(NST))
        return
    var hh = task - nrt
    var gbb = arg_f32(args, BW_G_BB).unsafe_offset(hh * NST)
    var gcb = arg_f32(args, BW_G_CB).unsafe_offset(hh * NST)
    comptime for cc in range(8):
        var ab = gbb.unsafe_load[width=16](cc * 16)
        var ac = gcb.unsafe_load[width=16](cc * 16)
        for r in range(rows):
            ab = ab + dqk.unsafe_load[width=16](wk.qk_row(r, hh) + NST + cc * 16)
            ac = ac + dqk.unsafe_load[width=16](wk.qk_row(r, hh) + cc * 16)
        gbb.unsafe_store(cc * 16, ab)
        gcb.unsafe_store(cc * 16, ac)
    var gdtb = arg_f32(args, BW_G_DTB)
    var gd = arg_f32(args, BW_G_D)
    var sdt = gdtb[unsafe_offset=hh]
    var sd = gd[unsafe_offset=hh]
    for r in range(rows):
        sdt = sdt + dproj[unsafe_offset=r * npj + dims.c_dt + hh]
        sd = sd + work[unsafe_offset=wk.o_dd + r * nh + hh]
    gdtb[unsafe_offset=hh] = sdt
    gd[unsafe_offset=hh] = sd


def _inproj_backward(args: I64Ptr, dims: M3Dims, wk: BW3, c: Int, nc: Int, task: Int):
    var work = arg_f32(args, BW_WORK)
    var rows = wk.b * nc
    var d = dims.d
    var npj = dims.np
    var n1 = matmul_ntasks(rows, d)
    var n2 = gemm_ntasks(npj, d) if wk.dw_now(c) else 0
    if task < n1:  # dxn[r, i] = sum_j dproj[r, j] W_in[j, i]
        var wt = arg_f32(args, BW_PANELS).unsafe_offset(_panels(dims).o1)
        _ = matmul_task(task, work.unsafe_offset(wk.o_dproj), npj, rows, wt, npj, d,
                        work.unsafe_offset(wk.o_dxn), d)
    elif task < n1 + n2 and wk.defer:  # all B L rows at once (chunk 0)
        _ = gemm_task(task - n1, work.unsafe_offset(wk.o_sdp), 1, npj,
                      work.unsafe_offset(wk.o_sxn), d, wk.b * wk.l,
                      arg_f32(args, BW_G_IN), d, npj, d, False)
    elif task < n1 + n2:  # dW_in[j, i] += sum_r dproj[r, j] xn[r, i]
        _ = gemm_task(task - n1, work.unsafe_offset(wk.o_dproj), 1, npj,
                      work.unsafe_offset(wk.o_xn), d, rows,
                      arg_f32(args, BW_G_IN), d, npj, d, c < wk.nchunks - 1)
    else:  # B_norm.weight | C_norm.weight += pbc rows, r ascending
        var q = task - n1 - n2
        var pbc = work.unsafe_offset(wk.o_pbc)
        var dst = arg_f32(args, BW_G_BNW)
        var col = q * 16
        if col >= NST:
            dst = arg_f32(args, BW_G_CNW)
            col -= NST
        var acc = dst.unsafe_load[width=16](col)
        for r in range(rows):
            acc = acc + pbc.unsafe_load[width=16](r * 2 * NST + q * 16)
        dst.unsafe_store(col, acc)


def _norm_backward(args: I64Ptr, dims: M3Dims, wk: BW3, c: Int, nc: Int, task: Int):
    """dx = g + RMSNorm VJP of dxn; pn = block norm weight terms."""
    var work = arg_f32(args, BW_WORK)
    var blob = arg_f32(args, BW_BLOB)
    var l = wk.l
    var d = dims.d
    var x = arg_f32(args, BW_X)
    var g = arg_f32(args, BW_G)
    var dx = arg_f32(args, BW_DX)
    var r0 = task * ROWS_PER_TASK
    var r1 = min(wk.b * nc, r0 + ROWS_PER_TASK)
    for r in range(r0, r1):
        var off = ((r // nc) * l + c * QC + r % nc) * d
        _norm_vjp(x.unsafe_offset(off), d, blob.unsafe_offset(dims.o_norm),
                  work.unsafe_offset(wk.o_dxn + r * d), dx.unsafe_offset(off),
                  work.unsafe_offset(wk.o_pn + r * d))
        for j in range(d):
            dx[unsafe_offset=off + j] = g[unsafe_offset=off + j] + dx[unsafe_offset=off + j]


def _normw(args: I64Ptr, dims: M3Dims, wk: BW3, nc: Int, task: Int):
    var work = arg_f32(args, BW_WORK)
    var gn = arg_f32(args, BW_G_NORM)
    var pn = work.unsafe_offset(wk.o_pn)
    var d = dims.d
    var col = task * 16
    var acc = gn.unsafe_load[width=16](col)
    for r in range(wk.b * nc):
        acc = acc + pn.unsafe_load[width=16](r * d + col)
    gn.unsafe_store(col, acc)
