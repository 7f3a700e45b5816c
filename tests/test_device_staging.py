"""The buffer tables a GPU binary stages by (ml_buffers), checked on the CPU.

With emulate_device the host layer stages every op's buffers in fresh host
copies exactly as a GPU binary does on the device (python/native/device.h):
inputs copied in, output-only and scratch copies starting as NaN bytes,
outputs copied back, a guard after each copy. Every case of the GPU check's
matrix (bench/gpu_cases.py) must give the same bytes as the direct run; a
missing slot, a short size or a wrong direction would change them or raise.
"""
import array

import pytest

np = pytest.importorskip("numpy")

import mojolearn  # noqa: E402
from mojolearn import _abi, _loader  # noqa: E402
from bench import gpu_cases  # noqa: E402
from tests.reference.weights import random_input  # noqa: E402


@pytest.fixture
def emulated():
    lib = _loader.library()
    before = lib.emulate_device
    yield lib
    lib.emulate_device = before


@pytest.mark.parametrize("shape", gpu_cases.SHAPES, ids=lambda s: f"m{s[0]}-d{s[1]}-B{s[2]}-L{s[3]}")
def test_staged_run_gives_the_direct_bytes(shape, emulated):
    emulated.emulate_device = False
    direct = gpu_cases.run_case(mojolearn, *shape)
    emulated.emulate_device = True
    staged = gpu_cases.run_case(mojolearn, *shape)
    assert list(staged) == list(direct)
    for name in direct:
        assert staged[name] == direct[name], name


@pytest.mark.parametrize("shape", gpu_cases.PACKED, ids=lambda s: f"m{s[0]}-packed")
def test_staged_run_on_packed_weights_gives_the_direct_bytes(shape, emulated):
    emulated.emulate_device = False
    direct = gpu_cases.run_packed(mojolearn, *shape)
    emulated.emulate_device = True
    assert gpu_cases.run_packed(mojolearn, *shape) == direct


def test_staged_math_gives_the_direct_bytes(emulated):
    emulated.emulate_device = False
    direct = gpu_cases.run_math(emulated)
    emulated.emulate_device = True
    staged = gpu_cases.run_math(emulated)
    assert len(direct) == gpu_cases.MATH_FUNCTIONS and staged == direct


def test_staging_compares_bytes_that_can_differ():
    # the comparison above can fail: another seed's weights change the bytes
    a = gpu_cases.run_case(mojolearn, *gpu_cases.SHAPES[0])
    w = gpu_cases._weights(1, 32)
    w["D"] = w["D"] + np.float32(1e-3)
    y = mojolearn.Mamba1Block(w).forward(random_input(1, 5, 32, seed=7))
    assert np.asarray(y).tobytes() != a["m1 d32 B1 L5 forward"]


def _math_eval_args(src_addr, dst_addr, n):
    return [0, src_addr, dst_addr, n, 1]  # exp, elementwise (OP_MATH_EVAL slots)


def test_staging_writes_outputs_back_and_keeps_inputs(emulated):
    src = array.array("f", [0.0, 1.0, -2.0, 3.5])
    dst = array.array("f", [9.0] * 4)
    emulated.emulate_device = True
    emulated.run(_abi.OP_MATH_EVAL, _math_eval_args(
        _loader.native().address(src), _loader.native().address(dst, True), 4))
    assert list(src) == [0.0, 1.0, -2.0, 3.5]
    assert dst[0] == 1.0 and dst[1] != 9.0


def test_overlapping_buffers_are_refused_when_staged(emulated):
    buf = array.array("f", [0.5] * 8)
    base = _loader.native().address(buf, True)
    args = _math_eval_args(base, base + 8, 4)  # dst overlaps src by 2 floats
    emulated.emulate_device = False
    emulated.run(_abi.OP_MATH_EVAL, list(args))  # fine on the host
    emulated.emulate_device = True
    with pytest.raises(RuntimeError, match="overlap"):
        emulated.run(_abi.OP_MATH_EVAL, list(args))
