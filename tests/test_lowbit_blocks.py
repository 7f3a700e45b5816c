"""mojolearn.lowbit's llama.cpp block formats q4_0 / q8_0 (docs/checkpoints.md):
pack gives the bytes of ggml's reference quantisers (re-implemented below in
float32 NumPy steps, and the gguf package's), the expansion is ggml's
dequantisation of the same bytes (re-implemented below from the byte layout,
and the gguf package's), a GGUF tensor's bytes are taken as they are
(from_ggml), and bad values are refused by name."""
import math
import pickle
import struct

import numpy as np
import pytest

from mojolearn import lowbit
from tests.bits import assert_same_bits
from tests.errors import raises_naming

F = np.float32
BB = {"q4_0": 18, "q8_0": 34}


# --------------------------------------------------------------------------- references
def ref_block(fmt, values) -> bytes:
    """ggml's quantize_row_q4_0_ref / quantize_row_q8_0_ref of one block, in
    float32 steps; a short block is padded with zeros."""
    x = [F(v) for v in values] + [F(0.0)] * (32 - len(values))
    amax, m = F(0.0), F(0.0)
    for v in x:
        if amax < abs(v):  # the first value of the largest magnitude
            amax, m = abs(v), v
    d = m / F(-8.0) if fmt == "q4_0" else amax / F(127.0)
    with np.errstate(over="ignore", divide="ignore"):
        inv = F(1.0) / d if d != 0 else F(0.0)
    if not np.isfinite(inv):  # undefined in ggml; lowbit's choice (module docstring)
        inv = F(0.0)
    head = struct.pack("<e", float(d))  # float16, nearest, ties to even
    if fmt == "q4_0":
        q = [min(15, int(v * inv + F(8.5))) for v in x]  # int(): truncation
        return head + bytes(q[j] | (q[j + 16] << 4) for j in range(16))
    codes = []
    for v in x:
        t = v * inv
        r = math.floor(abs(float(t)) + 0.5)  # roundf: half away from zero
        codes.append(-r if t < 0 else r)
    return head + struct.pack("<32b", *codes)


def ref_pack(fmt, w) -> bytes:
    w = np.asarray(w, F)
    return b"".join(ref_block(fmt, row[c:c + 32]) for row in w for c in range(0, w.shape[1], 32))


