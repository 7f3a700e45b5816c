"""mojolearn.Array (its API reference page): attributes, buffer protocol, NumPy
zero-copy, reshape/copy, 64-byte alignment, and that blocks return Arrays."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import mojolearn
from mojolearn import Array
from tests.errors import raises_naming
from mojolearn.reference.weights import mamba1_weights, random_input

ALIGN = 64

DTYPES = [("float32", "f", 4, np.float32), ("float64", "d", 8, np.float64),
          ("float16", "e", 2, np.float16), ("int8", "b", 1, np.int8),
          ("uint8", "B", 1, np.uint8), ("uint16", "H", 2, np.uint16),
          ("int32", "i", 4, np.int32), ("int64", "q", 8, np.int64)]


def _iota(a):
    """Fill a float32 Array with 0, 1, 2, ... through its buffer."""
    mv = memoryview(a).cast("B").cast("f")
    for i in range(len(mv)):
        mv[i] = float(i)
    return a


# ------------------------------------------------------------ attributes
def test_attributes_float32():
    a = Array((2, 3, 5))
    assert a.shape == (2, 3, 5)
    assert a.dtype == "float32"
    assert a.ndim == 3
    assert a.size == 30
    assert a.itemsize == 4
    assert a.nbytes == 120
    assert a.strides == (60, 20, 4)
    assert len(a) == 2
    assert isinstance(a.address, int) and a.address != 0


def test_int_shape_and_default_zeros():
    a = Array(7)
    assert a.shape == (7,) and a.ndim == 1 and a.size == 7 and len(a) == 7
    assert a.strides == (4,)
    assert a.tolist() == [0.0] * 7
    b = Array([2, 2])
    assert b.shape == (2, 2) and b.tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_zero_dim_and_empty():
    s = Array(())
    assert s.shape == () and s.ndim == 0 and s.size == 1 and s.nbytes == 4
    assert s.strides == ()
    assert s.tolist() == 0.0
    with pytest.raises(TypeError):
        len(s)
    e = Array((3, 0))
    assert e.size == 0 and e.nbytes == 0 and len(e) == 3
    assert e.tolist() == [[], [], []]


@pytest.mark.parametrize("name,fmt,size,npdt", DTYPES)
def test_dtypes(name, fmt, size, npdt):
    a = Array((4, 3), name)
    assert a.dtype == name and a.itemsize == size
    assert a.nbytes == 12 * size and a.strides == (3 * size, size)
    mv = memoryview(a)
    assert mv.format == fmt and mv.itemsize == size and mv.shape == (4, 3)
    n = np.asarray(a)
    assert n.dtype == npdt and n.shape == (4, 3)
    assert n.ctypes.data == a.address
    assert a.address % ALIGN == 0


def test_bad_construction():
    with raises_naming(TypeError, "dtype 'bfloat16'"):
        Array((2,), "bfloat16")
    with raises_naming(ValueError, "shape", "(2, -1)"):
        Array((2, -1))
    with pytest.raises(ValueError):
        Array((2.0, 3))
    with pytest.raises((TypeError, ValueError)):
        Array("abc")
    with pytest.raises(TypeError):
        Array(2.0)


def test_tolist_values():
    a = _iota(Array((2, 3)))
    assert a.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert _iota(Array(4)).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_repr():
    r = repr(Array((2, 3)))
    assert "(2, 3)" in r and "float32" in r


# ------------------------------------------------------------ memoryview
def test_memoryview():
    a = Array((3, 4))
    mv = memoryview(a)
    assert mv.format == "f"
    assert mv.shape == (3, 4)
    assert mv.strides == (16, 4)
    assert mv.itemsize == 4 and mv.nbytes == 48 and mv.ndim == 2
    assert mv.c_contiguous and not mv.readonly
    mv[1, 2] = 2.5
    assert a.tolist()[1][2] == 2.5
    flat = mv.cast("B").cast("f")
    flat[0] = -1.0
    assert a.tolist()[0][0] == -1.0
    assert mv.obj is a


# ------------------------------------------------------- numpy zero-copy
def test_numpy_asarray_zero_copy():
    a = Array((4, 6))
    n = np.asarray(a)
    assert n.ctypes.data == a.address
    assert n.shape == (4, 6) and n.dtype == np.float32 and n.strides == (24, 4)
    assert n.flags.c_contiguous and n.flags.writeable
    assert not n.flags.owndata
    n[2, 3] = 7.25
    n[0, :] = np.arange(6)
    assert a.tolist()[2][3] == 7.25
    assert a.tolist()[0] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    memoryview(a)[3, 5] = -3.0
    assert n[3, 5] == -3.0
    # a second view is the same memory again
    assert np.asarray(a).ctypes.data == a.address
    assert np.shares_memory(np.asarray(a), n)


def test_numpy_view_keeps_array_alive():
    n = np.asarray(_iota(Array((64, 64))))
    addr = n.ctypes.data
    gc.collect()
    others = [Array((64, 64)) for _ in range(8)]  # reuse of freed memory would show
    for o in others:
        np.asarray(o)[...] = -1.0
    assert n.ctypes.data == addr
    assert n.reshape(-1)[:5].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert n.reshape(-1)[-1] == 64 * 64 - 1


# ------------------------------------------------------------- reshape
def test_reshape_shares_memory():
    a = _iota(Array((2, 3, 4)))
    r = a.reshape(6, 4)
    assert isinstance(r, Array)
    assert r.shape == (6, 4) and r.dtype == "float32" and r.strides == (16, 4)
    assert r.address == a.address
    assert r.tolist()[1] == [4.0, 5.0, 6.0, 7.0]
    memoryview(r)[5, 3] = 100.0
    assert a.tolist()[1][2][3] == 100.0
    np.asarray(a)[0, 0, 0] = -5.0
    assert r.tolist()[0][0] == -5.0
    assert a.shape == (2, 3, 4)  # the original keeps its shape


@pytest.mark.parametrize("args,shape", [(((24,),), (24,)), ((24,), (24,)), ((-1,), (24,)),
                                        ((2, -1), (2, 12)), (((-1, 3, 2),), (4, 3, 2)),
                                        ((4, 6), (4, 6)), (([1, 24],), (1, 24)),
                                        ((1, 2, 1, 12, 1), (1, 2, 1, 12, 1))])
def test_reshape_forms(args, shape):
    a = _iota(Array((2, 3, 4)))
    r = a.reshape(*args)
    assert r.shape == shape and r.size == 24 and r.address == a.address
    assert np.asarray(r).reshape(-1).tolist() == list(map(float, range(24)))


@pytest.mark.parametrize("args", [(5, 5), (25,), (-1, 5), (-1, -1), (2, 3), (0, -1), (-2, -12)])
def test_bad_reshape(args):
    a = Array((2, 3, 4))
    with pytest.raises(ValueError):
        a.reshape(*args)
    assert a.shape == (2, 3, 4)


def test_reshape_keeps_base_alive():
    r = _iota(Array((8, 128))).reshape(-1)
    gc.collect()
    for _ in range(8):
        np.asarray(Array((8, 128)))[...] = -1.0
    assert r.tolist()[:3] == [0.0, 1.0, 2.0] and r.tolist()[-1] == 8 * 128 - 1


def test_reshape_other_dtype():
    a = Array((2, 4), "int32")
    r = a.reshape(8)
    assert r.dtype == "int32" and r.itemsize == 4 and memoryview(r).format == "i"


# ---------------------------------------------------------------- copy
def test_copy_independent():
    a = _iota(Array((3, 5)))
    c = a.copy()
    assert isinstance(c, Array)
    assert c.shape == a.shape and c.dtype == a.dtype and c.strides == a.strides
    assert c.address != a.address and c.address % ALIGN == 0
    assert memoryview(c).tobytes() == memoryview(a).tobytes()
    np.asarray(c)[...] = 9.0
    assert a.tolist()[2][4] == 14.0
    np.asarray(a)[0, 0] = -1.0
    assert c.tolist()[0][0] == 9.0


def test_copy_of_view_and_other_dtype():
    a = _iota(Array((4, 4)))
    c = a.reshape(16).copy()
    assert c.shape == (16,) and c.tolist() == list(map(float, range(16)))
    d = Array((3,), "float64")
    np.asarray(d)[...] = [1.5, 2.5, 3.5]
    e = d.copy()
    assert e.dtype == "float64" and e.tolist() == [1.5, 2.5, 3.5]


# ------------------------------------------------------------ alignment
@pytest.mark.parametrize("shape", [(1,), (3,), (7,), (15,), (17,), (33,), (1000,), (3, 5, 7),
                                   (0,), ()])
def test_alignment(shape):
    arrays = [Array(shape) for _ in range(16)]  # several, so a lucky allocator does not hide it
    for a in arrays:
        assert a.address % ALIGN == 0, (shape, a.address)
    for name, *_ in DTYPES:
        assert Array(shape, name).address % ALIGN == 0
    assert Array(shape, zero=False).address % ALIGN == 0


# ---------------------------------------------------- blocks return Arrays
@pytest.fixture(scope="module")
def block():
    return mojolearn.Mamba1Block(mamba1_weights(12, seed=0))


def test_block_outputs_are_arrays(block):
    x = random_input(2, 7, 12, seed=1)
    y = block.forward(x)
    assert isinstance(y, Array)
    assert y.shape == (2, 7, 12) and y.dtype == "float32" and y.address % ALIGN == 0
    n = np.asarray(y)
    assert n.ctypes.data == y.address and n.dtype == np.float32
    assert np.isfinite(n).all()
    st = block.allocate_state(2)
    for arr, shape in ((st.conv_window, (2, 24, 4)), (st.h, (2, 24, 16))):
        assert isinstance(arr, Array) and arr.shape == shape and arr.dtype == "float32"
        assert arr.address % ALIGN == 0
        assert memoryview(arr).tobytes() == bytes(arr.nbytes)
    y2 = block.forward(x, st)
    assert isinstance(y2, Array) and y2.address % ALIGN == 0
    ys = block.step(x[:, 0], st)
    assert isinstance(ys, Array) and ys.shape == (2, 1, 12) and ys.address % ALIGN == 0
    yl = block.forward(x, lengths=[3, 7])
    assert isinstance(yl, Array) and yl.address % ALIGN == 0
    with block.decode_session(st) as s:
        yd = s.step(x[:, 1])
    assert isinstance(yd, Array) and yd.shape == (2, 1, 12)
    for name, w in block.get_params()["weights"].items():
        assert isinstance(w, Array) and w.address % ALIGN == 0, name


def test_array_as_input(block):
    """An Array (and a reshaped view of one) is a valid input and gives the
    same bytes as the NumPy array it was filled from."""
    x = random_input(2, 5, 12, seed=2)
    a = Array((2 * 5 * 12,))
    np.asarray(a)[...] = x.reshape(-1)
    ref = memoryview(block.forward(x)).tobytes()
    assert memoryview(block.forward(a.reshape(2, 5, 12))).tobytes() == ref
    y = block.forward(x)
    # an output Array fed back as input
    assert memoryview(block.forward(y)).tobytes() == memoryview(block.forward(np.asarray(y))).tobytes()


def test_state_arrays_survive_numpy_round_trip(block):
    """State bytes can be saved and restored exactly through NumPy views."""
    x = random_input(1, 6, 12, seed=3)
    st = block.allocate_state(1)
    block.forward(x[:, :3], st)
    saved = (np.array(st.conv_window), np.array(st.h))
    y1 = memoryview(block.forward(x[:, 3:], st)).tobytes()
    np.asarray(st.conv_window)[...] = saved[0]
    np.asarray(st.h)[...] = saved[1]
    assert memoryview(block.forward(x[:, 3:], st)).tobytes() == y1
