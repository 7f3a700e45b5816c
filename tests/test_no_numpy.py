"""mojolearn without NumPy, lazy binary loading, and a missing binary.

Each check runs in a fresh interpreter (sys.executable) so that the state of
this process (NumPy imported, binaries loaded) does not leak in. The child
finds the same mojolearn as this process: the folder holding the package is
put in front of the inherited PYTHONPATH.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import mojolearn
from mojolearn.mamba import Mamba1State
from mojolearn.reference.weights import mamba1_weights, random_input

PKG_DIR = Path(mojolearn.__file__).resolve().parent
CHILD_TIMEOUT = 120

BLOCK_NUMPY = textwrap.dedent("""
    import sys

    class _BlockNumpy:
        def find_spec(self, name, path=None, target=None):
            if name == "numpy" or name.startswith("numpy."):
                raise ImportError(f"numpy is blocked in this test ({name})")
            return None

    assert "numpy" not in sys.modules, "numpy was imported at interpreter start"
    sys.meta_path.insert(0, _BlockNumpy())
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the numpy blocker does not work")
    try:
        import numpy.linalg  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the numpy blocker does not work for numpy.*")
""")


def run_child(code: str, *args, env_extra=None, pythonpath=None, tmp_path=None):
    """Run code in a fresh interpreter; returns the CompletedProcess (asserting rc 0
    is the caller's choice)."""
    env = dict(os.environ)
    inherited = env.get("PYTHONPATH", "")
    front = str(PKG_DIR.parent) if pythonpath is None else str(pythonpath)
    env["PYTHONPATH"] = front + (os.pathsep + inherited if inherited and pythonpath is None else "")
    for k, v in (env_extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    script = (tmp_path or Path.cwd()) / "child_script.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT,
                          cwd=str(tmp_path) if tmp_path else None)


def _ok(proc):
    assert proc.returncode == 0, f"child failed:\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


# ------------------------------------------------------------ no numpy
D, B, L = 20, 2, 6

CHILD_COMPUTE = BLOCK_NUMPY + textwrap.dedent("""
    import array, json
    import mojolearn
    from mojolearn.mamba import Mamba1State

    spec = json.load(open(sys.argv[1]))
    raw = open(sys.argv[2], "rb").read()

    def mv_of(name):
        off, n, shape = spec[name]
        buf = array.array("f")
        buf.frombytes(raw[off:off + n])
        return memoryview(buf).cast("B").cast("f", shape)

    def marr_of(name):
        off, n, shape = spec[name]
        a = mojolearn.Array(tuple(shape), zero=False)
        memoryview(a).cast("B")[:] = raw[off:off + n]
        return a

    names = spec["weight_names"]
    weights = {k: mv_of("w:" + k) for k in names}
    block = mojolearn.Mamba1Block(weights)
    assert (block.d_model, block.d_inner, block.dt_rank) == (%(D)d, %(DI)d, 2)
    out = {}
    def put(key, buf):
        out[key] = memoryview(buf).tobytes().hex()

    x_mv = mv_of("x")
    put("forward_memoryview", block.forward(x_mv))
    put("forward_Array", block.forward(marr_of("x")))
    put("forward_lengths", block.forward(x_mv, lengths=[3, %(L)d]))

    # conv1d.weight given as (C, 4)
    w2 = dict(weights)
    off, n, shape = spec["w:conv1d.weight"]
    w2["conv1d.weight"] = weights["conv1d.weight"].cast("B").cast("f", [shape[0], 4])
    put("forward_conv2d", mojolearn.Mamba1Block(w2).forward(x_mv))

    # carried state (allocated) : prefill, step (B, d) memoryview, step (B, 1, d) Array
    st = block.allocate_state(%(B)d)
    put("prefill", block.forward(x_mv, st))
    put("step1", block.step(mv_of("t1"), st))
    put("step2", block.step(marr_of("t2").reshape(%(B)d, 1, %(D)d), st))
    put("state_conv", st.conv_window)
    put("state_h", st.h)
    assert st.absolute_position == %(L)d + 2

    # caller-owned state buffers (array.array), and a decode session
    cw = array.array("f", bytes(4 * %(B)d * %(DI)d * 4))
    h = array.array("f", bytes(4 * %(B)d * %(DI)d * 16))
    st2 = Mamba1State(memoryview(cw).cast("B").cast("f", [%(B)d, %(DI)d, 4]),
                      memoryview(h).cast("B").cast("f", [%(B)d, %(DI)d, 16]))
    block.forward(x_mv, st2)
    with block.decode_session(st2) as session:
        put("session_step1", session.step(mv_of("t1")))
        put("session_step2", session.step(mv_of("t2")))
    out["caller_conv"] = cw.tobytes().hex()
    out["caller_h"] = h.tobytes().hex()

    assert "numpy" not in sys.modules, "mojolearn imported numpy"
    json.dump(out, open(sys.argv[3], "w"))
    print("done")
""") % {"D": D, "DI": 2 * D, "B": B, "L": L}


def test_block_without_numpy(tmp_path):
    weights = mamba1_weights(D, seed=21)
    x = random_input(B, L, D, seed=22)
    t1 = random_input(B, 1, D, seed=23).reshape(B, D)
    t2 = random_input(B, 1, D, seed=24).reshape(B, D)
    blobs, spec, off = [], {"weight_names": sorted(weights)}, 0
    for key, arr in [("w:" + k, weights[k]) for k in sorted(weights)] + \
            [("x", x), ("t1", t1), ("t2", t2)]:
        b = np.ascontiguousarray(arr, np.float32).tobytes()
        spec[key] = [off, len(b), list(arr.shape)]
        blobs.append(b)
        off += len(b)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "data.bin").write_bytes(b"".join(blobs))
    out_file = tmp_path / "out.json"
    proc = _ok(run_child(CHILD_COMPUTE, tmp_path / "spec.json", tmp_path / "data.bin", out_file,
                         tmp_path=tmp_path))
    assert "done" in proc.stdout
    got = {k: bytes.fromhex(v) for k, v in json.loads(out_file.read_text()).items()}

    # the same computation here, with NumPy inputs
    def b_(a):
        return memoryview(a).tobytes()

    block = mojolearn.Mamba1Block(weights)
    want = {}
    want["forward_memoryview"] = b_(block.forward(x))
    want["forward_Array"] = want["forward_memoryview"]
    want["forward_lengths"] = b_(block.forward(x, lengths=[3, L]))
    w2 = dict(weights)
    w2["conv1d.weight"] = weights["conv1d.weight"].reshape(2 * D, 4)
    want["forward_conv2d"] = b_(mojolearn.Mamba1Block(w2).forward(x))
    st = block.allocate_state(B)
    want["prefill"] = b_(block.forward(x, st))
    want["step1"] = b_(block.step(t1, st))
    want["step2"] = b_(block.step(t2[:, None, :], st))
    want["state_conv"] = b_(st.conv_window)
    want["state_h"] = b_(st.h)
    st2 = Mamba1State(np.zeros((B, 2 * D, 4), np.float32), np.zeros((B, 2 * D, 16), np.float32))
    block.forward(x, st2)
    want["session_step1"] = b_(block.step(t1, st2))
    want["session_step2"] = b_(block.step(t2, st2))
    want["caller_conv"] = b_(st2.conv_window)
    want["caller_h"] = b_(st2.h)

    assert set(got) == set(want)
    for k in want:
        assert got[k] == want[k], f"{k}: bytes differ between the NumPy-free child and NumPy"
    assert want["forward_conv2d"] == want["forward_memoryview"]
    assert want["session_step1"] == want["step1"] and want["caller_h"] == want["state_h"]