def ref_expand(fmt, raw: bytes, rows: int, cols: int) -> np.ndarray:
    """ggml's dequantize_row_q4_0 / q8_0 of the bytes: (q - 8) * d, q * d."""
    nb = -(-cols // 32)
    out = np.empty((rows, cols), F)
    for r in range(rows):
        for b in range(nb):
            blk = raw[(r * nb + b) * BB[fmt]:(r * nb + b + 1) * BB[fmt]]
            d = F(struct.unpack("<e", blk[:2])[0])
            for j in range(min(32, cols - 32 * b)):
                if fmt == "q4_0":
                    byte = blk[2 + j % 16]
                    q = (byte >> 4) if j >= 16 else (byte & 0x0F)
                    out[r, 32 * b + j] = F(q - 8) * d
                else:
                    out[r, 32 * b + j] = F(struct.unpack("<b", blk[2 + j:3 + j])[0]) * d
    return out


def raw_of(p) -> bytes:
    return bytes(memoryview(p.data).cast("B"))


# --------------------------------------------------------------------------- known codes
def test_q4_0_known_block():
    # m = -8: d = 1, id = 1, q = min(15, trunc(x + 8.5)): halves round up
    row = [0.0] * 32
    row[:8] = [-8.0, 2.5, -2.5, 7.9, 8.0, 0.49, -0.5, 0.0]
    row[16:18] = [3.0, -7.5]
    p = lowbit.pack_one(np.array([row], F), "q4_0")
    # codes 0, 11, 6, 15 (16.4 clamped), 15 (16.5 clamped), 8, 8, 8 ... ; 11, 1 in
    # elements 16, 17 (the high nibbles of bytes 0, 1); every other code 8
    want = bytes([0x00, 0x3C, 0xB0, 0x1B, 0x86, 0x8F, 0x8F, 0x88, 0x88, 0x88] + [0x88] * 8)
    assert raw_of(p) == want
    assert p.shape == (1, 32) and np.asarray(p.data).shape == (1, 18) and p.nbytes == 18
    wide = np.asarray(p.to_float32())[0]
    assert list(wide[:8]) == [-8.0, 3.0, -2.0, 7.0, 7.0, 0.0, 0.0, 0.0]
    assert list(wide[16:18]) == [3.0, -7.0]


def test_q8_0_known_block():
    # amax 127: d = 1, id = 1, q = roundf(x): halves away from zero
    row = [127.0, 2.5, -2.5, 1.4999999, -0.5, 0.5, -127.0] + [0.0] * 25
    p = lowbit.pack_one(np.array([row], F), "q8_0")
    assert raw_of(p) == bytes([0x00, 0x3C, 0x7F, 0x03, 0xFD, 0x01, 0xFF, 0x01, 0x81]) + bytes(25)
    assert list(np.asarray(p.to_float32())[0, :7]) == [127.0, 3.0, -3.0, 1.0, -1.0, 1.0, -127.0]


def test_zero_and_tiny_blocks():
    z = np.zeros((1, 32), F)
    # q4_0: m = +0, d = 0 / -8 = -0.0 (float16 0x8000), codes 8; value 0 * -0.0 = -0.0
    p = lowbit.pack_one(z, "q4_0")
    assert raw_of(p) == b"\x00\x80" + b"\x88" * 16
    assert set(np.asarray(p.to_float32()).view(np.uint32).ravel()) == {0x80000000}
    q = lowbit.pack_one(z, "q8_0")
    assert raw_of(q) == bytes(34)
    assert set(np.asarray(q.to_float32()).view(np.uint32).ravel()) == {0}
    # |d| < 2^-128: 1 / d is not finite; the codes of zero, a zero scale
    tiny = np.full((1, 32), 2.0 ** -130, F)
    tiny[0, 3] = -2.0 ** -131
    assert raw_of(lowbit.pack_one(tiny, "q4_0")) == b"\x00\x80" + b"\x88" * 16
    assert raw_of(lowbit.pack_one(tiny, "q8_0")) == bytes(34)


@pytest.mark.parametrize("d, bits", [
    (1.0, 0x3C00),
    (1.0 + 2.0 ** -11, 0x3C00),  # tie between 1 and 1 + 2^-10: to even (down)
    (1.0 + 3 * 2.0 ** -11, 0x3C02),  # tie: to even (up)
    (1.0 + 2.0 ** -11 + 2.0 ** -20, 0x3C01),  # just above the tie
    (65504.0, 0x7BFF),  # the largest float16
    (2.0 ** -14, 0x0400),  # the smallest normal float16
    (2.0 ** -24, 0x0001),  # the smallest subnormal
    (2.0 ** -25, 0x0000),  # tie between 0 and 2^-24: to even (zero)
    (3 * 2.0 ** -25, 0x0002),  # tie between 1 and 2 units: to even (up)
    (1023 * 2.0 ** -24 + 2.0 ** -25, 0x0400),  # subnormal rounding up into the normals
    (-(2.0 ** -14) * (1 + 2.0 ** -10), 0x8401),
])
def test_q4_0_scale_is_rounded_to_float16_to_nearest_even(d, bits):
    row = np.zeros((1, 32), F)
    row[0, 7] = F(-8.0 * d)  # d = m / -8 exactly
    assert F(-8.0 * d) == -8.0 * d
    raw = raw_of(lowbit.pack_one(row, "q4_0"))
    assert struct.unpack("<H", raw[:2])[0] == bits
    assert struct.pack("<e", d) == raw[:2]  # the reference rounding agrees


# --------------------------------------------------------------------------- random
def _random_rows(seed, rows, cols):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * np.exp2(rng.uniform(-40, 16, (rows, 1)))
    w = w.astype(F)
    w[1] = 0.0
    w[2, ::3] = -w[2, ::3]
    # values whose x * id + 8.5 (q4_0) or x * id (q8_0) is exactly a half: ties
    w[3] = F(0.5) * rng.integers(-16, 17, cols).astype(F)
    w[3, 0] = -8.0
    w[4] = rng.integers(-254, 255, cols).astype(F) / F(2.0)
    w[4, 0] = 127.0
    return w


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("cols", [96, 77, 5])  # whole blocks, a short last block, one short block
def test_pack_is_ggml_reference_and_expansion_is_ggml_dequantization(fmt, cols):
    w = _random_rows(1, 9, cols)
    p = lowbit.pack_one(w, fmt, "w")
    assert p.format == fmt and p.shape == w.shape and p.exponents is None
    nb = -(-cols // 32)
    assert np.asarray(p.data).shape == (9, nb * BB[fmt]) and np.asarray(p.data).dtype == np.uint8
    raw = raw_of(p)
    assert raw == ref_pack(fmt, w)
    wide = np.asarray(p.to_float32())
    assert_same_bits(wide, ref_expand(fmt, raw, 9, cols), "expansion")
    # the documented error bound (a: the block's largest magnitude)
    for r in range(9):
        for c0 in range(0, cols, 32):
            x = w[r, c0:c0 + 32].astype(np.float64)
            err = np.abs(x - wide[r, c0:c0 + 32])
            a = np.abs(x).max()
            bound = a * (1 / 8 + 2 ** -10) + 2 ** -22 if fmt == "q4_0" else \
                a * (1 / 254 + 2 ** -10) + 2 ** -17
            assert (err <= bound).all(), (r, c0)
    # packing the expansion again gives the same values (as numbers: a block
    # whose scale underflowed float16 expands to zeros of either sign)
    assert np.array_equal(np.asarray(lowbit.pack_one(wide, fmt).to_float32()), wide)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_same_bytes_and_values_as_the_gguf_package(fmt):
    """An independent oracle: the gguf package (llama.cpp's Python GGUF
    writer) quantises to the bytes of pack and dequantises them to our
    expansion, bit for bit."""
    from gguf import GGMLQuantizationType, quants
    qtype = {"q4_0": GGMLQuantizationType.Q4_0, "q8_0": GGMLQuantizationType.Q8_0}[fmt]
    w = _random_rows(5, 9, 96)
    p = lowbit.pack_one(w, fmt)
    theirs = quants.quantize(w, qtype)
    assert raw_of(p) == theirs.tobytes()
    assert_same_bits(p.to_float32(), quants.dequantize(theirs, qtype), "expansion")
    # negative control: another row's bytes differ
    assert raw_of(lowbit.pack_one(w[::-1].copy(), fmt)) != theirs.tobytes()


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_arbitrary_bytes_expand_as_ggml_does(fmt):
    """Any codes (q8_0: -128 too) and any finite scale, float16 subnormals included."""
    rng = np.random.default_rng(2)
    rows, cols = 6, 70
    nb = -(-cols // 32)
    blocks = rng.integers(0, 256, (rows * nb, BB[fmt]), dtype=np.uint8)
    scales = rng.integers(0, 0x7C00, rows * nb).astype(np.uint16)  # finite magnitudes
    scales[::3] &= 0x03FF  # subnormal
    scales[1::4] |= 0x8000  # negative
    blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    raw = blocks.tobytes()
    p = lowbit.from_ggml(fmt, raw, (rows, cols))
    assert p.shape == (rows, cols) and raw_of(p) == raw
    assert_same_bits(p.to_float32(), ref_expand(fmt, raw, rows, cols))
    # negative control: the reference reads the nibbles / codes it is given
    flipped = bytearray(raw)
    flipped[2] ^= 0x11
    assert np.asarray(lowbit.from_ggml(fmt, bytes(flipped), (rows, cols)).to_float32()).tobytes() \
        != np.asarray(p.to_float32()).tobytes()


def test_pack_is_independent_of_thread_count(threads):
    w = np.random.default_rng(3).standard_normal((300, 200)).astype(F)
    out = {}
    for n in (1, 2):
        threads(n)
        out[n] = [raw_of(lowbit.pack_one(w, f)) for f in ("q4_0", "q8_0")]
    assert out[1] == out[2]


# --------------------------------------------------------------------------- API and errors
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_api(fmt):
    w = np.random.default_rng(4).standard_normal((3, 40)).astype(F)
    p = lowbit.pack_one(w, fmt, "in_proj.weight")
    assert lowbit.is_packed(p) and lowbit.format_of(p) == fmt and lowbit.pack_one(p, fmt) is p
    assert p.nbytes == 3 * 2 * BB[fmt]
    with pytest.raises(TypeError):
        memoryview(p)
    r = pickle.loads(pickle.dumps(p))
    assert r.shape == p.shape and raw_of(r) == raw_of(p)
    # the constructor on the same bytes (cols given: the last block is short)
    c = lowbit.PackedWeight(fmt, np.asarray(p.data), cols=40)
    assert c.shape == (3, 40) and raw_of(c) == raw_of(p)
    assert lowbit.PackedWeight(fmt, np.asarray(p.data)).shape == (3, 64)
    # between formats through the exact expansion
    i8 = lowbit.pack_one(p, "int8")
    assert i8.format == "int8"
    assert_same_bits(i8.to_float32(), lowbit.pack_one(p.to_float32(), "int8").to_float32())


def test_refusals():
    with raises_naming(ValueError, "fmt", "'q4_1'"):
        lowbit.from_ggml("q4_1", bytes(18), (1, 32))
    with raises_naming(ValueError, "raw", "36", "18"):
        lowbit.from_ggml("q4_0", bytes(36), (1, 32))
    with raises_naming(ValueError, "shape"):
        lowbit.from_ggml("q4_0", bytes(18), (32,))
    with raises_naming(TypeError, "raw"):
        lowbit.from_ggml("q8_0", 3.0, (1, 32))
    bad = bytearray(b"\x00\x3C" + bytes(16)) * 3
    bad[18 * 2 + 1] = 0x7C  # block 0 of row 1 (2 blocks a row): infinity
    with raises_naming(ValueError, "block 0 of row 1", "non-finite"):
        lowbit.from_ggml("q4_0", bytes(bad[:36]) + bytes(bad[36:]) + bytes(18), (2, 64))
    with raises_naming(ValueError, "cols = 70", "3 blocks"):
        lowbit.PackedWeight("q8_0", np.zeros((1, 68), np.uint8), cols=70)
    with raises_naming(ValueError, "data", "34"):
        lowbit.PackedWeight("q8_0", np.zeros((1, 35), np.uint8))
    with raises_naming(TypeError, "data", "uint8"):
        lowbit.PackedWeight("q4_0", np.zeros((1, 18), np.int8))
    with raises_naming(ValueError, "exponents"):
        lowbit.PackedWeight("q4_0", np.zeros((1, 18), np.uint8), np.zeros(1, np.int32))
    with raises_naming(ValueError, "cols", "'int8'"):
        lowbit.PackedWeight("int8", np.zeros((1, 2), np.int8), np.zeros(1, np.int32), cols=2)


@pytest.mark.parametrize("fmt, big", [("q4_0", 524288.0), ("q8_0", 8.4e6)])
def test_scale_overflow_refused_by_name(fmt, big):
    w = np.ones((2, 40), F)
    w[1, 35] = -big  # its block's float16 scale would be infinite
    with raises_naming(ValueError, "out_proj.weight", "flat index 75", "infinite"):
        lowbit.pack_one(w, fmt, "out_proj.weight")
    w[1, 35] = -big / 2  # well inside: packs
    assert lowbit.pack_one(w, fmt).shape == (2, 40)
