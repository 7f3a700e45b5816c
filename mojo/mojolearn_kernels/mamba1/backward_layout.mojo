"""Mamba-1 backward: argument slots and the workspace layout (BWork). The
algorithm is described in mamba1/backward.mojo."""
from ..abi import I64Ptr, arg_int, ceil_div
from ..regions import Regions
from ..linear import packed_floats
from .forward import M1Dims, NSTATE, KCONV
from ..block_slots import BW_B, BW_L, BW_D, BW_X, BW_G, BW_BLOB, BW_WORK, BW_DX

# OP_M1_BACKWARD argument slots (after block_slots' BW_B ... BW_DX).
comptime BW_W_IN = 8  # row-major in_proj.weight (2di, d)
comptime BW_W_X = 9  # row-major x_proj.weight (nx, di)
comptime BW_W_DT = 10  # row-major dt_proj.weight (di, R)
comptime BW_W_OUT = 11  # row-major out_proj.weight (d, di)
comptime BW_G_NORM = 12  # gradient outputs, zero on entry, natural layouts
comptime BW_G_IN = 13
comptime BW_G_CONVW = 14  # (di, 4)
comptime BW_G_CONVB = 15
comptime BW_G_X = 16
comptime BW_G_DT = 17
comptime BW_G_DTB = 18
comptime BW_G_ALOG = 19  # (di, 16)
comptime BW_G_D = 20
comptime BW_G_OUT = 21
# Gradients through the state (each slot optional: 0 = absent). The forward
# being differentiated starts from (conv_window, h) and its final state gets
# the cotangents (gs_*); ragged rows end at their own length.
comptime BW_CONV_WINDOW = 22  # (B, di, 4) conv window at the start; 0: zeros
comptime BW_H = 23  # (B, di, 16) SSM state at the start; 0: zeros
comptime BW_GS_CONV = 24  # (B, di, 4) cotangent of the final conv window; 0: zeros
comptime BW_GS_H = 25  # (B, di, 16) cotangent of the final h; 0: zeros
comptime BW_LENGTHS = 26  # (B) int64 row lengths in [1, L]; 0: every row has L
comptime BW_G_CONV0 = 27  # (B, di, 4) out: gradient of the start conv window; 0: none
comptime BW_G_H0 = 28  # (B, di, 16) out: gradient of the start h; 0: none
comptime BW_NARGS = 29

comptime TC = 32  # tokens per chunk (fixed: the chunking is part of the order)
comptime LANES = 16
comptime LV = SIMD[DType.float32, LANES]
comptime ROWS_PER_TASK = 16
comptime CH_PER_TASK = 64

# Forward stages (pass A and B) and backward stages (pass B).
comptime F_NORM = 0
comptime F_INPROJ = 1
comptime F_CONV = 2
comptime F_XPROJ = 3
comptime F_BCDT = 4  # the B/C/dt norms (when the block has them)
comptime F_DTPROJ = 5
comptime F_SCAN = 6
comptime NF = 7
comptime B_OUT = 7  # dyg = g @ W_out; dW_out
comptime B_SCAN = 8  # selective scan VJP
comptime B_RED = 9  # dB/dC partials -> ddbc; ddtr; dW_dt; d dt_bias, dD, dA
comptime B_BCDT = 10  # ddbc through the B/C/dt norms, in place (when the block has them)
comptime B_XPROJ = 11  # du += ddbc @ W_x, dpre; dW_x
comptime B_CONV = 12  # dhid; dconv weight and bias
comptime B_INPROJ = 13  # dxn = dhg @ W_in; dW_in
comptime B_NORM = 14  # dx; norm weight contributions
comptime B_NORMW = 15  # d norm.weight
comptime NB = 16


