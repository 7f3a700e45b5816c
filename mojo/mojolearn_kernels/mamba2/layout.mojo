"""Mamba-2 kernel layout: sizes, argument slots, the prepared weight blob,
the per-call workspace and the decoded arguments of one forward call.
Mirrored in python/mojolearn/mamba/mamba2.py (slot numbers)."""
from ..abi import F32Ptr, I64Ptr, ALIGN_FLOATS, arg_int, arg_f32, arg_i64, ceil_div
from ..regions import Regions
from ..linear import packed_floats
from ..block_prepare import Projection, PreparedBlob
from ..weight_panels import blob_formats, section_format, blob_option_int, ALL_F32
from ..block_slots import PREP_D, PREP_NORM, PREP_IN, FWD_B, FWD_L, FWD_D, FWD_X, FWD_Y, FWD_BLOB

comptime P = 64  # head dim
comptime N = 128  # state size
comptime Q = 256  # chunk
comptime KCONV = 4
comptime VW = 16
comptime V = SIMD[DType.float32, VW]

# OP_M2_PREPARE argument slots (after block_slots' PREP_D, PREP_NORM, PREP_IN).
comptime PREP_CONVW = 3
comptime PREP_CONVB = 4
comptime PREP_DTB = 5
comptime PREP_ALOG = 6
comptime PREP_DSKIP = 7
comptime PREP_GNORM = 8
comptime PREP_OUT = 9
comptime PREP_LO = 10  # float32 bits of dt_limit[0] (as a signed int32)
comptime PREP_HI = 11
comptime PREP_BLOB = 12
comptime PREP_WFMT = 13  # projection formats word (weight_panels.mojo); 0: all float32
comptime PREP_IN_EXP = 14  # int8: int32 exponents, one per row
comptime PREP_OUT_EXP = 15
comptime PREP_A_GIVEN = 16  # 1: the A_log slot holds A itself (GGUF's -exp(A_log)), copied
# n_groups of B and C (0 reads as 1); recorded in the blob header's option
# word, so every op on the blob sees the same value.
comptime PREP_NGROUPS = 17

# The projections' sections (blob header words, formats word nibbles), in
# the order of the *_EXP slots.
comptime SEC_IN = 0
comptime SEC_OUT = 1
comptime NPROJ = 2

# OP_M2_FORWARD argument slots (after block_slots' FWD_B ... FWD_BLOB).
# (FWD_L may be 0: no new token, the h_last report of a state)
comptime FWD_CONV_WINDOW = 6
comptime FWD_H = 7  # 0: no state (zeros, nothing saved)
comptime FWD_BUF_XBC = 8
comptime FWD_BUF_DT = 9
comptime FWD_S = 10  # buffered_tokens of the state
comptime FWD_LENGTHS = 11  # 0: every row has length L
comptime FWD_HLAST = 12  # 0: no h_last report
comptime FWD_SAVE = 13  # 1: write the conv window and buffers back
comptime FWD_WORK = 14
comptime FWD_CACHE = 15  # 0, or a decode session's cache (see M2Call.hcache)
# 0, or int64 (B,): each row's own buffered_tokens (then FWD_S is 0). Only
# for one-token steps (L = 1) with a state: rows at different positions of
# their chunks decode in one call (continuous batching), each row exactly as
# it would alone.
comptime FWD_ROW_S = 16

# Stages of one chunk.
comptime ST_NORM = 0
comptime ST_INPROJ = 1
comptime ST_CONV = 2
comptime ST_CB = 3
comptime ST_SSD = 4
comptime ST_GNORM = 5
comptime ST_OUTPROJ = 6
comptime NSTAGES = 7

