"""Mamba-3 backward: argument slots, stage ids and the workspace layout
(BW3). The algorithm is described in mamba3/backward.mojo."""
from std.sys import get_defined_int
from ..abi import ceil_div
from ..regions import Regions
from ..linear import WIDE
from .layout import M3Dims, NST, HP, NANG, QC
from ..block_slots import BW_B, BW_L, BW_D, BW_X, BW_G, BW_BLOB, BW_WORK, BW_DX

# OP_M3_BACKWARD argument slots (after block_slots' BW_B ... BW_DX).
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
# Gradients through the state (all 0 for the zero-state backward, whose
# bits and work are unchanged). BW_STATED = 1: the forward started from the
# state in BW_S_* (buffered_tokens BW_N0, pending BW_PENDING), the final
# state's cotangents are in BW_C_* and the initial state's gradients go to
# BW_GS_* (every byte written; buffer rows past BW_N0 get +0.0).
comptime BW_N0 = 20  # buffered_tokens of the initial state, in [0, 64]
comptime BW_PENDING = 21  # 1: input states pending (then BW_N0 = 0)
comptime BW_STATED = 22
comptime BW_LENGTHS = 23  # 0, or int64 (B,) ragged lengths (only without a state)
comptime BW_S_THETA = 24  # the initial state (Mamba3State layouts), read only
comptime BW_S_H = 25
comptime BW_S_BK = 26
comptime BW_S_BV = 27
comptime BW_S_BDT = 28
comptime BW_S_BSG = 29
comptime BW_S_BADT = 30
comptime BW_S_PK = 31
comptime BW_S_PV = 32
comptime BW_C_THETA = 33  # cotangents of the final state (same layouts)
comptime BW_C_H = 34
comptime BW_C_BQ = 35
comptime BW_C_BK = 36
comptime BW_C_BV = 37
comptime BW_C_BDT = 38
comptime BW_C_BSG = 39
comptime BW_C_BADT = 40
comptime BW_C_PK = 41
comptime BW_C_PV = 42
comptime BW_GS_THETA = 43  # gradients of the initial state (same layouts)
comptime BW_GS_H = 44
comptime BW_GS_BQ = 45
comptime BW_GS_BK = 46
comptime BW_GS_BV = 47
comptime BW_GS_BDT = 48
comptime BW_GS_BSG = 49
comptime BW_GS_BADT = 50
comptime BW_GS_PK = 51
comptime BW_GS_PV = 52
comptime BW_NARGS = 53


comptime V16 = SIMD[DType.float32, 16]
comptime ROWS_PER_TASK = 16


@fieldwise_init
struct RowTask(ImplicitlyCopyable):
    """Rows [r0, r1) of one row task."""
    var r0: Int
    var r1: Int


