"""Shared fixtures. Tests run against the installed mojolearn (README's test
command installs it), or against the working tree after
scripts/dev_build.sh with PYTHONPATH=python."""
import ctypes

import pytest


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
