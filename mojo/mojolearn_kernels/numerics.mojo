"""The library's own float32 transcendental functions (identical-bits mode).

Every kernel uses these instead of `std.math` or a vendor library, so the CPU
and every GPU build compute the same bits. Rules followed by every function:

* Only IEEE operations that are correctly rounded on every target are used:
  + - * / and explicit `.fma()`, comparisons, `select`, bitcasts and integer
  bit operations, in the fixed order written here. Build with
  `--fp-mode contract=off` so the compiler fuses nothing by itself.
* Every function is elementwise and generic over the SIMD width W; no
  table, reduction or branch depends on W, so W = 1, 8 and 16 give the same
  bits. Branches are computed on all lanes and chosen with `select`; the
  only real branches are the in-range paths (exp, silu, sigmoid, softplus),
  taken when every lane is in range and giving the general path's bits.
* Subnormal policy (software DAZ + FTZ, the same on every device): an input
  with |x| < 2^-126 is treated as a zero of the same sign; a result with
  |r| < 2^-126 (and not an exact signed zero of an odd function at 0) is
  returned as +0.0. Both are decided on the bits, so hardware that flushes
  and hardware that does not agree. Intermediate values are kept normal
  (exponent scaling is split in two steps) wherever the result is normal.
* NaN inputs are returned unchanged (same bits). A NaN made from a non-NaN
  input (log(-1), sqrt(-1), sin(inf), ...) is the quiet NaN 0x7FC00000.

Accuracy (measured exhaustively, see docs/numerics.md; checked by
tests/test_numerics_ulp.py): max 0.61-0.69 ulp for exp, log, log1p, sigmoid,
silu, softplus, tanh; sqrt is exact; rsqrt = 1/sqrt is within 1.5 ulp. The
trigonometric functions (sin, cos, floor, mod2pi) are in trig.mojo under the
same rules. Each of them evaluates the main terms as unevaluated float pairs
(Fast2Sum/TwoSum, exact fma products and remainders) so only the final
rounding is significant.
Polynomial coefficients are weighted minimax fits (relative error of the
final function), rounded to float32 one coefficient at a time and refitted.
"""

from std.memory import bitcast

comptime F32 = DType.float32
comptime I32 = DType.int32

# Bit patterns.
comptime _SIGN = -2147483648  # 0x80000000
comptime _ABS = 0x7FFFFFFF
comptime _EXPMASK = 0x7F800000
comptime _QNAN = 0x7FC00000
comptime _PINF = 0x7F800000

# 1.5 * 2^23: (y + RND) - RND rounds |y| < 2^22 to the nearest integer.
comptime _RND = 12582912.0

# ln 2 split for exp: HI is float32(ln2) (24 bits), LO = ln2 - HI.
comptime _INVLN2 = 1.4426950216293335
comptime _LN2_HI24 = 0.6931471824645996
comptime _LN2_LO24 = -1.9046542121259336e-09
# ln 2 split for log: HI has 15 significant bits so k * HI is exact for |k| <= 256.
comptime _LN2_HI15 = 0.693145751953125
comptime _LN2_LO15 = 1.428606765330187e-06

# Largest x with finite exp(x) (float32 below ln(FLT_MAX) = 88.7228390...).
comptime _EXP_MAX_ARG = 88.72283172607422
# Inputs below this give exp(x) far below 2^-151: clamp here (keeps 2^k normal in halves).
comptime _EXP_MIN_ARG = -104.0
# exp_f32's fast range: e^x normal and 2^k a normal float (see there).
comptime EXP_FAST_LO = -87.0
comptime EXP_FAST_HI = 88.0

# exp: e^r = 1 + r + r^2 Q(r) on |r| <= ln2/2; Q minimax, max rel. contribution 2^-33.
comptime _E0 = 0.5
comptime _E1 = 0.1666666567325592
comptime _E2 = 0.041666463017463684
comptime _E3 = 0.008333571255207062
comptime _E4 = 0.0013935116585344076
comptime _E5 = 0.00019739694835152477

