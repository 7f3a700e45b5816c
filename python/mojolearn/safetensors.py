"""Safetensors files without PyTorch: reading (whole, or lazily tensor by
tensor and row range by row range) and writing float32.

The format: an 8-byte little-endian header length, a JSON header (per
tensor: dtype, shape, data_offsets), then the raw little-endian data. F32 is
read as is, BF16 and F16 are widened exactly to float32; any other dtype (F64
included: it would have to be rounded) is refused with a TypeError naming
the tensor.
"""
from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

from . import _intake, _json

__all__ = ["read_safetensors", "lazy_safetensors", "LazyTensor", "write_safetensors"]

# the format's own bound on the JSON header (a reader must not allocate more)
MAX_HEADER_BYTES = 100_000_000
# safetensors dtype -> bytes per element
_ST_DTYPES = {"F32": 4, "BF16": 2, "F16": 2}


def _new(shape):
    from ._array import Array
    return Array(tuple(shape), zero=False)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _from_raw(raw, dtype: str, shape, name: str):
    """float32 Array from little-endian raw bytes of a safetensors dtype."""
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        raise NotImplementedError("reading safetensors needs a little-endian host")
    out = _new(shape)
    dst = memoryview(out).cast("B")
    n = _numel(shape)
    if dtype == "F32":
        dst[:] = raw
    elif dtype == "BF16":
        # bfloat16 bits are the top half of the float32: exact widening by
        # interleaving two zero bytes below each value (byte-level slicing)
        wide = bytearray(4 * n)
        wide[2::4] = raw[0::2]
        wide[3::4] = raw[1::2]
        dst[:] = wide
    elif dtype == "F16":
        from array import array
        vals = array("f", struct.unpack(f"<{n}e", raw))  # half -> float32 is exact
        dst[:] = memoryview(vals).cast("B")
    else:
        raise TypeError(f"tensor {name} has dtype {dtype}; only F32, BF16 and F16 (widened "
                        "exactly to float32) can be loaded")
    return out


def _safetensors_header(f, path):
    head = f.read(8)
    if len(head) != 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", head)
    size = os.fstat(f.fileno()).st_size
    if n > size - 8:
        raise ValueError(f"{path}: not a safetensors file (header length {n} exceeds the file)")
    if n > MAX_HEADER_BYTES:
        raise ValueError(f"{path}: the header length {n} exceeds the format's limit of "
                         f"{MAX_HEADER_BYTES} bytes")
    try:
        header = _json.loads(f.read(n), "header")
    except ValueError as e:
        raise ValueError(f"{path}: not a safetensors file (bad JSON header: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (header is not a JSON object)")
    return header, 8 + n, size


def _entry(info, name, path):
    """(dtype, shape, begin, end) of a header entry, each checked for its
    kind; ValueError naming the file and the tensor otherwise."""
    def bad(what):
        return ValueError(f"{path}: tensor {name} has a malformed header entry ({what}): "
                          f"{info!r}")
    if not isinstance(info, dict):
        raise bad("not a JSON object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape", []), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad("dtype must be a string")
    if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise bad("shape must be a list of non-negative ints")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(
            isinstance(o, int) and not isinstance(o, bool) for o in offsets):
        raise bad("data_offsets must be two ints")
    return dtype, tuple(shape), offsets[0], offsets[1]


def read_safetensors(path, names=None) -> dict:
    """Read tensors of a ``.safetensors`` file as float32 ``mojolearn.Array``.

    Parameters
    ----------
    path : str or PathLike
    names : iterable of str or None
        Tensors to read (default: all).

    Returns
    -------
    dict of name -> mojolearn.Array (float32). F32 is read as is, BF16 and
    F16 are widened exactly; other dtypes raise TypeError naming the tensor.
    """
    return {name: t.load() for name, t in lazy_safetensors(path, names).items()}


