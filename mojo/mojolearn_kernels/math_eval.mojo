"""Elementwise evaluation of the own transcendentals (for accuracy tests).

math_eval(fn_id, inp, dst, n, width) writes dst[i] = f(inp[i]) for i < n,
using SIMD width `width` (16, 8, else 1) and a scalar tail. The functions
are width independent, so every width gives the same bits; the tests check it.
fn_id: 0 exp, 1 log, 2 log1p, 3 softplus, 4 sigmoid, 5 silu, 6 sqrt,
7 rsqrt, 8 tanh, 9 sin, 10 cos, 11 floor, 12 mod2pi, 13 sincos's sine,
14 sincos's cosine (one call giving both: the tests check that they are
the bits of sin and cos); any other id writes NaN.
"""
from std.memory import Pointer

from .numerics import (
    exp_f32, log_f32, log1p_f32, softplus_f32, sigmoid_f32, silu_f32, sqrt_f32, rsqrt_f32, tanh_f32,
)
from .trig import sin_f32, cos_f32, floor_f32, mod2pi_f32, sincos_f32

comptime F32Ptr = Pointer[Float32, MutUntrackedOrigin]
comptime MATH_EVAL_COUNT = 15

# OP_MATH_EVAL argument slots.
comptime ME_FN = 0
comptime ME_SRC = 1  # float32 (n,)
comptime ME_DST = 2  # float32 (n,)
comptime ME_N = 3
comptime ME_WIDTH = 4


@always_inline
def _apply[FN: Int, W: Int](x: SIMD[DType.float32, W]) -> SIMD[DType.float32, W]:
    comptime if FN == 0:
        return exp_f32[W](x)
    elif FN == 1:
        return log_f32[W](x)
    elif FN == 2:
        return log1p_f32[W](x)
    elif FN == 3:
        return softplus_f32[W](x)
    elif FN == 4:
        return sigmoid_f32[W](x)
    elif FN == 5:
        return silu_f32[W](x)
    elif FN == 6:
        return sqrt_f32[W](x)
    elif FN == 7:
        return rsqrt_f32[W](x)
    elif FN == 8:
        return tanh_f32[W](x)
    elif FN == 9:
        return sin_f32[W](x)
    elif FN == 10:
        return cos_f32[W](x)
    elif FN == 11:
        return floor_f32[W](x)
    elif FN == 12:
        return mod2pi_f32[W](x)
    elif FN == 13:
        return sincos_f32[W](x)[0]
    elif FN == 14:
        return sincos_f32[W](x)[1]
    else:
        return SIMD[DType.float32, W](FloatLiteral.nan)


def _run[FN: Int, W: Int](inp: F32Ptr, dst: F32Ptr, n: Int):
    var i = 0
    while i + W <= n:
        dst.unsafe_store(i, _apply[FN, W](inp.unsafe_load[width=W](i)))
        i += W
    while i < n:  # scalar tail: same formula, same bits
        dst[unsafe_offset=i] = _apply[FN, 1](inp[unsafe_offset=i])
        i += 1


def _run_width[FN: Int](inp: F32Ptr, dst: F32Ptr, n: Int, width: Int):
    if width == 16:
        _run[FN, 16](inp, dst, n)
    elif width == 8:
        _run[FN, 8](inp, dst, n)
    else:
        _run[FN, 1](inp, dst, n)


def math_eval(fn_id: Int, inp: F32Ptr, dst: F32Ptr, n: Int, width: Int):
    """dst[i] = f_{fn_id}(inp[i]) for i in [0, n), SIMD width 16, 8 or 1."""
    comptime for FN in range(MATH_EVAL_COUNT + 1):
        if fn_id == FN or (FN == MATH_EVAL_COUNT and (fn_id < 0 or fn_id >= MATH_EVAL_COUNT)):
            _run_width[FN](inp, dst, n, width)
