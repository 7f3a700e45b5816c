"""GGUF files (llama.cpp's format) without NumPy: the header, the metadata
and lazily read tensors.

Layout (little-endian): the magic ``GGUF``, a uint32 version (2 or 3), the
uint64 tensor and metadata counts, the metadata (a string key, a uint32
value type, the value), the tensor infos (name, uint32 dimension count, a
uint64 per dimension, fastest-varying first, uint32 ggml type, uint64
offset), padding to ``general.alignment`` (default 32), then the data, each
tensor at an offset that is a multiple of the alignment.

Every count, length, offset and size is checked against the file before
anything is allocated or read; a malformed file is a ValueError naming the
file and the key or tensor. Tensor types: F32 is read as is; F16, BF16,
Q8_0 and Q4_0 are widened exactly to float32 (each Q8_0 / Q4_0 value is a
float16 scale times a small integer, representable in float32); any other
type is a TypeError naming the tensor and the type. ``read_tokenizer`` builds
the tokenizer a file carries (llama.cpp's "gpt2" byte-level BPE).
"""
from __future__ import annotations

import mmap
import struct
import sys
from pathlib import Path

from .safetensors import LazyTensor, _from_raw

__all__ = ["GGUFFile", "GGUFTensor", "read_gguf", "read_tokenizer", "GGML_TYPE_NAMES"]

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
# metadata value types: id -> (name, struct code or None)
_VALUE_TYPES = {0: ("uint8", "B"), 1: ("int8", "b"), 2: ("uint16", "H"), 3: ("int16", "h"),
                4: ("uint32", "I"), 5: ("int32", "i"), 6: ("float32", "f"), 7: ("bool", "?"),
                8: ("string", None), 9: ("array", None), 10: ("uint64", "Q"),
                11: ("int64", "q"), 12: ("float64", "d")}
_STRING, _ARRAY, _BOOL = 8, 9, 7

# ggml tensor types (ggml.h), for the names in messages
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
# the types read: ggml type -> (elements per block, bytes per block)
_BLOCKS = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 2: (32, 18)}
# Types kept packed ({ggml type: mojolearn.lowbit format}, the same bytes)
# in the matrices the kernels can read packed (_PACKABLE: projections, the
# embedding and the head); anywhere else they are widened exactly.
KEEP_PACKED: dict = {8: "q8_0", 2: "q4_0"}
_PACKABLE = ("ssm_in.weight", "ssm_out.weight", "ssm_x.weight", "ssm_dt.weight",
             "token_embd.weight", "output.weight")


