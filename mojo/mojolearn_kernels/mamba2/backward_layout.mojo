"""Mamba-2 backward: argument slots, stage ids and the workspace layout
(BW2). The algorithm is described in mamba2/backward.mojo."""
from ..abi import I64Ptr, arg_int, arg_f32, ceil_div
from ..regions import Regions
from .layout import P, N, Q, M2Dims, blob_ngroups
from ..block_slots import BW_B, BW_L, BW_D, BW_X, BW_G, BW_BLOB, BW_WORK, BW_DX

# OP_M2_BACKWARD argument slots (after block_slots' BW_B ... BW_DX).
comptime BW_W_IN = 8  # row-major in_proj.weight (npj, d)
comptime BW_W_OUT = 9  # row-major out_proj.weight (d, di)
comptime BW_G_NORM = 10  # gradient outputs, zero on entry, natural layouts
# (except BW_G_IN and BW_G_OUT: pass B's first chunk, the last one, writes
# their chains' first terms, fma from +0.0, so the caller skips zeroing them)
comptime BW_G_IN = 11
comptime BW_G_CONVW = 12  # (cd, 4)
comptime BW_G_CONVB = 13
comptime BW_G_DTB = 14
comptime BW_G_ALOG = 15
comptime BW_G_D = 16
comptime BW_G_GNORM = 17
comptime BW_G_OUT = 18
comptime BW_PANELS = 19  # W_in^T | W_out^T panels (OP_PACK_TRANSPOSED)
# Gradients through the state (all 0 for the zero-state backward, whose bits
# and work are unchanged; backward_state.mojo). BW_STATED = 1: the
# forward started from the state in BW_S_* (buffered_tokens BW_N0), the
# final state's cotangents are in BW_C_* and the start state's gradients go
# to BW_GS_* (every byte written; buffer rows past BW_N0 get +0.0). A null
# BW_S_* or BW_C_* array is zeros. Layouts: the Mamba2State arrays.
comptime BW_N0 = 20  # buffered_tokens of the start state, in [0, 256)
comptime BW_STATED = 21
comptime BW_LENGTHS = 22  # 0, or int64 (B,) ragged lengths (only without a state)
comptime BW_S_CONV = 23  # (B, cd, 4) conv_window
comptime BW_S_H = 24  # (B, H, P, N)
comptime BW_S_BX = 25  # (B, Q, cd) buffer_xbc
comptime BW_S_BD = 26  # (B, Q, H) buffer_dtraw
comptime BW_C_CONV = 27
comptime BW_C_H = 28
comptime BW_C_BX = 29
comptime BW_C_BD = 30
comptime BW_GS_CONV = 31
comptime BW_GS_H = 32
comptime BW_GS_BX = 33
comptime BW_GS_BD = 34
comptime BW_NARGS = 35

comptime LANES = 16
comptime LV = SIMD[DType.float32, LANES]
comptime ROWS_PER_TASK = 16
comptime CH_PER_TASK = 64
# Per (row, head) task; the recompute (backward_recompute._ssd_fwd) uses its
# first 2 Q + N P + layout.TILE_SCR floats.
comptime SCR = Q * P + 2 * P * N + 8 * Q

# Stages. Pass A: S_NORM, S_INPROJ, S_CONV, A_FOLD; pass B: all but A_FOLD.
comptime S_NORM = 0
comptime S_INPROJ = 1
comptime S_CONV = 2  # conv + SiLU (keeps the pre-activation); dt, dA rows
comptime S_CB = 3
comptime S_SSD = 4  # y (before the gate) and yg
comptime S_GNORM = 5
comptime S_OUT = 6  # dg = grad_out @ W_out; d out_proj
comptime S_GATE = 7  # gated norm VJP, dy, dz
comptime S_SSD1 = 8  # per (row, head): dx, d dt, d(dA), dh carry | dCB rows
comptime S_SSD3 = 9  # dB, dC
comptime S_CONVB = 10  # conv VJP; d conv weight, bias
comptime S_INB = 11  # dxn = dzx @ W_in; d in_proj
comptime S_NORMB = 12  # dx; block norm weight terms
comptime S_COLS = 13  # column sums: norm weights, dt_bias, A, D
comptime NBS = 14
comptime NAS = 4


