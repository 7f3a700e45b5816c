"""Intake of caller buffers: any float32 buffer, no NumPy needed.

Every check raises before anything is written, so a failed call leaves the
state and every caller buffer as they were. Messages name the array.
"""
from __future__ import annotations

from array import array as _pyarray

from . import _abi
from ._loader import native

_FORMAT_NAMES = {
    "f": "float32", "d": "float64", "e": "float16", "b": "int8", "B": "uint8",
    "h": "int16", "H": "uint16", "i": "int32", "I": "uint32", "l": "int64",
    "L": "uint64", "q": "int64", "Q": "uint64", "?": "bool",
}


def _dtype_name_of(obj) -> str | None:
    """The dtype an object declares (numpy, torch, ml_dtypes...), if any."""
    dt = getattr(obj, "dtype", None)
    if dt is None:
        return None
    name = str(dt)
    return name[6:] if name.startswith("torch.") else name


class View:
    """A validated caller buffer: its memoryview (held for the call), its
    address and shape."""

    __slots__ = ("mv", "address", "shape", "name")

    def __init__(self, mv, address, shape, name):
        self.mv = mv
        self.address = address
        self.shape = shape
        self.name = name


def float32_view(obj, name: str, *, ndim=None, writable: bool = False,
                 contiguous_only: bool = False) -> View:
    """Validate obj as a float32 buffer and return a View of it.

    Non-contiguous inputs are copied to a contiguous buffer unless
    contiguous_only (state buffers, which are written in place).
    """
    declared = _dtype_name_of(obj)
    if declared is not None and declared not in ("float32", "float"):
        raise TypeError(f"{name} must be float32, got {declared}; convert it "
                        "explicitly (mojolearn never converts dtypes)")
    try:
        mv = memoryview(obj)
    except TypeError:
        hint = ""
        if type(obj).__module__.startswith("torch"):
            hint = " (a torch.Tensor exports no buffer: pass tensor.numpy() for a CPU tensor)"
        raise TypeError(f"{name} must be a float32 buffer (NumPy array, "
                        f"array.array('f'), memoryview, mojolearn.Array), got "
                        f"{type(obj).__name__}{hint}") from None
    fmt = mv.format.lstrip("@=<")
    if fmt != "f" or mv.itemsize != 4:
        got = _FORMAT_NAMES.get(fmt, f"buffer format {mv.format!r}")
        if fmt == "H" and declared is None:
            got = "uint16 (bfloat16 bits?)"
        raise TypeError(f"{name} must be float32, got {got}; convert it "
                        "explicitly (mojolearn never converts dtypes)")
    if ndim is not None and mv.ndim not in ndim:
        raise ValueError(f"{name} must have {' or '.join(str(n) for n in ndim)} "
                         f"dimensions, got shape {tuple(mv.shape)}")
    if writable and mv.readonly:
        raise ValueError(f"{name} is read-only; state buffers are updated in place")
    if not mv.c_contiguous:
        if contiguous_only:
            raise ValueError(f"{name} must be C-contiguous (it is updated in place)")
        shape = tuple(mv.shape)
        data = _pyarray("f")
        data.frombytes(mv.tobytes())
        mv = memoryview(data).cast("B").cast("f", shape) if shape else memoryview(data)
    return View(mv, native().address(mv, writable), tuple(mv.shape), name)


def _shared_memory(a: View, b: View, written: View) -> ValueError:
    return ValueError(f"{a.name} and {b.name} share memory; the call writes "
                      f"{written.name} in place, so pass separate buffers")


def refuse_overlap(written) -> None:
    """ValueError naming two of the `written` Views (buffers a call updates
    in place, such as a state's arrays) that share memory: a shared byte
    would give wrong results."""
    spans = sorted(((v.address, v.address + v.mv.nbytes, v) for v in written
                    if v.mv.nbytes), key=lambda t: t[:2])
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:  # (sorted by start: an overlap shows between neighbours)
            raise _shared_memory(b, a, a)


def refuse_read_of_written(read: View, written) -> None:
    """ValueError if the input View `read` shares memory with one of the
    `written` Views (checked among themselves by refuse_overlap)."""
    if not read.mv.nbytes:
        return
    lo, hi = read.address, read.address + read.mv.nbytes
    for w in written:
        if w.mv.nbytes and lo < w.address + w.mv.nbytes and w.address < hi:
            raise _shared_memory(read, w, w)


def check_shape(v: View, expected: tuple, what: str = "") -> None:
    if v.shape != tuple(expected):
        raise ValueError(f"{v.name} must have shape {tuple(expected)}{what}, got {v.shape}")


def check_finite(lib, v: View, *, rows=None, lengths_address: int = 0) -> None:
    """ValueError naming v and the first flat index of a NaN or infinity.

    With lengths, v is (B, L, inner) and only real positions are checked
    (padding may hold anything).
    """
    n = 1
    for s in v.shape:
        n *= s
    if n == 0:
        return
    if rows is None or not lengths_address:
        bad = lib.first_nonfinite(v.address, n)
    else:
        b, l = rows
        out = _pyarray("q", [-1])
        out_mv = memoryview(out)
        op = _abi.OP_FIRST_NONFINITE
        lib.run(op, _abi.op_spec(lib, op).pack(
            src=v.address, b=b, l=l, inner=n // (b * l), lengths=lengths_address,
            out=native().address(out_mv, True)))
        bad = out[0]
    if bad >= 0:
        raise ValueError(f"{v.name} contains a non-finite value (NaN or inf) at "
                         f"flat index {bad}")


def float32_round(v: float) -> float:
    """v rounded to float32, as the kernels receive it (inf beyond its
    range; NaN and inf as they are)."""
    import math
    import struct
    if not math.isfinite(v):
        return v
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def positive_float32(value, name: str) -> float:
    """value as a Python float that float32 holds as a finite number > 0
    (kernels take float32(value)); TypeError naming `name` for a non-number,
    ValueError otherwise."""
    import math
    import numbers
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive number, got "
                        f"{type(value).__name__} {value!r}")
    v = float(value)
    f32 = float32_round(v)
    if not math.isfinite(f32) or v <= 0 or f32 == 0.0:
        raise ValueError(f"{name} must be a finite number > 0 that float32 can hold, "
                         f"got {value!r}")
    return v


def as_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        # integers from NumPy are accepted through __index__
        idx = getattr(type(value), "__index__", None)
        if idx is None or isinstance(value, bool) or _dtype_name_of(value) == "bool":
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        value = idx(value)
    return int(value)


def lengths_array(lengths, batch: int, seq_len: int):
    """Validate ragged lengths; returns (int64 array, its memoryview, address)."""
    try:
        items = list(lengths)
    except TypeError:
        raise TypeError(f"lengths must be a sequence of ints, got "
                        f"{type(lengths).__name__}") from None
    if len(items) != batch:
        raise ValueError(f"lengths must have one entry per row (B={batch}), got {len(items)}")
    vals = []
    for i, v in enumerate(items):
        iv = as_int(v, f"lengths[{i}]")
        if not 1 <= iv <= seq_len:
            raise ValueError(f"lengths[{i}] = {iv} is outside [1, L={seq_len}]")
        vals.append(iv)
    arr = _pyarray("q", vals)
    mv = memoryview(arr)
    return arr, mv, native().address(mv)
