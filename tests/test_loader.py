"""The loader: what a binary says about itself, refusal of a mismatch,
`python -m mojolearn info`."""
import os
import subprocess
import sys

import pytest

import mojolearn
from mojolearn import _loader


def _run(code, **env):
    e = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=e, timeout=120)


def test_binary_describes_itself():
    lib = _loader.library()
    d = _loader.describe(lib)
    assert d["vendor"] == "cpu" and d["mode"] == "identical"
    assert d["arch"] and d["features"]
    assert lib.abi_version == mojolearn._abi.ABI_VERSION
    block_vendor = mojolearn.Mamba1Block.__name__  # import path works
    assert block_vendor == "Mamba1Block"


def test_abi_mismatch_is_refused():
    code = ("import mojolearn, mojolearn._abi as a; a.ABI_VERSION = 999\n"
            "from tests.reference.weights import mamba1_weights\n"
            "try:\n    mojolearn.Mamba1Block(mamba1_weights(4, 0))\n"
            "except mojolearn.BinaryNotFoundError as e:\n    print('REFUSED', e)\n")
    r = _run(code)
    assert "REFUSED" in r.stdout and "ABI version" in r.stdout, r.stdout + r.stderr


def test_mode_mismatch_is_refused():
    # the CPU binary runs 'identical'; asking the loader for 'fast' must fail
    with pytest.raises(mojolearn.BinaryNotFoundError, match="numeric mode"):
        _loader._load(_loader.library_path("cpu"), "cpu", "fast")


def test_missing_cpu_features_are_reported(monkeypatch):
    lib = _loader.library()
    assert _loader.missing_cpu_features(lib) == []  # this machine runs it
    monkeypatch.setattr(_loader, "cpu_flags", lambda: {"sse2"})
    assert "avx2" in _loader.missing_cpu_features(lib)


def test_info_command():
    r = subprocess.run([sys.executable, "-m", "mojolearn", "info"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for needle in ("mojolearn " + mojolearn.__version__, "libmojolearn_cpu.so",
                   "vendor=cpu", "mode=identical", "abi=", "would use:", "threads:",
                   "needs CPU features:"):
        assert needle in out, f"{needle!r} missing from:\n{out}"


def test_vendor_and_mode_used_come_from_the_binary():
    from tests.reference.weights import mamba1_weights
    b = mojolearn.Mamba1Block(mamba1_weights(4, 0))
    assert b.vendor_used() == "cpu"
    assert b.numeric_mode_used() == "identical"


def test_set_num_threads_validates():
    with pytest.raises(ValueError):
        mojolearn.set_num_threads(0)
    with pytest.raises(TypeError):
        mojolearn.set_num_threads(2.0)
