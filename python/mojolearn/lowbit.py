"""mojolearn.lowbit: packed projection weights (docs/checkpoints.md).

Formats
-------
'float32'
    Plain float32 buffers (nothing packed).
'bfloat16'
    The top 16 bits of each float32: round to nearest, ties to even, on the
    low 16 bits; float32 subnormals flush to a zero of the same sign; a
    finite value that would round to infinity is refused (ValueError).
    Widening back (``bits << 16``) is exact.
'int8'
    One power-of-two exponent per row: with ``m`` the row's absmax,
    ``e = floor(log2(m)) - 6`` (floored at -149, so that the dequantized
    values stay exactly representable; this only touches rows whose absmax
    is below 2^-143; an all-zero row gets e = -149), and
    ``code = clamp(round_half_even(x * 2^-e), -127, 127)``. The dequantized
    value ``code * 2^e`` is exact in float32.
'q4_0'
    llama.cpp's q4_0: each row is cut into blocks of 32 consecutive values,
    each with one float16 scale ``d`` and 4-bit codes ``q`` in 0..15; the
    value is ``(q - 8) * d``, exact in float32. ``pack`` quantises as ggml's
    reference quantiser does, in float32 arithmetic: ``m`` is the block's
    first value of the largest magnitude (its sign kept), ``d = m / -8``,
    ``id = 1 / d``, ``q = min(15, trunc(x * id + 8.5))``, and ``d`` is
    stored rounded to float16 (nearest, ties to even). Error bound, ``a``
    the block's largest magnitude: ``|x - (q - 8) * d16| <= a * (1/16 +
    2^-10) + 2^-22`` for every value except those of the sign opposite to
    ``m`` near ``-m`` (the code 16 is clamped to 15), where it is ``a *
    (1/8 + 2^-10) + 2^-22``; the ``2^-10`` terms are the float16 rounding
    of ``d`` and of the float32 steps, the ``2^-22`` the float16 subnormal
    range. A block with ``|d| < 2^-128`` (every value below ``2^-125`` in
    magnitude, where ``1 / d`` is not finite and ggml's result undefined)
    gets the code of zero, 8; it expands to zeros either way. (The float32
    steps are separately rounded, as C without contraction evaluates them;
    a ggml build that fuses ``x * id + 8.5`` into one multiply-add can pick
    the other code at a rare near-tie. A GGUF file's bytes are taken as
    they are, whichever quantiser made them.)
'q8_0'
    llama.cpp's q8_0: blocks of 32, one float16 scale ``d = a / 127`` (``a``
    the block's largest magnitude), int8 codes ``q = round_half_away(x / d)``
    (computed as ``x * (1 / d)`` in float32), value ``q * d``, exact in
    float32. Error: ``|x - q * d16| <= a * (1/254 + 2^-10) + 2^-17``. It
    differs from 'int8' (one power-of-two scale per row).

The two block formats keep the bytes of a GGUF tensor of that type as they
are (rows one after the other, each ``ceil(cols / 32)`` blocks; a q4_0
block: the float16 ``d``, little-endian, then 16 bytes whose low nibbles are
elements 0..15 and high nibbles elements 16..31; a q8_0 block: ``d`` then 32
int8 codes), so a file's bytes become a PackedWeight without repacking
(``from_ggml``). A row whose length is not a multiple of 32 ends in a short
block, quantised as if padded with zeros (llama.cpp refuses such rows; they
have no GGUF form, but the projections of small models need them: Mamba's
dt_proj has 48 columns at d_model 768). A non-finite float16 scale is
refused (ValueError naming the block).

A packed value is a :class:`PackedWeight`: a plain container, deliberately
*not* a buffer (``memoryview(p)`` raises TypeError, it has no ``dtype``), so
nothing can mistake its codes for float32 values. Blocks (Mamba1Block,
Mamba2Block, Mamba3Block) accept packed projection weights, keep them packed
(their kernels widen each weight exactly to float32 on load) and report the
format in ``weight_format``; the outputs are byte-identical to the same
block built on ``unpack(weights)[0]``.

Mixed formats: each projection may be in its own format (llama.cpp's GGUF
files keep Mamba's x_proj and dt_proj in float32 next to q4_0 in_proj and
out_proj). ``pack(weights, {name: fmt})`` packs the named projections only,
each in its format; a block keeps each one in its own format, reports
``weight_format == 'mixed'`` and each projection's format in
``weight_formats`` ({name: format}); ``format_of`` and ``unpack`` report
'mixed' for such a dict, and ``formats_of`` gives the per-name formats.

The packing and expansion loops run in the kernel binary (ops
OP_LOWBIT_PACK / OP_LOWBIT_UNPACK), row blocks in parallel; each row is a
pure function of itself, so the bits never depend on the thread count.
"""
from __future__ import annotations