# A chunk's new rows are processed in groups of at most this many rows in
# all (B rows x G tokens), to bound the workspace; grouping never changes an
# operand, so it never changes a bit.
comptime MAX_GROUP_ROWS = 256
comptime CB_ROWS_PER_TASK = 16
# Up to this many new rows per chunk (decode), CB is computed from the
# row-major B rows (8 interleaved scalar chains) instead of a transposed B.
comptime DIRECT_CB_MAX = 8
# Rows per register tile of the prefill SSD (mamba2/ssd_tiles.mojo) and its
# scratch: TR decay-sum rows, TR weight rows (Q each), TR Ydiag and TR Yoff
# rows (P each).
comptime TR = 4
comptime TILE_SCR = TR * (2 * Q + 2 * P)
# Per SSD task (one row and head; kept across the groups of a chunk): seg
# row, w row, h transposed (valid from the chunk's first group to its fold),
# the tile scratch.
comptime SCR = 2 * Q + N * P + TILE_SCR
# Decode session cache, per batch row: for each head a marker float and h
# transposed (N, P); then a count float and the open chunk's B rows
# transposed (ng N, Q); then for each head a count float and the dt and dA rows
# of the open chunk (Q each); then for each head a count float and the open
# chunk's x rows of that head (Q rows of P). Copies of state values only (or
# of values computed from them by the same functions), laid out so one-token
# steps run the same fma chains vectorized instead of gathering lanes, and
# compute the dt of a buffered row once per chunk instead of at every step; a
# marker or count is 0 when the copy must be rebuilt (new session, reload,
# fold) and counts past the current row mean a new chunk began (ssd.held_rows
# for the B and x rows). The x rows are a head-major copy because a step
# reads one head's rows as one contiguous run: from the state's rows (256
# bytes every cd floats) a batch-8 step's reads stayed out of the last-level
# cache.
comptime CACHE_HDR = 16
comptime CACHE_HEAD = CACHE_HDR + N * P
comptime CACHE_DT = CACHE_HDR + 2 * Q
comptime CACHE_X = CACHE_HDR + Q * P


def cache_floats_per_row(nh: Int, ng: Int) -> Int:
    return nh * CACHE_HEAD + CACHE_HDR + ng * N * Q + nh * CACHE_DT + nh * CACHE_X


def blob_ngroups(blob: F32Ptr) -> Int:
    """n_groups a prepare op recorded in blob (1 for none or a null blob)."""
    return max(1, blob_option_int(blob))


