"""Shared fixtures. Tests run against the installed mojolearn (README's test
command installs it), or against the working tree after
scripts/dev_build.sh with PYTHONPATH=python."""
import ctypes

import pytest


# The GPU compile checks (tests/test_gpu_build.py, marked gpu_build) build
# four GPU binaries: most of the suite's time on 2 cores. They run through
# their own command (README: `./run.sh gpu-check`, which CI also runs), so
# `./run.sh test` stays quick. With --gpu-build only they are collected.
def pytest_addoption(parser):
    parser.addoption("--gpu-build", action="store_true",
                     help="run only the GPU compile checks (tests marked gpu_build)")


def pytest_collection_modifyitems(config, items):
    want = config.getoption("--gpu-build")
    keep = [it for it in items if (it.get_closest_marker("gpu_build") is not None) == want]
    drop = [it for it in items if (it.get_closest_marker("gpu_build") is not None) != want]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def native_lib():
    """ctypes view of the CPU kernel binary (for raw-ABI tests)."""
    from mojolearn import _loader
    lib = ctypes.CDLL(str(_loader.library_path("cpu")))
    lib.ml_math_eval.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_int64]
    lib.ml_math_eval.restype = ctypes.c_int64
    return lib


@pytest.fixture
def threads():
    """Set the kernel thread count inside a test; restored afterwards."""
    import mojolearn
    before = mojolearn.get_num_threads()
    yield mojolearn.set_num_threads
    mojolearn.set_num_threads(before)
