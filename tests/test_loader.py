"""The loader: what a binary says about itself, refusal of a mismatch,
`python -m mojolearn info`."""
import ctypes
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mojolearn
from mojolearn import _loader
from tests.errors import raises_naming


def _run(code, **env):
    e = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=e, timeout=120)


REPO = Path(__file__).resolve().parents[1]
ELF_MACHINE = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183}
# CMakeLists.txt: the baseline binary's target and features per host CPU
BASELINE = {62: ("x86-64-v3", "avx2,fma,bmi2,f16c"), 183: ("generic", "baseline")}


def _raw_self_report(path):
    """vendor, numeric mode, ABI version and description read straight from
    the binary's exports with ctypes (not through the host layer)."""
    so = ctypes.CDLL(str(path))
    for name in ("ml_abi_version", "ml_vendor", "ml_numeric_mode"):
        getattr(so, name).restype = ctypes.c_int64
    so.ml_describe.restype = ctypes.c_int64
    so.ml_describe.argtypes = [ctypes.c_char_p, ctypes.c_int64]
    buf = ctypes.create_string_buffer(512)
    n = so.ml_describe(buf, 512)
    return (so.ml_vendor(), so.ml_numeric_mode(), so.ml_abi_version(),
            buf.raw[:n].decode(), so)


CPU_BINARIES = [p for p in _loader.find_binaries() if p.name.startswith("libmojolearn_cpu")]


@pytest.mark.parametrize("path", CPU_BINARIES or [None], ids=lambda p: p and p.name)
def test_binary_describes_itself(path):
    """What each installed CPU binary says about itself against facts that do
    not come from it: the ABI version in the Mojo source, the file's ELF
    machine and build name (set by CMakeLists.txt from the target), this
    CPU's flags, and the identical mode's promise (bits independent of the
    SIMD width) measured on its own functions."""
    assert path is not None, "no CPU binary installed"
    vendor, mode, abi, desc, so = _raw_self_report(path)
    d = dict(part.split("=", 1) for part in desc.split(";"))
    assert set(d) == {"vendor", "arch", "features", "mode"}, desc
    # the host layer reads the same values
    lib = _loader.native().Library(str(path))
    assert (lib.vendor, lib.numeric_mode, lib.abi_version, lib.description) == \
        (vendor, mode, abi, desc)
    # ABI version: the constant of mojo/mojolearn_kernels/abi.mojo
    src = (REPO / "mojo" / "mojolearn_kernels" / "abi.mojo").read_text()
    assert abi == int(re.search(r"ABI_VERSION\s*=\s*(\d+)", src).group(1))
    assert abi == mojolearn._abi.ABI_VERSION
    # vendor: the integer and the text agree; a host binary is the CPU one
    assert mojolearn._abi.VENDORS[vendor] == d["vendor"] == "cpu"
    # arch: the ELF header's machine is this machine's; the target is the
    # file name's suffix (baseline: CMakeLists.txt's default for the CPU)
    with open(path, "rb") as f:
        head = f.read(20)
    assert head[:4] == b"\x7fELF"
    machine = int.from_bytes(head[18:20], "little")
    assert machine == ELF_MACHINE[platform.machine().lower()]
    target = path.name[len("libmojolearn_cpu"):-len(".so")].lstrip("_")
    if target:
        assert d["arch"] == target
        assert d["features"] == ",".join(_loader.CPU_VARIANT_FLAGS[target])
    else:
        assert (d["arch"], d["features"]) == BASELINE[machine]
    flags = _loader.cpu_flags()
    if flags is not None and d["features"] != "baseline" and \
            not set(d["features"].split(",")) <= flags:
        # Loading and describing run no vector code, so a variant whose
        # features this CPU lacks (x86-64-v4 on an AVX2-only CPU) gets this
        # far; its functions below would fault. The loader must not choose it
        # and must say why it skips it.
        assert path.name in dict(_loader.skipped_variants())
        assert _loader.library_path("cpu").name != path.name
        return
    # numeric mode: 'identical' in both forms, and its promise holds on the
    # binary's own exp/tanh/sin at SIMD widths 16, 8 and 1
    assert mojolearn._abi.NUMERIC_MODES[mode] == d["mode"] == "identical"
    so.ml_math_eval.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_int64, ctypes.c_int64]
    x = np.linspace(-30, 30, 4099, dtype=np.float32)
    for fn in (0, 8, 9):
        outs = []
        for width in (16, 8, 1):
            out = np.full_like(x, np.nan)
            so.ml_math_eval(fn, x.ctypes.data, out.ctypes.data, x.size, width)
            outs.append(out.tobytes())
        assert outs[0] == outs[1] == outs[2], fn


def test_abi_mismatch_is_refused():
    code = ("import mojolearn, mojolearn._abi as a; a.ABI_VERSION = 999\n"
            "from mojolearn.reference.weights import mamba1_weights\n"
            "try:\n    mojolearn.Mamba1Block(mamba1_weights(4, 0))\n"
            "except mojolearn.BinaryNotFoundError as e:\n    print('REFUSED', e)\n")
    r = _run(code)
    assert "REFUSED" in r.stdout and "ABI version" in r.stdout, r.stdout + r.stderr


def test_mode_mismatch_is_refused():
    # the CPU binary runs 'identical'; asking the loader for 'fast' must fail
    with raises_naming(mojolearn.BinaryNotFoundError, "numeric mode 'identical'", "'fast'"):
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
    from mojolearn.reference.weights import mamba1_weights
    b = mojolearn.Mamba1Block(mamba1_weights(4, 0))
    assert b.vendor_used() == "cpu"
    assert b.numeric_mode_used() == "identical"


def test_set_num_threads_validates():
    with pytest.raises(ValueError):
        mojolearn.set_num_threads(0)
    with pytest.raises(TypeError):
        mojolearn.set_num_threads(2.0)
