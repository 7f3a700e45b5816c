"""Mamba-1 block: prepare (pack weights) and forward (prefill, continuation,
ragged rows and the one-token decode step are all this one operation).

Every token's output is computed by the same per-token formula whatever the
batch, the chunking of tokens into workspace rows, or the thread split:
    xn  = RMSNorm(x)                              (norms.mojo)
    hg  = in_proj @ xn          [hid | gate]      (linear.mojo)
    u   = silu(conv(hid))                          (conv.mojo)
    dbc = x_proj @ u            [dtr | B | C]
    (optional, Falcon-Mamba) dtr, B, C each = v * r, r = 1 / sqrt(mean(v^2)
        + eps): the weightless RMS norm (norms.mojo) with the eps the
        prepare op records in the blob (+0.0: no norms, the stage is empty)
    dl  = softplus(dt_proj @ dtr + dt_bias)
    per channel c, state n = 0..15 (sequential):
        h_n = fma(exp(dl * A_n), h_n, (dl * B_n) * u)
        y   = fma(C_n, h_n, y)                     (y starts at +0.0)
    y   = fma(u, D, y);  yg = y * silu(gate)
    out = x + out_proj @ yg
Tokens are processed in chunks of rows (B rows x Tc tokens) only to bound the
workspace; the chunking never changes an operation's operands.
Reference: mojolearn.reference.mamba1 (float64 NumPy); tests compare
against transformers' MambaBlock run in float64 (tests/reference/hf_mamba.py),
itself checked equal to it to 1e-10.
"""
from ..abi import (
    F32Ptr, I64Ptr, ALIGN_FLOATS, PHASE_END, PLAN_WORKSPACE, arg_int, arg_f32, arg_i64, ceil_div,
)
from ..residual import add_residual_tile
from ..regions import Regions
from ..linear import packed_floats, matmul_ntasks, matmul_task_wf
from ..weight_panels import (
    blob_formats, section_format, set_blob_option, blob_option_f32, ALL_F32,
)
from ..block_prepare import Projection, PreparedBlob, prepare_plan, pack_projection, set_blob_header
from ..numerics import exp_f32
from ..lanes import copy_floats, transpose_in, transpose_out
from .stages import M1Chunk, m1_stage, m1_stage_ntasks, RUN_FWD
from ..block_slots import PREP_D, PREP_NORM, PREP_IN, FWD_B, FWD_L, FWD_D, FWD_X, FWD_Y, FWD_BLOB

comptime NSTATE = 16
comptime KCONV = 4

# OP_M1_PREPARE argument slots (after block_slots' PREP_D, PREP_NORM, PREP_IN).
comptime PREP_CONVW = 3
comptime PREP_CONVB = 4
comptime PREP_X = 5
comptime PREP_DT = 6
comptime PREP_DTB = 7
comptime PREP_ALOG = 8
comptime PREP_D_SKIP = 9
comptime PREP_OUT = 10
comptime PREP_BLOB = 11
comptime PREP_WFMT = 12  # projection formats word (weight_panels.mojo); 0: all float32
comptime PREP_IN_EXP = 13  # int8: int32 exponents, one per row
comptime PREP_X_EXP = 14
comptime PREP_DT_EXP = 15
comptime PREP_OUT_EXP = 16
comptime PREP_BCDT_EPS = 17  # float32 bits of the B/C/dt norms' eps; 0: no norms
comptime PREP_A_GIVEN = 18  # 1: the A_log slot holds A itself (GGUF's -exp(A_log)), copied

# The projections' sections (blob header words, formats word nibbles), in
# the order of the *_EXP slots.
comptime SEC_IN = 0
comptime SEC_X = 1
comptime SEC_DT = 2
comptime SEC_OUT = 3
comptime NPROJ = 4

# OP_M1_FORWARD argument slots (after block_slots' FWD_B ... FWD_BLOB).
comptime FWD_CONV_WINDOW = 6  # 0: start from zeros, do not save
comptime FWD_H = 7  # 0: start from zeros, do not save
comptime FWD_LENGTHS = 8  # 0: every row has length L
comptime FWD_WORK = 9
comptime FWD_FLAGS = 10  # bit set of the FLAG_* below; 0 for a plain call

