"""Mamba-3's forward row stages and per-token pieces, written once: the
forward op (mamba3/forward.mojo, mamba3/scan.mojo) and the backward's recompute
(mamba3/backward.mojo) both call them, on their own memory (pointer
arguments, never an op's argument record), so the recomputed activations
have the forward's bits (tests/test_recompute_bits.py compares them).
"""
from std.collections import Array
from ..abi import F32Ptr, I64Ptr
from ..linear import WIDE
from ..norms import rms_scales_of, scale_row
from ..dot128 import dot128
from ..numerics import silu_f32
from ..trig import sincos_f32, mod2pi_f32
from .layout import NST, HP, NANG, NG, BC_ROWS_PER_TASK, A_FLOOR, V16


def norm_rows(x: F32Ptr, l: Int, d: Int, t0: Int, nc: Int, r0: Int, r1: Int,
              w: F32Ptr, xn: F32Ptr, lens: Int):
    """Block RMSNorm of rows [r0, r1) of a pass of B rows x nc tokens from
    token t0 (row r: batch row r // nc, token t0 + r % nc) into xn (stride
    d). lens: the address of ragged lengths (int64), or 0; padding rows
    read +0.0."""
    var r = r0
    while r < r1:
        # NG rows consecutive in x (one batch row's tokens, or whole batch
        # rows when the pass holds every token, as in a decode step) in a
        # group: one stride; their scales come out side by side
        # (norms.rms_scales_of, the same chains as one row alone)
        var xr = x.unsafe_offset(((r // nc) * l + t0 + r % nc) * d)
        var ng = min(NG, r1 - r)
        if nc != l:
            ng = min(ng, nc - r % nc)
        var sc = rms_scales_of[NG](xr, d, d, ng)
        for g in range(ng):
            var dst = xn.unsafe_offset((r + g) * d)
            var bb = (r + g) // nc
            if lens != 0 and t0 + (r + g) % nc >= Int(I64Ptr(unsafe_from_address=lens)[
                    unsafe_offset=bb]):
                for j in range(d):
                    dst[unsafe_offset=j] = 0.0
            else:
                scale_row(xr.unsafe_offset(g * d), d, sc[g], w, dst)
        r += ng


def bc_norm_rows(src: F32Ptr, ld: Int, c_b: Int, c_c: Int, r0: Int, r1: Int, bnw: F32Ptr,
                 cnw: F32Ptr, dst: F32Ptr, ldd: Int, d_b: Int, d_c: Int):
    """RMSNorm of the B and C columns (NST each, at c_b and c_c of rows of
    stride ld) of rows [r0, r1) of src into dst rows (stride ldd, at d_b and
    d_c; dst may be src: each group's scales are taken before it is
    written). BC_ROWS_PER_TASK rows' scales advance side by side."""
    var r = r0
    while r < r1:
        var ng = min(BC_ROWS_PER_TASK, r1 - r)
        var p0 = src.unsafe_offset(r * ld)
        var sb = rms_scales_of[BC_ROWS_PER_TASK](p0.unsafe_offset(c_b), ld, NST, ng)
        var scc = rms_scales_of[BC_ROWS_PER_TASK](p0.unsafe_offset(c_c), ld, NST, ng)
        for g in range(ng):
            var pr = p0.unsafe_offset(g * ld)
            var dr = dst.unsafe_offset((r + g) * ldd)
            scale_row(pr.unsafe_offset(c_b), NST, sb[g], bnw, dr.unsafe_offset(d_b))
            scale_row(pr.unsafe_offset(c_c), NST, scc[g], cnw, dr.unsafe_offset(d_c))
        r += ng


@always_inline
def phi_a[W: Int](u: SIMD[DType.float32, W]) -> SIMD[DType.float32, W]:
    """A = min(-phi(u), -1e-4); phi(u) = 1 + u (u >= 0), 1 / (1 - u)
    (u < 0). Both branches are computed and one chosen per lane (the other
    is never used), so the bits do not depend on W."""
    comptime V = SIMD[DType.float32, W]
    var ph = u.ge(V(0.0)).select(V(1.0) + u, V(1.0) / (V(1.0) - u))
    return min(-ph, V(-A_FLOOR))


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


@always_inline
def rotate_token[KEEP_CS: Bool](bn: F32Ptr, cn: F32Ptr, bbias: F32Ptr, cbias: F32Ptr,
                                ang0: V16, ang1: V16, dt: Float32, theta: F32Ptr,
                                qu: F32Ptr, ku: F32Ptr, qrow: F32Ptr, krow: F32Ptr,
                                cs: F32Ptr) -> Float32:
    """One token of one head: q = Cn + C_bias, k = Bn + B_bias (into qu, ku);
    the angles advance, theta = mod2pi(fma(ang, dt, theta)) (ang: the 32
    angles tanh(.) pi, in two vectors); pairs (2r, 2r+1), r < 32, of q and k
    rotated into qrow, krow (the other 64 lanes copied); with KEEP_CS, cos
    | sin of the angles into cs. Returns q . k (unrotated)."""
    comptime for c in range(8):
        qu.unsafe_store(c * 16, cn.unsafe_load[width=16](c * 16)
                        + cbias.unsafe_load[width=16](c * 16))
        ku.unsafe_store(c * 16, bn.unsafe_load[width=16](c * 16)
                        + bbias.unsafe_load[width=16](c * 16))
    comptime for c in range(2):  # angles 16 c .. 16 c + 15 rotate lanes 32 c .. 32 c + 31
        var ang = ang0 if c == 0 else ang1
        var th = mod2pi_f32[16](ang.fma(V16(dt), theta.unsafe_load[width=16](c * 16)))
        theta.unsafe_store(c * 16, th)
        var sc2 = sincos_f32[16](th)
        var sn = sc2[0]
        var co = sc2[1]
        comptime if KEEP_CS:
            cs.unsafe_store(c * 16, co)
            cs.unsafe_store(NANG + c * 16, sn)
        comptime for half in range(2):
            comptime o = c * 32 + half * 16
            var cd = _dup_half[half](co)
            var sd = _dup_half[half](sn)
            qrow.unsafe_store(o, _rotate16(qu.unsafe_load[width=16](o), cd, sd))
            krow.unsafe_store(o, _rotate16(ku.unsafe_load[width=16](o), cd, sd))
    comptime for c in range(4, 8):
        qrow.unsafe_store(c * 16, qu.unsafe_load[width=16](c * 16))
        krow.unsafe_store(c * 16, ku.unsafe_load[width=16](c * 16))
    return dot128(qu, ku)


# A fold register block: FOLD_P rows p x FOLD_N vectors of FOLD_W lanes of
# n (AVX-512: 4 x 4 x 16, 16 + 5 of 32 registers; AVX2: 4 x 2 x 8, 8 + 3 of
# 16, six loads per eight fmas: one row at a time was load-bound)
comptime FOLD_P = 4
comptime FOLD_W = 16 if WIDE else 8
comptime FOLD_N = 4 if WIDE else 2


def fold_into(v: F32Ptr, vs: Int, k: F32Ptr, ks: Int, w: F32Ptr, count: Int, hdec: Float32,
              src: F32Ptr, dst: F32Ptr, u: F32Ptr):
    """The fold of a chunk of count rows into h: dst[p, n] = hdec src[p, n],
    then fma((w_j * v_j[p]), k_j[n], .) for j = 0..count-1 ascending.
    v_j at v + j vs (HP floats), rotated k_j at k + j ks (NST floats); dst
    may be src; u: (64, 64) scratch for the products w_j * v_j[p]. Each
    element is its own chain, so the blocking (FOLD_P x FOLD_N x FOLD_W) is
    free; the columns n are the outer loop, so one block's k columns stay
    in L1 while every p passes over them."""
    comptime VW = SIMD[DType.float32, FOLD_W]
    comptime NB = FOLD_N * FOLD_W
    for j in range(count):
        var wj = V16(w[unsafe_offset=j])
        var vr = v.unsafe_offset(j * vs)
        comptime for c in range(4):
            u.unsafe_store(j * HP + c * 16, wj * vr.unsafe_load[width=16](c * 16))
    for n0 in range(0, NST, NB):
        for p0 in range(0, HP, FOLD_P):
            var acc = Array[VW, FOLD_P * FOLD_N](fill=VW(0.0))
            comptime for pp in range(FOLD_P):
                comptime for c in range(FOLD_N):
                    acc[pp * FOLD_N + c] = VW(hdec) * src.unsafe_load[width=FOLD_W](
                        (p0 + pp) * NST + n0 + c * FOLD_W)
            for j in range(count):
                var kr = k.unsafe_offset(j * ks + n0)
                var kv = Array[VW, FOLD_N](fill=VW(0.0))
                comptime for c in range(FOLD_N):
                    kv[c] = kr.unsafe_load[width=FOLD_W](c * FOLD_W)
                comptime for pp in range(FOLD_P):
                    var uv = VW(u[unsafe_offset=j * HP + p0 + pp])
                    comptime for c in range(FOLD_N):
                        acc[pp * FOLD_N + c] = uv.fma(kv[c], acc[pp * FOLD_N + c])
            comptime for pp in range(FOLD_P):
                comptime for c in range(FOLD_N):
                    dst.unsafe_store((p0 + pp) * NST + n0 + c * FOLD_W, acc[pp * FOLD_N + c])


@always_inline
def out_token[KEEP_Y: Bool](w: F32Ptr, i: Int, hdec: Float32, hq: F32Ptr, v: F32Ptr, vs: Int,
                            diag: Float32, dsk: Float32, z: F32Ptr, o: F32Ptr, y: F32Ptr):
    """One token's output for one head (64 values, four chains side by
    side): y = hdec hq, then fma(w_j, v_j, y) for j < i ascending, then
    fma(diag, v_i, y) and fma(D, v_i, y); o = y * silu(z), and y itself
    into y if KEEP_Y. w_j = exp(seg(i, j)) scale_j (q . k_j); hq = q . h;
    v_j at v + j vs."""
    _out_token[KEEP_Y, False](w, 1, w, i, hdec, hq, v, vs, diag, dsk, z, o, y)


@always_inline
def out_token_wq(wt: F32Ptr, ws: Int, qk: F32Ptr, i: Int, hdec: Float32, hq: F32Ptr, v: F32Ptr,
                 vs: Int, diag: Float32, dsk: Float32, z: F32Ptr, o: F32Ptr):
    """out_token[False] with w_j = wt[j ws] * qk[j] formed as it is used
    (the product out_token's caller forms first, w_j = (exp(seg) scale_j)
    (q . k_j)): the weights of a token computed side by side with others'
    (scan._seg_table) sit ws floats apart."""
    _out_token[False, True](wt, ws, qk, i, hdec, hq, v, vs, diag, dsk, z, o, o)


@always_inline
def _out_token[KEEP_Y: Bool, WQ: Bool](w: F32Ptr, ws: Int, qk: F32Ptr, i: Int, hdec: Float32,
                                       hq: F32Ptr, v: F32Ptr, vs: Int, diag: Float32,
                                       dsk: Float32, z: F32Ptr, o: F32Ptr, y: F32Ptr):
    """out_token's body; WQ: w_j = w[j ws] * qk[j] (else w[j])."""
    var acc = Array[V16, 4](fill=V16(0.0))
    comptime for cc in range(4):
        acc[cc] = V16(hdec) * hq.unsafe_load[width=16](cc * 16)
    for j in range(i):
        var wj: V16
        comptime if WQ:
            wj = V16(w[unsafe_offset=j * ws] * qk[unsafe_offset=j])
        else:
            wj = V16(w[unsafe_offset=j])
        var vj = v.unsafe_offset(j * vs)
        comptime for cc in range(4):
            acc[cc] = wj.fma(vj.unsafe_load[width=16](cc * 16), acc[cc])
    var vrow = v.unsafe_offset(i * vs)
    comptime for cc in range(4):
        var vi = vrow.unsafe_load[width=16](cc * 16)
        var yy = V16(diag).fma(vi, acc[cc])
        yy = V16(dsk).fma(vi, yy)
        comptime if KEEP_Y:
            y.unsafe_store(cc * 16, yy)
        o.unsafe_store(cc * 16, yy * silu_f32[16](z.unsafe_load[width=16](cc * 16)))