# log: log1p(f) = 2 atanh(s), s = f / (2 + f), |s| <= 0.1716;
# 2 atanh(s) = 2 s + s R(z), R(z) = z (L1 + L2 z + L3 z^2 + L4 z^3), z = s^2 (2^-35).
comptime _L1 = 0.6666666269302368
comptime _L2 = 0.40000972151756287
comptime _L3 = 0.2849878966808319
comptime _L4 = 0.2427894026041031

# tanh for |x| < 0.25: tanh(a) = a + a^3 (T0 + T1 a^2 + T2 a^4 + T3 a^6) (2^-34.3).
comptime _TANH_SMALL = 0.25
comptime _T0 = -0.3333333134651184
comptime _T1 = 0.1333307921886444
comptime _T2 = -0.05386711657047272
comptime _T3 = 0.020277271047234535
# tanh(a) rounds to 1 for a >= 9.0109134 (atanh(1 - 2^-25)); saturate a bit above.
comptime _TANH_SAT = 9.5


# ----------------------------------------------------------------------------
# Bit helpers
# ----------------------------------------------------------------------------


@always_inline
def _bits[W: Int](x: SIMD[F32, W]) -> SIMD[I32, W]:
    return bitcast[I32, W](x)


@always_inline
def _from_bits[W: Int](b: SIMD[I32, W]) -> SIMD[F32, W]:
    return bitcast[F32, W](b)


@always_inline
def _is_nan[W: Int](x: SIMD[F32, W]) -> SIMD[DType.bool, W]:
    return (_bits[W](x) & _ABS).gt(SIMD[I32, W](_PINF))


@always_inline
def _is_zero[W: Int](x: SIMD[F32, W]) -> SIMD[DType.bool, W]:
    return (_bits[W](x) & _ABS).eq(SIMD[I32, W](0))


@always_inline
def _qnan[W: Int]() -> SIMD[F32, W]:
    return _from_bits[W](SIMD[I32, W](_QNAN))


@always_inline
def _inf[W: Int]() -> SIMD[F32, W]:
    return _from_bits[W](SIMD[I32, W](_PINF))


@always_inline
def _abs[W: Int](x: SIMD[F32, W]) -> SIMD[F32, W]:
    return _from_bits[W](_bits[W](x) & _ABS)


@always_inline
def _daz[W: Int](x: SIMD[F32, W]) -> SIMD[F32, W]:
    """Subnormal input -> zero of the same sign (decided on the bits)."""
    var b = _bits[W](x)
    return (b & _EXPMASK).eq(SIMD[I32, W](0)).select(_from_bits[W](b & _SIGN), x)


@always_inline
def _ftz[W: Int](y: SIMD[F32, W]) -> SIMD[F32, W]:
    """Zero or subnormal result -> +0.0 (decided on the bits)."""
    return (_bits[W](y) & _EXPMASK).eq(SIMD[I32, W](0)).select(SIMD[F32, W](0.0), y)


@always_inline
def _pow2[W: Int](k: SIMD[I32, W]) -> SIMD[F32, W]:
    """2^k for integer k in [-126, 127], built from bits (exact)."""
    return _from_bits[W]((k + 127) << 23)


# silu / sigmoid / softplus: inputs in [FAST_LO, 20] (the common case) skip
# the clamp and apply 2^k (k >= -116) in one step; same bits (below).
comptime FAST_LO = -80.0


@always_inline
def _scale_split[W: Int, FAST: Bool](k: SIMD[I32, W]) -> SIMD[I32, W]:
    """k1 of the two-step scaling x * 2^k = (x * 2^k1) * 2^(k - k1) that
    keeps 2^k normal down to k = -252. FAST (k >= -116): k1 = k, so the
    second factor is 1 and the compiler drops it. Where x * 2^k is normal
    both forms are one exact product; for the low parts (pl, at least
    2^-60 or zero for k != 0) x * 2^k1 is normal, so both round once at the
    same place. Same bits on every float32 in [-104, 104] (widths 16, 8, 1;
    tests/test_numerics_ulp.py compares the paths)."""
    comptime if FAST:
        return k
    return k >> 1


@always_inline
def _clamp[W: Int](x: SIMD[F32, W], lo: Float32, hi: Float32) -> SIMD[F32, W]:
    """Clamp to [lo, hi]; NaN -> 0 so no lane carries NaN into integer code."""
    var y = x.lt(SIMD[F32, W](lo)).select(SIMD[F32, W](lo), x)
    y = y.gt(SIMD[F32, W](hi)).select(SIMD[F32, W](hi), y)
    return _is_nan[W](x).select(SIMD[F32, W](0.0), y)


