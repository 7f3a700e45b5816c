"""Mamba-3 SISO block: sizes, argument slots, the weight blob's and the
workspace's layouts (mamba3/forward.mojo runs the block, mamba3/scan.mojo its scan;
the backward modules share these)."""
from std.sys import is_defined
from ..abi import F32Ptr, I64Ptr, ALIGN_FLOATS, round_up, ceil_div, arg_int, arg_i64
from ..regions import Regions
from ..linear import packed_floats
from ..block_prepare import Projection, PreparedBlob
from ..weight_panels import section_format, ALL_F32
from ..block_slots import PREP_D, PREP_NORM, PREP_IN, FWD_B, FWD_L, FWD_D, FWD_X, FWD_Y, FWD_BLOB

comptime NST = 128  # N, q/k head dimension
comptime HP = 64  # P, v head dimension
comptime NANG = 32  # rotary angles
comptime QC = 64  # chunk size
comptime A_FLOOR: Float32 = 1e-4
comptime PI_F32: Float32 = 3.1415927410125732

# OP_M3_PREPARE argument slots (after block_slots' PREP_D, PREP_NORM, PREP_IN).
comptime PREP_DTB = 3
comptime PREP_BNW = 4
comptime PREP_CNW = 5
comptime PREP_BB = 6
comptime PREP_CB = 7
comptime PREP_DSKIP = 8
comptime PREP_OUT = 9
comptime PREP_BLOB = 10
comptime PREP_WFMT = 11  # projection formats word (weight_panels.mojo); 0: all float32
comptime PREP_IN_EXP = 12  # int8: int32 exponents, one per row
comptime PREP_OUT_EXP = 13

# The projections' sections (blob header words, formats word nibbles), in
# the order of the *_EXP slots.
comptime SEC_IN = 0
comptime SEC_OUT = 1
comptime NPROJ = 2

# OP_M3_FORWARD argument slots (after block_slots' FWD_B ... FWD_BLOB).
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
# 0, or int64 (B,): each row's own buffered_tokens on entry (then FWD_N0 is
# 0 and nothing is pending): rows at different positions of their chunks
# step in one call (continuous batching), each row exactly as alone.
comptime FWD_ROW_N0 = 25

comptime ST_NORM = 0
comptime ST_INPROJ = 1
comptime ST_BCNORM = 2
comptime ST_SCAN = 3
comptime ST_OUTPROJ = 4
comptime NSTAGES = 5

comptime NG = 8  # rows whose RMSNorm sums advance side by side
# B/C norms and gates: small tasks, so a few rows (a decode step) still
# spread over the threads
comptime BC_ROWS_PER_TASK = 4
# Rows (batch rows x tokens) per pass. 1024 holds a whole chunk of tokens
# per pass up to B = 16, so the scan batches its dot products over chunks;
# the workspace is then about 17 MB at d = 768 (one per calling thread).
comptime MAX_CHUNK_ROWS = 1024
# Scratch of one (row, head) scan task, in floats.
comptime S_QU = 0  # (128) unrotated q of one token
comptime S_KU = S_QU + NST  # (128) unrotated k
comptime S_W = S_KU + NST  # (64) chunk weights of one token
comptime S_SC = S_W + QC  # (64) scale_j = gamma_j + beta_j of the rows j < last
comptime S_DIAG = S_SC + QC  # (64) (q . k) gamma per token of a segment
comptime S_HQ = S_DIAG + QC  # (64, 64) q_u . h[p]; the fold's w_j v_j[p]
# (QC + SEG_G, SEG_G) exp(seg) scale_j of SEG_G tokens side by side
# (scan._seg_table: their seg sums advance in step, not one chain at a time)
comptime SEG_G = 8
comptime S_WT = S_HQ + QC * HP
comptime S_QK = S_WT + (QC + SEG_G) * SEG_G  # (64, 64) q_u . k_j
# a scan task's scratch: S_QK plus one q . k row per token of its longest
# segment (min(tokens per pass, QC)); a decode step needs one row
comptime FOLD_SCR = S_HQ + QC * HP  # what a fold alone needs (reports)
# A scan task of a long pass (COPY_TOKENS or more tokens: B <= 16 at 1024
# rows) works on a contiguous copy of its head's working-chunk k and v
# rows, then dt, sg, adt, at S_CHUNK: in the state a head's rows are 12 KB
# apart, so all of them fall in the same few cache sets, and the fold and
# the q . k and output loops, which pass over them again and again, kept
# evicting them (AVX2 scan of a d = 768 pass: 128 tokens 25%, 64 tokens 16%
# slower). q rows stay in the state: only the current segment's are read,
# a few at a time. On a CPU such a task runs a few heads of its row in turn
# on one scratch (M3Work.scan_heads), so a pass has at most about COPY_TASKS
# of these 87 KB scratches (B = 8: 48 tasks of 4 heads).
# Short passes (decode) keep the smaller scratch and work in the state.
comptime COPY_TOKENS = QC
comptime COPY_TASKS = 48
comptime S_CHUNK = S_QK + QC * QC
comptime CHUNK_COPY = QC * (NST + HP + 3)