class _Reader:
    """Bounds-checked little-endian reads from a buffer; errors name the file
    and what was being read."""

    def __init__(self, buf, path):
        self.buf, self.path, self.at, self.size = buf, path, 0, len(buf)

    def fail(self, msg):
        return ValueError(f"{self.path}: not a valid GGUF file: {msg}")

    def take(self, n: int, what: str):
        if n < 0 or n > self.size - self.at:
            raise self.fail(f"{what} needs {n} bytes at byte {self.at}, the file has "
                            f"{self.size - self.at} left")
        start = self.at
        self.at += n
        return start

    def unpack(self, code: str, what: str):
        n = struct.calcsize("<" + code)
        return struct.unpack_from("<" + code, self.buf, self.take(n, what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("Q", f"the length of {what}")
        start = self.take(n, what)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def value(self, vtype: int, key: str, in_array: bool = False):
        if vtype not in _VALUE_TYPES:
            raise self.fail(f"metadata key {key!r} has unknown value type {vtype}")
        name, code = _VALUE_TYPES[vtype]
        if vtype == _STRING:
            return self.string(f"the value of metadata key {key!r}")
        if vtype == _ARRAY:
            if in_array:
                raise self.fail(f"metadata key {key!r} holds an array of arrays (not read)")
            etype = self.unpack("I", f"the element type of metadata key {key!r}")
            if etype not in _VALUE_TYPES:
                raise self.fail(f"metadata key {key!r} has unknown element type {etype}")
            count = self.unpack("Q", f"the element count of metadata key {key!r}")
            ecode = _VALUE_TYPES[etype][1]
            least = 8 if etype == _STRING else (struct.calcsize("<" + ecode) if ecode else 12)
            if count > (self.size - self.at) // least:
                raise self.fail(f"metadata key {key!r} claims {count} elements, more than "
                                "the file holds")
            if ecode is not None:
                start = self.take(count * struct.calcsize("<" + ecode), f"metadata key {key!r}")
                vals = list(struct.unpack_from(f"<{count}{ecode}", self.buf, start))
                if etype == _BOOL and any(v not in (0, 1) for v in
                                          self.buf[start:start + count]):
                    raise self.fail(f"metadata key {key!r} holds a bool that is not 0 or 1")
                return vals
            return [self.value(etype, key, True) for _ in range(count)]
        v = self.unpack(code, f"the value of metadata key {key!r}")
        if vtype == _BOOL and self.buf[self.at - 1] not in (0, 1):
            raise self.fail(f"metadata key {key!r} holds a bool that is not 0 or 1")
        return v


class GGUFTensor(LazyTensor):
    """One tensor of a GGUF file, read when asked (``load()``, ``rows(r0,
    r1)``: float32 mojolearn.Array). ``shape`` is in C order (the file's
    dimensions reversed); ``ggml_type`` the type's name ('F32', 'Q8_0' ...)."""

    def __init__(self, path, name, ggml_type: int, shape, begin: int):
        super().__init__(path, name, GGML_TYPE_NAMES[ggml_type], shape, begin, 0)
        self.ggml_type = self.dtype
        self._type = ggml_type

    def reshaped(self, shape) -> "GGUFTensor":
        """The same values (C order) under another shape of as many elements."""
        return GGUFTensor(self.path, self.name, self._type, tuple(shape), self._begin)

    def _read(self, first: int, count: int, shape):
        per, size = _BLOCKS[self._type]
        # rows start on block boundaries: the fastest dimension is a whole
        # number of blocks (checked when the header was read)
        if first % per or count % per:
            raise ValueError(f"tensor {self.name}: a {self.ggml_type} range must start and "
                             f"end on a block of {per} values")
        with open(self.path, "rb") as f:
            f.seek(self._begin + first // per * size)
            raw = f.read(count // per * size)
        if len(raw) != count // per * size:
            raise ValueError(f"{self.path}: tensor {self.name} is truncated")
        if self._type in KEEP_PACKED and self.name.endswith(_PACKABLE) and len(shape) == 2:
            from . import lowbit
            return lowbit.from_ggml(KEEP_PACKED[self._type], raw, shape)
        if self._type in (0, 1, 30):
            return _from_raw(raw, {0: "F32", 1: "F16", 30: "BF16"}[self._type], shape, self.name)
        return _widen_blocks(raw, self._type, count, shape)


def _widen_blocks(raw, ggml_type: int, count: int, shape):
    """float32 Array of Q8_0 / Q4_0 blocks: scale (float16) times the code;
    both factors are small enough that every product is exact in float32."""
    from array import array
    from ._array import Array
    out = array("f", bytes(4 * count))
    if ggml_type == 8:  # Q8_0: f16 d, 32 int8 codes
        for b in range(count // 32):
            d = struct.unpack_from("<e", raw, 34 * b)[0]
            codes = struct.unpack_from("<32b", raw, 34 * b + 2)
            out[32 * b:32 * b + 32] = array("f", [d * q for q in codes])
    else:  # Q4_0: f16 d, 16 bytes; low nibbles are values 0..15, high ones 16..31
        for b in range(count // 32):
            d = struct.unpack_from("<e", raw, 18 * b)[0]
            qs = raw[18 * b + 2:18 * b + 18]
            vals = [((q & 15) - 8) * d for q in qs] + [((q >> 4) - 8) * d for q in qs]
            out[32 * b:32 * b + 32] = array("f", vals)
    arr = Array(tuple(shape), zero=False)
    memoryview(arr).cast("B")[:] = memoryview(out).cast("B")
    return arr


class GGUFFile:
    """A parsed GGUF header.

    Attributes
    ----------
    path : Path
    version : int
    metadata : dict of str to value
        Scalars as Python ints / floats / bools / strs, arrays as lists.
    tensors : dict of str to GGUFTensor
        In file order; nothing read yet.
    alignment : int
    """

    def __init__(self, path, version, metadata, tensors, alignment):
        self.path, self.version, self.metadata = path, version, metadata
        self.tensors, self.alignment = tensors, alignment

    def __repr__(self):
        return (f"GGUFFile({self.path.name!r}, version={self.version}, "
                f"{len(self.metadata)} keys, {len(self.tensors)} tensors)")


def read_gguf(path) -> GGUFFile:
    """Read and check the header of a GGUF file (no tensor data).

    Parameters
    ----------
    path : str or PathLike

    Returns
    -------
    GGUFFile

    Raises
    ------
    ValueError naming the file and the key or tensor for anything malformed:
    the magic, the version, counts, string lengths, value types, duplicate
    keys or tensor names, dimensions, offsets outside the data, misaligned
    or overlapping tensors, an alignment that is not a power of two.
    TypeError naming a tensor of a type that is not read (see module).
    """
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        raise NotImplementedError("reading GGUF needs a little-endian host")
    path = Path(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ValueError(f"{path}: not a GGUF file (shorter than its 24-byte header)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(_Reader(memoryview(buf), path), path)


def read_tokenizer(path):
    """The tokenizer a GGUF file carries, as a ``tokenizers.Tokenizer``.

    llama.cpp's converter stores a Mamba model's tokenizer in the
    ``tokenizer.ggml.*`` metadata; this rebuilds it: llama.cpp's "gpt2"
    tokenizer model (byte-level BPE with the file's tokens and merges, its
    control tokens as special tokens) with the split ``tokenizer.ggml.pre``
    names, "gpt-2", "mpt", "olmo" or "falcon" (docs/checkpoints.md, "GGUF
    files").
    Encoding, special tokens and decoding are those of the model's own
    tokenizer.json. Needs the optional ``tokenizers`` package.

    Parameters
    ----------
    path : str or PathLike

    Returns
    -------
    tokenizers.Tokenizer
        A new object each call, sharing nothing with the file (which is
        closed when this returns).

    Raises
    ------
    ValueError naming the metadata key: the file carries no tokenizer, another
    tokenizer model ("llama" ...), another split, malformed tokens, token types,
    merges or special-token ids; and read_gguf's errors.
    ImportError without the ``tokenizers`` package.
    """
    from ._gguf_tokenizer import gguf_tokenizer
    path = Path(path)
    return gguf_tokenizer(read_gguf(path).metadata, path)


def _parse(r: _Reader, path) -> GGUFFile:
    try:
        return _parse_header(r, path)
    finally:
        r.buf.release()


def _parse_header(r: _Reader, path) -> GGUFFile:
    if bytes(r.buf[:4]) != MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic {bytes(r.buf[:4])!r}, not b'GGUF')")
    r.at = 4
    version = r.unpack("I", "the version")
    if version not in (2, 3):
        raise r.fail(f"version {version} (only 2 and 3 are read)")
    n_tensors = r.unpack("Q", "the tensor count")
    n_kv = r.unpack("Q", "the metadata count")
    if n_kv > (r.size - r.at) // 13:  # key length 8 + at least 1 byte + type 4
        raise r.fail(f"metadata count {n_kv} is more than the file can hold")
    metadata = {}
    for _ in range(n_kv):
        key = r.string("a metadata key")
        vtype = r.unpack("I", f"the value type of metadata key {key!r}")
        value = r.value(vtype, key)
        if key in metadata:
            raise r.fail(f"metadata key {key!r} appears twice")
        metadata[key] = value
    if n_tensors > (r.size - r.at) // 24:  # name length 8 + dims 4 + type 4 + offset 8
        raise r.fail(f"tensor count {n_tensors} is more than the file can hold")
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 \
            or alignment & (alignment - 1):
        raise r.fail(f"metadata key 'general.alignment' = {alignment!r} is not a power of two")
    infos = []
    for _ in range(n_tensors):
        name = r.string("a tensor name")
        n_dims = r.unpack("I", f"the dimension count of tensor {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise r.fail(f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = [r.unpack("Q", f"the dimensions of tensor {name}") for _ in range(n_dims)]
        gtype = r.unpack("I", f"the type of tensor {name}")
        offset = r.unpack("Q", f"the offset of tensor {name}")
        infos.append((name, dims, gtype, offset))
    data_start = -(-r.at // alignment) * alignment
    if data_start > r.size:
        raise r.fail(f"the data section would start at byte {data_start}, past the end")
    data_size = r.size - data_start
    tensors, spans = {}, []
    for name, dims, gtype, offset in infos:
        if name in tensors:
            raise r.fail(f"tensor {name} appears twice")
        if gtype not in _BLOCKS:
            tname = GGML_TYPE_NAMES.get(gtype, f"unknown ({gtype})")
            raise TypeError(f"{path}: tensor {name} has ggml type {tname}; only F32, F16, BF16 "
                            "(widened exactly) and Q8_0, Q4_0 (expanded exactly) are read")
        per, bsize = _BLOCKS[gtype]
        numel = 1
        for n in dims:
            if n < 1:
                raise r.fail(f"tensor {name} has a dimension of size {n}")
            numel *= n
        if dims[0] % per:
            raise r.fail(f"tensor {name}: its first dimension {dims[0]} is not a multiple of "
                         f"{GGML_TYPE_NAMES[gtype]}'s block of {per}")
        nbytes = numel // per * bsize
        if offset % alignment:
            raise r.fail(f"tensor {name}'s offset {offset} is not a multiple of the "
                         f"alignment {alignment}")
        if nbytes > data_size or offset > data_size - nbytes:
            raise r.fail(f"tensor {name} ({GGML_TYPE_NAMES[gtype]} {dims}) at offset {offset} "
                         f"needs {nbytes} bytes; the data section holds {data_size}")
        spans.append((offset, offset + nbytes, name))
        tensors[name] = GGUFTensor(path, name, gtype, tuple(reversed(dims)),
                                   data_start + offset)
    spans.sort()
    for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise r.fail(f"tensors {n0} and {n1} overlap (bytes {b1} to {e0} of the data)")
    return GGUFFile(path, version, metadata, tensors, alignment)