# ----------------------------------------------------------------------------
# exp core: e^x = 2^k (ph + pl), ph in about [0.70, 1.42], |pl| <= ulp(ph)/2
# ----------------------------------------------------------------------------


@always_inline
def _exp_parts[W: Int](x: SIMD[F32, W]) -> Tuple[SIMD[F32, W], SIMD[F32, W], SIMD[I32, W]]:
    """Returns (ph, pl, k) with e^x = 2^k (ph + pl) to about 2^-33 relative.

    x must be finite and in [-104, 89]. Fixed order:
    k = rint(x / ln2) via the 1.5*2^23 trick; r = x - k*LN2_HI24 (one fma, exact:
    the result has |r| < 0.5 and no bits below 2^-24); rl = -k*LN2_LO24;
    P = 1 + r + r^2 Q(r); e^(r + rl) = P + rl*P, summed as 1 + r (Fast2Sum)
    plus the small terms; (ph, pl) is that sum renormalized by Fast2Sum, so
    ph is the rounded value and pl (|pl| <= ulp(ph)/2) what rounding dropped.
    """
    comptime V = SIMD[F32, W]
    var kt = x.fma(V(_INVLN2), V(_RND))  # k in the low mantissa bits
    var k = kt - V(_RND)
    var r = (-k).fma(V(_LN2_HI24), x)
    var rl = (-k) * V(_LN2_LO24)
    var z = r * r
    var q = V(_E5).fma(r, V(_E4))
    q = q.fma(r, V(_E3))
    q = q.fma(r, V(_E2))
    q = q.fma(r, V(_E1))
    q = q.fma(r, V(_E0))
    var t1 = z * q  # r^2 Q(r)
    var s = V(1.0) + r
    var slo = r - (s - V(1.0))  # exact error of s (Fast2Sum, |r| < 1)
    var tail = rl.fma(s + t1, t1)  # r^2 Q + rl * P
    var lo = slo + tail
    var ph = s + lo  # = the rounded e^(r + rl)
    var pl = lo - (ph - s)  # Fast2Sum: |pl| <= ulp(ph) / 2
    return (ph, pl, _bits[W](kt) - _bits[W](V(_RND)))  # = k as an integer


# ----------------------------------------------------------------------------
# log core: log(u) + c = hi + lo for positive normal finite u
# ----------------------------------------------------------------------------


@always_inline
def _log_parts[W: Int](u: SIMD[F32, W], c: SIMD[F32, W]) -> Tuple[SIMD[F32, W], SIMD[F32, W]]:
    """Returns (hi, lo) with log(u) + c = hi + lo (c: a small correction).

    u = 2^k m with m in [sqrt(2)/2, sqrt(2)) (integer ops), f = m - 1 (exact).
    log1p(f) = f - h + s (h + R(s^2)), h = f^2/2, s = f / (2 + f).
    f - h is kept as a Fast2Sum pair, k*LN2_HI15 is exact, and
    hi = Fast2Sum(k*LN2_HI15, f - h); everything else is summed into lo in
    the order written.
    """
    comptime V = SIMD[F32, W]
    comptime I = SIMD[I32, W]
    var b = _bits[W](u)
    var k = (b - I(0x3F3504F3)) >> 23  # 0x3F3504F3 = float32(sqrt(2)/2)
    var f = _from_bits[W](b - (k << 23)) - V(1.0)
    var hf = V(0.5) * f
    var h = hf * f
    var h_lo = hf.fma(f, -h)  # exact: h + h_lo = f^2 / 2
    var a = f - h
    var a_lo = ((f - a) - h) - h_lo  # (f - a) - h is exact (Fast2Sum, |h| <= |f|)
    var s = f / (V(2.0) + f)
    var z = s * s
    var rz = V(_L4).fma(z, V(_L3))
    rz = rz.fma(z, V(_L2))
    rz = rz.fma(z, V(_L1))
    rz = rz * z
    var tt = s * (h + rz)
    var kf = k.cast[F32]()
    var kh = kf * V(_LN2_HI15)  # exact
    var hi = kh + a
    var e2 = a - (hi - kh)  # exact (Fast2Sum: k = 0 or |kh| >= |a|)
    var lo = e2 + (a_lo + (tt + kf.fma(V(_LN2_LO15), c)))
    return (hi, lo)