comptime V16 = SIMD[DType.float32, 16]


struct M3Dims(ImplicitlyCopyable, PreparedBlob):
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
    var wfs: Int  # the projections' formats word (weight_panels.mojo)
    var wf_in: Int  # each projection's format (linear.WF_*)
    var wf_out: Int

    def __init__(out self, d: Int, wfs: Int = ALL_F32):
        self.d = d
        self.wfs = wfs
        self.wf_in = section_format(wfs, SEC_IN)
        self.wf_out = section_format(wfs, SEC_OUT)
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
        var regions = Regions(ALIGN_FLOATS)  # header: the weight formats (weight_panels.mojo)
        self.o_norm = regions.take(d)
        self.o_in = regions.take_exact(packed_floats(self.np, d, self.wf_in))
        self.o_out = regions.take_exact(packed_floats(d, self.di, self.wf_out))
        self.o_dtb = regions.take(self.nh)
        self.o_bnw = regions.take_exact(NST)
        self.o_cnw = regions.take_exact(NST)
        self.o_bb = regions.take_exact(self.nh * NST)
        self.o_cb = regions.take_exact(self.nh * NST)
        self.o_dskip = regions.take(self.nh)
        self.blob = regions.end

    def projection(self, sec: Int) -> Projection:
        """Projection sec (SEC_*) as the prepare op packs it."""
        if sec == SEC_IN:
            return Projection(PREP_IN, PREP_IN_EXP, self.np, self.d, self.wf_in, self.o_in)
        return Projection(PREP_OUT, PREP_OUT_EXP, self.d, self.di, self.wf_out, self.o_out)


struct M3Work(ImplicitlyCopyable):
    var b: Int
    var l: Int
    var tc: Int
    var nchunks: Int
    var o_xn: Int  # (rows, d), reused for the out_proj result
    var o_proj: Int  # (rows, np); the scan's output o replaces its z columns
    var o_scr: Int  # (scan_tasks, scr)
    var scr: Int  # floats of one scan task's scratch
    var scan_heads: Int  # heads of one row a scan task runs in turn
    var scan_tasks: Int  # B * ceil(H / scan_heads)
    var floats: Int

    def __init__(out self, dims: M3Dims, b: Int, l: Int):
        self.b = b
        self.l = l
        self.tc = max(1, min(l, MAX_CHUNK_ROWS // b))
        self.nchunks = ceil_div(l, self.tc)
        var rows = b * self.tc
        var regions = Regions()
        self.o_xn = regions.take(rows * dims.d)
        self.o_proj = regions.take(rows * dims.np)
        self.scr = S_QK + min(self.tc, QC) * QC
        self.scan_heads = 1
        if self.tc >= COPY_TOKENS:
            self.scr = S_CHUNK + CHUNK_COPY
            comptime if not is_defined["GPU_API"]():  # a GPU wants a thread per head
                self.scan_heads = ceil_div(dims.nh, max(1, min(dims.nh, COPY_TASKS // b)))
        self.scan_tasks = b * ceil_div(dims.nh, self.scan_heads)
        self.o_scr = regions.take_exact(self.scan_tasks * self.scr)
        self.floats = regions.end

    def chunk_tokens(self, c: Int) -> Int:
        return min(self.tc, self.l - c * self.tc)


def n0_of(args: I64Ptr, bb: Int) -> Int:
    """Row bb's buffered tokens on entry (FWD_ROW_N0, else FWD_N0)."""
    if arg_int(args, FWD_ROW_N0) != 0:
        return Int(arg_i64(args, FWD_ROW_N0)[unsafe_offset=bb])
    return arg_int(args, FWD_N0)


def count_after(n0: Int, k: Int) -> Int:
    """buffered_tokens after k more tokens from n0."""
    if k == 0:
        return n0
    return (n0 + k - 1) % QC + 1

