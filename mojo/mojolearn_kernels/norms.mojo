"""RMSNorm, the one normalization every block uses (eps = 1e-5).

Canonical order for a row v of n values with weight w:
    s = 0; for j in 0..n-1: s = fma(v_j, v_j, s)      (sequential)
    r = 1 / sqrt(s / n + eps)                           (own sqrt, exact div)
    out_j = w_j * (v_j * r)
The weightless form (Falcon-Mamba's norms of B, C and dt, with their own
eps) is out_j = v_j * r: the weighted one at w = 1, bit for bit.
"""
from .abi import F32Ptr
from .numerics import sqrt_f32

comptime RMS_EPS: Float32 = 1e-5
# Rows one task of a norm stage takes (the LM's final norm; every block's
# row norms, forward and backward): a row's bits never depend on it.
comptime NORM_ROWS_PER_TASK = 16


@always_inline
def rms_scales[R: Int](v: F32Ptr, stride: Int, n: Int,
                       eps: Float32 = RMS_EPS) -> SIMD[DType.float32, R]:
    """Lane r = 1 / sqrt(mean(row_r^2) + eps) of the rows v + r * stride, in
    the canonical order: each row is one sequential chain; R rows' chains
    advance side by side, which hides the fma latency one chain alone is
    bound by (same bits for any R)."""
    var s = SIMD[DType.float32, R](0.0)
    for j in range(n):
        var vj = SIMD[DType.float32, R](0.0)
        comptime for r in range(R):
            vj[r] = v[unsafe_offset=r * stride + j]
        s = vj.fma(vj, s)
    var ms = s / SIMD[DType.float32, R](Float32(n))
    return SIMD[DType.float32, R](1.0) / sqrt_f32[R](ms + SIMD[DType.float32, R](eps))


@always_inline
def rms_scales_of[R: Int](v: F32Ptr, stride: Int, n: Int, count: Int) -> SIMD[DType.float32, R]:
    """rms_scales of the first count (<= R) rows: all R side by side when
    count = R, else one row at a time (the same bits); lanes past count 0."""
    if count == R:
        return rms_scales[R](v, stride, n)
    var s = SIMD[DType.float32, R](0.0)
    for g in range(count):
        s[g] = rms_scale(v.unsafe_offset(g * stride), n)
    return s


@always_inline
def rms_scale(v: F32Ptr, n: Int, eps: Float32 = RMS_EPS) -> Float32:
    """1 / sqrt(mean(v^2) + eps), in the canonical order (one row of rms_scales)."""
    return rms_scales[1](v, 0, n, eps)[0]


def scale_row(v: F32Ptr, n: Int, r: Float32, w: F32Ptr, dst: F32Ptr):
    """dst = w * (v * r): the second half of rmsnorm_row."""
    comptime W = 16
    var j = 0
    while j + W <= n:
        var vv = v.unsafe_load[width=W](j)
        dst.unsafe_store(j, w.unsafe_load[width=W](j) * (vv * r))
        j += W
    while j < n:
        dst[unsafe_offset=j] = w[unsafe_offset=j] * (v[unsafe_offset=j] * r)
        j += 1


def rmsnorm_row(v: F32Ptr, n: Int, w: F32Ptr, dst: F32Ptr):
    """dst = w * (v * r), r = rms_scale(v)."""
    scale_row(v, n, rms_scale(v, n), w, dst)


@always_inline
def rms_vjp_coef(v: F32Ptr, n: Int, w: F32Ptr, dout: F32Ptr) -> Tuple[Float32, Float32]:
    """(r, coef) of the RMSNorm VJP of one row: r = rms_scale(v, n), dot =
    fma chain over j of (dout_j w_j) v_j from +0.0, coef = (dot ((r r) r))
    / n (rmsnorm_row_vjp and Mamba-2's gated norm apply it)."""
    var rs = rms_scale(v, n)
    var dot: Float32 = 0.0
    for j in range(n):
        var gx = dout[unsafe_offset=j] * w[unsafe_offset=j]
        dot = gx.fma(v[unsafe_offset=j], dot)
    return (rs, (dot * ((rs * rs) * rs)) / Float32(n))


def rmsnorm_row_vjp[ADD_G: Bool](v: F32Ptr, n: Int, w: F32Ptr, dout: F32Ptr, g: F32Ptr,
                                 dv: F32Ptr, pw: F32Ptr):
    """VJP of rmsnorm_row for one row (every backward's, one definition):
    gx_j = dout_j w_j; dot = fma chain over j of gx_j v_j from +0.0;
    coef = (dot ((r r) r)) / n; dv_j = fma(-v_j, coef, r gx_j), plus g_j
    (g_j + that) if ADD_G (a residual's gradient); pw_j = dout_j (v_j r),
    the weight's per-row terms."""
    var rc = rms_vjp_coef(v, n, w, dout)
    var rs = rc[0]
    var coef = rc[1]
    for j in range(n):
        var vj = v[unsafe_offset=j]
        var gxn = dout[unsafe_offset=j]
        var t = (-vj).fma(coef, rs * (gxn * w[unsafe_offset=j]))
        comptime if ADD_G:
            dv[unsafe_offset=j] = g[unsafe_offset=j] + t
        else:
            dv[unsafe_offset=j] = t
        pw[unsafe_offset=j] = gxn * (vj * rs)


def block_norm_vjp_row(x: F32Ptr, g: F32Ptr, dx: F32Ptr, w: F32Ptr, dxn: F32Ptr, pn: F32Ptr,
                       d: Int, pad: Bool):
    """The block's input norm, backward, for one token (every block's last
    backward stage): dx = g + the RMSNorm VJP of dxn (rmsnorm_row_vjp;
    x, g and dx at the token, w the norm weight) and pn the weight's terms.
    A padding token of a ragged row (pad) gets dx = pn = +0.0; its x and g
    are not read."""
    if pad:
        for j in range(d):
            dx[unsafe_offset=j] = 0.0
            pn[unsafe_offset=j] = 0.0
        return
    rmsnorm_row_vjp[True](x, d, w, dxn, g, dx, pn)


def rmsnorm_plain_row(v: F32Ptr, n: Int, eps: Float32, dst: F32Ptr):
    """dst = v * r, r = rms_scale(v, n, eps): the weightless norm (dst may
    be v: each element is read before it is written)."""
    var r = rms_scale(v, n, eps)
    for j in range(n):
        dst[unsafe_offset=j] = v[unsafe_offset=j] * r


def rmsnorm_plain_vjp(v: F32Ptr, n: Int, eps: Float32, dout: F32Ptr, dv: F32Ptr):
    """VJP of rmsnorm_plain_row (rmsnorm_row_vjp's formula at w = 1; dv may
    be dout): dot = fma chain over j of dout_j v_j from +0.0;
    coef = (dot ((r r) r)) / n; dv_j = fma(-v_j, coef, r dout_j)."""
    var rs = rms_scale(v, n, eps)
    var dot: Float32 = 0.0
    for j in range(n):
        dot = dout[unsafe_offset=j].fma(v[unsafe_offset=j], dot)
    var coef = (dot * ((rs * rs) * rs)) / Float32(n)
    for j in range(n):
        dv[unsafe_offset=j] = (-v[unsafe_offset=j]).fma(coef, rs * dout[unsafe_offset=j])