import math

from . import _abi, _intake

FORMATS = ("float32", "bfloat16", "int8", "q4_0", "q8_0")
MIXED = "mixed"  # the format of a weight dict whose projections differ in format
# Format ids of the kernels (lowbit.mojo FMT_*, linear.mojo WF_*: the same ids).
FORMAT_IDS = {"float32": 0, "bfloat16": 1, "int8": 2, "q4_0": 3, "q8_0": 4}
_FMT_ID = {f: i for f, i in FORMAT_IDS.items() if f != "float32"}
_E_MIN, _E_MAX = -149, 121
BLOCK = 32  # values per block of q4_0 / q8_0
BLOCK_BYTES = {"q4_0": 18, "q8_0": 34}  # float16 scale + codes

__all__ = ["FORMATS", "MIXED", "PackedWeight", "pack", "pack_one", "unpack", "is_packed",
           "format_of", "formats_of", "is_projection", "from_ggml"]


def is_projection(name) -> bool:
    """Whether a weight name is a projection weight (``*proj.weight``), the
    weights that ``pack`` packs."""
    return isinstance(name, str) and name.endswith("proj.weight")


def _check_format(fmt) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {fmt!r}")
    return fmt


def _lib():
    from ._loader import library
    return library("identical")


def _buffer_view(obj, name, fmt_char, itemsize, dtype_name, shape=None):
    """A C-contiguous memoryview of obj with buffer format fmt_char."""
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(f"{name} must be a {dtype_name} buffer, got "
                        f"{type(obj).__name__}") from None
    if mv.format.lstrip("@=<") != fmt_char or mv.itemsize != itemsize:
        raise TypeError(f"{name} must be {dtype_name}, got buffer format {mv.format!r}")
    if shape is not None and tuple(mv.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(mv.shape)}")
    if not mv.c_contiguous:
        mv = memoryview(mv.tobytes()).cast(fmt_char, tuple(mv.shape))
    return mv