# ----------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------


@always_inline
def exp_f32_in_range[W: Int](x: SIMD[F32, W]) -> SIMD[F32, W]:
    """exp_f32's bits for x in [EXP_FAST_LO, EXP_FAST_HI] on every lane (the
    caller has checked it; anything else, NaN included, is undefined)."""
    var q = _exp_parts[W](x)
    # ph * 2^k as an exponent add: ph in [0.70, 1.42] and k in [-126, 127]
    # give a normal result here, where both are exact, so the bits are the
    # product's (two vector integer ops instead of a convert, two integer
    # ops and a multiply).
    return _from_bits[W](_bits[W](q[0]) + (q[2] << 23))


def exp_f32[W: Int](x: SIMD[F32, W]) -> SIMD[F32, W]:
    """e^x. Overflow (x > 88.7228317) -> +inf; results below 2^-126 -> +0."""
    comptime V = SIMD[F32, W]
    # Fast path, same bits: for x in [-87, 88] (no NaN) the clamp changes
    # nothing, k is in [-126, 127] and e^x >= 1.6e-38 is normal, so ph * 2^k
    # is one exact product equal to the two exact steps below, and the
    # flush and the overflow / NaN selects keep it. About 40% fewer vector
    # ops: most of a Mamba-1 scan step.
    if (x.ge(V(EXP_FAST_LO)) & x.le(V(EXP_FAST_HI))).reduce_and():
        return exp_f32_in_range[W](x)
    var xc = _clamp[W](x, _EXP_MIN_ARG, 89.0)
    var p = _exp_parts[W](xc)
    var y = p[0]
    var k1 = p[2] >> 1
    var k2 = p[2] - k1
    var res = (y * _pow2[W](k1)) * _pow2[W](k2)  # two exact steps: 2^k may be 2^128
    res = _ftz[W](res)
    res = x.gt(V(_EXP_MAX_ARG)).select(_inf[W](), res)
    return _is_nan[W](x).select(x, res)


def log_f32[W: Int](x: SIMD[F32, W]) -> SIMD[F32, W]:
    """Natural log. log(+-0) = -inf, log(x<0) = NaN, log(+inf) = +inf."""
    comptime V = SIMD[F32, W]
    comptime I = SIMD[I32, W]
    var xd = _daz[W](x)
    var b = _bits[W](xd)
    var ok = b.gt(I(0)) & b.lt(I(_PINF))  # positive, normal, finite
    var p = _log_parts[W](ok.select(xd, V(1.0)), V(0.0))
    var res = p[0] + p[1]
    res = b.lt(I(0)).select(_qnan[W](), res)
    res = _is_zero[W](xd).select(-_inf[W](), res)
    res = b.eq(I(_PINF)).select(_inf[W](), res)
    return _is_nan[W](x).select(x, res)


def log1p_f32[W: Int](x: SIMD[F32, W]) -> SIMD[F32, W]:
    """log(1 + x). log1p(-1) = -inf, log1p(x < -1) = NaN, log1p(+-0) = +-0.

    u + t = 1 + x exactly (TwoSum); log(1 + x) = log(u) + t/u.
    """
    comptime V = SIMD[F32, W]
    var xd = _daz[W](x)
    var bad = xd.le(V(-1.0)) | xd.ge(_inf[W]()) | _is_nan[W](x)
    var xs = bad.select(V(0.0), xd)
    var u = V(1.0) + xs
    var bb = u - V(1.0)
    var t = (V(1.0) - (u - bb)) + (xs - bb)
    var p = _log_parts[W](u, t / u)
    var res = p[0] + p[1]
    res = xd.lt(V(-1.0)).select(_qnan[W](), res)
    res = xd.eq(V(-1.0)).select(-_inf[W](), res)
    res = xd.ge(_inf[W]()).select(_inf[W](), res)
    res = _is_zero[W](xd).select(xd, _ftz[W](res))
    return _is_nan[W](x).select(x, res)


