"""The host layer's op recorder and the ABI replay driver (python/native/record.h,
tools/abi_replay/replay.c), natively: what the arm64 check (tools/arm64_check.sh)
relies on, kept working by the ordinary test suite.

Records of a few cases (forward, ragged, decode steps, a decode session,
backward, packed weights with the lowbit ops) replay on the same binary to the
recorded bytes; a flipped output byte is reported; an op whose argument points
at memory the host layer does not know runs but is counted as not recorded;
no file is written once recording is off. Needs a C compiler (`cc`).
"""
import shutil
import subprocess

import pytest

np = pytest.importorskip("numpy")

import mojolearn  # noqa: E402
from mojolearn import _abi, _loader  # noqa: E402
from bench import gpu_cases  # noqa: E402
from tests.test_cpu_variants import ROOT  # noqa: E402


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler for tools/abi_replay/replay.c")
    exe = tmp_path_factory.mktemp("replay") / "replay"
    subprocess.run([cc, "-O2", "-std=c99", "-Wall", "-Wextra", "-Werror", "-o", str(exe),
                    str(ROOT / "tools" / "abi_replay" / "replay.c"), "-ldl"], check=True)
    return [str(exe), _loader.library().path]


@pytest.fixture
def recording(tmp_path):
    native = _loader.native()
    native.set_record_dir(str(tmp_path), "t")
    yield tmp_path
    native.set_record_dir("", "")


def _run(cmd, files):
    r = subprocess.run(cmd + [str(f) for f in files], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def test_records_replay_to_the_recorded_bytes(replay, recording):
    gpu_cases.run_case(mojolearn, 2, 32, 2, 12, [12, 5])  # forward .. session, backward
    gpu_cases.run_packed(mojolearn, 3, 64, 1, 6)  # bfloat16/int8 blocks, lowbit ops
    files = sorted(recording.glob("t-*.mlrec"))
    written, skipped, _ = _loader.native().record_status()
    assert written == len(files) > 0 and skipped == 0
    ops = {int(f.stem.rsplit("op", 1)[1]) for f in files}
    assert {_abi.OP_M2_FORWARD, _abi.OP_M2_BACKWARD, _abi.OP_M3_FORWARD, _abi.OP_LOWBIT_PACK,
            _abi.OP_LOWBIT_UNPACK, _abi.OP_PANELS_EXTRACT} <= ops
    rc, out = _run(replay, files)
    assert rc == 0, out
    assert f"{len(files)} records, {len(files)} identical" in out


def test_a_flipped_output_byte_is_reported(replay, recording, tmp_path):
    x = np.ones(100, np.float32)
    y = np.zeros(100, np.float32)
    _loader.library().run(_abi.OP_MATH_EVAL, [0, x.ctypes.data, y.ctypes.data, x.size, 1])
    (f,) = recording.glob("t-*-op2.mlrec")
    data = bytearray(f.read_bytes())
    data[-8] ^= 1  # the last output word of y (400 bytes: no padding)
    bad = tmp_path / "bad.mlrec"
    bad.write_bytes(bytes(data))
    rc, out = _run(replay, [bad])
    assert rc == 1 and "DIFF" in out and "400 bytes" in out, out


def test_an_unknown_address_is_run_but_not_recorded(recording):
    a = np.zeros((1, 1, 3), np.float32)
    a[0, 0, 2] = np.nan
    lens, got = np.array([1], np.int64), np.full(1, -7, np.int64)
    # ctypes addresses: the host layer has not seen these buffers
    _loader.library().run(_abi.OP_FIRST_NONFINITE,
                          [a.ctypes.data, 1, 1, 3, lens.ctypes.data, got.ctypes.data])
    assert got[0] == 2
    written, skipped, why = _loader.native().record_status()
    assert (written, skipped) == (0, 1) and "outside every known buffer" in why
    assert not list(recording.glob("*.mlrec"))


def test_nothing_is_recorded_once_off(tmp_path):
    native = _loader.native()
    native.set_record_dir(str(tmp_path), "t")
    native.set_record_dir("", "")
    mojolearn.Mamba1Block(gpu_cases._weights(1, 32)).forward(np.ones((1, 3, 32), np.float32))
    assert not list(tmp_path.iterdir())