class PackedWeight:
    """A 2-D weight packed in a low-bit format.

    Not a buffer: pass it to a block (or ``unpack``) to use it. Make one with
    ``pack_one``/``pack``, from stored parts with the constructor, or from a
    GGUF tensor's bytes with ``from_ggml``.

    Parameters
    ----------
    format : {'bfloat16', 'int8', 'q4_0', 'q8_0'}
    data : buffer
        bfloat16: uint16 bit patterns, shape (rows, cols); int8: int8 codes
        in [-127, 127], shape (rows, cols); q4_0 / q8_0: uint8 block bytes,
        shape (rows, ceil(cols / 32) * block bytes) (18 for q4_0, 34 for
        q8_0), the layout of a GGUF tensor (module docstring).
    exponents : int32 buffer, shape (rows,), int8 only
        Per-row power-of-two exponents, each in [-149, 121].
    cols : int, block formats only
        The row length; default ``32 *`` blocks per row (give it for rows
        that end in a short block).

    Attributes
    ----------
    format : str
    shape : tuple (rows, cols)
    data : mojolearn.Array (uint16, int8 or uint8), a private copy
    exponents : mojolearn.Array (int32) or None
    nbytes : int
        Bytes held (data plus exponents).
    """

    __slots__ = ("format", "shape", "data", "exponents")

    def __init__(self, format, data, exponents=None, *, cols=None):
        from ._array import Array
        if format not in _FMT_ID:
            raise ValueError(f"a PackedWeight format must be one of {list(_FMT_ID)}, "
                             f"got {format!r}")
        if format in BLOCK_BYTES:
            self._init_blocks(format, data, exponents, cols)
            return
        if cols is not None:
            raise ValueError(f"cols is for the block formats, not {format!r}")
        if format == "bfloat16":
            mv = _buffer_view(data, "data", "H", 2, "uint16 (bfloat16 bits)")
            if exponents is not None:
                raise ValueError("bfloat16 PackedWeight takes no exponents")
        else:
            mv = _buffer_view(data, "data", "b", 1, "int8")
        if mv.ndim != 2:
            raise ValueError(f"data must be 2-D (rows, cols), got shape {tuple(mv.shape)}")
        shape = tuple(mv.shape)
        dtype = "uint16" if format == "bfloat16" else "int8"
        a = Array(shape, dtype, zero=False)
        if a.nbytes:  # (a view with a zero in its shape cannot be cast)
            memoryview(a).cast("B")[:] = mv.cast("B")
        ex = None
        if format == "int8":
            if b"\x80" in memoryview(a).tobytes():
                raise ValueError("int8 codes must lie in [-127, 127]; data holds -128")
            if exponents is None:
                raise ValueError("int8 PackedWeight needs exponents (int32, one per row)")
            emv = _buffer_view(exponents, "exponents", "i", 4, "int32", (shape[0],))
            ex = Array((shape[0],), "int32", zero=False)
            if shape[0]:
                memoryview(ex).cast("B")[:] = emv.cast("B")
            for r, e in enumerate(memoryview(ex)):
                if not _E_MIN <= e <= _E_MAX:
                    raise ValueError(f"exponents[{r}] = {e} is outside [{_E_MIN}, {_E_MAX}]")
        self.format = format
        self.shape = shape
        self.data = a
        self.exponents = ex

    def _init_blocks(self, format, data, exponents, cols):
        from ._array import Array
        if exponents is not None:
            raise ValueError(f"{format} PackedWeight takes no exponents (its scales are in data)")
        mv = _buffer_view(data, "data", "B", 1, f"uint8 ({format} block bytes)")
        if mv.ndim != 2:
            raise ValueError(f"data must be 2-D (rows, bytes per row), got shape {tuple(mv.shape)}")
        rows, width = mv.shape
        bb = BLOCK_BYTES[format]
        if width % bb:
            raise ValueError(f"data: a {format} row is whole blocks of {bb} bytes, got "
                             f"{width} bytes per row")
        nb = width // bb
        if cols is None:
            cols = nb * BLOCK
        cols = _intake.as_int(cols, "cols")
        if cols < 0 or -(-cols // BLOCK) != nb:
            raise ValueError(f"cols = {cols} needs {-(-cols // BLOCK)} blocks per row, "
                             f"data holds {nb}")
        a = Array((rows, width), "uint8", zero=False)
        if rows * width:  # (a view with a zero in its shape cannot be cast)
            memoryview(a).cast("B")[:] = mv.cast("B")
            _check_block_scales(format, a, nb)
        self.format = format
        self.shape = (rows, cols)
        self.data = a
        self.exponents = None

    @classmethod
    def _wrap(cls, format, shape, data, exponents):
        self = object.__new__(cls)
        self.format, self.shape, self.data, self.exponents = format, shape, data, exponents
        return self

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.exponents.nbytes if self.exponents is not None else 0)

    def to_float32(self):
        """The exact float32 expansion, a new mojolearn.Array (rows, cols)."""
        return _expand(self)

    def __repr__(self):
        return f"PackedWeight(format={self.format!r}, shape={self.shape})"

    def __reduce__(self):
        return (_from_bytes, (self.format, self.shape, memoryview(self.data).tobytes(),
                              None if self.exponents is None
                              else memoryview(self.exponents).tobytes()))


