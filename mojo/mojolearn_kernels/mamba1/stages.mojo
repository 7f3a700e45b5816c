"""Mamba-1's forward stages over one chunk of B rows x nc tokens, written
once. The forward op (mamba1/forward.mojo) runs them, and so does the backward's
recompute (mamba1/backward.mojo, both passes), so the activations the
gradients are taken of are the forward's, bit for bit
(tests/test_recompute_bits.py compares them).

Ragged rows (lens set) end at their own length: a padded token reads as
+0.0 (normalised input), its conv output u is +0.0, and the scan leaves h
and the conv window as they were after the row's last real token (so the
state a ragged forward leaves is the state at each row's length) and gives
y = yg = +0.0 there. Real tokens never see padding (the block is causal).

A stage reads and writes only through an M1Chunk (pointers to the chunk's
rows and to its state), never an op's argument record. The run kind, a
compile-time parameter, only adds stores (pass B keeps what the VJP
needs) or drops outputs nobody reads (pass A wants only the state at the
next chunk start); it never changes an operation or its order.
"""
from std.collections import Array
from std.sys.intrinsics import prefetch, PrefetchOptions
from ..abi import F32Ptr, I64Ptr, ceil_div
from ..linear import matmul_ntasks, matmul_task_wf
from ..norms import rmsnorm_row, rmsnorm_plain_row, NORM_ROWS_PER_TASK
from ..conv import conv_silu
from ..lanes import LANES, LV, ld_lanes, st_lanes
from ..numerics import exp_f32, exp_f32_in_range, EXP_FAST_LO, EXP_FAST_HI, softplus_f32, silu_f32
from .forward import (
    M1Dims, NSTATE, KCONV, ST_NORM, ST_INPROJ, ST_CONV, ST_XPROJ, ST_BCDT, ST_DTPROJ,
    CONV_CHANNELS_PER_TASK, SCAN_LANES,
)

# Scan tasks of a one-token chunk (a decode step) run this many 16-channel
# blocks each: one block's token is too little work for a task of its own
# (a B = 32 d = 768 step had 3072 scan tasks per layer, each paying the
# task's dispatch and layout set-up). Each lane is its own channel: the
# grouping never changes a bit.
comptime SCAN_STEP_BLOCKS = 4
# Decode steps of at least this many rows ask for the state lines of the
# next scan task (and the conv window of the next row) while on this one:
# a batched step finds them evicted by the weight stream. Into L2, not L1:
# measured faster on the whole model (bench/RESULTS.md). One row's state is
# left to the hardware, as before.
comptime FETCH_STATE_ROWS = 2


@always_inline
def _fetch(p: F32Ptr):
    """Prefetch p's line into L2."""
    prefetch[PrefetchOptions().for_read().medium_locality()](p)


@always_inline
def _scan_task_blocks(nc: Int) -> Int:
    """16-channel blocks per scan task for a chunk of nc tokens per row."""
    return SCAN_STEP_BLOCKS if nc == 1 else 1


comptime RUN_FWD = 0  # the forward op
comptime RUN_A = 1  # backward pass A: the state at the next chunk start
comptime RUN_B = 2  # backward pass B: the outputs, and pre, v, y, hs


@fieldwise_init
struct M1Chunk(ImplicitlyCopyable):
    """Where one chunk's stages read and write. Row arrays start at the
    chunk's first row, rows b-major (row = bb * nc + j); state arrays are
    per batch row, in the kernel's layouts. A Pointer is never null: those
    a run kind neither reads nor writes may point anywhere (the forward
    passes xn)."""
    var b: Int
    var nc: Int  # tokens of the chunk, per row
    var t0: Int  # index in x of the chunk's first token
    var l: Int  # tokens per row of x
    var x: F32Ptr  # (B, L, d) the block input
    var lens: Int  # address of the (B) row lengths (int64); 0: not ragged
    var xn: F32Ptr  # (B nc, d)
    var hg: F32Ptr  # (B nc, 2 di) hidden | gate
    var u: F32Ptr  # (B nc, di)
    var dbc: F32Ptr  # (B nc, nx) dt_raw | B | C (normalised in place if the block norms them)
    var dl: F32Ptr  # (B nc, di) softplus(dt)
    var yg: F32Ptr  # (B nc, di)
    var win_in: F32Ptr  # (B, 4, di) conv window at the chunk start
    var win_out: F32Ptr  # (B, 4, di) at its end (may be win_in); not RUN_B
    var h_in: F32Ptr  # (B, 16, di) SSM state at the chunk start
    var h_out: F32Ptr  # at its end (may be h_in); not RUN_B
    var pre: F32Ptr  # RUN_B: (B nc, di) conv output before the SiLU
    var dbc_raw: F32Ptr  # RUN_B with B/C/dt norms: (B nc, nx) dbc before them
    var v: F32Ptr  # RUN_B: (B nc, di) softplus input
    var y: F32Ptr  # RUN_B: (B nc, di) scan output before the gate
    var hs: F32Ptr  # RUN_B: (B, nblk, hs_tokens, 16, 16) h after each token
    var hs_tokens: Int


