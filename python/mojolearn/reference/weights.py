"""Deterministic float32 weights and inputs for Mamba1Block, Mamba2Block and Mamba3Block.

Use them to build a block and feed the same weights and inputs to the float64
references (:mod:`mojolearn.reference.mamba1`, ``mamba2``, ``mamba3``); the
test suite builds its blocks from them. Every array is drawn from
``numpy.random.default_rng(seed)`` in a fixed order, so the same
``(d_model, seed, ...)`` always gives the same bytes. Names and shapes are
exactly the constructor names of :class:`mojolearn.Mamba1Block`,
:class:`mojolearn.Mamba2Block` and :class:`mojolearn.Mamba3Block`; every
array is float32 and C-contiguous.

The initialisation follows mamba_ssm / transformers (``init_mamba_weights``):

- projection matrices ``W (out, in)`` ~ U(-1/sqrt(in), 1/sqrt(in)) (PyTorch Linear);
- depthwise conv weight and bias ~ U(-1/2, 1/2) (PyTorch Conv1d, fan_in = 4);
- Mamba-1 ``dt_proj.weight`` ~ U(-R^-1/2, R^-1/2) (mamba_ssm ``dt_init="random"``);
- dt bias = inverse softplus of dt, dt log-uniform in [dt_min, dt_max] (0.001, 0.1),
  floored at 1e-4;
- Mamba-1 ``A_log[c, n] = log(n + 1)`` (S4D-real); Mamba-2 ``A_log[h] = log(U(1, 16))``;
- norms ``1 + 0.05 N(0, 1)`` and ``D`` ``1 + 0.1 U(-1, 1)`` (near 1, with a little noise
  so that a swapped or ignored element is visible);
- Mamba-3 (mamba_ssm's ``Mamba3`` module): ``B_bias`` and ``C_bias`` are ones in
  mamba_ssm, here ``1 + 0.1 N(0, 1)``, for the same reason.

``scale`` multiplies every projection matrix and the conv weight (``in_proj``,
``conv1d.weight``, ``x_proj``, ``dt_proj.weight``, ``out_proj``); norms, biases,
``A_log`` and ``D`` are not scaled. ``scale=1.0`` is the realistic initialisation.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["mamba1_weights", "mamba2_weights", "mamba3_weights", "random_input",
           "mamba1_dims", "mamba2_dims", "mamba3_dims"]

D_STATE_1 = 16
D_STATE_2 = 128
HEAD_DIM = 64
D_CONV = 4
D_STATE_3 = 128
N_ANGLES = 32


def mamba1_dims(d_model: int) -> dict:
    """Derived Mamba-1 sizes: d_inner = 2 d, dt_rank = ceil(d / 16), d_state 16."""
    d_model = int(d_model)
    if d_model < 1:
        raise ValueError(f"d_model must be >= 1, got {d_model}")
    return {"d_model": d_model, "d_inner": 2 * d_model, "dt_rank": math.ceil(d_model / 16),
            "d_state": D_STATE_1, "d_conv": D_CONV}


def mamba2_dims(d_model: int, n_groups: int = 1) -> dict:
    """Derived Mamba-2 sizes: d_inner = 2 d, H = d_inner / 64, conv_dim =
    d_inner + 256 n_groups."""
    d_model = int(d_model)
    if d_model < 32 or d_model % 32:
        raise ValueError(f"Mamba-2 needs d_model a positive multiple of 32, got {d_model}")
    d_inner = 2 * d_model
    nheads = d_inner // HEAD_DIM
    g = int(n_groups)
    if g < 1 or nheads % g:
        raise ValueError(f"n_groups must be a positive divisor of the {nheads} heads, got {g}")
    bc = 2 * g * D_STATE_2
    return {"d_model": d_model, "d_inner": d_inner, "nheads": nheads, "head_dim": HEAD_DIM,
            "d_state": D_STATE_2, "n_groups": g, "conv_dim": d_inner + bc,
            "d_in_proj": 2 * d_inner + bc + nheads, "d_conv": D_CONV}


def _linear(rng: np.random.Generator, out_f: int, in_f: int, scale: float) -> np.ndarray:
    bound = 1.0 / math.sqrt(in_f)
    return rng.uniform(-bound, bound, size=(out_f, in_f)) * scale


def _dt_bias(rng: np.random.Generator, n: int, dt_min: float, dt_max: float) -> np.ndarray:
    u = rng.random(n)
    dt = np.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = np.maximum(dt, 1e-4)
    # inverse softplus: softplus(dt + log(-expm1(-dt))) == dt
    return dt + np.log(-np.expm1(-dt))


def _f32(d: dict) -> dict:
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in d.items()}


def mamba1_weights(d_model: int, seed: int, scale: float = 1.0, *,
                   dt_min: float = 0.001, dt_max: float = 0.1) -> dict[str, np.ndarray]:
    """Float32 Mamba-1 block weights (names and shapes of Mamba1Block), deterministic in seed.

    Shapes with d = d_model, di = 2d, R = ceil(d/16): norm.weight (d,), in_proj.weight
    (2di, d), conv1d.weight (di, 1, 4), conv1d.bias (di,), x_proj.weight (R + 32, di),
    dt_proj.weight (di, R), dt_proj.bias (di,), A_log (di, 16), D (di,), out_proj.weight
    (d, di).
    """
    dims = mamba1_dims(d_model)
    d, di, R, N = dims["d_model"], dims["d_inner"], dims["dt_rank"], dims["d_state"]
    rng = np.random.default_rng(seed)
    w = {}
    w["norm.weight"] = 1.0 + 0.05 * rng.standard_normal(d)
    w["in_proj.weight"] = _linear(rng, 2 * di, d, scale)
    w["conv1d.weight"] = rng.uniform(-0.5, 0.5, size=(di, 1, D_CONV)) * scale
    w["conv1d.bias"] = rng.uniform(-0.5, 0.5, size=di)
    w["x_proj.weight"] = _linear(rng, R + 2 * N, di, scale)
    dt_std = R ** -0.5
    w["dt_proj.weight"] = rng.uniform(-dt_std, dt_std, size=(di, R)) * scale
    w["dt_proj.bias"] = _dt_bias(rng, di, dt_min, dt_max)
    w["A_log"] = np.log(np.broadcast_to(np.arange(1, N + 1, dtype=np.float64), (di, N)))
    w["D"] = 1.0 + 0.1 * rng.uniform(-1.0, 1.0, size=di)
    w["out_proj.weight"] = _linear(rng, d, di, scale)
    return _f32(w)


def mamba2_weights(d_model: int, seed: int, scale: float = 1.0, *,
                   dt_min: float = 0.001, dt_max: float = 0.1,
                   A_init_range: tuple[float, float] = (1.0, 16.0),
                   n_groups: int = 1) -> dict[str, np.ndarray]:
    """Float32 Mamba-2 block weights (names and shapes of Mamba2Block), deterministic in seed.

    Shapes with d = d_model (multiple of 32), di = 2d, H = di/64, G = n_groups,
    CD = di + 256 G (in_proj: 2di + 256 G + H rows); n_groups = 1 draws the
    same values as before the option:
    block_norm.weight (d,), in_proj.weight (2di + 256G + H, d) in row order z | xBC | dt,
    conv1d.weight (CD, 1, 4), conv1d.bias (CD,), dt_bias (H,), A_log (H,), D (H,),
    norm.weight (di,) (the gated norm), out_proj.weight (d, di).
    """
    dims = mamba2_dims(d_model, n_groups)
    d, di, H, CD = dims["d_model"], dims["d_inner"], dims["nheads"], dims["conv_dim"]
    rng = np.random.default_rng(seed)
    w = {}
    w["block_norm.weight"] = 1.0 + 0.05 * rng.standard_normal(d)
    w["in_proj.weight"] = _linear(rng, dims["d_in_proj"], d, scale)
    w["conv1d.weight"] = rng.uniform(-0.5, 0.5, size=(CD, 1, D_CONV)) * scale
    w["conv1d.bias"] = rng.uniform(-0.5, 0.5, size=CD)
    w["dt_bias"] = _dt_bias(rng, H, dt_min, dt_max)
    w["A_log"] = np.log(rng.uniform(A_init_range[0], A_init_range[1], size=H))
    w["D"] = 1.0 + 0.1 * rng.uniform(-1.0, 1.0, size=H)
    w["norm.weight"] = 1.0 + 0.05 * rng.standard_normal(di)
    w["out_proj.weight"] = _linear(rng, d, di, scale)
    return _f32(w)


def mamba3_dims(d_model: int) -> dict:
    """Derived Mamba-3 sizes: d_inner = 2 d, H = d_inner / 64, d_state 128, 32 angles,
    d_in_proj = 2 d_inner + 256 + 3 H + 32."""
    d_model = int(d_model)
    if d_model < 32 or d_model % 32:
        raise ValueError(f"Mamba-3 needs d_model a positive multiple of 32, got {d_model}")
    di = 2 * d_model
    h = di // HEAD_DIM
    return {"d_model": d_model, "d_inner": di, "nheads": h, "head_dim": HEAD_DIM,
            "d_state": D_STATE_3, "n_angles": N_ANGLES,
            "d_in_proj": 2 * di + 2 * D_STATE_3 + 3 * h + N_ANGLES}


def mamba3_weights(d_model: int, seed: int, scale: float = 1.0, *,
                   dt_min: float = 0.001, dt_max: float = 0.1) -> dict:
    """Float32 Mamba-3 block weights (names and shapes of Mamba3Block), deterministic in seed.

    Shapes with d = d_model (multiple of 32), H = 2d/64: block_norm.weight (d,),
    in_proj.weight (d_in_proj, d) in row order z | x | B | C | dd_dt | dd_A | trap |
    angle, dt_bias (H,), B_norm.weight (128,), C_norm.weight (128,), B_bias (H, 128),
    C_bias (H, 128), D (H,), out_proj.weight (d, 2d). ``scale`` multiplies the two
    projection matrices.
    """
    dm = mamba3_dims(d_model)
    d, di, h, npj = dm["d_model"], dm["d_inner"], dm["nheads"], dm["d_in_proj"]
    rng = np.random.default_rng(seed)
    w = {}
    w["block_norm.weight"] = 1.0 + 0.05 * rng.standard_normal(d)
    b = 1.0 / math.sqrt(d)
    w["in_proj.weight"] = rng.uniform(-b, b, size=(npj, d)) * scale
    u = rng.random(h)
    dt = np.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = np.maximum(dt, 1e-4)
    w["dt_bias"] = dt + np.log(-np.expm1(-dt))
    w["B_norm.weight"] = 1.0 + 0.05 * rng.standard_normal(D_STATE_3)
    w["C_norm.weight"] = 1.0 + 0.05 * rng.standard_normal(D_STATE_3)
    w["B_bias"] = 1.0 + 0.1 * rng.standard_normal((h, D_STATE_3))
    w["C_bias"] = 1.0 + 0.1 * rng.standard_normal((h, D_STATE_3))
    w["D"] = 1.0 + 0.1 * rng.uniform(-1.0, 1.0, size=h)
    b = 1.0 / math.sqrt(di)
    w["out_proj.weight"] = rng.uniform(-b, b, size=(d, di)) * scale
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in w.items()}


def random_input(B: int, L: int, d: int, seed: int, scale: float = 1.0) -> np.ndarray:
    """Float32 activations (B, L, d) ~ scale * N(0, 1), deterministic in seed."""
    rng = np.random.default_rng(seed)
    return np.ascontiguousarray(rng.standard_normal((B, L, d)) * scale, dtype=np.float32)