@fieldwise_init
struct _OnePlusExp[W: Int](TrivialRegisterPassable):
    """1 + e^-a as d + dl (Fast2Sum), with the pieces the sigmoid, silu and
    softplus cores reuse: e^-a = 2^k (ph + pl), 2^k = s1 * s2, e = the
    rounded e^-a."""
    var ph: SIMD[F32, Self.W]
    var pl: SIMD[F32, Self.W]
    var s1: SIMD[F32, Self.W]
    var s2: SIMD[F32, Self.W]
    var e: SIMD[F32, Self.W]
    var d: SIMD[F32, Self.W]
    var dl: SIMD[F32, Self.W]


@always_inline
def _one_plus_exp_neg[W: Int, FAST: Bool](a: SIMD[F32, W]) -> _OnePlusExp[W]:
    """1 + e^-a for a in [0, 104] (FAST: 2^k applies in one step,
    _scale_split)."""
    comptime V = SIMD[F32, W]
    var p = _exp_parts[W](-a)
    var k1 = _scale_split[W, FAST](p[2])
    var s1 = _pow2[W](k1)
    var s2 = _pow2[W](p[2] - k1)
    var e = (p[0] * s1) * s2
    var el = (p[1] * s1) * s2
    var d = V(1.0) + e
    var dl = (e - (d - V(1.0))) + el
    return _OnePlusExp[W](p[0], p[1], s1, s2, e, d, dl)


@always_inline
def _quotient[W: Int](
    nh: SIMD[F32, W], nl: SIMD[F32, W], x: _OnePlusExp[W], neg: SIMD[DType.bool, W]
) -> SIMD[F32, W]:
    """(nh + nl) / (d + dl) with one correction step (exact remainder by
    fma), times 2^k where neg (the numerator then holds the unscaled e^-a)."""
    var q = nh / x.d
    var rem = (-q).fma(x.d, nh)
    q = q + ((rem + nl) - q * x.dl) / x.d
    return neg.select((q * x.s1) * x.s2, q)


def sigmoid_f32[W: Int](v: SIMD[F32, W]) -> SIMD[F32, W]:
    """1 / (1 + e^-v), evaluated as n / (1 + e) with e = e^-|v| (never overflows).

    v >= 0: n = 1; v < 0: n = e (kept unscaled, 2^k applied at the end).
    e and n carry a low part; the quotient gets one correction step
    (exact remainder by fma), so only the last rounding is significant.
    """
    comptime V = SIMD[F32, W]
    var vd = _daz[W](v)
    var a = _abs[W](vd)
    if a.le(V(-FAST_LO)).reduce_and():
        return _sigmoid_core[W, True](vd, a)
    var res = _sigmoid_core[W, False](vd, _clamp[W](a, 0.0, 104.0))
    return _is_nan[W](v).select(v, res)


@always_inline
def _sigmoid_core[W: Int, FAST: Bool](vd: SIMD[F32, W], a: SIMD[F32, W]) -> SIMD[F32, W]:
    """sigmoid of vd with a = |vd| in [0, 104] (FAST: a <= -FAST_LO, 2^k in
    one step)."""
    comptime V = SIMD[F32, W]
    var neg = vd.lt(V(0.0))
    var x = _one_plus_exp_neg[W, FAST](a)
    var nh = neg.select(x.ph, V(1.0))
    var nl = neg.select(x.pl, V(0.0))
    return _ftz[W](_quotient[W](nh, nl, x, neg))


def silu_f32[W: Int](v: SIMD[F32, W]) -> SIMD[F32, W]:
    """v / (1 + e^-v) = v * sigmoid(v), same evaluation as sigmoid_f32.

    silu(v) = v for v > 20 (exactly rounded there); for v < 0 the factor
    2^k is applied last, so silu stays accurate down to its own underflow
    (about v = -92) instead of stopping where e^v underflows.
    """
    comptime V = SIMD[F32, W]
    var vd = _daz[W](v)
    if (vd.ge(V(FAST_LO)) & vd.le(V(20.0))).reduce_and():
        return _silu_core[W, True](vd, vd)
    var res = _silu_core[W, False](vd, _clamp[W](vd, -104.0, 20.0))
    res = vd.gt(V(20.0)).select(vd, res)
    return _is_nan[W](v).select(v, res)


