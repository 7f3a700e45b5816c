"""The check-op cases of the digest matrix (bench/gpu_cases.py, listed
first): the own transcendentals (OP_MATH_EVAL, every function, SIMD widths
1, 8 and 16) over a fixed set of float32 inputs, and the non-finite scan
(OP_FIRST_NONFINITE and the plain export). Needs NumPy."""
from __future__ import annotations

MATH_FUNCTIONS = 15  # math_eval.mojo MATH_EVAL_COUNT: exp, ..., mod2pi, sincos's sin, cos


def math_input(perturb: bool = False):
    """The fixed float32 inputs (perturb: every element one ulp down)."""
    import numpy as np
    rng = np.random.default_rng(5)
    x = np.concatenate([
        np.linspace(-100, 100, 4001, dtype=np.float32),
        (rng.standard_normal(4000) * 10).astype(np.float32),
        np.exp2(rng.uniform(-140, 120, 4000)).astype(np.float32),
        np.array([0.0, -0.0, 1e-45, -1e-45, 1e-38, 3.4e38, -3.4e38], np.float32)])
    if perturb:  # every element: floor and mod2pi see few one-ulp steps
        x = np.nextafter(x, np.float32(-np.inf))
    return x


def math_values(lib, x, fn, width) -> bytes:
    """Bytes of function `fn` over float32 array x at SIMD width `width`."""
    import numpy as np
    from mojolearn import _abi
    y = np.full_like(x, 7.0)
    op = _abi.OP_MATH_EVAL
    lib.run(op, _abi.op_spec(lib, op).pack(fn=fn, src=x.ctypes.data, dst=y.ctypes.data,
                                           n=x.size, width=width))
    return y.tobytes()


def run_math(lib) -> dict:
    """Every function at width 1, run by `lib` (a loaded binary): the
    simplest op, so a GPU mismatch here points at the numerics, not at a
    block."""
    x = math_input()
    return {f"math fn{fn}": math_values(lib, x, fn, 1) for fn in range(MATH_FUNCTIONS)}


def nonfinite_bytes(lib) -> bytes:
    """OP_FIRST_NONFINITE (ragged rows: padding not looked at) and the plain
    scan export, over arrays with a NaN or inf placed in turn."""
    import numpy as np
    from mojolearn import _abi
    b, l, inner = 3, 7, 37
    lens = np.array([7, 3, 1], np.int64)
    out = []
    for i, pos in enumerate([None, (0, 6, 36), (1, 2, 0), (1, 3, 5), (2, 0, 17), (2, 4, 1)]):
        a = np.random.default_rng(13 + i).standard_normal((b, l, inner)).astype(np.float32)
        if pos is not None:
            a[pos] = np.nan if i % 2 else -np.inf
        got = np.full(1, -7, np.int64)
        op = _abi.OP_FIRST_NONFINITE
        lib.run(op, _abi.op_spec(lib, op).pack(src=a.ctypes.data, b=b, l=l, inner=inner,
                                               lengths=lens.ctypes.data, out=got.ctypes.data))
        out += [int(got[0]), lib.first_nonfinite(a.ctypes.data, a.size)]
    return np.array(out, np.int64).tobytes()


def math_cases(lib, perturb: bool = False):
    """(name, bytes) of the check-op cases, in the matrix order."""
    x = math_input(perturb)
    for fn in range(MATH_FUNCTIONS):
        yield f"math fn{fn}", math_values(lib, x, fn, 1)
    wide = (math_values(lib, x, fn, w) for w in (8, 16) for fn in range(MATH_FUNCTIONS))
    yield f"math fn0-{MATH_FUNCTIONS - 1} w8 w16", b"".join(wide)
    yield "nonfinite", nonfinite_bytes(lib)
