"""CPU binary variants: the portable baseline (x86-64-v3) and the faster
x86-64-v4 build run the same formula code, so every output byte must match;
and the loader picks the variant the CPU can run (or the one asked for)."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mojolearn
from mojolearn import _loader

ROOT = Path(__file__).resolve().parent.parent

# Each child hashes forward, decode steps, a ragged batch and backward of all
# three blocks, at lengths that cross the chunk sizes (Q=256, Q=64), and
# batch-8 steps; also on bfloat16 / int8 packed weights (the GEMM widening
# them on load).
CHILD = r"""
import hashlib, json, sys
import numpy as np
import mojolearn
from mojolearn import _loader, lowbit
from tests.reference.weights import mamba1_weights, mamba2_weights, random_input
from tests.reference.mamba3_weights import mamba3_weights
bump = sys.argv[1] == "bump"
out = {"arch": _loader.describe(_loader.library())["arch"]}
for name, make, cls, L in (("m1", mamba1_weights, mojolearn.Mamba1Block, 70),
                           ("m2", mamba2_weights, mojolearn.Mamba2Block, 260),
                           ("m3", mamba3_weights, mojolearn.Mamba3Block, 70)):
    for d, fmt in ((32, "float32"), (64, "float32"), (64, "bfloat16"), (64, "int8")):
        blk = cls(lowbit.pack(make(d, seed=3), fmt))  # packed: kernels on bf16/int8 panels
        x = random_input(3, L, d, seed=5)
        if bump:   # negative control: one input one ulp away
            x[1, 2, 0] = np.nextafter(x[1, 2, 0], np.float32(9))
        h = hashlib.sha256()
        h.update(np.asarray(blk.forward(x)).tobytes())
        h.update(np.asarray(blk.forward(x, lengths=[L, 5, L - 3])).tobytes())
        st = blk.allocate_state(3)
        for t in range(6):
            h.update(np.asarray(blk.step(np.ascontiguousarray(x[:, t]), st)).tobytes())
        x8, st8 = random_input(8, 3, d, seed=7), blk.allocate_state(8)
        for t in range(3):  # 8-row products: x86-64-v4 runs them as one 8-row pass
            h.update(np.asarray(blk.step(np.ascontiguousarray(x8[:, t]), st8)).tobytes())
        if fmt == "float32":  # (backward on packed weights runs the float32 kernels)
            g = blk.backward(x[:, :40], random_input(3, 40, d, seed=6))
            for k in sorted(g):
                h.update(np.asarray(g[k]).tobytes())
        out[f"{name}_d{d}_{fmt}"] = h.hexdigest()
print(json.dumps(out))
"""


def _hashes(target, mode="plain"):
    # the child imports the mojolearn this test runs against (installed or
    # the source tree), and tests.reference from the checkout
    pkg_parent = Path(mojolearn.__file__).resolve().parent.parent
    env = dict(os.environ, MOJOLEARN_CPU_TARGET=target, MOJOLEARN_NUM_THREADS="2",
               PYTHONPATH=os.pathsep.join([str(pkg_parent), str(ROOT)]))
    r = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _have_variant(target):
    flags = _loader.cpu_flags() or set()
    names = [d / f"libmojolearn_cpu_{target}.so" for d in _loader.lib_dirs()]
    return any(p.is_file() for p in names) and set(_loader.CPU_VARIANT_FLAGS[target]) <= flags


@pytest.mark.skipif(not _have_variant("x86-64-v4"),
                    reason="no x86-64-v4 binary installed or this CPU lacks AVX-512")
def test_v4_binary_gives_the_baseline_bytes():
    base = _hashes("baseline")
    v4 = _hashes("x86-64-v4")
    assert base.pop("arch") == "x86-64-v3" and v4.pop("arch") == "x86-64-v4"
    assert v4 == base
    # negative control: the hashes do see a one-ulp change of one input
    bumped = _hashes("x86-64-v4", "bump")
    bumped.pop("arch")
    assert all(bumped[k] != v4[k] for k in v4)


def test_unknown_cpu_target_is_refused(monkeypatch):
    monkeypatch.setenv("MOJOLEARN_CPU_TARGET", "pentium")
    with pytest.raises(ValueError, match="MOJOLEARN_CPU_TARGET"):
        _loader.library_path("cpu")


def test_variant_the_cpu_cannot_run_is_never_chosen(monkeypatch):
    monkeypatch.setattr(_loader, "cpu_flags", lambda: {"avx2", "fma", "bmi2", "f16c"})
    monkeypatch.delenv("MOJOLEARN_CPU_TARGET", raising=False)
    assert _loader.library_path("cpu").name == "libmojolearn_cpu.so"
    monkeypatch.setenv("MOJOLEARN_CPU_TARGET", "x86-64-v4")
    with pytest.raises(_loader.BinaryNotFoundError, match="avx512f"):
        _loader.library_path("cpu")


def test_baseline_can_be_forced(monkeypatch):
    monkeypatch.setenv("MOJOLEARN_CPU_TARGET", "baseline")
    assert _loader.library_path("cpu").name == "libmojolearn_cpu.so"


@pytest.mark.skipif(not _have_variant("x86-64-v4"),
                    reason="no x86-64-v4 binary installed or this CPU lacks AVX-512")
def test_best_variant_is_the_default(monkeypatch):
    monkeypatch.delenv("MOJOLEARN_CPU_TARGET", raising=False)
    assert _loader.library_path("cpu").name == "libmojolearn_cpu_x86-64-v4.so"