struct M2Dims(ImplicitlyCopyable, PreparedBlob):
    """Sizes of a Mamba-2 block and the layout of its prepared weight blob."""
    var d: Int
    var di: Int
    var nh: Int
    var ng: Int  # groups of B and C; head hh reads group hh // hpg
    var hpg: Int  # heads per group
    var gs: Int  # channels of d_inner per group (the gated norm's groups)
    var cd: Int  # x | B (ng N) | C (ng N)
    var npj: Int  # in_proj outputs: z | xBC | dtraw
    var o_norm: Int
    var o_in: Int
    var o_convw: Int  # (4, cd) tap-major
    var o_convb: Int
    var o_dtb: Int
    var o_a: Int  # -exp(A_log)
    var o_dskip: Int
    var o_gnorm: Int
    var o_out: Int
    var o_lim: Int  # lo, hi
    var blob: Int
    var wfs: Int  # the projections' formats word (weight_panels.mojo)
    var wf_in: Int  # each projection's format (linear.WF_*)
    var wf_out: Int

    def __init__(out self, d: Int, wfs: Int = ALL_F32, ng: Int = 1):
        self.d = d
        self.di = 2 * d
        self.nh = self.di // P
        self.ng = max(1, ng)
        self.hpg = max(1, self.nh // self.ng)
        self.gs = self.di // self.ng
        self.cd = self.di + 2 * self.ng * N
        self.npj = 2 * self.di + 2 * self.ng * N + self.nh
        self.wfs = wfs
        self.wf_in = section_format(wfs, SEC_IN)
        self.wf_out = section_format(wfs, SEC_OUT)
        var regions = Regions(ALIGN_FLOATS)  # header: the weight formats (weight_panels.mojo)
        self.o_norm = regions.take(d)
        self.o_in = regions.take_exact(packed_floats(self.npj, d, self.wf_in))
        self.o_convw = regions.take(KCONV * self.cd)
        self.o_convb = regions.take(self.cd)
        self.o_dtb = regions.take(self.nh)
        self.o_a = regions.take(self.nh)
        self.o_dskip = regions.take(self.nh)
        self.o_gnorm = regions.take(self.di)
        self.o_out = regions.take_exact(packed_floats(d, self.di, self.wf_out))
        self.o_lim = regions.take(2)
        self.blob = regions.end

    def projection(self, sec: Int) -> Projection:
        """Projection sec (SEC_*) as the prepare op packs it."""
        if sec == SEC_IN:
            return Projection(PREP_IN, PREP_IN_EXP, self.npj, self.d, self.wf_in, self.o_in)
        return Projection(PREP_OUT, PREP_OUT_EXP, self.d, self.di, self.wf_out, self.o_out)

    @always_inline
    def group(self, hh: Int) -> Int:
        """The group of B and C head hh reads."""
        return hh // self.hpg

    @always_inline
    def bcol(self, g: Int) -> Int:
        """Column of group g's B in an xBC row."""
        return self.di + g * N

    @always_inline
    def ccol(self, g: Int) -> Int:
        """Column of group g's C in an xBC row."""
        return self.di + (self.ng + g) * N


struct M2Work(ImplicitlyCopyable):
    """Chunk geometry and workspace layout of one forward call.

    Virtual rows: the s buffered rows of the open chunk, then the L new
    tokens; chunk c covers virtual rows [c Q, c Q + rows(c)). Its new rows
    are processed in groups of g tokens per row: group arrays are
    (B, gn, ...) b-major (dense, for the matrix products); chunk arrays are
    indexed by the row inside the chunk (cx by the new-row index).
    """
    var b: Int
    var l: Int
    var s: Int
    var nch: Int
    var nn: Int  # most new rows of one chunk
    var g: Int  # tokens per row in one group
    var o_win: Int  # (B, 4, cd) conv window, tap-major
    var o_h: Int  # (B, H, P, N) SSM state when there is no caller state
    var o_xn: Int  # (B g, d) norm output; reused for the out_proj result
    var o_zx: Int  # (B g, npj) in_proj output
    var o_cx: Int  # (B nn, cd) post-conv post-SiLU xBC of the chunk's new rows
    var o_draw: Int  # (B, H, Q) raw dt of the chunk's new rows
    var o_dt: Int  # (B, H, Q) dt of every chunk row (M2Call.dt_row)
    var o_da: Int  # (B, H, Q) dA = dt * A of every chunk row
    var o_bt: Int  # (B, ng N, Q) B transposed
    var o_cb: Int  # (ng, B g, Q) C_i . B_j of the group's rows i, per B/C group
    var o_yg: Int  # (B g, di) gated y, then g (normed in place)
    var o_scr: Int  # (B H, SCR) SSD task scratch
    var floats: Int

    def __init__(out self, dims: M2Dims, b: Int, l: Int, s: Int, has_state: Bool):
        self.b = b
        self.l = l
        self.s = s
        self.nch = max(1, ceil_div(s + l, Q))
        self.nn = max(1, min(l, Q))
        self.g = max(1, min(self.nn, MAX_GROUP_ROWS // b))
        var rows = b * self.g
        var regions = Regions()
        self.o_win = regions.take(b * KCONV * dims.cd)
        self.o_h = regions.take(b * dims.nh * P * N if not has_state else 0)
        self.o_xn = regions.take(rows * dims.d)
        self.o_zx = regions.take(rows * dims.npj)
        self.o_cx = regions.take(b * self.nn * dims.cd)
        self.o_draw = regions.take(b * dims.nh * Q)
        self.o_dt = regions.take(b * dims.nh * Q)
        self.o_da = regions.take(b * dims.nh * Q)
        self.o_bt = regions.take(b * dims.ng * N * Q)
        self.o_cb = regions.take(dims.ng * rows * Q)
        self.o_yg = regions.take(rows * dims.di)
        self.o_scr = regions.take(b * dims.nh * SCR)
        self.floats = regions.end

    def rows(self, c: Int) -> Int:
        """Rows of chunk c (buffered and new)."""
        return min(Q, self.s + self.l - c * Q)

    def i0(self, c: Int) -> Int:
        """First new row of chunk c."""
        return self.s if c == 0 else 0

    def nnew(self, c: Int) -> Int:
        return self.rows(c) - self.i0(c)

    def t0(self, c: Int) -> Int:
        """Token index (in x) of the first new row of chunk c."""
        return 0 if c == 0 else c * Q - self.s

    def ngroups(self, c: Int) -> Int:
        """Groups of chunk c (one, possibly empty, when it has no new row:
        the h_last report of a state)."""
        return max(1, ceil_div(self.nnew(c), self.g))

    def ngroups_total(self) -> Int:
        var n = 0
        for c in range(self.nch):
            n += self.ngroups(c)
        return n

    def group(self, idx: Int) -> M2Group:
        """The idx-th group of the call (chunks in order)."""
        var k = idx
        var c = 0
        while k >= self.ngroups(c):
            k -= self.ngroups(c)
            c += 1
        return M2Group(self, c, k)


struct M2Group(ImplicitlyCopyable):
    """Group k of chunk c: new rows [i0 + gs, i0 + gs + gn) of the chunk
    (gn per batch row). The conv phase of a group also prepares chunk rows
    [lo, hi): from 0 for the first group (the buffered rows), else from the
    group's first row."""
    var c: Int
    var k: Int
    var i0: Int  # first new row of the chunk
    var n_c: Int  # rows of the chunk
    var nnew: Int  # new rows of the chunk
    var gs: Int  # offset of the group among the chunk's new rows
    var gn: Int  # rows of the group (per batch row)
    var t0: Int  # token index (in x) of the group's first row
    var lo: Int
    var hi: Int
    var last: Bool  # the chunk's last group (fold, report)

    def __init__(out self, wk: M2Work, c: Int, k: Int):
        self.c = c
        self.k = k
        self.i0 = wk.i0(c)
        self.n_c = wk.rows(c)
        self.nnew = wk.nnew(c)
        self.gs = k * wk.g
        self.gn = max(0, min(wk.g, self.nnew - self.gs))
        self.t0 = wk.t0(c) + self.gs
        self.lo = 0 if k == 0 else self.i0 + self.gs
        self.hi = self.i0 + self.gs + self.gn
        self.last = k == wk.ngroups(c) - 1


struct XRows(ImplicitlyCopyable):
    """Where one batch row's post-conv xBC rows (cd floats each) of a chunk
    live: rows i < nbuf in buf (a state's buffered rows, row 0 first), the
    others in new (its first row is chunk row i0); bo and co: the columns
    of the B and C group the reader uses. The SSD functions
    (mamba2/ssd.mojo) read rows only through this, so the forward and the
    backward's recompute run the same code on their own memory."""
    var buf: F32Ptr
    var nbuf: Int
    var new: F32Ptr
    var i0: Int
    var cd: Int
    var bo: Int
    var co: Int

    def __init__(out self, buf: F32Ptr, nbuf: Int, new: F32Ptr, i0: Int, dims: M2Dims, g: Int):
        self.buf = buf
        self.nbuf = nbuf
        self.new = new
        self.i0 = i0
        self.cd = dims.cd
        self.bo = dims.bcol(g)
        self.co = dims.ccol(g)

    @always_inline
    def row(self, i: Int) -> F32Ptr:
        if i < self.nbuf:
            return self.buf.unsafe_offset(i * self.cd)
        return self.new.unsafe_offset((i - self.i0) * self.cd)

    @always_inline
    def run_end(self, i: Int, end: Int) -> Int:
        """End (<= end) of the rows from i that lie in the same memory as
        row i, cd floats apart (so a loop can step a pointer)."""
        if i < self.nbuf:
            return min(end, self.nbuf)
        return end


struct M2Call(ImplicitlyCopyable):
    """The arguments of one forward call, decoded once per task."""
    var dims: M2Dims
    var wk: M2Work
    var has_state: Bool
    var ragged: Bool
    var has_hlast: Bool
    var save: Bool
    var x: F32Ptr
    var y: F32Ptr
    var blob: F32Ptr
    var cw: F32Ptr
    var h: F32Ptr
    var bufx: F32Ptr
    var bufd: F32Ptr
    var lens: I64Ptr
    var hlast: F32Ptr
    var work: F32Ptr
    var cache: F32Ptr
    var has_cache: Bool
    var row_s: I64Ptr
    var per_row: Bool

    def __init__(out self, args: I64Ptr):
        var blob = arg_f32(args, FWD_BLOB)
        self.dims = M2Dims(arg_int(args, FWD_D), blob_formats(blob), blob_ngroups(blob))
        self.has_state = arg_int(args, FWD_H) != 0
        var s = arg_int(args, FWD_S) if self.has_state else 0
        self.wk = M2Work(self.dims, arg_int(args, FWD_B), arg_int(args, FWD_L), s,
                         self.has_state)
        self.ragged = arg_int(args, FWD_LENGTHS) != 0
        self.has_hlast = arg_int(args, FWD_HLAST) != 0
        self.save = self.has_state and arg_int(args, FWD_SAVE) != 0
        self.x = arg_f32(args, FWD_X)
        self.y = arg_f32(args, FWD_Y)
        self.blob = arg_f32(args, FWD_BLOB)
        self.cw = arg_f32(args, FWD_CONV_WINDOW)
        self.h = arg_f32(args, FWD_H)
        self.bufx = arg_f32(args, FWD_BUF_XBC)
        self.bufd = arg_f32(args, FWD_BUF_DT)
        self.lens = arg_i64(args, FWD_LENGTHS)
        self.hlast = arg_f32(args, FWD_HLAST)
        self.work = arg_f32(args, FWD_WORK)
        self.has_cache = arg_int(args, FWD_CACHE) != 0
        self.cache = arg_f32(args, FWD_CACHE)
        self.row_s = arg_i64(args, FWD_ROW_S)
        self.per_row = self.has_state and arg_int(args, FWD_ROW_S) != 0

    def s_of(self, bb: Int) -> Int:
        """Buffered tokens of row bb on entry."""
        if self.per_row:
            return Int(self.row_s[unsafe_offset=bb])
        return self.wk.s

    def row_work(self, bb: Int) -> M2Work:
        """The call's chunk bookkeeping as row bb sees it (its own position
        with FWD_ROW_S; the layout offsets do not depend on it)."""
        if self.per_row:
            return M2Work(self.dims, self.wk.b, self.wk.l, self.s_of(bb), self.has_state)
        return self.wk

    def row_group(self, gp: M2Group, bb: Int) -> M2Group:
        """Group gp as row bb sees it (gp itself unless rows have their own
        positions: a one-token step has one group, of chunk 0)."""
        if self.per_row:
            return M2Group(self.row_work(bb), gp.c, gp.k)
        return gp

    def vlen(self, bb: Int) -> Int:
        """Virtual rows of batch row bb (buffered + its real tokens)."""
        if self.ragged:
            return Int(self.lens[unsafe_offset=bb])
        return self.s_of(bb) + self.wk.l

    def xrows(self, bb: Int, c: Int, g: Int) -> XRows:
        """Post-conv xBC rows of row bb's chunk c: the state buffer's, then
        the new rows' (B and C of group g)."""
        var cd = self.dims.cd
        var s = self.s_of(bb)
        var i0 = s if c == 0 else 0  # M2Work.i0 for the row's own position
        return XRows(self.bufx.unsafe_offset(bb * Q * cd), s if c == 0 else 0,
                     self.work.unsafe_offset(self.wk.o_cx + bb * self.wk.nn * cd),
                     i0, self.dims, g)

    def xbc_row(self, bb: Int, c: Int, i: Int) -> F32Ptr:
        """Post-conv xBC of chunk row i: the state buffer or a new row."""
        return self.xrows(bb, c, 0).row(i)

    def dtraw(self, bb: Int, c: Int, i: Int, hh: Int) -> Float32:
        if c == 0 and i < self.s_of(bb):
            return self.bufd[unsafe_offset=(bb * Q + i) * self.dims.nh + hh]
        return self.work[unsafe_offset=self.wk.o_draw + (bb * self.dims.nh + hh) * Q + i]

    def hhome(self, bb: Int, hh: Int) -> F32Ptr:
        """Where head hh of row bb keeps h (the caller's state or the workspace)."""
        var off = (bb * self.dims.nh + hh) * P * N
        if self.has_state:
            return self.h.unsafe_offset(off)
        return self.work.unsafe_offset(self.wk.o_h + off)

    def hcache(self, bb: Int, hh: Int) -> F32Ptr:
        """Head hh of row bb in the decode cache: marker, then h^T (N, P)."""
        var base = bb * cache_floats_per_row(self.dims.nh, self.dims.ng)
        return self.cache.unsafe_offset(base + hh * CACHE_HEAD)

    def bcache(self, bb: Int) -> F32Ptr:
        """Row bb's open-chunk B^T in the decode cache: count, then (ng N, Q)."""
        var nh = self.dims.nh
        return self.cache.unsafe_offset(bb * cache_floats_per_row(nh, self.dims.ng)
                                        + nh * CACHE_HEAD)

    def dtcache(self, bb: Int, hh: Int) -> F32Ptr:
        """Head hh of row bb's open-chunk dt rows in the decode cache: count,
        then dt (Q), then dA (Q)."""
        return self.bcache(bb).unsafe_offset(CACHE_HDR + self.dims.ng * N * Q + hh * CACHE_DT)

    def xcache(self, bb: Int, hh: Int) -> F32Ptr:
        """Head hh of row bb's open-chunk x rows in the decode cache: count,
        then (Q, P)."""
        return self.dtcache(bb, self.dims.nh).unsafe_offset(hh * CACHE_X)

    def dt_cached(self, gp: M2Group) -> Bool:
        """Whether a group's dt and dA rows live in the decode cache (one-token
        steps of a session; gp as the row sees it) or in the workspace."""
        return self.has_cache and gp.nnew <= DIRECT_CB_MAX

    def dt_row(self, bb: Int, hh: Int, cached: Bool) -> F32Ptr:
        """dt of head hh of row bb, chunk rows 0..Q-1 (see dt_cached)."""
        if cached:
            return self.dtcache(bb, hh).unsafe_offset(CACHE_HDR)
        return self.work.unsafe_offset(self.wk.o_dt + (bb * self.dims.nh + hh) * Q)

    def da_row(self, bb: Int, hh: Int, cached: Bool) -> F32Ptr:
        """dA = dt * A of head hh of row bb (as dt_row)."""
        if cached:
            return self.dtcache(bb, hh).unsafe_offset(CACHE_HDR + Q)
        return self.work.unsafe_offset(self.wk.o_da + (bb * self.dims.nh + hh) * Q)