@always_inline
def real_tokens(ch: M1Chunk, bb: Int) -> Int:
    """Tokens of the chunk before row bb's ragged length (all if not ragged)."""
    if ch.lens == 0:
        return ch.nc
    var ln = Int(I64Ptr(unsafe_from_address=ch.lens)[unsafe_offset=bb])
    return min(ch.nc, max(0, ln - ch.t0))


def m1_stage_ntasks(dims: M1Dims, stage: Int, b: Int, nc: Int) -> Int:
    """Tasks of a forward stage over a chunk of b rows x nc tokens."""
    var rows = b * nc
    if stage == ST_NORM:
        return ceil_div(rows, NORM_ROWS_PER_TASK)
    if stage == ST_INPROJ:
        return matmul_ntasks(rows, 2 * dims.di)
    if stage == ST_CONV:
        return ceil_div(dims.di, CONV_CHANNELS_PER_TASK)
    if stage == ST_XPROJ:
        return matmul_ntasks(rows, dims.nx)
    if stage == ST_BCDT:
        return 0 if dims.bcdt_eps == 0.0 else ceil_div(rows, NORM_ROWS_PER_TASK)
    if stage == ST_DTPROJ:
        return matmul_ntasks(rows, dims.di)
    return b * ceil_div(ceil_div(dims.di, SCAN_LANES), _scan_task_blocks(nc))  # ST_SCAN


