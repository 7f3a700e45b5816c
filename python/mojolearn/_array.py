"""mojolearn.Array: the C-contiguous container returned for outputs, states
and gradients.

Memory is 64-byte aligned and owned by the host layer, which exports the
buffer protocol (format, shape, strides), so `memoryview(a)` and
`numpy.asarray(a)` see the same memory without a copy. Importing this module
loads the host layer (`mojolearn._native`), not a kernel binary.
"""
from __future__ import annotations

from ._loader import native

# buffer format -> (dtype name, itemsize)
DTYPES = {
    "f": ("float32", 4),
    "d": ("float64", 8),
    "e": ("float16", 2),
    "b": ("int8", 1),
    "B": ("uint8", 1),
    "H": ("uint16", 2),
    "i": ("int32", 4),
    "q": ("int64", 8),
}
_FORMAT_OF = {name: (fmt, size) for fmt, (name, size) in DTYPES.items()}


def _shape_tuple(shape) -> tuple:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    for s in dims:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"shape must hold non-negative ints, got {shape!r}")
    return dims


class Array(native().Storage):
    """A C-contiguous n-dimensional array (float32 by default).

    Parameters
    ----------
    shape : int or tuple of int
        Dimensions.
    dtype : str, default 'float32'
        One of float32, float64, float16, int8, uint8, uint16, int32, int64.
    zero : bool, default True
        Fill with zeros (otherwise the contents are undefined).

    Attributes
    ----------
    shape : tuple of int
        Dimensions.
    dtype : str
        Element type name, e.g. 'float32'.
    ndim : int
        Number of dimensions.
    size : int
        Number of elements.
    nbytes : int
        Size in bytes.
    strides : tuple of int
        C-contiguous strides in bytes.
    itemsize : int
        Bytes per element.

    Notes
    -----
    Exports the buffer protocol: ``numpy.asarray(a)`` is zero-copy (same
    address), ``memoryview(a)`` works without NumPy. Not thread-safe for
    concurrent writes, like any array.
    """

    def __init__(self, shape, dtype: str = "float32", *, zero: bool = True, _base=None):
        if dtype not in _FORMAT_OF:
            raise TypeError(f"unsupported dtype {dtype!r}; use one of {sorted(_FORMAT_OF)}")
        fmt, size = _FORMAT_OF[dtype]
        super().__init__(list(_shape_tuple(shape)), fmt, size, zero, _base)

    @property
    def shape(self) -> tuple:
        return self._shape

    @property
    def dtype(self) -> str:
        return DTYPES[self._format][0]

    @property
    def itemsize(self) -> int:
        return self._itemsize

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        n = 1
        for s in self._shape:
            n *= s
        return n

    @property
    def strides(self) -> tuple:
        out, st = [], self._itemsize
        for s in reversed(self._shape):
            out.append(st)
            st *= s
        return tuple(reversed(out))

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d Array")
        return self._shape[0]

    def tolist(self):
        """Nested Python lists of the values (a scalar for 0-d)."""
        return memoryview(self).tolist()

    def reshape(self, *shape) -> "Array":
        """A view with another shape and the same size (shares memory)."""
        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = shape[0]
        if isinstance(shape, int):
            shape = (shape,)
        dims = list(shape)
        if dims.count(-1) > 1:
            raise ValueError("only one dimension can be -1")
        if -1 in dims:
            known = 1
            for s in dims:
                if s != -1:
                    known *= s
            if known == 0 or self.size % known:
                raise ValueError(f"cannot reshape {self._shape} into {tuple(shape)}")
            dims[dims.index(-1)] = self.size // known
        dims = _shape_tuple(dims)
        n = 1
        for s in dims:
            n *= s
        if n != self.size:
            raise ValueError(f"cannot reshape {self._shape} into {tuple(dims)}")
        return Array(dims, self.dtype, _base=self)

    def copy(self) -> "Array":
        """A new Array with the same shape, dtype and values."""
        out = Array(self._shape, self.dtype, zero=False)
        if self.nbytes:  # (a view with a 0 in its shape cannot be cast)
            memoryview(out).cast("B")[:] = memoryview(self).cast("B")
        return out

    def __copy__(self) -> "Array":
        return self.copy()

    def __deepcopy__(self, memo) -> "Array":
        return self.copy()

    def __reduce__(self):
        # shape, dtype and the bytes as they are in memory (little-endian)
        data = bytes(memoryview(self).cast("B")) if self.nbytes else b""
        return (_from_bytes, (self._shape, self.dtype, data))

    # -- DLPack (torch.from_dlpack(a), numpy.from_dlpack(a), ...) ------------
    def __dlpack_device__(self) -> tuple:
        """(device type, device id) for DLPack: (1, 0), kDLCPU (host memory)."""
        return (1, 0)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule of the array's memory (zero-copy unless copy=True).

        Made by NumPy's own ``__dlpack__`` on ``numpy.asarray(self)``: the
        capsule holds that NumPy array, which holds this Array, so the memory
        stays alive as long as the consumer's tensor. Needs NumPy (else
        ImportError; ``torch.frombuffer(a, dtype=...)`` shares memory without
        NumPy). stream must be None (host memory); dl_device None or (1, 0).
        """
        try:
            import numpy as np
        except ImportError:
            raise ImportError(
                "mojolearn.Array.__dlpack__ needs NumPy (the capsule is made by "
                "numpy.asarray(a).__dlpack__); without NumPy, torch.frombuffer(a, "
                "dtype=torch.float32).view(a.shape) shares the memory too") from None
        if stream is not None and stream != -1:
            raise BufferError(f"mojolearn.Array lives in host memory: stream must be None, "
                              f"got {stream!r}")
        if dl_device is not None and tuple(dl_device) != (1, 0):
            raise BufferError(f"mojolearn.Array lives in host memory (kDLCPU, 0); cannot "
                              f"export it to device {tuple(dl_device)}")
        arr = np.array(self, copy=True) if copy else np.asarray(self)
        if max_version is None:
            return arr.__dlpack__()
        try:
            return arr.__dlpack__(max_version=max_version)
        except TypeError:  # NumPy < 2.1: no max_version; a legacy capsule
            return arr.__dlpack__()

    def __repr__(self) -> str:
        return f"mojolearn.Array(shape={self._shape}, dtype={self.dtype})"

    def __eq__(self, other):  # arrays are containers; compare bytes explicitly
        return NotImplemented

    __hash__ = None


def _from_bytes(shape, dtype, data) -> Array:
    """Unpickle an Array (see Array.__reduce__)."""
    out = Array(shape, dtype, zero=False)
    if len(data) != out.nbytes:
        raise ValueError(f"pickled Array of shape {tuple(shape)} ({dtype}) needs "
                         f"{out.nbytes} bytes, got {len(data)}")
    if out.nbytes:
        memoryview(out).cast("B")[:] = data
    return out
