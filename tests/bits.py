"""Exact byte comparison helpers for the bit-equality properties."""
import numpy as np


def as_bytes(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).tobytes()


def assert_same_bits(a, b, what=""):
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a32.shape == b32.shape, f"{what}: shapes {a32.shape} != {b32.shape}"
    if as_bytes(a32) != as_bytes(b32):
        diff = np.flatnonzero(a32.view(np.uint32).ravel() != b32.view(np.uint32).ravel())
        raise AssertionError(f"{what}: {diff.size} of {a32.size} values differ in their "
                             f"bits, first at flat index {diff[0]}")


def assert_bits_differ(a, b, what=""):
    """Negative control: the comparison above is able to fail."""
    assert as_bytes(a) != as_bytes(b), f"{what}: expected different bits"


def nudge(a, index=0):
    """A copy of float32 array a with one value moved by one ulp."""
    out = np.array(a, dtype=np.float32, copy=True)
    flat = out.reshape(-1)
    flat[index] = np.nextafter(flat[index], np.float32(np.inf))
    return out
