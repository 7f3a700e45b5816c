"""The host layer's op recorder and the ABI replay driver (python/native/record.h,
tools/abi_replay/replay.c), natively: what the arm64 check (tools/arm64_check.sh)
relies on, kept working by the ordinary test suite.

Records of a few cases (forward, ragged, decode steps, a decode session,
backward, packed weights with the lowbit ops) replay on the same binary to the
recorded bytes; a byte flipped in any compared buffer of a record is
reported; an op whose argument points at memory the host layer does not know
runs but is counted as not recorded; no file is written once recording is
off. Needs a C compiler (`cc`).
"""
import importlib.util
import random
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


FLIP_SEED = 20261203  # offsets and bits of the flips below (in every failure message)


def _arm64_check():
    """tools/arm64_check.py as a module (its record layout and flip control)."""
    spec = importlib.util.spec_from_file_location("arm64_check",
                                                  ROOT / "tools" / "arm64_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_flipped_byte_in_any_buffer_is_reported(replay, recording, tmp_path):
    """For each record of a few ops (state-carrying forwards of the three
    blocks, whose ops write two or more buffers, and math_eval), one copy per
    compared buffer with one byte flipped at a seeded random offset and bit:
    the replay reports every copy as a DIFF of exactly that buffer (so it
    compares every byte of every buffer, not a stride, a prefix or the first
    written buffer only). The same check is the arm64 check's negative
    control (tools/arm64_check.py)."""
    ac = _arm64_check()
    for kind in (1, 2, 3):
        blk = gpu_cases.block_for(mojolearn, kind, 32)
        blk.forward(gpu_cases._input(2, 5, 32, seed=kind), blk.allocate_state(2))
    x = np.ones(100, np.float32)
    y = np.zeros(100, np.float32)
    _loader.library().run(_abi.OP_MATH_EVAL, [0, x.ctypes.data, y.ctypes.data, x.size, 1])
    files = sorted(recording.glob("t-*.mlrec"))
    rc, out = _run(replay, files)
    assert rc == 0 and f"{len(files)} records, {len(files)} identical" in out, out
    multi = [f.name for f in files if len(ac.written_buffers(f)) >= 2]
    assert len(multi) >= 3, [(f.name, ac.written_buffers(f)) for f in files]
    rng = random.Random(FLIP_SEED)
    flips = []
    for f in files:
        flips += ac.flipped_copies(f, tmp_path, rng)
    assert len(flips) >= 2 * len(files)
    assert ac.unseen_flips(replay, flips) == [], f"flip seed {FLIP_SEED}"
    # the flips reach past the first 8-byte word of a buffer and off the
    # 8-byte grid (the old controls flipped bytes 0 and 392 only)
    offsets = [off for _, _, off in flips]
    assert max(offsets) >= 64 and any(off % 8 for off in offsets), offsets
    # control of the control: an intact copy is not reported
    assert ac.unseen_flips(replay, [(files[0], 0, 0)]) != []


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