def _from_bytes(format, shape, data, exponents):
    """Unpickling: PackedWeight from its raw bytes (validated again)."""
    if format in BLOCK_BYTES:
        return from_ggml(format, data, shape)
    from ._array import Array
    code = "H" if format == "bfloat16" else "b"
    if data:
        mv = memoryview(data).cast(code, tuple(shape))
    else:  # (a view with a zero in its shape cannot be cast)
        mv = Array(tuple(shape), "uint16" if format == "bfloat16" else "int8")
    ex = None if exponents is None else memoryview(exponents).cast("i")
    return PackedWeight(format, mv, ex)


def _check_block_scales(format, data, nb):
    """ValueError naming the first block whose float16 scale is not finite."""
    step = BLOCK_BYTES[format]
    # the high byte of each little-endian scale: exponent bits all ones?
    high = memoryview(data).cast("B")[1::step].tobytes()
    bad = high.translate(_NONFINITE_HIGH).find(1)
    if bad >= 0:
        r, b = divmod(bad, nb) if nb else (0, 0)
        raise ValueError(f"data: block {b} of row {r} (columns {b * BLOCK}..{b * BLOCK + 31}) "
                         f"has a non-finite float16 scale")


# byte -> 1 where a float16's high byte has exponent bits all ones (inf / NaN)
_NONFINITE_HIGH = bytes(1 if (v & 0x7C) == 0x7C else 0 for v in range(256))