class LazyTensor:
    """One tensor of a safetensors file, read when asked: ``load()`` (the
    whole tensor) or ``rows(r0, r1)`` (a range along the first axis), each
    a new float32 mojolearn.Array. Lets a large checkpoint be turned into
    blocks layer by layer without holding every tensor at once."""

    def __init__(self, path, name, dtype, shape, begin, base):
        self.path = Path(path)
        self.name = name
        self.dtype = dtype
        self.shape = tuple(shape)
        self._begin = base + begin

    def __repr__(self):
        return f"LazyTensor({self.name!r}, {self.dtype}, {self.shape}, {self.path.name})"

    def load(self):
        return self.rows(0, self.shape[0]) if self.shape else self._read(0, 1, ())

    def rows(self, r0: int, r1: int):
        """Rows [r0, r1) along the first axis."""
        if not 0 <= r0 <= r1 <= self.shape[0]:
            raise ValueError(f"tensor {self.name}: rows [{r0}, {r1}) outside its "
                             f"{self.shape[0]} rows")
        per = _numel(self.shape[1:])
        return self._read(r0 * per, (r1 - r0) * per, (r1 - r0,) + self.shape[1:])

    def _read(self, first: int, count: int, shape):
        size = _ST_DTYPES[self.dtype]
        with open(self.path, "rb") as f:
            f.seek(self._begin + first * size)
            if self.dtype == "F32" and sys.byteorder == "little":
                arr = _new(shape)
                if count and f.readinto(memoryview(arr).cast("B")) != count * size:
                    raise ValueError(f"{self.path}: tensor {self.name} is truncated")
                return arr
            raw = f.read(count * size)
        if len(raw) != count * size:
            raise ValueError(f"{self.path}: tensor {self.name} is truncated")
        return _from_raw(raw, self.dtype, shape, self.name)


def lazy_safetensors(path, names=None) -> dict:
    """{name: LazyTensor} of a .safetensors file: the header is read and
    checked (dtypes, offsets), no data."""
    path = Path(path)
    with open(path, "rb") as f:
        header, base, size = _safetensors_header(f, path)
    header.pop("__metadata__", None)
    want = list(header) if names is None else list(names)
    missing = [n for n in want if n not in header]
    if missing:
        raise ValueError(f"{path}: no tensors named {missing}")
    entries = {name: _entry(info, name, path) for name, info in header.items()}
    _check_tiling(entries, size - base, path)
    out = {}
    for name in want:
        dtype, shape, begin, end = _checked_entry(header[name], name, path, base, size)
        out[name] = LazyTensor(path, name, dtype, shape, begin, base)
    return out


def _check_tiling(entries: dict, data_size: int, path) -> None:
    """The format's rule: the tensors' byte ranges, in offset order, tile the
    data that follows the header exactly (no overlap, no gap, no tail)."""
    at, prev = 0, None
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda e: e[1][2:]):
        if begin != at or end < begin:
            before = f"tensor {prev}" if prev is not None else "the start of the data"
            what = "ends before it starts" if begin == at else \
                f"{'overlaps' if begin < at else 'leaves a gap after'} {before} (byte {at})"
            raise ValueError(f"{path}: tensor {name}'s data_offsets {[begin, end]} {what}; "
                             "the format needs the tensors to tile the data without "
                             "overlaps or gaps")
        at, prev = end, name
    if at > data_size:
        raise ValueError(f"{path}: truncated: the tensors' data ends at byte {at} but the "
                         f"file holds {data_size} data bytes")
    if at < data_size:
        raise ValueError(f"{path}: {data_size - at} bytes after the last tensor's data (the "
                         "format allows no tail)")


def _checked_entry(info, name, path, base, size):
    dtype, shape, begin, end = _entry(info, name, path)
    if dtype not in _ST_DTYPES:
        raise TypeError(f"tensor {name} has dtype {dtype}; only F32, BF16 and F16 "
                        "(widened exactly to float32) can be loaded")
    if end - begin != _numel(shape) * _ST_DTYPES[dtype] or begin < 0 or base + end > size:
        raise ValueError(f"{path}: tensor {name} has inconsistent data offsets "
                         f"{[begin, end]} for {dtype} {list(shape)}")
    return dtype, shape, begin, end


def write_safetensors(path, tensors: dict) -> None:
    """Write float32 buffers (name -> C-contiguous float32 buffer, any
    shape) as a .safetensors file, in name order."""
    views = {}
    for name in sorted(tensors):
        views[name] = _intake.float32_view(tensors[name], name)
    header, offset = {}, 0
    for name, v in views.items():
        n = v.mv.nbytes
        header[name] = {"dtype": "F32", "shape": list(v.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for v in views.values():
            b = v.mv.cast("B")
            if sys.byteorder != "little":
                b = memoryview(_swapped(b))
            f.write(b)


def _swapped(b) -> bytes:
    from array import array
    a = array("f", bytes(b))
    a.byteswap()
    return a.tobytes()

