"""The library's own float32 trigonometric functions: sin, cos, sincos,
floor and mod2pi (Mamba-3's rotation angles).

Same rules as numerics.mojo (its module docstring): correctly rounded IEEE
operations only, in the fixed order written; generic over the SIMD width W
with the same bits for every W; software DAZ/FTZ; NaN inputs returned
unchanged, made NaNs the quiet NaN 0x7FC00000.

Accuracy (measured exhaustively, docs/numerics.md; checked by
tests/test_numerics_ulp.py): max 0.78 ulp for sin and cos (|x| < 2^21);
floor is exact; mod2pi is the correctly rounded remainder.
"""

from .numerics import _bits, _from_bits, _is_nan, _is_zero, _qnan, _daz, _clamp, _RND, _ABS, _PINF, F32, I32


# sin(r) = r + r^3 (S0 + S1 z + S2 z^2 + S3 z^3), cos(r) = 1 - z/2 + z^2 (C0 + C1 z + C2 z^2),
# z = r^2, |r| <= pi/4 (+0.1%) (2^-32.5 and 2^-33).
comptime _S0 = -0.1666666716337204
comptime _S1 = 0.008333379402756691
comptime _S2 = -0.00019853064441122115
comptime _S3 = 2.8325100629444933e-06
comptime _C0 = 0.04166664555668831
comptime _C1 = -0.0013887309469282627
comptime _C2 = 2.4432327336398885e-05

# pi/2 = P1 + P2 + P3 (+1.1e-23); P1 = float32(pi/2).
comptime _TWO_OVER_PI = 0.6366197466850281
comptime _PIO2_1 = 1.5707963705062866
comptime _PIO2_2 = -4.371138828673793e-08
comptime _PIO2_3 = -1.7151245100058819e-15

# mod2pi works modulo C = float32(2 pi) = 6.2831854820... (slightly above 2 pi).
comptime _TWO_PI = 6.2831854820251465
comptime _INV_TWO_PI = 0.15915493667125702


@always_inline
def _reduce_pio2[W: Int](x: SIMD[F32, W]) -> Tuple[SIMD[F32, W], SIMD[F32, W], SIMD[I32, W]]:
    """x = k pi/2 + (rh + rl), |rh| <= pi/4 (+tiny), quadrant q = k mod 4.

    k = rint(x 2/pi) (1.5*2^23 trick); r1 = x - k*P1 (one fma, exact);
    k*P2 = th + tl exactly (fma); rh + e = r1 - th exactly (TwoSum);
    rl = (e - tl) - k*P3 (one fma). k needs |x 2/pi| < 2^22: callers clamp
    |x| to 2^22.
    """
    comptime V = SIMD[F32, W]
    var k = x.fma(V(_TWO_OVER_PI), V(_RND)) - V(_RND)
    var r1 = (-k).fma(V(_PIO2_1), x)
    var th = k * V(_PIO2_2)
    var tl = k.fma(V(_PIO2_2), -th)
    var rh = r1 - th
    var bb = rh - r1
    var e = (r1 - (rh - bb)) + ((-th) - bb)
    var rl = (-k).fma(V(_PIO2_3), e - tl)
    return (rh, rl, k.cast[I32]() & 3)


@always_inline
def _sin_poly[W: Int](rh: SIMD[F32, W], rl: SIMD[F32, W]) -> SIMD[F32, W]:
    """sin(rh + rl) ~ rh + (rh z S(z) + rl (1 - z/2)), z = rh^2."""
    comptime V = SIMD[F32, W]
    var z = rh * rh
    var p = V(_S3).fma(z, V(_S2))
    p = p.fma(z, V(_S1))
    p = p.fma(z, V(_S0))
    var lo = (V(-0.5) * rl).fma(z, rl)
    return rh + (rh * z).fma(p, lo)


@always_inline
def _cos_poly[W: Int](rh: SIMD[F32, W], rl: SIMD[F32, W]) -> SIMD[F32, W]:
    """cos(rh + rl) ~ w + (((1 - w) - z/2) + (z^2 C(z) - zl/2 - rh rl)), w = 1 - z/2."""
    comptime V = SIMD[F32, W]
    var z = rh * rh
    var zl = rh.fma(rh, -z)  # exact: rh^2 = z + zl
    var hz = V(0.5) * z
    var w = V(1.0) - hz
    var c = V(_C2).fma(z, V(_C1))
    c = c.fma(z, V(_C0))
    var lo = (z * z).fma(c, (-rh).fma(rl, V(-0.5) * zl))
    return w + (((V(1.0) - w) - hz) + lo)


