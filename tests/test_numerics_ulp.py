"""Accuracy and bit-identity of the library's own float32 transcendentals.

The kernels are called through `ml_math_eval(fn_id, inp, out, n, width)` of
the CPU binary (fixture `native_lib`, tests/conftest.py). Errors are measured
in float32 ulps of the float64 NumPy value (not rounded first):
    err = |got - ref64| / ulp32(ref64),  ulp32(y) = 2^(max(floor(log2|y|), -126) - 23)
so a correctly rounded result has err <= 0.5. The bounds are the measured
maxima (docs/numerics.md, exhaustive runs) rounded up a little, so a change
that makes any function less accurate fails here.
Subnormal policy (numerics.mojo): subnormal inputs act as zeros of the same
sign; results below 2^-126 are +0.0.
"""
import ctypes

import numpy as np
import pytest

FN = {"exp": 0, "log": 1, "log1p": 2, "softplus": 3, "sigmoid": 4, "silu": 5,
      "sqrt": 6, "rsqrt": 7, "tanh": 8, "sin": 9, "cos": 10, "floor": 11,
      "mod2pi": 12, "sincos.sin": 13, "sincos.cos": 14}
TINY = 2.0 ** -126
FLT_MAX = float(np.finfo(np.float32).max)
TWO_PI_F32 = np.float32(2 * np.pi)  # 6.2831855, the modulus of mod2pi


def run(lib, name, x, width=16):
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.full_like(x, np.nan)
    rc = lib.ml_math_eval(FN[name], x.ctypes.data, out.ctypes.data, x.size, width)
    assert rc == 0
    return out


def ulp32(y):
    a = np.abs(y)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    return np.ldexp(1.0, (np.maximum(e, -126) - 23).astype(np.int64))


def f32(v):
    return np.asarray(v, dtype=np.float32)


def lin(a, b, n):
    return np.linspace(a, b, n, dtype=np.float64).astype(np.float32)


def pow2s(e0, e1, n, sign=1.0):
    return (sign * np.exp2(np.linspace(e0, e1, n))).astype(np.float32)


def ref_softplus(v):
    return np.where(v > 20, v, np.log1p(np.exp(v)))