struct BWork(ImplicitlyCopyable):
    """Workspace layout of one backward call (floats)."""
    var b: Int
    var l: Int
    var tc: Int
    var nchunks: Int
    var nblk: Int  # channel blocks of 16
    var o_ckh: Int  # (nchunks, B, 16, di) h at each chunk start
    var o_ckw: Int  # (nchunks, B, 4, di) conv window at each chunk start
    var o_dh: Int  # (B, 16, di) dh carried to the previous chunk
    var o_dpc: Int  # (B, 3, di) first 3 dpre rows of the following chunk
    var o_xn: Int  # (rows, d)
    var o_gch: Int  # (rows, d) grad_output rows of the chunk
    var o_hg: Int  # (rows, 2di)
    var o_pre: Int  # (rows, di) conv output before SiLU
    var o_u: Int
    var o_dbc: Int  # (rows, nx)
    var o_dbcr: Int  # (rows, nx) dbc before the B/C/dt norms (none without them)
    var o_v: Int  # (rows, di) softplus input
    var o_dl: Int
    var o_y: Int
    var o_yg: Int
    var o_hs: Int  # (B, nblk, tc, 16, 16) h after each token; then dA terms
    var o_dyg: Int
    var o_du: Int
    var o_dv: Int
    var o_ddc: Int  # (rows, di) dD terms
    var o_part: Int  # (rows, nblk, 32) dB | dC block partials
    var o_ddbc: Int  # (rows, nx)
    var o_dpre: Int
    var o_dhg: Int  # (rows, 2di)
    var o_dxn: Int  # (rows, d)
    var o_pn: Int  # (rows, d) norm weight terms
    var o_tin: Int  # W_in^T, W_out^T, W_x^T, W_dt^T in linear.mojo's panels
    var o_tout: Int
    var o_tx: Int
    var o_tdt: Int
    var floats: Int

    def __init__(out self, dims: M1Dims, b: Int, l: Int):
        self.b = b
        self.l = l
        self.tc = min(TC, l)
        self.nchunks = ceil_div(l, self.tc)
        self.nblk = ceil_div(dims.di, LANES)
        var rows = b * self.tc
        var d = dims.d
        var di = dims.di
        var regions = Regions()
        self.o_ckh = regions.take(self.nchunks * b * NSTATE * di)
        self.o_ckw = regions.take(self.nchunks * b * KCONV * di)
        self.o_dh = regions.take(b * NSTATE * di)
        self.o_dpc = regions.take(b * 3 * di)
        self.o_xn = regions.take(rows * d)
        self.o_gch = regions.take(rows * d)
        self.o_hg = regions.take(rows * 2 * di)
        self.o_pre = regions.take(rows * di)
        self.o_u = regions.take(rows * di)
        self.o_dbc = regions.take(rows * dims.nx)
        self.o_dbcr = regions.take(rows * dims.nx if dims.bcdt_eps != 0.0 else 0)
        self.o_v = regions.take(rows * di)
        self.o_dl = regions.take(rows * di)
        self.o_y = regions.take(rows * di)
        self.o_yg = regions.take(rows * di)
        self.o_hs = regions.take_exact(b * self.nblk * self.tc * NSTATE * LANES)
        self.o_dyg = regions.take(rows * di)
        self.o_du = regions.take(rows * di)
        self.o_dv = regions.take(rows * di)
        self.o_ddc = regions.take(rows * di)
        self.o_part = regions.take(rows * self.nblk * 2 * NSTATE)
        self.o_ddbc = regions.take(rows * dims.nx)
        self.o_dpre = regions.take(rows * di)
        self.o_dhg = regions.take(rows * 2 * di)
        self.o_dxn = regions.take(rows * d)
        self.o_pn = regions.take(rows * d)
        self.o_tin = regions.take_exact(packed_floats(d, 2 * di))
        self.o_tout = regions.take_exact(packed_floats(di, d))
        self.o_tx = regions.take_exact(packed_floats(di, dims.nx))
        self.o_tdt = regions.take_exact(packed_floats(dims.r, di))
        self.floats = regions.end

    def chunk_tokens(self, c: Int) -> Int:
        return min(self.tc, self.l - c * self.tc)


@always_inline
def row_length(args: I64Ptr, bb: Int) -> Int:
    """Tokens of row bb the forward runs over: its ragged length, else L."""
    var lens = arg_int(args, BW_LENGTHS)
    if lens == 0:
        return arg_int(args, BW_L)
    return Int(I64Ptr(unsafe_from_address=lens)[unsafe_offset=bb])