def from_ggml(fmt, raw, shape):
    """A PackedWeight from the bytes of a GGUF (ggml) tensor, as they are.

    Parameters
    ----------
    fmt : {'q4_0', 'q8_0'}
    raw : bytes-like
        The tensor's bytes: ``rows * ceil(cols / 32)`` blocks (18 bytes
        each for q4_0, 34 for q8_0), row after row (a GGUF tensor of
        dimensions ``[cols, rows]``: ggml lists the row length first).
    shape : (rows, cols)

    Returns
    -------
    PackedWeight
        Holding a copy of the bytes; ``to_float32()`` is ggml's
        dequantisation of them, exactly.

    Raises
    ------
    ValueError for another format, a shape that is not two non-negative
    ints, a byte count that does not match the shape, or a non-finite
    float16 scale (naming the block).
    """
    if fmt not in BLOCK_BYTES:
        raise ValueError(f"fmt must be one of {list(BLOCK_BYTES)}, got {fmt!r}")
    if not isinstance(shape, (tuple, list)) or len(shape) != 2:
        raise ValueError(f"shape must be (rows, cols), got {shape!r}")
    rows, cols = (_intake.as_int(v, f"shape[{i}]") for i, v in enumerate(shape))
    if rows < 0 or cols < 0:
        raise ValueError(f"shape must be non-negative, got {(rows, cols)}")
    try:
        mv = memoryview(raw).cast("B")
    except TypeError:
        raise TypeError(f"raw must be bytes-like, got {type(raw).__name__}") from None
    width = -(-cols // BLOCK) * BLOCK_BYTES[fmt]
    if mv.nbytes != rows * width:
        raise ValueError(f"raw holds {mv.nbytes} bytes; a {fmt} tensor of shape "
                         f"{(rows, cols)} has {rows * width}")
    if not mv.nbytes:
        from ._array import Array
        return PackedWeight(fmt, Array((rows, width), "uint8"), cols=cols)
    return PackedWeight(fmt, mv.cast("B", (rows, width)), cols=cols)


def is_packed(value) -> bool:
    """Whether value is a PackedWeight."""
    return isinstance(value, PackedWeight)


def _expand(p: PackedWeight):
    from ._array import Array
    out = Array(p.shape, zero=False)
    rows, cols = p.shape
    if rows * cols:
        aux = p.exponents.address if p.exponents is not None else 0
        lib = _lib()
        op = _abi.OP_LOWBIT_UNPACK
        lib.run(op, _abi.op_spec(lib, op).pack(fmt=_FMT_ID[p.format], src=p.data, aux=aux,
                                               rows=rows, cols=cols, dst=out))
    return out


def pack_one(value, fmt, name: str = "weight"):
    """Pack one 2-D float32 weight.

    Parameters
    ----------
    value : float32 buffer (rows, cols), or a PackedWeight
        A PackedWeight is returned unchanged for its own format, otherwise
        expanded exactly and packed again.
    fmt : {'float32', 'bfloat16', 'int8', 'q4_0', 'q8_0'}
        'float32' returns a float32 mojolearn.Array copy (nothing packed).
    name : str
        Names the weight in error messages.

    Returns
    -------
    PackedWeight, or mojolearn.Array for 'float32'.

    Raises
    ------
    TypeError for a non-float32 buffer; ValueError for a shape that is not
    2-D, a NaN or infinity (naming the flat index), a bfloat16 value that
    would round to infinity, or a q4_0 / q8_0 block whose float16 scale
    would (naming its largest value's flat index).
    """
    from ._array import Array
    _check_format(fmt)
    if isinstance(value, PackedWeight):
        if value.format == fmt:
            return value
        value = _expand(value)
    v = _intake.float32_view(value, name)
    if len(v.shape) != 2:
        raise ValueError(f"{name}: only 2-D weights can be packed, got shape {v.shape}")
    rows, cols = v.shape
    lib = _lib()
    _intake.check_finite(lib, v)
    if fmt == "float32":
        out = Array(v.shape, zero=False)
        memoryview(out).cast("B")[:] = v.mv.cast("B")
        return out
    if fmt in BLOCK_BYTES:
        data = Array((rows, -(-cols // BLOCK) * BLOCK_BYTES[fmt]), "uint8", zero=False)
    else:
        data = Array(v.shape, "uint16" if fmt == "bfloat16" else "int8", zero=False)
    aux = Array((rows,), "int32", zero=False)
    if rows * cols:
        op = _abi.OP_LOWBIT_PACK
        lib.run(op, _abi.op_spec(lib, op).pack(fmt=_FMT_ID[fmt], src=v.address, rows=rows,
                                               cols=cols, dst=data, aux=aux))
    else:  # nothing to pack: no overflow (bfloat16, blocks), int8's empty-row exponent
        for r in range(rows):
            memoryview(aux)[r] = _E_MIN if fmt == "int8" else -1
    if fmt != "int8":
        what = "rounds to infinity in bfloat16" if fmt == "bfloat16" else \
            f"makes its block's float16 scale infinite in {fmt}"
        for r, c in enumerate(memoryview(aux)):
            if c >= 0:
                raise ValueError(f"{name}: value {v.mv.cast('B').cast('f')[r * cols + c]!r} at "
                                 f"flat index {r * cols + c} {what}")
        return PackedWeight._wrap(fmt, v.shape, data, None)
    return PackedWeight._wrap(fmt, v.shape, data, aux)


def pack(weights, fmt):
    """Pack the projection weights of a weight dict.

    Parameters
    ----------
    weights : dict of name -> float32 buffer or PackedWeight
    fmt : str or dict of name -> str
        A format ('float32', 'bfloat16', 'int8', 'q4_0', 'q8_0'): every 2-D
        projection weight (name ending in 'proj.weight') in that format;
        ``pack(w, 'float32')`` expands packed values instead (the same as
        ``unpack(w)[0]``). A dict {name: format}: only the named projection
        weights, each in its own format (a mix, as llama.cpp's GGUF files
        have: ``{'in_proj.weight': 'q4_0', 'out_proj.weight': 'q4_0'}``
        leaves x_proj and dt_proj as they are).

    Returns
    -------
    dict
        A new dict; every entry not packed is passed through unchanged.

    Raises
    ------
    ValueError for an unknown format, or (dict form) a name that is not a
    projection weight of `weights` (naming it); pack_one's errors.
    """
    if not hasattr(weights, "keys"):
        raise TypeError(f"weights must be a dict of name -> buffer, got {type(weights).__name__}")
    if hasattr(fmt, "keys"):
        return _pack_named(weights, fmt)
    _check_format(fmt)
    if fmt == "float32":
        return unpack(weights)[0]
    out = {}
    for name in weights.keys():
        value = weights[name]
        if is_projection(name) and (is_packed(value) or _ndim(value) == 2):
            out[name] = pack_one(value, fmt, name)
        else:
            out[name] = value
    return out


def _pack_named(weights, fmts):
    """pack's dict form: each named projection in its own format."""
    names = set(weights.keys())
    for name in fmts.keys():
        if name not in names:
            raise ValueError(f"fmt names {name!r}, which is not in weights")
        if not is_projection(name):
            raise ValueError(f"fmt names {name!r}: only projection weights "
                             "(names ending in 'proj.weight') are packed")
        if fmts[name] not in FORMATS:
            raise ValueError(f"fmt[{name!r}] must be one of {list(FORMATS)}, "
                             f"got {fmts[name]!r}")
    done = {name: pack_one(weights[name], fmts[name], name) for name in fmts.keys()}
    return {name: done.get(name, weights[name]) for name in weights.keys()}


def _ndim(value):
    try:
        return memoryview(value).ndim
    except TypeError:
        return None


def formats_of(weights) -> dict:
    """{name: format} of every packed value and every plain projection
    weight of a weight dict ('float32' for a plain one)."""
    if not hasattr(weights, "keys"):
        raise TypeError(f"weights must be a dict of name -> buffer, got {type(weights).__name__}")
    got = {}
    for name in weights.keys():
        value = weights[name]
        if is_packed(value):
            got[name] = value.format
        elif is_projection(name):
            got[name] = "float32"
    return got


def _common_format(formats) -> str:
    """The one format of the values of a {name: format} dict, MIXED when
    they differ, 'float32' when it is empty."""
    kinds = set(formats.values())
    if len(kinds) > 1:
        return MIXED
    return kinds.pop() if kinds else "float32"


def unpack(weights):
    """Expand packed values exactly to float32.

    Returns
    -------
    (dict, fmt) : a new dict where every PackedWeight is replaced by its
        float32 expansion (a mojolearn.Array) and every other entry is passed
        through unchanged, and the format the weights were in ('float32'
        when nothing was packed, 'mixed' when they mix formats: packed
        values of two formats, or packed and plain float32 projection
        weights; ``formats_of`` tells which is which).
    """
    fmt = _common_format(formats_of(weights))
    out = {}
    for name in weights.keys():
        value = weights[name]
        out[name] = _expand(value) if is_packed(value) else value
    return out, fmt


def format_of(value) -> str:
    """Format of one weight ('float32' for a plain float32 buffer) or of a
    weight dict (its common format, 'mixed' if it mixes formats)."""
    if is_packed(value):
        return value.format
    if hasattr(value, "keys"):
        return _common_format(formats_of(value))
    _intake.float32_view(value, "value")
    return "float32"


def bfloat16_bits(x: float) -> int:
    """Reference (pure Python) bfloat16 rounding of one float32 value, as
    16-bit pattern; for tests and documentation."""
    import struct
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    if u & 0x7F800000 == 0:
        return (u >> 16) & 0x8000
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def int8_row_reference(row):
    """Reference (pure Python) int8 packing of one row of float32 values:
    (codes, e). For tests and documentation."""
    amax = max((abs(v) for v in row), default=0.0)
    if amax == 0.0:
        e = _E_MIN
    else:
        e = max(math.frexp(amax)[1] - 1 - 6, _E_MIN)
    codes = [max(-127, min(127, round(math.ldexp(v, -e)))) for v in row]
    return codes, e
