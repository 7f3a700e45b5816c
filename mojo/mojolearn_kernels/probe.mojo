"""Test hook: where an op's workspace holds a named activation once the op
has returned.

tests/test_recompute_bits.py reads the activations a backward recomputed
and those of the forward out of the caller's workspace and compares their
bytes. The offsets come from the ops' own layout structs, built from the
op's own argument record, so no test restates a layout or a slot number.
No op calls this.
"""
from std.collections import Array
from .abi import I64Ptr, arg_int, arg_f32
from .ops import M1Forward, M1Backward, M2Forward, M2Backward, M3Forward, M3Backward
from .mamba1.forward import M1Work, forward_dims as m1_forward_dims, dims_of_blob as m1_dims_of_blob
from .mamba1.forward import FWD_B as M1_FWD_B, FWD_L as M1_FWD_L
from .mamba1.backward_layout import (
    BWork, BW_B as M1_BW_B, BW_L as M1_BW_L, BW_D as M1_BW_D, BW_BLOB as M1_BW_BLOB,
)
from .mamba2.layout import M2Call
from .mamba2.backward_layout import BW2
from .mamba3.layout import M3Dims, M3Work
from .mamba3.forward import forward_dims as m3_forward_dims
from .mamba3.layout import FWD_B as M3_FWD_B, FWD_L as M3_FWD_L
from .mamba3.backward_layout import BW3, BW_B as M3_BW_B, BW_L as M3_BW_L, BW_D as M3_BW_D

# Names of the activations; an op answers -1 for one it does not have.
# PR_TOKENS and PR_ROWS answer a count, not an offset.
comptime PR_TOKENS = 0  # tokens per chunk
comptime PR_XN = 1  # normed input rows of the chunk
comptime PR_HG = 2  # in_proj output (Mamba-1 hg, Mamba-2 zx, Mamba-3 proj)
comptime PR_U = 3  # conv + SiLU output (Mamba-1 u, Mamba-2 xBC)
comptime PR_DBC = 4  # Mamba-1 x_proj output
comptime PR_DL = 5  # Mamba-1 softplus(dt); Mamba-2 dt (B, H, Q)
comptime PR_YG = 6  # gated scan output (Mamba-1 yg, Mamba-2 the gated norm's
# output, Mamba-3 o); the forward's at the chunk's rows
comptime PR_WIN = 7  # Mamba-1 conv window: at the end (forward), per chunk start
comptime PR_H = 8  # SSM state: at the end (forward), per chunk start (backward)
comptime PR_DA = 9  # Mamba-2 dA (B, H, Q)
comptime PR_CB = 10  # Mamba-2 C_i . B_j (B, Q, Q)
comptime PR_BCN = 11  # Mamba-3 normed B | C (backward: its own array)
comptime PR_QKR = 12  # Mamba-3 rotated q | k rows, (H, PR_ROWS, 256)
comptime PR_THETA = 13  # Mamba-3 angles at each chunk start
comptime PR_KLAST = 14  # Mamba-3 previous chunk's last rotated k, per chunk
comptime PR_VLAST = 15  # Mamba-3 previous chunk's last v, per chunk
comptime PR_ROWS = 16  # Mamba-3 rows per head of the qkr array
comptime NPR = 17  # names in all


def workspace_offset(op: Int, args: I64Ptr, which: Int) -> Int:
    """Float offset of activation `which` in op's workspace; -1 if none."""
    if op == M1Forward.ID:
        var wk = M1Work(m1_forward_dims(args), arg_int(args, M1_FWD_B), arg_int(args, M1_FWD_L))
        return _pick(which, tokens=wk.tc, hg=wk.o_hg, u=wk.o_u, dbc=wk.o_dbc, dl=wk.o_dl,
                     yg=wk.o_yg, win=wk.o_win, h=wk.o_ht)
    if op == M1Backward.ID:
        var bw = BWork(m1_dims_of_blob(arg_int(args, M1_BW_D), arg_f32(args, M1_BW_BLOB)),
                       arg_int(args, M1_BW_B),
                       arg_int(args, M1_BW_L))
        return _pick(which, tokens=bw.tc, xn=bw.o_xn, hg=bw.o_hg, u=bw.o_u, dbc=bw.o_dbc,
                     dl=bw.o_dl, yg=bw.o_yg, win=bw.o_ckw, h=bw.o_ckh)
    if op == M2Forward.ID:
        var cl = M2Call(args)
        var wk = cl.wk
        # tokens: per row of one group
        return _pick(which, tokens=wk.g, hg=wk.o_zx, u=wk.o_cx, dl=wk.o_dt, yg=wk.o_yg,
                     h=wk.o_h if not cl.has_state else -1, da=wk.o_da, cb=wk.o_cb)
    if op == M2Backward.ID:
        var bw = BW2(args)
        return _pick(which, tokens=bw.nc(0), xn=bw.o_xn, hg=bw.o_zx, u=bw.o_cx, dl=bw.o_dt,
                     yg=bw.o_g, h=bw.o_ckh, da=bw.o_da, cb=bw.o_cb)
    if op == M3Forward.ID:
        var wk = M3Work(m3_forward_dims(args), arg_int(args, M3_FWD_B), arg_int(args, M3_FWD_L))
        return _pick(which, tokens=wk.tc, hg=wk.o_proj, yg=wk.o_proj)
    if op == M3Backward.ID:
        var dims = M3Dims(arg_int(args, M3_BW_D))
        var bw = BW3(dims, arg_int(args, M3_BW_B), arg_int(args, M3_BW_L))
        if bw.defer:  # where pass B of chunk 0 (the last it runs) left its rows
            bw.use_store(0, dims.d, dims.np, dims.di)
        if bw.kept(0):
            bw.use_kept(0, dims.d)
        return _pick(which, tokens=bw.chunk_tokens(0), xn=bw.o_xn, hg=bw.o_proj, yg=bw.o_o,
                     h=bw.o_ckh, bcn=bw.o_bcn, qkr=bw.o_qkr, theta=bw.o_ckt, klast=bw.o_ckk,
                     vlast=bw.o_ckv, rows=bw.rmax)
    return -1


def _pick(
    which: Int, tokens: Int = -1, xn: Int = -1, hg: Int = -1, u: Int = -1, dbc: Int = -1,
    dl: Int = -1, yg: Int = -1, win: Int = -1, h: Int = -1, da: Int = -1, cb: Int = -1,
    bcn: Int = -1, qkr: Int = -1, theta: Int = -1, klast: Int = -1, vlast: Int = -1,
    rows: Int = -1,
) -> Int:
    """Activation `which` of an op that names its own (-1: one it lacks)."""
    comptime assert PR_TOKENS == 0 and PR_ROWS == NPR - 1, "PR_* number 0 .. NPR - 1"
    var at: Array[Int, NPR] = [
        tokens, xn, hg, u, dbc, dl, yg, win, h, da, cb, bcn, qkr, theta, klast, vlast, rows
    ]
    return at[which] if 0 <= which < NPR else -1
