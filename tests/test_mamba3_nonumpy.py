"""Mamba3Block without NumPy: array.array buffers in, mojolearn.Array out,
and the same bytes as the NumPy path in this process."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np

import mojolearn
from tests.test_no_numpy import BLOCK_NUMPY, PKG_DIR, CHILD_TIMEOUT

D, B, L = 32, 2, 5

MAKE = textwrap.dedent(f"""
    import random
    from array import array
    D, B, L = {D}, {B}, {L}
    H = 2 * D // 64
    SHAPES = {{"block_norm.weight": (D,), "in_proj.weight": (4 * D + 256 + 3 * H + 32, D),
              "dt_bias": (H,), "B_norm.weight": (128,), "C_norm.weight": (128,),
              "B_bias": (H, 128), "C_bias": (H, 128), "D": (H,), "out_proj.weight": (D, 2 * D)}}

    def buf(shape, rng, scale):
        n = 1
        for s in shape:
            n *= s
        a = array("f", [rng.uniform(-scale, scale) for _ in range(n)])
        return memoryview(a).cast("B").cast("f", shape)

    def make():
        rng = random.Random(0)
        w = {{k: buf(s, rng, 0.2 if len(s) == 2 else 1.0) for k, s in SHAPES.items()}}
        x = buf((B, L, D), rng, 1.0)
        xs = buf((B, D), rng, 1.0)
        return w, x, xs
""")

CHILD = BLOCK_NUMPY + MAKE + textwrap.dedent("""
    import mojolearn
    w, x, xs = make()
    blk = mojolearn.Mamba3Block(w)
    y = blk.forward(x)
    st = blk.allocate_state(B)
    blk.forward(x, st)
    blk.step(xs, st)
    h = blk.h_last_
    assert "numpy" not in sys.modules
    sys.stdout.write(memoryview(y).tobytes().hex() + "\\n" + memoryview(h).tobytes().hex())
""")


def test_mamba3_without_numpy_same_bytes():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PKG_DIR.parent) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                       text=True, timeout=CHILD_TIMEOUT)
    assert r.returncode == 0, r.stderr[-2000:]
    y_hex, h_hex = r.stdout.strip().split("\n")
    ns = {}
    exec(MAKE, ns)
    w, x, xs = ns["make"]()
    w = {k: np.asarray(v) for k, v in w.items()}
    x, xs = np.asarray(x), np.asarray(xs)
    blk = mojolearn.Mamba3Block(w)
    y = np.asarray(blk.forward(x))
    assert y.tobytes().hex() == y_hex
    st = blk.allocate_state(B)
    blk.forward(x, st)
    blk.step(xs, st)
    assert np.asarray(blk.h_last_).tobytes().hex() == h_hex