@always_inline
def task_rows(task: Int, rows: Int) -> RowTask:
    """Row task `task` of `rows` rows: ROWS_PER_TASK rows (fewer in the
    last)."""
    var r0 = task * ROWS_PER_TASK
    return RowTask(r0, min(rows, r0 + ROWS_PER_TASK))

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
# The state path's chunk 0 holds the state's buffered rows before its
# tokens: per (row, head) its v rows and their gradients as two contiguous
# (64, 64) matrices (state rows, then tokens), since state and token rows
# sit in different arrays (o_sv; only allocated with a state).
comptime SV = 2 * QC * HP


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
    var n0: Int  # state rows in front of chunk 0 (the initial buffered_tokens)
    var stated: Bool
    var o_sv: Int  # (B, H, SV) v | dv rows of chunk 0 (state path with n0 > 0)
    var nkeep: Int  # pass-A chunks n-1-nkeep .. n-2 are kept
    var keep_slot: Int  # floats per kept chunk: xn | proj | bcn, B * 64 rows each
    var keep_at_proj: Int  # where proj and bcn start in a keep slot
    var keep_at_bcn: Int
    var o_keep: Int
    var defer: Bool  # weight gradients once at the end (DEFER_MAX_BYTES)
    var o_sdp: Int  # (B L, np) dproj rows, processing order (defer only)
    var o_sxn: Int  # (B L, d) xn rows
    var o_sgc: Int  # (B L, d) grad_output rows
    var o_so: Int  # (B L, di) o rows
    var floats: Int

    def __init__(out self, dims: M3Dims, b: Int, l: Int, n0: Int = 0, stated: Bool = False):
        self.b = b
        self.l = l
        self.n0 = n0
        self.stated = stated
        self.nh = dims.nh
        # chunks of the rows "state rows, then tokens" (aligned to absolute
        # positions: the forward's chunks); n0 = 0: ceil(L / 64)
        self.nchunks = ceil_div(n0 + l, QC)
        self.rmax = b * (QC + 1)
        var bh = b * dims.nh
        var r = self.rmax
        var d = dims.d
        var di = dims.di
        var regions = Regions()
        self.o_ckh = regions.take(self.nchunks * bh * HP * NST)
        self.o_ckt = regions.take(self.nchunks * bh * NANG)
        self.o_ckv = regions.take(self.nchunks * bh * HP)
        self.o_ckk = regions.take(self.nchunks * bh * NST)
        self.o_cdh = regions.take(bh * HP * NST)
        self.o_cdt = regions.take(bh * NANG)
        self.o_cbeta = regions.take(bh)
        self.o_xn = regions.take(r * d)
        self.o_gch = regions.take(r * d)
        self.o_proj = regions.take(r * dims.np)
        self.o_bcn = regions.take(r * 2 * NST)
        self.o_o = regions.take(r * di)
        self.o_y = regions.take(r * di)
        self.o_do = regions.take(r * di)
        self.o_dproj = regions.take(r * dims.np)
        self.o_qkr = regions.take(r * dims.nh * QK)
        self.o_cs = regions.take(r * dims.nh * CSW)
        self.o_dqk = regions.take(r * dims.nh * QK)
        self.o_dang = regions.take(r * dims.nh * NANG)
        self.o_dd = regions.take(r * dims.nh)
        self.o_pbc = regions.take(r * 2 * NST)
        self.o_pn = regions.take(r * d)
        self.o_dxn = regions.take(r * d)
        self.o_scr = regions.take_exact(bh * SCR)
        self.o_sv = regions.take_exact(bh * SV if n0 > 0 else 0)
        # a kept chunk's slot: xn | proj | bcn rows, B * 64 of each
        var kr = b * QC
        var slot = Regions()
        _ = slot.take(kr * d)
        self.keep_at_proj = slot.take(kr * dims.np)
        self.keep_at_bcn = slot.take(kr * 2 * NST)
        self.keep_slot = slot.end
        self.nkeep = min(self.nchunks - 1, KEEP_MAX_BYTES // (4 * self.keep_slot))
        self.o_keep = regions.take_exact(self.nkeep * self.keep_slot)
        # the deferred rows' store: dproj | xn | grad_output | o rows, B L of each
        var tot = b * l
        var store = Regions()
        _ = store.take(tot * dims.np)
        var at_xn = store.take(tot * d)
        var at_gc = store.take(tot * d)
        var at_o = store.take(tot * di)
        self.defer = store.end * 4 <= DEFER_MAX_BYTES
        self.o_sdp = regions.take_exact(store.end if self.defer else 0)
        self.o_sxn = self.o_sdp
        self.o_sgc = self.o_sdp
        self.o_so = self.o_sdp
        if self.defer:
            self.o_sxn = self.o_sdp + at_xn
            self.o_sgc = self.o_sdp + at_gc
            self.o_so = self.o_sdp + at_o
        self.floats = regions.end

    def chunk_tokens(self, c: Int) -> Int:
        """Tokens of chunk c (chunk 0 may have none: a full buffered chunk)."""
        return min(self.l, (c + 1) * QC - self.n0) - self.tok0(c)

    def tok0(self, c: Int) -> Int:
        """The first token of chunk c."""
        return max(0, c * QC - self.n0)

    def s0(self, c: Int) -> Int:
        """State rows in front of chunk c's tokens (n0 in chunk 0)."""
        return self.n0 if c == 0 else 0

    def scan_row(self, r: Int, nt: Int, s0: Int) -> Int:
        """The qkr / cs / dqk row of token row r of a chunk of nt tokens
        after s0 state rows (batch row r // nt holds s0 + nt scan rows)."""
        if s0 == 0:
            return r
        return (r // nt) * (s0 + nt) + s0 + r % nt

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

    def keep_proj(self, c: Int) -> Int:
        return self.keep_base(c) + self.keep_at_proj

    def keep_bcn(self, c: Int) -> Int:
        return self.keep_base(c) + self.keep_at_bcn

    def srow(self, c: Int) -> Int:
        """Store rows before chunk c: B x the tokens of the chunks after it
        (pass B runs chunks last to first)."""
        return self.b * max(0, self.l - ((c + 1) * QC - self.n0))

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

    def use_kept(mut self, c: Int, d: Int):
        """Pass B of a kept chunk reads xn, proj, bcn where pass A left them."""
        var xn = self.keep_xn(c, d)
        var pj = self.keep_proj(c)
        var bc = self.keep_bcn(c)
        self.o_xn = xn
        self.o_proj = pj
        self.o_bcn = bc


struct HeadChunk(ImplicitlyCopyable):
    """One (row bb, head hh) task of the scan passes over chunk c: its s0
    state rows and nt tokens (n = s0 + nt scan rows) and where it sits in
    the per-(row, head) arrays."""
    var bh: Int  # bb * H + hh
    var nbh: Int  # B * H
    var s0: Int
    var nt: Int
    var n: Int

    def __init__(out self, wk: BW3, c: Int, bb: Int, hh: Int):
        self.nbh = wk.b * wk.nh
        self.bh = bb * wk.nh + hh
        self.s0 = wk.s0(c)
        self.nt = wk.chunk_tokens(c)
        self.n = self.s0 + self.nt

    @always_inline
    def ckpt(self, k: Int) -> Int:
        """Index of chunk k's entry for this row and head in the
        (nchunks, B, H, ...) checkpoint arrays."""
        return k * self.nbh + self.bh