def m1_stage[RUN: Int](dims: M1Dims, blob: F32Ptr, ch: M1Chunk, stage: Int, task: Int):
    """Task `task` of forward stage `stage` of the chunk."""
    var d = dims.d
    var di = dims.di
    var rows = ch.b * ch.nc
    if stage == ST_NORM:
        var ragged = ch.lens != 0
        var r0 = task * NORM_ROWS_PER_TASK
        for r in range(r0, min(rows, r0 + NORM_ROWS_PER_TASK)):
            var bb = r // ch.nc
            var t = ch.t0 + r % ch.nc
            var dst = ch.xn.unsafe_offset(r * d)
            if ragged and t >= Int(I64Ptr(unsafe_from_address=ch.lens)[unsafe_offset=bb]):
                for j in range(d):  # padding reads as +0.0, whatever it holds
                    dst[unsafe_offset=j] = 0.0
            else:
                rmsnorm_row(ch.x.unsafe_offset((bb * ch.l + t) * d), d,
                            blob.unsafe_offset(dims.o_norm), dst)
    elif stage == ST_INPROJ:
        _ = matmul_task_wf(dims.wf_in, task, ch.xn, d, rows, blob.unsafe_offset(dims.o_in), d,
                           2 * di, ch.hg, 2 * di)
    elif stage == ST_CONV:
        var c0 = task * CONV_CHANNELS_PER_TASK
        var c1 = min(di, c0 + CONV_CHANNELS_PER_TASK)
        var fetch = ch.nc == 1 and ch.b >= FETCH_STATE_ROWS
        for bb in range(ch.b):
            var win = ch.win_in.unsafe_offset(bb * KCONV * di)
            if fetch and bb + 1 < ch.b:  # the next row's window
                _fetch_runs(win.unsafe_offset(KCONV * di), KCONV, di, c0, c1)
            var pre = ch.pre.unsafe_offset(bb * ch.nc * di) if RUN == RUN_B else ch.pre
            var u = ch.u.unsafe_offset(bb * ch.nc * di)
            var n = real_tokens(ch, bb)  # the window is saved after the real ones
            conv_silu[RUN == RUN_B](
                win, di, ch.hg.unsafe_offset(bb * ch.nc * 2 * di), 2 * di, n,
                blob.unsafe_offset(dims.o_convw), di, blob.unsafe_offset(dims.o_convb),
                c0, c1, u, di, ch.win_out.unsafe_offset(bb * KCONV * di), RUN != RUN_B, pre)
            for j in range(n, ch.nc):  # a ragged row's padding: u (and pre) +0.0
                for c in range(c0, c1):
                    u[unsafe_offset=j * di + c] = 0.0
                    comptime if RUN == RUN_B:
                        pre[unsafe_offset=j * di + c] = 0.0
    elif stage == ST_XPROJ:
        _ = matmul_task_wf(dims.wf_x, task, ch.u, di, rows, blob.unsafe_offset(dims.o_x), di,
                           dims.nx, ch.dbc, dims.nx)
    elif stage == ST_BCDT:  # in place, each of dtr, B, C over its own row segment
        var nx = dims.nx
        var r0 = task * NORM_ROWS_PER_TASK
        for r in range(r0, min(rows, r0 + NORM_ROWS_PER_TASK)):
            var v = ch.dbc.unsafe_offset(r * nx)
            comptime if RUN == RUN_B:  # the VJP needs the values before the norms
                for j in range(nx):
                    ch.dbc_raw[unsafe_offset=r * nx + j] = v[unsafe_offset=j]
            rmsnorm_plain_row(v, dims.r, dims.bcdt_eps, v)
            rmsnorm_plain_row(v.unsafe_offset(dims.r), NSTATE, dims.bcdt_eps,
                              v.unsafe_offset(dims.r))
            rmsnorm_plain_row(v.unsafe_offset(dims.r + NSTATE), NSTATE, dims.bcdt_eps,
                              v.unsafe_offset(dims.r + NSTATE))
    elif stage == ST_DTPROJ:
        var raw = ch.v if RUN == RUN_B else ch.dl  # the dt_proj product, then
        var t = matmul_task_wf(dims.wf_dt, task, ch.dbc, dims.nx, rows,
                               blob.unsafe_offset(dims.o_dt), dims.r, di, raw, di)
        var bias = blob.unsafe_offset(dims.o_dtb)
        for r in range(t.r0, t.r1):  # v = raw + bias in place; dl = softplus(v)
            _bias_softplus(raw.unsafe_offset(r * di), ch.dl.unsafe_offset(r * di), bias,
                           t.c0, t.c1)
    else:  # ST_SCAN
        var nblk = ceil_div(di, SCAN_LANES)
        var per = _scan_task_blocks(ch.nc)
        var ntb = ceil_div(nblk, per)  # tasks per row
        var bb = task // ntb
        var q0 = (task % ntb) * per
        if ch.nc == 1 and ch.b >= FETCH_STATE_ROWS and task + 1 < ch.b * ntb:
            var f0 = ((task + 1) % ntb) * per * SCAN_LANES  # the next task's state
            _fetch_runs(ch.h_in.unsafe_offset((task + 1) // ntb * NSTATE * di), NSTATE, di, f0,
                        min(di, f0 + per * SCAN_LANES))
        for q in range(q0, min(nblk, q0 + per)):
            var c0 = q * SCAN_LANES
            var nv = min(SCAN_LANES, di - c0)
            if nv == SCAN_LANES:
                _scan[RUN, False](dims, blob, ch, bb, q, c0, nv)
            else:
                _scan[RUN, True](dims, blob, ch, bb, q, c0, nv)


@always_inline
def _fetch_runs(p: F32Ptr, runs: Int, stride: Int, c0: Int, c1: Int):
    """Ask for the lines of channels [c0, c1) of `runs` rows stride floats
    apart at p: a scan block's 16 states, a conv window's 4 rows (short
    runs di floats apart, which no hardware prefetcher follows)."""
    for n in range(runs):
        var c = c0
        while c < c1:
            _fetch(p.unsafe_offset(n * stride + c))
            c += SCAN_LANES


def _bias_softplus(raw: F32Ptr, dst: F32Ptr, bias: F32Ptr, c0: Int, c1: Int):
    """raw[c] += bias[c]; dst[c] = softplus(raw[c]) for c in [c0, c1),
    lane-wise (raw may be dst)."""
    comptime W = 16
    var c = c0
    while c + W <= c1:
        var v = raw.unsafe_load[width=W](c) + bias.unsafe_load[width=W](c)
        raw.unsafe_store(c, v)
        dst.unsafe_store(c, softplus_f32[W](v))
        c += W
    while c < c1:
        var v = raw[unsafe_offset=c] + bias[unsafe_offset=c]
        raw[unsafe_offset=c] = v
        dst[unsafe_offset=c] = softplus_f32[1](v)
        c += 1


@always_inline
def _scan_token[RUN: Int, FAST: Bool](mut h: Array[LV, NSTATE], a: Array[LV, NSTATE], delta: LV,
                                      uu: LV, bc: F32Ptr, mut y: LV):
    """One token of the scan: h_n = fma(exp(delta A_n), h_n, (delta B_n) u) and
    y = fma(C_n, h_n, y) for n ascending (FAST: every delta A_n is in exp's
    fast range)."""
    comptime for n in range(NSTATE):
        var da: LV
        comptime if FAST:
            da = exp_f32_in_range[LANES](delta * a[n])
        else:
            da = exp_f32[LANES](delta * a[n])
        var dbu = (delta * LV(bc[unsafe_offset=n])) * uu
        h[n] = da.fma(h[n], dbu)
        comptime if RUN != RUN_A:
            y = LV(bc[unsafe_offset=NSTATE + n]).fma(h[n], y)


@always_inline
def _scan[RUN: Int, MASKED: Bool](dims: M1Dims, blob: F32Ptr, ch: M1Chunk, bb: Int,
                                  q: Int, c0: Int, nv: Int):
    """Selective scan of channels [c0, c0 + nv) of row bb over the chunk's
    tokens, 16 lanes (MASKED: lanes past nv read +0.0 and are not stored;
    each lane is its own channel, so the bits do not depend on it):
        h_n = fma(exp(dl * A_n), h_n, (dl * B_n) * u);  y = fma(C_n, h_n, y)
        y = fma(u, D, y);  yg = y * silu(gate)
    RUN_A leaves out y; RUN_B also keeps y and h after every token (hs).
    Tokens from nreal on are a ragged row's padding (module docstring)."""
    var di = dims.di
    var nx = dims.nx
    var r = dims.r
    var nc = ch.nc
    var dl = ch.dl  # locals: the loop's stores cannot be taken to change them
    var u = ch.u
    var dbc = ch.dbc
    var hg = ch.hg
    var yg = ch.yg
    var ys = ch.y
    var hin = ch.h_in.unsafe_offset(bb * NSTATE * di)
    var hs = ch.hs.unsafe_offset((bb * ceil_div(di, LANES) + q) * ch.hs_tokens * NSTATE * LANES)
    var h = Array[LV, NSTATE](fill=LV(0.0))
    var a = Array[LV, NSTATE](fill=LV(0.0))
    comptime for n in range(NSTATE):
        h[n] = ld_lanes[MASKED](hin, n * di + c0, nv)
        a[n] = ld_lanes[MASKED](blob, dims.o_a + n * di + c0, nv)
    var dskip = ld_lanes[MASKED](blob, dims.o_dskip + c0, nv)
    # A token whose delta is >= 0 with delta * min_n A and delta * max_n A
    # in exp's fast range has every delta * A_n there (rounding is monotonic),
    # so its 16 exps skip their own range checks (same bits). NaN in A: never.
    var amin = a[0]
    var amax = a[0]
    var a_nan = a[0].ne(a[0])
    comptime for n in range(1, NSTATE):
        amin = a[n].lt(amin).select(a[n], amin)
        amax = a[n].gt(amax).select(a[n], amax)
        a_nan = a_nan | a[n].ne(a[n])
    var a_ok = not a_nan.reduce_or()
    var nreal = real_tokens(ch, bb)
    for j in range(nreal):
        var row = bb * nc + j
        var delta = ld_lanes[MASKED](dl, row * di + c0, nv)
        var uu = ld_lanes[MASKED](u, row * di + c0, nv)
        var bc = dbc.unsafe_offset(row * nx + r)
        var y = LV(0.0)
        var fast = a_ok and (delta.ge(LV(0.0)) & (delta * amin).ge(LV(EXP_FAST_LO))
                             & (delta * amax).le(LV(EXP_FAST_HI))).reduce_and()
        # Two copies of the token's 16 states, so each is one straight block
        # (a test per state split it into 16 blocks): 1.1x on both binaries.
        if fast:
            _scan_token[RUN, True](h, a, delta, uu, bc, y)
        else:
            _scan_token[RUN, False](h, a, delta, uu, bc, y)
        comptime if RUN == RUN_B:
            comptime for n in range(NSTATE):
                hs.unsafe_store((j * NSTATE + n) * LANES, h[n])
        comptime if RUN != RUN_A:
            y = uu.fma(dskip, y)
            var gate = ld_lanes[MASKED](hg, row * 2 * di + di + c0, nv)
            comptime if RUN == RUN_B:
                st_lanes[MASKED](ys, row * di + c0, y, nv)
            st_lanes[MASKED](yg, row * di + c0, y * silu_f32[LANES](gate), nv)
    for j in range(nreal, nc):  # a ragged row's padding: h stays, y = yg = +0.0
        var row = bb * nc + j
        comptime if RUN == RUN_B:
            st_lanes[MASKED](ys, row * di + c0, LV(0.0), nv)
            comptime for n in range(NSTATE):
                hs.unsafe_store((j * NSTATE + n) * LANES, h[n])
        comptime if RUN != RUN_A:
            st_lanes[MASKED](yg, row * di + c0, LV(0.0), nv)
    comptime if RUN != RUN_B:
        var hout = ch.h_out.unsafe_offset(bb * NSTATE * di)
        comptime for n in range(NSTATE):
            st_lanes[MASKED](hout, n * di + c0, h[n], nv)