# --------------------------------------------------------- lazy loading
CHILD_LAZY = BLOCK_NUMPY + textwrap.dedent("""
    import array

    def loaded():
        maps = open("/proc/self/maps").read()
        return {
            "native_module": "mojolearn._native" in sys.modules,
            "native_so": "mojolearn/_native" in maps or "/_native." in maps,
            "kernel_so": "libmojolearn_" in maps,
        }

    before = loaded()
    assert not any(before.values()), before
    import mojolearn
    after_import = loaded()
    assert not any(after_import.values()), ("import mojolearn loaded a binary", after_import)
    # the float64 references need NumPy only when one is used
    import mojolearn.reference
    assert mojolearn.reference is sys.modules["mojolearn.reference"]
    assert "mamba1_numpy" in dir(mojolearn.reference)
    try:
        mojolearn.reference.mamba1_numpy
    except ImportError as e:
        assert "numpy" in str(e), e
    else:
        raise SystemExit("a NumPy reference resolved without NumPy")
    assert not any(loaded().values()), ("mojolearn.reference loaded a binary", loaded())
    import mojolearn.mamba
    from mojolearn import Mamba1Block, Mamba1State, BinaryNotFoundError  # noqa: F401
    after_names = loaded()
    assert not any(after_names.values()), ("importing the classes loaded a binary", after_names)

    d, di, r = 1, 2, 1
    shapes = {"norm.weight": [d], "in_proj.weight": [2 * di, d], "conv1d.weight": [di, 1, 4],
              "conv1d.bias": [di], "x_proj.weight": [r + 32, di], "dt_proj.weight": [di, r],
              "dt_proj.bias": [di], "A_log": [di, 16], "D": [di], "out_proj.weight": [d, di]}
    weights = {}
    for j, (k, shape) in enumerate(sorted(shapes.items())):
        n = 1
        for s in shape:
            n *= s
        buf = array.array("f", [((i * 7 + j) % 11 - 5) / 16.0 for i in range(n)])
        weights[k] = memoryview(buf).cast("B").cast("f", shape)
    block = Mamba1Block(weights)
    after_block = loaded()
    assert after_block["native_module"] and after_block["kernel_so"], after_block
    maps = open("/proc/self/maps").read()
    assert "libmojolearn_cpu" in maps  # the baseline or a faster CPU variant
    x = array.array("f", [0.5, -0.25, 1.0])
    y = block.forward(memoryview(x).cast("B").cast("f", [1, 3, 1]))
    assert isinstance(y, mojolearn.Array) and y.shape == (1, 3, 1)
    assert all(v == v for v in memoryview(y).cast("B").cast("f").tolist())
    assert "numpy" not in sys.modules
    print("lazy ok")
""")