def sincos_f32[W: Int](x: SIMD[F32, W]) -> Tuple[SIMD[F32, W], SIMD[F32, W]]:
    """(sin(x), cos(x)) from one range reduction (both polynomials are needed
    for either: the quadrant picks which one is the sine)."""
    comptime I = SIMD[I32, W]
    var xd = _daz[W](x)
    var xs = _clamp[W](xd, -4194304.0, 4194304.0)
    var red = _reduce_pio2[W](xs)
    var sv = _sin_poly[W](red[0], red[1])
    var cv = _cos_poly[W](red[0], red[1])
    var q = red[2]
    var odd = (q & 1).eq(I(0))
    var rs = odd.select(sv, cv)
    rs = (q & 2).eq(I(0)).select(rs, -rs)
    var rc = odd.select(cv, sv)
    rc = ((q + 1) & 2).eq(I(0)).select(rc, -rc)
    var inf = (_bits[W](xd) & _ABS).eq(I(_PINF))
    rs = inf.select(_qnan[W](), rs)
    rc = inf.select(_qnan[W](), rc)
    rs = _is_zero[W](xd).select(xd, rs)
    var nan = _is_nan[W](x)
    return (nan.select(x, rs), nan.select(x, rc))


def sin_f32[W: Int](x: SIMD[F32, W]) -> SIMD[F32, W]:
    """sin(x): max 0.78 ulp for |x| < 2^21, 1.02 ulp for |x| < 2^22; inputs beyond
    +-2^22 are clamped to +-2^22 (meaningless there). sin(+-inf) = NaN."""
    return sincos_f32[W](x)[0]


def cos_f32[W: Int](x: SIMD[F32, W]) -> SIMD[F32, W]:
    """cos(x): max 0.78 ulp for |x| < 2^21, 1.02 ulp for |x| < 2^22; inputs beyond
    +-2^22 are clamped to +-2^22 (meaningless there). cos(+-inf) = NaN."""
    return sincos_f32[W](x)[1]


def floor_f32[W: Int](x: SIMD[F32, W]) -> SIMD[F32, W]:
    """Exact floor on the bits (no float arithmetic). floor(-0) = -0,
    floor(x) = -1 for -1 < x < 0; inf and NaN are returned unchanged."""
    comptime I = SIMD[I32, W]
    var xd = _daz[W](x)
    var b = _bits[W](xd)
    var neg = b.lt(I(0))
    var e = ((b >> 23) & 0xFF) - 127
    # |x| < 1: +0, -0 (for -0) or -1
    var below_one = neg.select(
        _is_zero[W](xd).select(xd, SIMD[F32, W](-1.0)), SIMD[F32, W](0.0)
    )
    var sh = e.lt(I(0)).select(I(0), e)
    sh = sh.gt(I(23)).select(I(23), sh)
    var mask = I(0x7FFFFF) >> sh  # fraction bits (0 once |x| >= 2^23)
    var has_frac = (b & mask).ne(I(0))
    var down = (neg & has_frac).select(b + mask, b) & ~mask
    return e.lt(I(0)).select(below_one, _from_bits[W](down))


def mod2pi_f32[W: Int](v: SIMD[F32, W]) -> SIMD[F32, W]:
    """v - C floor(v / C) in [0, C), C = float32(2 pi) = 6.2831855.

    Fixed order: k = floor_f32(v * (1/C)); the sign of r = fma(-k, C, v) is
    exact, so k is corrected by -1 if r < 0 and by +1 if fma(-(k+1), C, v)
    >= 0 (then k = floor(v / C) exactly); the result is fma(-k, C, v), the
    remainder rounded once. A remainder just below C that rounds up to C
    is returned as 0. Exact in this sense for |v| <= 2^24 (inputs beyond
    are clamped to +-2^24 first, where float32 spacing is already 2);
    +-inf -> NaN.
    """
    comptime V = SIMD[F32, W]
    var vd = _daz[W](v)
    var vs = _clamp[W](vd, -16777216.0, 16777216.0)
    var k = floor_f32[W](vs * V(_INV_TWO_PI))
    var r = (-k).fma(V(_TWO_PI), vs)
    k = r.lt(V(0.0)).select(k - V(1.0), k)
    var r2 = (-(k + V(1.0))).fma(V(_TWO_PI), vs)
    k = r2.ge(V(0.0)).select(k + V(1.0), k)
    r = (-k).fma(V(_TWO_PI), vs)
    r = r.ge(V(_TWO_PI)).select(V(0.0), r)
    r = (_bits[W](vd) & _ABS).eq(SIMD[I32, W](_PINF)).select(_qnan[W](), r)
    return _is_nan[W](v).select(v, r)