# name: (float64 reference, sweep inputs, bound in ulps). Bounds: measured max
# over all float32 of the main domain (docs/numerics.md) rounded up by ~0.02.
CASES = {
    "exp": (np.exp, lambda: np.concatenate([
        lin(-87.33, 88.72, 1_000_000), lin(-1, 1, 300_001), pow2s(-40, 0, 100_000, -1),
        pow2s(-40, 0, 100_000)]), 0.63),
    "log": (np.log, lambda: np.concatenate([
        pow2s(-126, 127.999, 1_000_000), lin(0.5, 2, 500_001)]), 0.68),
    "log1p": (np.log1p, lambda: np.concatenate([
        pow2s(-126, -1e-7, 400_000, -1), pow2s(-126, 127.99, 400_000),
        lin(-0.9999, 4, 600_001)]), 0.70),
    "softplus": (ref_softplus, lambda: np.concatenate([
        lin(-87.3, 30, 800_001), lin(-8, 8, 400_001)]), 0.70),
    "sigmoid": (lambda v: 1 / (1 + np.exp(-v)), lambda: np.concatenate([
        lin(-87.3, 30, 800_001), lin(-8, 8, 400_001)]), 0.63),
    "silu": (lambda v: v / (1 + np.exp(-v)), lambda: np.concatenate([
        lin(-91.5, 30, 800_001), lin(-8, 8, 400_001)]), 0.66),
    "sqrt": (np.sqrt, lambda: np.concatenate([
        pow2s(-126, 127.999, 800_000), lin(0, 16, 200_001)]), 0.5),
    "rsqrt": (lambda v: 1 / np.sqrt(v), lambda: np.concatenate([
        pow2s(-126, 127.999, 800_000), lin(1, 4, 200_001)]), 1.50),
    "tanh": (np.tanh, lambda: np.concatenate([
        lin(-10, 10, 800_001), pow2s(-126, 3.3, 200_000), pow2s(-126, 3.3, 200_000, -1)]),
        0.63),
    "sin": (np.sin, lambda: np.concatenate([
        lin(-100, 100, 1_000_001), lin(-4, 4, 200_001), pow2s(-30, 20.99, 200_000),
        pow2s(-30, 20.99, 200_000, -1)]), 0.80),
    "cos": (np.cos, lambda: np.concatenate([
        lin(-100, 100, 1_000_001), lin(-4, 4, 200_001), pow2s(-30, 20.99, 200_000),
        pow2s(-30, 20.99, 200_000, -1)]), 0.80),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_max_ulp_error(native_lib, name):
    ref_fn, inputs, bound = CASES[name]
    x = inputs()
    got = run(native_lib, name, x)
    with np.errstate(all="ignore"):
        ref = ref_fn(x.astype(np.float64))
    normal = np.isfinite(ref) & (np.abs(ref) >= TINY) & (np.abs(ref) <= FLT_MAX)
    err = np.abs(got[normal].astype(np.float64) - ref[normal]) / ulp32(ref[normal])
    worst = int(np.argmax(err))
    assert err.max() <= bound, (
        f"{name}: {err.max():.4f} ulp > {bound} at x={x[normal][worst]!r} "
        f"(got {got[normal][worst]!r}, want {ref[normal][worst]!r})")
    # results below 2^-126 are flushed to +0 (2^-126 itself allowed at the edge)
    tiny = np.isfinite(ref) & (np.abs(ref) < TINY) & (x != 0)
    edge = np.abs(ref) >= TINY * (1 - 2.0 ** -23)
    ok = (got.view(np.uint32) == 0) | (edge & (np.abs(got) == np.float32(TINY)))
    assert np.all(ok[tiny]), f"{name}: tiny results not flushed to +0: {x[tiny & ~ok][:5]}"


def test_sqrt_exact_exhaustive_mantissas(native_lib):
    """Every float32 in [1, 4) (all mantissas, both exponent parities): sqrt is
    computed as sqrt(m) 2^e with m in [1, 4), so this covers all normal inputs."""
    b = np.arange(0x3F800000, 0x40800000, dtype=np.uint32)
    x = b.view(np.float32)
    assert np.array_equal(run(native_lib, "sqrt", x).view(np.uint32),
                          np.sqrt(x).view(np.uint32))


def test_sqrt_exact_random_normals(native_lib):
    rng = np.random.default_rng(7)
    b = rng.integers(0x00800000, 0x7F800000, size=1_000_000, dtype=np.uint32)
    x = b.view(np.float32)
    assert np.array_equal(run(native_lib, "sqrt", x).view(np.uint32),
                          np.sqrt(x).view(np.uint32))
    # rsqrt is defined as 1 / sqrt (both correctly rounded)
    want = (np.float32(1) / np.sqrt(x)).view(np.uint32)
    assert np.array_equal(run(native_lib, "rsqrt", x).view(np.uint32), want)


def test_floor_exact(native_lib):
    rng = np.random.default_rng(8)
    b = rng.integers(0, 2 ** 32, size=1_000_000, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([b.view(np.float32), lin(-300, 300, 400_001),
                        f32([0.5, -0.5, 2.5, -2.5, 8388607.5, -8388607.5, 8388609, -1, 1])])
    sub = (x.view(np.uint32) & 0x7F800000) == 0
    xd = np.where(sub, np.copysign(np.float32(0), x), x)  # DAZ
    nan = np.isnan(xd)
    want = np.floor(np.where(nan, np.float32(0), xd))
    got = run(native_lib, "floor", x)
    assert np.array_equal(got[nan].view(np.uint32), x[nan].view(np.uint32))
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def _mod2pi_ref(v):
    """Float32 rounding of the exact remainder of v modulo C = float32(2 pi) in
    [0, C), with C itself mapped to 0. In float64, k*C and v - k*C are exact
    here (|v| <= 2^24, or |v| small enough that the rounding cannot matter)."""
    c = np.float64(TWO_PI_F32)
    v = np.where(np.abs(v) < TINY, np.float32(0), v).astype(np.float64)  # DAZ
    k = np.floor(v / c)
    k = np.where(v - k * c < 0, k - 1, k)  # the sign of a rounded difference is exact
    k = np.where(v - (k + 1) * c >= 0, k + 1, k)
    r32 = (v - k * c).astype(np.float32)
    return np.where(r32 >= TWO_PI_F32, np.float32(0), r32)


def test_mod2pi(native_lib):
    rng = np.random.default_rng(9)
    mult = (np.arange(-2000, 2001) * np.float64(TWO_PI_F32)).astype(np.float32)
    near = np.concatenate([mult, np.nextafter(mult, np.float32(np.inf)),
                           np.nextafter(mult, np.float32(-np.inf))])
    v = np.concatenate([lin(-1000, 1000, 1_000_001), near,
                        rng.uniform(-2.0 ** 24, 2.0 ** 24, 200_000).astype(np.float32),
                        f32([0.0, 1e-30, -1e-30, -1e-7, -3e-7, np.pi, -np.pi, 7.0,
                             2.0 ** 24, -2.0 ** 24, TWO_PI_F32])])
    got = run(native_lib, "mod2pi", v)
    want = _mod2pi_ref(v)
    bad = got.view(np.uint32) != want.view(np.uint32)
    assert not bad.any(), f"mod2pi differs at {v[bad][:5]}: {got[bad][:5]} vs {want[bad][:5]}"
    assert np.all((got >= 0) & (got < TWO_PI_F32))
    assert run(native_lib, "mod2pi", f32([-0.0])).view(np.uint32)[0] == 0  # +0


def _bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


QNAN = 0x7FC00000
INF = np.float32(np.inf)
SUB = np.float32(1e-40)  # subnormal

# (function, input, expected float32 value); NaN expected means bits 0x7FC00000.
SPECIALS = [
    ("exp", 0.0, 1.0), ("exp", -0.0, 1.0), ("exp", INF, INF), ("exp", -INF, 0.0),
    ("exp", 88.72283172607422, 3.4027985e38), ("exp", 88.72284, INF), ("exp", -104.0, 0.0),
    ("exp", -87.33654, 1.1754997e-38), ("exp", -87.33655, 0.0), ("exp", SUB, 1.0),
    ("log", 1.0, 0.0), ("log", 0.0, -INF), ("log", -0.0, -INF), ("log", SUB, -INF),
    ("log", -1.0, np.nan), ("log", -INF, np.nan), ("log", INF, INF),
    ("log", 2.0, 0.6931472),
    ("log1p", 0.0, 0.0), ("log1p", -0.0, -0.0), ("log1p", -1.0, -INF), ("log1p", -2.0, np.nan),
    ("log1p", INF, INF), ("log1p", -INF, np.nan), ("log1p", 1e-30, 1e-30),
    ("log1p", -SUB, -0.0), ("log1p", FLT_MAX, 88.72284),
    ("softplus", 0.0, 0.6931472), ("softplus", -0.0, 0.6931472), ("softplus", 20.0, 20.0),
    ("softplus", 20.5, 20.5), ("softplus", 1e30, 1e30), ("softplus", INF, INF),
    ("softplus", -INF, 0.0), ("softplus", -90.0, 0.0), ("softplus", -200.0, 0.0),
    ("sigmoid", 0.0, 0.5), ("sigmoid", INF, 1.0), ("sigmoid", -INF, 0.0),
    ("sigmoid", 20.0, 1.0), ("sigmoid", -88.0, 0.0), ("sigmoid", -1e30, 0.0),
    ("silu", 0.0, 0.0), ("silu", -0.0, -0.0), ("silu", INF, INF), ("silu", -INF, 0.0),
    ("silu", 25.0, 25.0), ("silu", -100.0, 0.0), ("silu", -90.0, -7.374611e-38),
    ("sqrt", 0.0, 0.0), ("sqrt", -0.0, -0.0), ("sqrt", SUB, 0.0), ("sqrt", -SUB, -0.0),
    ("sqrt", -1.0, np.nan), ("sqrt", -INF, np.nan), ("sqrt", INF, INF), ("sqrt", 4.0, 2.0),
    ("rsqrt", 0.0, INF), ("rsqrt", -0.0, -INF), ("rsqrt", INF, 0.0), ("rsqrt", 4.0, 0.5),
    ("rsqrt", -1.0, np.nan),
    ("tanh", 0.0, 0.0), ("tanh", -0.0, -0.0), ("tanh", INF, 1.0), ("tanh", -INF, -1.0),
    ("tanh", 9.5, 1.0), ("tanh", 9.02, 1.0), ("tanh", 9.0, 0.99999994), ("tanh", -30.0, -1.0),
    ("tanh", 1e-30, 1e-30), ("tanh", -SUB, -0.0),
    ("sin", 0.0, 0.0), ("sin", -0.0, -0.0), ("sin", INF, np.nan), ("sin", -INF, np.nan),
    ("sin", np.float32(np.pi), -8.742278e-08), ("sin", 1e-30, 1e-30),
    ("cos", 0.0, 1.0), ("cos", -0.0, 1.0), ("cos", INF, np.nan),
    ("cos", np.float32(np.pi / 2), -4.371139e-08),
    ("floor", -0.0, -0.0), ("floor", -0.5, -1.0), ("floor", 0.5, 0.0), ("floor", -SUB, -0.0),
    ("floor", SUB, 0.0), ("floor", INF, INF), ("floor", -INF, -INF), ("floor", -2.5, -3.0),
    ("mod2pi", 0.0, 0.0), ("mod2pi", TWO_PI_F32, 0.0), ("mod2pi", np.float32(np.pi), np.pi),
    ("mod2pi", -np.float32(np.pi), np.pi), ("mod2pi", INF, np.nan), ("mod2pi", -1e-30, 0.0),
]


@pytest.mark.parametrize("name,x,want", SPECIALS)
def test_special_values(native_lib, name, x, want):
    got = run(native_lib, name, f32([x]))
    want = f32([want])
    if np.isnan(want[0]):
        assert _bits(got)[0] == QNAN, f"{name}({x}) = {got[0]!r}, want NaN 0x7FC00000"
    else:
        assert _bits(got)[0] == _bits(want)[0], f"{name}({x}) = {got[0]!r}, want {want[0]!r}"


@pytest.mark.parametrize("name", sorted(FN))
def test_nan_passthrough(native_lib, name):
    x = np.array([0x7FC00000, 0xFFC00000, 0x7FC12345, 0x7F800001], np.uint32).view(np.float32)
    assert np.array_equal(_bits(run(native_lib, name, x)), _bits(x))


def _random_bits_inputs(n=300_007):
    rng = np.random.default_rng(10)
    b = rng.integers(0, 2 ** 32, size=n, dtype=np.uint64).astype(np.uint32)
    x = b.view(np.float32).copy()
    x[: n // 3] = rng.uniform(-120, 120, n // 3).astype(np.float32)  # main domains
    x[n // 3: n // 3 + 8] = f32([0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 1])
    return x


@pytest.mark.parametrize("name", sorted(FN))
def test_width_identical_bits(native_lib, name):
    """SIMD width 16, 8 and 1 (odd n: scalar tails too) give the same bytes."""
    x = _random_bits_inputs()
    g16, g8, g1 = (_bits(run(native_lib, name, x, w)) for w in (16, 8, 1))
    assert np.array_equal(g16, g8)
    assert np.array_equal(g16, g1)


@pytest.mark.parametrize("name", sorted(FN))
def test_subnormal_policy(native_lib, name):
    """Subnormal inputs act as zeros of the same sign; no result is subnormal;
    -0.0 comes out only for a -0.0 (or negative subnormal) input."""
    sub = np.array([1, 0x7FFFFF, 0x400000, 0x80000001, 0x807FFFFF], np.uint32).view(np.float32)
    zeros = np.where(np.signbit(sub), np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    assert np.array_equal(_bits(run(native_lib, name, sub)), _bits(run(native_lib, name, zeros)))
    x = _random_bits_inputs()
    gb = _bits(run(native_lib, name, x))
    assert not np.any(((gb & 0x7F800000) == 0) & ((gb & 0x7FFFFF) != 0)), "subnormal result"
    negzero_in = (_bits(x) & 0x7F800000) == 0
    negzero_in &= (_bits(x) & 0x80000000) != 0
    assert np.all(negzero_in[gb == 0x80000000]), "-0.0 from a nonzero input"


def test_sincos_gives_the_bits_of_sin_and_cos(native_lib):
    """sincos_f32 (one range reduction for both, used by the Mamba-3 scan)
    returns exactly sin_f32's and cos_f32's bits, specials included."""
    specials = f32([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 4194304.0,
                    -4194304.0, 5e6, -3e38, np.pi, TWO_PI_F32, 1e-8])
    x = np.concatenate([_random_bits_inputs(), lin(-100, 100, 200_001), specials])
    for part, ref in (("sincos.sin", "sin"), ("sincos.cos", "cos")):
        for w in (16, 8, 1):
            assert np.array_equal(_bits(run(native_lib, part, x, w)),
                                  _bits(run(native_lib, ref, x, w))), (part, w)
    # negative controls, real outputs that must differ: the other part, and
    # each part at the neighbouring inputs (the comparison sees a part that
    # reads the wrong one of its two results, or a perturbed argument)
    finite = np.isfinite(x) & (np.abs(x) >= 2.0 ** -126)
    with np.errstate(invalid="ignore"):  # NaN inputs stay NaN
        xn = np.nextafter(x, np.float32(np.inf))
    for part, ref, other in (("sincos.sin", "sin", "cos"), ("sincos.cos", "cos", "sin")):
        got = _bits(run(native_lib, part, x))
        assert not np.array_equal(got, _bits(run(native_lib, other, x))), (part, other)
        moved = got != _bits(run(native_lib, ref, xn))
        assert moved[finite].mean() > 0.5, (part, "at the next float")


def test_unknown_fn_id_writes_nan(native_lib):
    x = f32([1.0, 2.0, 3.0])
    out = np.zeros_like(x)
    native_lib.ml_math_eval(99, x.ctypes.data, out.ctypes.data, x.size, 16)
    assert np.all(np.isnan(out))
    native_lib.ml_math_eval(-1, x.ctypes.data, out.ctypes.data, x.size, 8)
    assert np.all(np.isnan(out))


def test_widths_other_than_8_16_use_scalar(native_lib):
    x = lin(-5, 5, 1001)
    assert np.array_equal(_bits(run(native_lib, "exp", x, 3)), _bits(run(native_lib, "exp", x, 1)))
    assert np.array_equal(_bits(run(native_lib, "exp", x[:0], 16)), _bits(x[:0]))


# The in-range fast paths of numerics.mojo (exp: [-87, 88]; silu, sigmoid,
# softplus: [-80, 20] after DAZ; sigmoid by |v|) run when all lanes of a
# vector are inside. A 16-lane vector whose last lane is out of range sends
# its other 15 lanes down the general path, so the two are compared on the
# same inputs. Values: a stride over every float32 of [-90, 90] plus both
# edges of each range and the tiny normals (where the general path flushes).
FAST_PATHS = {"exp": 1000.0, "silu": 1000.0, "sigmoid": 1000.0, "softplus": 1000.0}


def _fast_path_inputs():
    hi = np.float32(90.0).view(np.uint32)
    pos = np.arange(0, hi, 997, dtype=np.uint32).view(np.float32)
    edges = [np.float32(e) for e in (-87.0, 88.0, -80.0, 20.0, 80.0)]
    near = [np.nextafter(e, np.float32(s * np.inf)) for e in edges for s in (-1, 1)]
    tiny = np.float32(2.0 ** -126) * np.arange(1, 64, dtype=np.float32)
    x = np.concatenate([pos, -pos, edges, near, tiny, -tiny, f32([0.0, -0.0])])
    return x[np.abs(x) <= 90.0]


@pytest.mark.parametrize("name", sorted(FAST_PATHS))
def test_fast_paths_give_the_general_paths_bits(native_lib, name):
    x = _fast_path_inputs()
    x = np.concatenate([x, np.zeros((-x.size) % 15, np.float32)]).reshape(-1, 15)
    grouped = np.concatenate([x, np.zeros((x.shape[0], 1), np.float32)], axis=1)
    mixed = grouped.copy()
    mixed[:, 15] = FAST_PATHS[name]  # out of every fast range: the general path
    fast = _bits(run(native_lib, name, grouped.ravel(), 16)).reshape(-1, 16)[:, :15]
    general = _bits(run(native_lib, name, mixed.ravel(), 16)).reshape(-1, 16)[:, :15]
    in_fast = np.abs(x) <= (87.0 if name == "exp" else 20.0)  # some groups are all inside
    assert in_fast.all(axis=1).sum() > 1000  # the fast path was taken
    assert np.array_equal(fast, general), (name, x[fast != general][:8])