def test_import_loads_no_binary(tmp_path):
    proc = _ok(run_child(CHILD_LAZY, tmp_path=tmp_path))
    assert "lazy ok" in proc.stdout


# ------------------------------------------------------- missing binary
CHILD_MISSING = textwrap.dedent("""
    import array, os, sys
    import mojolearn
    assert os.path.realpath(mojolearn.__file__).startswith(os.path.realpath(sys.argv[1])), \\
        (mojolearn.__file__, sys.argv[1])
    assert "libmojolearn_" not in open("/proc/self/maps").read()
    assert issubclass(mojolearn.BinaryNotFoundError, Exception)

    d, di = 1, 2
    shapes = {"norm.weight": [d], "in_proj.weight": [2 * di, d], "conv1d.weight": [di, 1, 4],
              "conv1d.bias": [di], "x_proj.weight": [33, di], "dt_proj.weight": [di, 1],
              "dt_proj.bias": [di], "A_log": [di, 16], "D": [di], "out_proj.weight": [d, di]}
    weights = {}
    for k, shape in shapes.items():
        n = 1
        for s in shape:
            n *= s
        weights[k] = memoryview(array.array("f", [0.125] * n)).cast("B").cast("f", shape)
    for attempt in range(2):   # the error is not cached into something else
        try:
            mojolearn.Mamba1Block(weights)
        except mojolearn.BinaryNotFoundError as e:
            msg = str(e)
        else:
            raise SystemExit("constructing a block without its binary did not raise")
        print("MESSAGE:", msg)
    assert "libmojolearn_" not in open("/proc/self/maps").read()
""")


def _pkg_copy(tmp_path, *, keep_native=True):
    """A copy of the installed package without its kernel binaries (the
    install itself is not touched)."""
    root = tmp_path / "site"
    def ignore(folder, names):
        drop = {"lib", "__pycache__"}
        if not keep_native:
            drop |= {n for n in names if n.startswith("_native")}
        return [n for n in names if n in drop or n.startswith("libmojolearn_")]
    shutil.copytree(PKG_DIR, root / "mojolearn", ignore=ignore)
    return root


def test_missing_kernel_binary(tmp_path):
    empty = tmp_path / "empty_lib"
    empty.mkdir()
    root = _pkg_copy(tmp_path)
    assert not (root / "mojolearn" / "lib").exists()
    proc = _ok(run_child(CHILD_MISSING, root, pythonpath=root, tmp_path=tmp_path,
                         env_extra={"MOJOLEARN_LIB_DIR": str(empty), "MOJOLEARN_VENDOR": None}))
    messages = [ln for ln in proc.stdout.splitlines() if ln.startswith("MESSAGE:")]
    assert len(messages) == 2
    for m in messages:
        assert "libmojolearn_cpu.so" in m, m
        assert str(empty) in m, m   # says where it looked


def test_missing_host_layer(tmp_path):
    """Kernel binary present (MOJOLEARN_LIB_DIR points at the real one) but the
    host layer mojolearn._native missing: import works, first use names it."""
    root = _pkg_copy(tmp_path, keep_native=False)
    proc = _ok(run_child(CHILD_MISSING, root, pythonpath=root, tmp_path=tmp_path,
                         env_extra={"MOJOLEARN_LIB_DIR": str(PKG_DIR / "lib"),
                                    "MOJOLEARN_VENDOR": None}))
    messages = [ln for ln in proc.stdout.splitlines() if ln.startswith("MESSAGE:")]
    assert len(messages) == 2 and all("mojolearn._native" in m for m in messages), proc.stdout


def test_vendor_without_binary(tmp_path):
    """MOJOLEARN_VENDOR=cuda on the real install (no CUDA binary is built)."""
    from mojolearn import _loader
    if any(p.name.startswith("libmojolearn_cuda_") for p in _loader.find_binaries()):
        pytest.skip("a CUDA binary is installed")
    proc = _ok(run_child(CHILD_MISSING, PKG_DIR.parent, tmp_path=tmp_path,
                         env_extra={"MOJOLEARN_VENDOR": "cuda"}))
    messages = [ln for ln in proc.stdout.splitlines() if ln.startswith("MESSAGE:")]
    assert len(messages) == 2 and all("libmojolearn_cuda_<arch>.so" in m for m in messages), proc.stdout