# A decode session keeps the state resident in its own workspace (in the
# kernel's layout) between steps, and converts only when it opens or syncs.
comptime FLAG_NO_LOAD = 1  # the workspace already holds the state
comptime FLAG_NO_SAVE = 2  # leave the state in the workspace
comptime FLAG_NO_TOKENS = 4  # only load and/or save the state

# Stages of one token chunk.
comptime ST_NORM = 0
comptime ST_INPROJ = 1
comptime ST_CONV = 2
comptime ST_XPROJ = 3
comptime ST_BCDT = 4  # the B/C/dt norms (no tasks when the block has none)
comptime ST_DTPROJ = 5
comptime ST_SCAN = 6
comptime ST_OUTPROJ = 7
comptime NSTAGES = 8

comptime CONV_CHANNELS_PER_TASK = 64
comptime SCAN_LANES = 16
comptime MAX_CHUNK_ROWS = 256


struct M1Dims(ImplicitlyCopyable, PreparedBlob):
    """Sizes of a Mamba-1 block and the layout of its prepared weight blob."""
    var d: Int
    var di: Int
    var r: Int  # dt_rank
    var nx: Int  # dt_rank + 2 * NSTATE: x_proj outputs
    var o_norm: Int
    var o_in: Int
    var o_convw: Int  # (4, di), tap-major
    var o_convb: Int
    var o_x: Int
    var o_dt: Int
    var o_dtb: Int
    var o_a: Int  # (16, di) = -exp(A_log) transposed
    var o_dskip: Int
    var o_out: Int
    var blob: Int  # floats
    var wfs: Int  # the projections' formats word (weight_panels.mojo)
    var wf_in: Int  # each projection's format (linear.WF_*)
    var wf_x: Int
    var wf_dt: Int
    var wf_out: Int
    var bcdt_eps: Float32  # eps of the B/C/dt norms; +0.0: none (read from the blob)

    def __init__(out self, d: Int, wfs: Int = ALL_F32):
        self.d = d
        self.bcdt_eps = 0.0
        self.di = 2 * d
        self.r = ceil_div(d, 16)
        self.nx = self.r + 2 * NSTATE
        self.wfs = wfs
        self.wf_in = section_format(wfs, SEC_IN)
        self.wf_x = section_format(wfs, SEC_X)
        self.wf_dt = section_format(wfs, SEC_DT)
        self.wf_out = section_format(wfs, SEC_OUT)
        var regions = Regions(ALIGN_FLOATS)  # header: the weight formats (weight_panels.mojo)
        self.o_norm = regions.take(d)
        self.o_in = regions.take_exact(packed_floats(2 * self.di, d, self.wf_in))
        self.o_convw = regions.take(KCONV * self.di)
        self.o_convb = regions.take(self.di)
        self.o_x = regions.take_exact(packed_floats(self.nx, self.di, self.wf_x))
        self.o_dt = regions.take_exact(packed_floats(self.di, self.r, self.wf_dt))
        self.o_dtb = regions.take(self.di)
        self.o_a = regions.take(NSTATE * self.di)
        self.o_dskip = regions.take(self.di)
        self.o_out = regions.take_exact(packed_floats(d, self.di, self.wf_out))
        self.blob = regions.end

    def projection(self, sec: Int) -> Projection:
        """Projection sec (SEC_*) as the prepare op packs it."""
        if sec == SEC_IN:
            return Projection(PREP_IN, PREP_IN_EXP, 2 * self.di, self.d, self.wf_in, self.o_in)
        if sec == SEC_X:
            return Projection(PREP_X, PREP_X_EXP, self.nx, self.di, self.wf_x, self.o_x)
        if sec == SEC_DT:
            return Projection(PREP_DT, PREP_DT_EXP, self.di, self.r, self.wf_dt, self.o_dt)
        return Projection(PREP_OUT, PREP_OUT_EXP, self.d, self.di, self.wf_out, self.o_out)


