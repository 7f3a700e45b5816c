"""The fixed matrix of cases whose output bytes a GPU binary must reproduce.

`run_cases(mojolearn)` runs every case on the binary the process uses and
returns {case name: output bytes}. bench/gpu_check.py runs it once on the
CPU binary and once on a GPU binary and compares; tests/test_device_staging.py
runs it with the host layer staging buffers like a device does. Needs NumPy
(weights from tests/reference).
"""
from __future__ import annotations

# (block, d_model, B, L, ragged lengths): small, but crossing each block's
# chunk size once (Mamba-2: 256, Mamba-3: 64) and the B x L chunking of
# Mamba-1's workspace (256 rows).
SHAPES = [
    (1, 32, 1, 5, None), (1, 64, 3, 100, [100, 37, 1]),
    (2, 32, 1, 5, None), (2, 64, 2, 300, [300, 41]),
    (3, 32, 1, 5, None), (3, 64, 2, 90, [90, 13]),
]
DECODE_STEPS = 3
# Blocks on packed projection weights (mojolearn.lowbit): (block, d, B, L).
PACKED = [(1, 64, 2, 20), (2, 64, 2, 20), (3, 64, 2, 20)]


def _weights(kind: int, d: int):
    from tests.reference.weights import mamba1_weights, mamba2_weights
    from tests.reference.mamba3_weights import mamba3_weights
    return {1: mamba1_weights, 2: mamba2_weights, 3: mamba3_weights}[kind](d, seed=kind)


def _bytes(a) -> bytes:
    import numpy as np
    return np.ascontiguousarray(np.asarray(a)).tobytes()


def block_for(mojolearn, kind: int, d: int):
    cls = {1: mojolearn.Mamba1Block, 2: mojolearn.Mamba2Block, 3: mojolearn.Mamba3Block}[kind]
    return cls(_weights(kind, d))


def run_case(mojolearn, kind, d, b, l, lengths) -> dict:
    """Output bytes of one shape: forward, prefill + decode steps, ragged
    forward, backward (every gradient)."""
    from tests.reference.weights import random_input
    block = block_for(mojolearn, kind, d)
    x = random_input(b, l, d, seed=7)
    tag = f"m{kind} d{d} B{b} L{l}"
    out = {f"{tag} forward": _bytes(block.forward(x))}
    state = block.allocate_state(b)
    ys = [_bytes(block.forward(x[:, : l - DECODE_STEPS], state))]
    for t in range(l - DECODE_STEPS, l):
        ys.append(_bytes(block.step(x[:, t], state)))
    out[f"{tag} decode"] = b"".join(ys)
    if lengths is not None:
        out[f"{tag} ragged"] = _bytes(block.forward(x, lengths=lengths))
    g = random_input(b, l, d, seed=8)
    grads = block.backward(x, g)
    out[f"{tag} backward"] = b"".join(_bytes(grads[k]) for k in sorted(grads))
    return out


def run_packed(mojolearn, kind, d, b, l) -> dict:
    """Forward and decode of a block built on bfloat16 and int8 packed
    weights (the blob keeps them packed; the GEMM widens them on load)."""
    from tests.reference.weights import random_input
    cls = {1: mojolearn.Mamba1Block, 2: mojolearn.Mamba2Block, 3: mojolearn.Mamba3Block}[kind]
    x = random_input(b, l, d, seed=9)
    out = {}
    for fmt in ("bfloat16", "int8"):
        block = cls(mojolearn.lowbit.pack(_weights(kind, d), fmt))
        tag = f"m{kind} d{d} B{b} L{l} {fmt}"
        out[f"{tag} forward"] = _bytes(block.forward(x))
        state = block.allocate_state(b)
        ys = [_bytes(block.forward(x[:, : l - DECODE_STEPS], state))]
        for t in range(l - DECODE_STEPS, l):
            ys.append(_bytes(block.step(x[:, t], state)))
        out[f"{tag} decode"] = b"".join(ys)
    return out


MATH_FUNCTIONS = 13  # math_eval.mojo: exp, log, ..., mod2pi


def run_math(lib) -> dict:
    """The own transcendentals (OP_MATH_EVAL, every function) over a fixed
    set of float32 inputs, run by `lib` (a loaded binary): the simplest op,
    so a GPU mismatch here points at the numerics, not at a block."""
    import numpy as np
    from mojolearn import _abi
    rng = np.random.default_rng(5)
    x = np.concatenate([
        np.linspace(-100, 100, 4001, dtype=np.float32),
        (rng.standard_normal(4000) * 10).astype(np.float32),
        np.exp2(rng.uniform(-140, 120, 4000)).astype(np.float32),
        np.array([0.0, -0.0, 1e-45, -1e-45, 1e-38, 3.4e38, -3.4e38], np.float32)])
    out = {}
    for fn in range(MATH_FUNCTIONS):
        y = np.full_like(x, 7.0)
        lib.run(_abi.OP_MATH_EVAL, [fn, x.ctypes.data, y.ctypes.data, x.size, 1])
        out[f"math fn{fn}"] = y.tobytes()
    return out


def run_cases(mojolearn, shapes=SHAPES, packed=PACKED) -> dict:
    from mojolearn import _loader
    out = run_math(_loader.library())
    for s in shapes:
        out.update(run_case(mojolearn, *s))
    for s in packed:
        out.update(run_packed(mojolearn, *s))
    return out
