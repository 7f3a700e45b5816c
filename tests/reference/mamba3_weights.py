"""Deterministic float32 test weights for Mamba3Block (names and shapes of the
constructor), drawn from ``numpy.random.default_rng(seed)`` in a fixed order.

Initialisation follows mamba_ssm's ``Mamba3`` module: projections
U(-1/sqrt(in), 1/sqrt(in)) (PyTorch Linear); dt_bias = inverse softplus of dt
log-uniform in [dt_min, dt_max] (floored at 1e-4); B_bias and C_bias are
ones in mamba_ssm, here ``1 + 0.1 N(0, 1)`` and norms ``1 + 0.05 N(0, 1)``,
D ``1 + 0.1 U(-1, 1)``, so that a swapped or ignored element is visible.
"""
from __future__ import annotations

import math

import numpy as np

from .weights import random_input  # noqa: F401  (re-exported for the tests)

__all__ = ["mamba3_dims", "mamba3_weights", "random_input"]

D_STATE = 128
HEAD_DIM = 64
N_ANGLES = 32


def mamba3_dims(d_model: int) -> dict:
    d_model = int(d_model)
    if d_model < 32 or d_model % 32:
        raise ValueError(f"Mamba-3 needs d_model a positive multiple of 32, got {d_model}")
    di = 2 * d_model
    h = di // HEAD_DIM
    return {"d_model": d_model, "d_inner": di, "nheads": h, "head_dim": HEAD_DIM,
            "d_state": D_STATE, "n_angles": N_ANGLES,
            "d_in_proj": 2 * di + 2 * D_STATE + 3 * h + N_ANGLES}


def mamba3_weights(d_model: int, seed: int, scale: float = 1.0, *,
                   dt_min: float = 0.001, dt_max: float = 0.1) -> dict:
    """Float32 Mamba-3 weights: block_norm.weight (d,), in_proj.weight
    (d_in_proj, d) rows z | x | B | C | dd_dt | dd_A | trap | angle,
    dt_bias (H,), B_norm.weight (128,), C_norm.weight (128,), B_bias (H, 128),
    C_bias (H, 128), D (H,), out_proj.weight (d, 2d). ``scale`` multiplies
    the two projection matrices."""
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
    w["B_norm.weight"] = 1.0 + 0.05 * rng.standard_normal(D_STATE)
    w["C_norm.weight"] = 1.0 + 0.05 * rng.standard_normal(D_STATE)
    w["B_bias"] = 1.0 + 0.1 * rng.standard_normal((h, D_STATE))
    w["C_bias"] = 1.0 + 0.1 * rng.standard_normal((h, D_STATE))
    w["D"] = 1.0 + 0.1 * rng.uniform(-1.0, 1.0, size=h)
    b = 1.0 / math.sqrt(di)
    w["out_proj.weight"] = rng.uniform(-b, b, size=(d, di)) * scale
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in w.items()}