@always_inline
def _silu_core[W: Int, FAST: Bool](vd: SIMD[F32, W], vc: SIMD[F32, W]) -> SIMD[F32, W]:
    """silu of vc (vd: the input after DAZ, for the sign of zero). FAST:
    vc = vd in [FAST_LO, 20], so 2^k applies in one step (_scale_split)."""
    comptime V = SIMD[F32, W]
    var neg = vc.lt(V(0.0))
    var x = _one_plus_exp_neg[W, FAST](_abs[W](vc))
    var m = neg.select(x.ph, V(1.0))
    var ml = neg.select(x.pl, V(0.0))
    var nh = vc * m
    var nl = vc.fma(m, -nh) + vc * ml
    var res = _ftz[W](_quotient[W](nh, nl, x, neg))
    return _is_zero[W](vd).select(vd, res)


def softplus_f32[W: Int](v: SIMD[F32, W]) -> SIMD[F32, W]:
    """v if v > 20 else log1p(e^v).

    With a = |v|: log1p(e^v) = log1p(e^-a) for v <= 0 and
    v + log1p(e^-a) for v > 0. e^-a <= 1 is passed to the log core as
    u + t = 1 + e (Fast2Sum) and the final sum v + hi + lo uses TwoSum;
    for v < -6.9 a short series in e replaces the log core.
    """
    comptime V = SIMD[F32, W]
    var vd = _daz[W](v)
    if (vd.ge(V(FAST_LO)) & vd.le(V(20.0))).reduce_and():
        return _softplus_core[W, True](vd)
    var res = _softplus_core[W, False](_clamp[W](vd, -104.0, 20.0))
    res = vd.gt(V(20.0)).select(vd, res)
    return _is_nan[W](v).select(v, res)


@always_inline
def _softplus_core[W: Int, FAST: Bool](vc: SIMD[F32, W]) -> SIMD[F32, W]:
    """softplus of vc in [-104, 20] (FAST: in [FAST_LO, 20], 2^k in one step)."""
    comptime V = SIMD[F32, W]
    var x = _one_plus_exp_neg[W, FAST](_abs[W](vc))
    var e = x.e
    var lg = _log_parts[W](x.d, x.dl / x.d)
    var sh = vc + lg[0]
    var bb = sh - vc
    var err = (vc - (sh - bb)) + (lg[0] - bb)
    var pos = sh + (err + lg[1])
    # v < -6.9 (e < 2^-10): log1p(e) = e (1 - e/2 + e^2/3) (rel. error < 2^-32),
    # summed on the unscaled ph + pl and scaled by 2^k last (the log core would
    # round u = 1 + e first; the scaled low part could be subnormal).
    var series = (x.ph * e).fma(V(0.3333333432674408).fma(e, V(-0.5)), x.pl)
    var small = ((x.ph + series) * x.s1) * x.s2
    var negr = e.lt(V(0.0009765625)).select(small, lg[0] + lg[1])
    var res = vc.gt(V(0.0)).select(pos, negr)
    return _ftz[W](res)


def sqrt_f32[W: Int](x: SIMD[F32, W]) -> SIMD[F32, W]:
    """Correctly rounded square root (equal to IEEE sqrt for normal inputs).

    x = m 4^e with m in [1, 4) (integer ops); y ~ 1/sqrt(m) from the bit
    trick + 3 Newton steps (fma); s = m y + one Heron correction; then the
    Tuckerman test on the neighbours s-, s+ (the sign of fma(s, s+-, -m) is
    exact) picks the correctly rounded value; the result is s 2^e (exact).
    sqrt(+-0) = +-0, sqrt(x<0) = NaN, sqrt(+inf) = +inf.
    """
    comptime V = SIMD[F32, W]
    comptime I = SIMD[I32, W]
    var xd = _daz[W](x)
    var b = _bits[W](xd)
    var ok = b.gt(I(0)) & b.lt(I(_PINF))
    var bs = ok.select(b, I(0x3F800000))
    var e = (bs >> 23) - 127
    var eh = e >> 1  # floor(e / 2)
    var mb = (bs & 0x7FFFFF) | ((e - (eh << 1) + 127) << 23)
    var m = _from_bits[W](mb)
    var y = _from_bits[W](I(0x5F3759DF) - (mb >> 1))
    var hm = V(0.5) * m
    y = y.fma((-hm).fma(y * y, V(0.5)), y)
    y = y.fma((-hm).fma(y * y, V(0.5)), y)
    y = y.fma((-hm).fma(y * y, V(0.5)), y)
    var s = m * y
    s = ((-s).fma(s, m)).fma(V(0.5) * y, s)
    var sm = _from_bits[W](_bits[W](s) - 1)
    s = s.fma(sm, -m).ge(V(0.0)).select(sm, s)
    var sp = _from_bits[W](_bits[W](s) + 1)
    s = s.fma(sp, -m).lt(V(0.0)).select(sp, s)
    var res = s * _pow2[W](eh)
    res = b.lt(I(0)).select(_qnan[W](), res)
    res = b.eq(I(_PINF)).select(_inf[W](), res)
    res = _is_zero[W](xd).select(xd, res)
    return _is_nan[W](x).select(x, res)