struct M1Work(ImplicitlyCopyable):
    """Workspace layout of one forward call over (B, L) tokens."""
    var b: Int
    var l: Int
    var tc: Int  # tokens per row in one chunk
    var nchunks: Int
    var o_xn: Int  # (rows, d); reused as the out_proj result
    var o_hg: Int  # (rows, 2 di)
    var o_u: Int  # (rows, di)
    var o_dbc: Int  # (rows, nx)
    var o_dl: Int  # (rows, di)
    var o_yg: Int  # (rows, di)
    var o_win: Int  # (B, 4, di) conv window, oldest first
    var o_ht: Int  # (B, 16, di) SSM state, state-major
    var floats: Int

    def __init__(out self, dims: M1Dims, b: Int, l: Int):
        self.b = b
        self.l = l
        self.tc = max(1, min(l, MAX_CHUNK_ROWS // b))
        self.nchunks = ceil_div(l, self.tc)
        var rows = b * self.tc
        var regions = Regions()
        self.o_xn = regions.take(rows * dims.d)
        self.o_hg = regions.take(rows * 2 * dims.di)
        self.o_u = regions.take(rows * dims.di)
        self.o_dbc = regions.take(rows * dims.nx)
        self.o_dl = regions.take(rows * dims.di)
        self.o_yg = regions.take(rows * dims.di)
        self.o_win = regions.take(b * KCONV * dims.di)
        self.o_ht = regions.take(b * NSTATE * dims.di)
        self.floats = regions.end

    def chunk_tokens(self, c: Int) -> Int:
        return min(self.tc, self.l - c * self.tc)


# ---------------------------------------------------------------- prepare


def m1_prepare_plan(args: I64Ptr, phase: Int) -> Int:
    var wfs = arg_int(args, PREP_WFMT)
    return prepare_plan(phase, wfs, NPROJ, M1Dims(arg_int(args, PREP_D), wfs).blob, NPROJ + 3)


def m1_prepare_task(args: I64Ptr, phase: Int, task: Int):
    var wfs = arg_int(args, PREP_WFMT)
    var dims = M1Dims(arg_int(args, PREP_D), wfs)
    var blob = arg_f32(args, PREP_BLOB)
    var d = dims.d
    var di = dims.di
    if task < NPROJ:
        pack_projection(args, dims, task, blob)
    elif task == NPROJ:
        var alog = arg_f32(args, PREP_ALOG)
        var given = arg_int(args, PREP_A_GIVEN) != 0
        for c in range(di):
            for n in range(NSTATE):
                var v = alog[unsafe_offset=c * NSTATE + n]
                blob[unsafe_offset=dims.o_a + n * di + c] = v if given else -exp_f32[1](v)
    elif task == NPROJ + 1:
        var cw = arg_f32(args, PREP_CONVW)
        for c in range(di):
            for k in range(KCONV):
                blob[unsafe_offset=dims.o_convw + k * di + c] = cw[unsafe_offset=c * KCONV + k]
    else:
        set_blob_header(blob, wfs, dims, NPROJ)
        set_blob_option(blob, arg_int(args, PREP_BCDT_EPS))
        copy_floats(arg_f32(args, PREP_NORM), blob.unsafe_offset(dims.o_norm), d)
        copy_floats(arg_f32(args, PREP_CONVB), blob.unsafe_offset(dims.o_convb), di)
        copy_floats(arg_f32(args, PREP_DTB), blob.unsafe_offset(dims.o_dtb), di)
        copy_floats(arg_f32(args, PREP_D_SKIP), blob.unsafe_offset(dims.o_dskip), di)


# ---------------------------------------------------------------- forward


def dims_of_blob(d: Int, blob: F32Ptr) -> M1Dims:
    """The block's sizes and blob layout, in the weight format and with the
    B/C/dt norms' eps its blob records."""
    var dims = M1Dims(d, blob_formats(blob))
    dims.bcdt_eps = blob_option_f32(blob)
    return dims


def forward_dims(args: I64Ptr) -> M1Dims:
    return dims_of_blob(arg_int(args, FWD_D), arg_f32(args, FWD_BLOB))


def m1_forward_plan(args: I64Ptr, phase: Int) -> Int:
    var dims = forward_dims(args)
    var b = arg_int(args, FWD_B)
    var wk = M1Work(dims, b, arg_int(args, FWD_L))
    if phase == PLAN_WORKSPACE:
        return wk.floats * 4
    var flags = arg_int(args, FWD_FLAGS)
    if phase == 0:
        return 0 if (flags & FLAG_NO_LOAD) != 0 else b
    var last = 1 + wk.nchunks * NSTAGES
    if phase == last:
        var save = arg_int(args, FWD_H) != 0 and (flags & FLAG_NO_SAVE) == 0
        return b if save else 0
    if phase > last:
        return PHASE_END
    if (flags & FLAG_NO_TOKENS) != 0:
        return 0
    var c = (phase - 1) // NSTAGES
    var stage = (phase - 1) % NSTAGES
    var nc = wk.chunk_tokens(c)
    if stage == ST_OUTPROJ:
        return matmul_ntasks(b * nc, dims.d)
    return m1_stage_ntasks(dims, stage, b, nc)


def m1_forward_task(args: I64Ptr, phase: Int, task: Int):
    var dims = forward_dims(args)
    var b = arg_int(args, FWD_B)
    var wk = M1Work(dims, b, arg_int(args, FWD_L))
    var work = arg_f32(args, FWD_WORK)
    if phase == 0:
        _load_state(args, dims, wk, work, task)
        return
    if phase == 1 + wk.nchunks * NSTAGES:
        _save_state(args, dims, wk, work, task)
        return
    var c = (phase - 1) // NSTAGES
    var stage = (phase - 1) % NSTAGES
    var t0 = c * wk.tc
    var nc = wk.chunk_tokens(c)
    var rows = b * nc
    var blob = arg_f32(args, FWD_BLOB)
    var xn = work.unsafe_offset(wk.o_xn)
    if stage == ST_OUTPROJ:
        var t = matmul_task_wf(dims.wf_out, task, work.unsafe_offset(wk.o_yg), dims.di, rows,
                               blob.unsafe_offset(dims.o_out), dims.di, dims.d, xn, dims.d)
        add_residual_tile(arg_f32(args, FWD_X), arg_f32(args, FWD_Y), xn, arg_int(args, FWD_L),
                          dims.d, arg_i64(args, FWD_LENGTHS), arg_int(args, FWD_LENGTHS) != 0,
                          t0, nc, t.r0, t.r1, t.c0, t.c1)
        return
    var win = work.unsafe_offset(wk.o_win)  # the state lives in the workspace
    var ht = work.unsafe_offset(wk.o_ht)
    var ch = M1Chunk(b=b, nc=nc, t0=t0, l=arg_int(args, FWD_L), x=arg_f32(args, FWD_X),
                     lens=arg_int(args, FWD_LENGTHS), xn=xn, hg=work.unsafe_offset(wk.o_hg),
                     u=work.unsafe_offset(wk.o_u), dbc=work.unsafe_offset(wk.o_dbc),
                     dl=work.unsafe_offset(wk.o_dl), yg=work.unsafe_offset(wk.o_yg),
                     win_in=win, win_out=win, h_in=ht, h_out=ht,
                     pre=xn, dbc_raw=xn, v=xn, y=xn, hs=xn, hs_tokens=0)  # no RUN_B arrays
    m1_stage[RUN_FWD](dims, blob, ch, stage, task)



def _load_state(args: I64Ptr, dims: M1Dims, wk: M1Work, work: F32Ptr, bb: Int):
    """Row bb: carried state (or zeros) into the workspace layouts (the
    window (4, di) and h^T (16, di)): 16 channels at a time, so each store
    is one contiguous vector (a transpose by single floats wrote 20
    scattered floats per channel: 290 us for a d=768 B=8 state)."""
    var di = dims.di
    var win = work.unsafe_offset(wk.o_win + bb * KCONV * di)
    var ht = work.unsafe_offset(wk.o_ht + bb * NSTATE * di)
    if arg_int(args, FWD_H) == 0:
        for i in range(KCONV * di):
            win[unsafe_offset=i] = 0.0
        for i in range(NSTATE * di):
            ht[unsafe_offset=i] = 0.0
        return
    transpose_in(arg_f32(args, FWD_CONV_WINDOW).unsafe_offset(bb * di * KCONV), KCONV, di, win)
    transpose_in(arg_f32(args, FWD_H).unsafe_offset(bb * di * NSTATE), NSTATE, di, ht)


def _save_state(args: I64Ptr, dims: M1Dims, wk: M1Work, work: F32Ptr, bb: Int):
    var di = dims.di
    var win = work.unsafe_offset(wk.o_win + bb * KCONV * di)
    var ht = work.unsafe_offset(wk.o_ht + bb * NSTATE * di)
    transpose_out(win, KCONV, di, arg_f32(args, FWD_CONV_WINDOW).unsafe_offset(bb * di * KCONV))
    transpose_out(ht, NSTATE, di, arg_f32(args, FWD_H).unsafe_offset(bb * di * NSTATE))