@fieldwise_init
struct M2Chunk(ImplicitlyCopyable):
    """Rows of one chunk (BW2.chunk): s0 state rows, then nt tokens from
    token t0 of x; nc = s0 + nt."""
    var s0: Int
    var nt: Int
    var nc: Int
    var t0: Int


struct BW2(ImplicitlyCopyable):
    """Sizes and workspace layout (floats) of one backward call."""
    var dims: M2Dims
    var b: Int
    var l: Int
    var n0: Int  # state rows in front of chunk 0's tokens (buffered_tokens)
    var stated: Bool
    var lens: Int  # address of the ragged lengths, or 0
    var nch: Int
    var o_ckh: Int  # (nch, B, H, P, N) h at each chunk start
    var o_dh: Int  # (2, B, H, P, N) dh at a chunk end, by chunk parity
    var o_dpc: Int  # (B, 3, cd) first 3 dpre rows of the following chunk
    var o_xn: Int  # (rows, d)
    var o_xnp: Int  # (B 3, d) the 3 tokens before the chunk
    var o_gch: Int  # (rows, d) grad_output rows of the chunk
    var o_zx: Int  # (rows, npj)
    var o_zxp: Int  # (B 3, npj)
    var o_pre: Int  # (rows, cd) conv output before SiLU
    var o_cx: Int  # (rows, cd) after SiLU
    var o_dt: Int  # (B, H, Q)
    var o_da: Int
    var o_sg: Int  # d dt / d(dtraw + dt_bias) (clamp mask times softplus')
    var o_eoff: Int  # exp(S_i(-1))
    var o_elast: Int  # exp(S_last(j)) dt_j
    var o_pdtb: Int  # per (row, head, token) terms of d dt_bias, d A, d D
    var o_pa: Int
    var o_pd: Int
    var o_cb: Int  # (ng, B, Q, Q): per B/C group
    var o_dcb: Int  # (ng, B, Q, Q)
    var o_y: Int  # (rows, di)
    var o_yg: Int
    var o_g: Int
    var o_dg: Int
    var o_dy: Int
    var o_pgn: Int  # gated norm weight terms
    var o_dzx: Int  # (rows, npj)
    var o_dcx: Int  # (rows, cd) d post-SiLU xBC, then d pre-activation
    var o_dxn: Int  # (rows, d)
    var o_pn: Int  # (rows, d)
    var o_scr: Int  # (B H, SCR)
    var o_scr2: Int  # (B ceil(Q/16), Q)
    var floats: Int

    def __init__(out self, args: I64Ptr):
        self.dims = M2Dims(arg_int(args, BW_D), ng=blob_ngroups(arg_f32(args, BW_BLOB)))
        self.b = arg_int(args, BW_B)
        self.l = arg_int(args, BW_L)
        self.n0 = arg_int(args, BW_N0)
        self.stated = arg_int(args, BW_STATED) != 0
        self.lens = arg_int(args, BW_LENGTHS)
        # chunks of the rows "n0 state rows, then the L tokens", aligned to
        # absolute positions as the forward's; n0 = 0: ceil(L / Q)
        self.nch = ceil_div(self.n0 + self.l, Q)
        var b = self.b
        var d = self.dims.d
        var di = self.dims.di
        var cd = self.dims.cd
        var npj = self.dims.npj
        var nh = self.dims.nh
        var rows = b * min(Q, self.n0 + self.l)
        var hs = b * nh * P * N
        var regions = Regions()
        self.o_ckh = regions.take(self.nch * hs)
        self.o_dh = regions.take(2 * hs)
        self.o_dpc = regions.take(b * 3 * cd)
        self.o_xn = regions.take(rows * d)
        self.o_xnp = regions.take(b * 3 * d)
        self.o_gch = regions.take(rows * d)
        self.o_zx = regions.take(rows * npj)
        self.o_zxp = regions.take(b * 3 * npj)
        self.o_pre = regions.take(rows * cd)
        self.o_cx = regions.take(rows * cd)
        var hq = b * nh * Q
        self.o_dt = regions.take(hq)
        self.o_da = regions.take(hq)
        self.o_sg = regions.take(hq)
        self.o_eoff = regions.take(hq)
        self.o_elast = regions.take(hq)
        self.o_pdtb = regions.take(hq)
        self.o_pa = regions.take(hq)
        self.o_pd = regions.take(hq)
        self.o_cb = regions.take(self.dims.ng * b * Q * Q)
        self.o_dcb = regions.take(self.dims.ng * b * Q * Q)
        self.o_y = regions.take(rows * di)
        self.o_yg = regions.take(rows * di)
        self.o_g = regions.take(rows * di)
        self.o_dg = regions.take(rows * di)
        self.o_dy = regions.take(rows * di)
        self.o_pgn = regions.take(rows * di)
        self.o_dzx = regions.take(rows * npj)
        self.o_dcx = regions.take(rows * cd)
        self.o_dxn = regions.take(rows * d)
        self.o_pn = regions.take(rows * d)
        self.o_scr = regions.take(b * nh * SCR)
        self.o_scr2 = regions.take(b * ceil_div(Q, ROWS_PER_TASK) * Q)
        self.floats = regions.end

    def tok0(self, c: Int) -> Int:
        """The first token of chunk c."""
        return max(0, c * Q - self.n0)

    def s0(self, c: Int) -> Int:
        """State rows in front of chunk c's tokens (n0 in chunk 0)."""
        return self.n0 if c == 0 else 0

    def nt(self, c: Int) -> Int:
        """Tokens of chunk c (at least 1: n0 < Q and L >= 1)."""
        return min(self.l, (c + 1) * Q - self.n0) - self.tok0(c)

    def nc(self, c: Int) -> Int:
        """Rows of chunk c: its state rows, then its tokens. Row arrays of
        the scan (cx, pre, dcx; the (B, H, Q) rows, CB, dCB) hold rows
        bb * nc + j; token arrays (xn, zx, y, dy, dzx, ...) hold only the
        tokens, bb * nt + t (row j = s0 + t)."""
        return self.s0(c) + self.nt(c)

    def chunk(self, c: Int) -> M2Chunk:
        """Chunk c's rows (tok0, s0, nt, nc)."""
        return M2Chunk(self.s0(c), self.nt(c), self.nc(c), self.tok0(c))

    def fold_terms(self, args: I64Ptr, c: Int) -> Bool:
        """May dh at the end of chunk c be nonzero (not the last chunk, or a
        full last chunk with the final h's cotangent)? Then its h_end terms
        run."""
        return c < self.nch - 1 or (self.has(args, BW_C_H) and not self.last_open(c))

    def last_open(self, c: Int) -> Bool:
        """Is chunk c the final state's open chunk (the last chunk, not
        full: the final h is its start state, its rows the final buffers)?"""
        return c == self.nch - 1 and self.nc(c) < Q

    def has(self, args: I64Ptr, slot: Int) -> Bool:
        """A state slot is given (stated call, non-null array)."""
        return self.stated and arg_int(args, slot) != 0

    def pad(self, bb: Int, t: Int) -> Bool:
        """Is token t of row bb padding (ragged rows)?"""
        return self.lens != 0 and t >= Int(I64Ptr(unsafe_from_address=self.lens)[unsafe_offset=bb])

    def qq(self, g: Int, bb: Int) -> Int:
        """Offset of group g's (Q, Q) block of row bb in o_cb / o_dcb."""
        return (g * self.b + bb) * Q * Q

    def hq(self, bb: Int, hh: Int) -> Int:
        """Offset of row bb, head hh in a (B, H, Q) array."""
        return (bb * self.dims.nh + hh) * Q