def rsqrt_f32[W: Int](x: SIMD[F32, W]) -> SIMD[F32, W]:
    """1 / sqrt_f32(x) (two correct roundings). rsqrt(+-0) = +-inf, rsqrt(inf) = 0.
    NaN bits from sqrt_f32 are passed on by select (devices differ in what
    1 / NaN returns)."""
    var s = sqrt_f32[W](x)
    return _is_nan[W](s).select(s, SIMD[F32, W](1.0) / s)


def tanh_f32[W: Int](x: SIMD[F32, W]) -> SIMD[F32, W]:
    """Hyperbolic tangent, odd, saturating to +-1 (exactly) for |x| >= 9.5.

    a = |x| < 0.25: a + a^3 P(a^2). Otherwise E = expm1(-2a) = (2^k ph - 1)
    + 2^k pl as a Fast2Sum pair and tanh(a) = -E / (2 + E), divided once
    with one exact-remainder correction step. The sign of x is copied back.
    """
    comptime V = SIMD[F32, W]
    var xd = _daz[W](x)
    var sign = _bits[W](xd) & _SIGN
    var ax = _abs[W](xd)
    var a = _clamp[W](ax, 0.0, _TANH_SAT)
    # small |x|
    var z = a * a
    var pz = V(_T3).fma(z, V(_T2))
    pz = pz.fma(z, V(_T1))
    pz = pz.fma(z, V(_T0))
    var small = (a * z).fma(pz, a)
    # |x| >= 0.25
    var p = _exp_parts[W](V(-2.0) * a)  # k in [-28, 0]
    var sc = _pow2[W](p[2])
    var g = p[0] * sc  # exact
    var eh = g - V(1.0)
    var el = (g - (eh + V(1.0))) + p[1] * sc
    var n = -eh
    var nl = -el
    var d = V(2.0) + eh
    var dl = (eh - (d - V(2.0))) + el
    var q = n / d
    var rem = (-q).fma(d, n)
    var big = q + ((rem + nl) - q * dl) / d
    var res = a.lt(V(_TANH_SMALL)).select(small, big)
    res = ax.ge(V(_TANH_SAT)).select(V(1.0), res)
    res = _from_bits[W](_bits[W](res) | sign)
    res = _is_zero[W](xd).select(xd, res)
    return _is_nan[W](x).select(x, res)


# ---------------------------------------------------------------- derivatives
# Shared by the backwards (one definition, so one set of bits).


@always_inline
def silu_grad_f32[W: Int](z: SIMD[F32, W]) -> SIMD[F32, W]:
    """d silu / dz = s * (1 + z (1 - s)), s = sigmoid(z): s * fma(z, 1 - s, 1)."""
    comptime V = SIMD[F32, W]
    var s = sigmoid_f32[W](z)
    return s * z.fma(V(1.0) - s, V(1.0))


@always_inline
def softplus_grad_f32[W: Int](v: SIMD[F32, W]) -> SIMD[F32, W]:
    """1 where softplus is the identity (v > 20, PyTorch's threshold), else
    sigmoid(v)."""
    comptime V = SIMD[F32, W]
    return v.gt(V(20.0)).select(V(1.0), sigmoid_f32[W](v))
