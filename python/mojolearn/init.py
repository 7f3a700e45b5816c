"""init_weights: fresh block weights drawn like mamba_ssm initialises its
modules, for training from scratch (no PyTorch, no NumPy).

Distributions (mamba_ssm's ``Mamba``, ``Mamba2`` and ``Mamba3`` modules and
``MixerModel._init_weights``; PyTorch's defaults where they keep them):

- projection matrices ``W (out, in)`` ~ U(-1/sqrt(in), 1/sqrt(in)) (Linear);
  with ``n_layers`` given, ``out_proj.weight`` is divided by sqrt(n_layers)
  (``rescale_prenorm_residual``: one residual per layer);
- depthwise conv weight and bias ~ U(-1/2, 1/2) (Conv1d, fan_in = 4);
- Mamba-1 ``dt_proj.weight`` ~ U(-R^-1/2, R^-1/2), R = dt_rank;
- dt biases: the inverse softplus of dt, with dt log-uniform in
  [dt_min, dt_max] = [0.001, 0.1] and floored at 1e-4;
- Mamba-1 ``A_log[c, n] = log(n + 1)`` (S4D-real); Mamba-2
  ``A_log[h] = log(U(1, 16))``;
- every norm weight and ``D`` ones; Mamba-3 ``B_bias`` and ``C_bias`` ones.

Values are drawn in float64 from ``random.Random(seed)`` in a fixed order
(the dict's order) and rounded to float32, so the same arguments give the
same bytes everywhere. Pure Python: about a second per million values.
"""
from __future__ import annotations

import math
import random
from array import array

__all__ = ["init_weights"]


def init_weights(kind: str, d_model: int, seed: int = 0, *, n_layers: int | None = None,
                 dt_min: float = 0.001, dt_max: float = 0.1) -> dict:
    """Fresh weights for a Mamba1Block, Mamba2Block or Mamba3Block.

    Parameters
    ----------
    kind : {'mamba1', 'mamba2', 'mamba3'}
        A kind of mojolearn.families ('mamba' is the same family as 'mamba1').
    d_model : int
        Model dimension (Mamba-2 and Mamba-3: a multiple of 32).
    seed : int
    n_layers : int or None
        Layers of the model the block is part of: scales out_proj by
        1/sqrt(n_layers) as mamba_ssm does; None leaves it unscaled.
    dt_min, dt_max : float
        Range of the initial time steps.

    Returns
    -------
    dict of str to mojolearn.Array (float32), under the block's names and
    in the shapes its constructor documents.

    Examples
    --------
    >>> w = mojolearn.init_weights("mamba2", 64, seed=1, n_layers=2)
    >>> block = mojolearn.Mamba2Block(w)
    >>> sorted(w)[:3], w["in_proj.weight"].shape
    (['A_log', 'D', 'block_norm.weight'], (514, 64))
    """
    from . import _intake
    from .families import family
    fam = family(kind)
    d = _intake.as_int(d_model, "d_model")
    fam.check_d_model(d)
    if n_layers is not None and _intake.as_int(n_layers, "n_layers") < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    if not 0 < dt_min <= dt_max:
        raise ValueError(f"need 0 < dt_min <= dt_max, got {dt_min}, {dt_max}")
    draw = _Draw(random.Random(_intake.as_int(seed, "seed")))
    out_scale = 1.0 / math.sqrt(n_layers) if n_layers else 1.0
    return {name: _array(shape, values) for name, (shape, values)
            in fam.initial_weights(d, draw, out_scale, dt_min, dt_max).items()}


class _Draw:
    def __init__(self, rng):
        self.rng = rng

    def uniform(self, n, lo, hi):
        u = self.rng.random
        return [lo + (hi - lo) * u() for _ in range(n)]

    def linear(self, out_f, in_f, scale=1.0):
        b = 1.0 / math.sqrt(in_f)
        return (out_f, in_f), [scale * v for v in self.uniform(out_f * in_f, -b, b)]

    def dt_bias(self, n, dt_min, dt_max):
        lo, hi = math.log(dt_min), math.log(dt_max)
        out = []
        for u in self.uniform(n, 0.0, 1.0):
            dt = max(math.exp(lo + u * (hi - lo)), 1e-4)
            out.append(dt + math.log(-math.expm1(-dt)))  # softplus(out) == dt
        return (n,), out


def _ones(*shape):
    return shape, [1.0] * math.prod(shape)


def _array(shape, values):
    from ._array import Array
    a = Array(shape, zero=False)
    memoryview(a).cast("B")[:] = array("f", values).tobytes()
    return a


def _mamba1(d, draw, out_scale, dt_min, dt_max):
    di, r, n = 2 * d, -(-d // 16), 16
    w = {"norm.weight": _ones(d), "in_proj.weight": draw.linear(2 * di, d),
         "conv1d.weight": ((di, 1, 4), draw.uniform(di * 4, -0.5, 0.5)),
         "conv1d.bias": ((di,), draw.uniform(di, -0.5, 0.5)),
         "x_proj.weight": draw.linear(r + 2 * n, di)}
    std = r ** -0.5
    w["dt_proj.weight"] = ((di, r), draw.uniform(di * r, -std, std))
    w["dt_proj.bias"] = draw.dt_bias(di, dt_min, dt_max)
    w["A_log"] = ((di, n), [math.log(k + 1) for _ in range(di) for k in range(n)])
    w["D"] = _ones(di)
    w["out_proj.weight"] = draw.linear(d, di, out_scale)
    return w


def _mamba2(d, draw, out_scale, dt_min, dt_max):
    di = 2 * d
    h, cd = di // 64, di + 256
    w = {"block_norm.weight": _ones(d), "in_proj.weight": draw.linear(2 * di + 256 + h, d),
         "conv1d.weight": ((cd, 1, 4), draw.uniform(cd * 4, -0.5, 0.5)),
         "conv1d.bias": ((cd,), draw.uniform(cd, -0.5, 0.5)),
         "dt_bias": draw.dt_bias(h, dt_min, dt_max),
         "A_log": ((h,), [math.log(a) for a in draw.uniform(h, 1.0, 16.0)]),
         "D": _ones(h), "norm.weight": _ones(di),
         "out_proj.weight": draw.linear(d, di, out_scale)}
    return w


def _mamba3(d, draw, out_scale, dt_min, dt_max):
    di = 2 * d
    h = di // 64
    w = {"block_norm.weight": _ones(d),
         "in_proj.weight": draw.linear(2 * di + 256 + 3 * h + 32, d),
         "dt_bias": draw.dt_bias(h, dt_min, dt_max),
         "B_norm.weight": _ones(128), "C_norm.weight": _ones(128),
         "B_bias": _ones(h, 128), "C_bias": _ones(h, 128), "D": _ones(h),
         "out_proj.weight": draw.linear(d, di, out_scale)}
    return w
