"""mojolearn.lowbit (docs/checkpoints.md): exact bit-level packing, exact expansion,
blocks on packed weights byte-identical to blocks on the expanded weights."""
import math
import pickle
import struct
from array import array

import numpy as np
import pytest

import mojolearn
from mojolearn import lowbit
from tests.bits import assert_same_bits
from tests.errors import raises_naming
from mojolearn.reference.weights import (mamba1_weights, mamba2_weights, mamba3_weights,
                                         random_input)


def f32(bits):
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def bf16_of(values):
    a = np.asarray(values, dtype=np.float32).reshape(1, -1)
    return np.asarray(lowbit.pack_one(a, "bfloat16").data).reshape(-1)


def numpy_bf16(w):
    u = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16
    return np.where((u & 0x7F800000) == 0, (u >> 16) & 0x8000, rounded).astype(np.uint16)


# --------------------------------------------------------------------------- bfloat16
@pytest.mark.parametrize("bits, want", [
    (0x3F800000, 0x3F80),  # 1.0
    (0x3F807FFF, 0x3F80),  # just below the tie: down
    (0x3F808000, 0x3F80),  # tie, even upper half: stays
    (0x3F818000, 0x3F82),  # tie, odd upper half: up to even
    (0x3F808001, 0x3F81),  # just above the tie: up
    (0xBF818000, 0xBF82),  # negative tie to even
    (0xBF808000, 0xBF80),
    (0x3FFFFFFF, 0x4000),  # carry into the exponent
    (0x00000001, 0x0000),  # smallest subnormal: flushed
    (0x80000001, 0x8000),  # negative subnormal: flushed to -0.0
    (0x007FFFFF, 0x0000),  # largest subnormal: flushed (not rounded up to normal)
    (0x807FFFFF, 0x8000),
    (0x00800000, 0x0080),  # smallest normal is kept
    (0x00000000, 0x0000),
    (0x80000000, 0x8000),
    (0x7F7F7FFF, 0x7F7F),  # largest value that stays finite
])
def test_bfloat16_rounding_bits(bits, want):
    assert int(bf16_of([f32(bits)])[0]) == want
    assert lowbit.bfloat16_bits(f32(bits)) == want


def test_bfloat16_overflow_refused():
    w = np.zeros((2, 3), np.float32)
    w[1, 2] = f32(0x7F7F8000)  # tie at the top: would round to infinity
    with raises_naming(ValueError, "w", "flat index 5", "infinity"):
        lowbit.pack_one(w, "bfloat16", "w")


def test_bfloat16_random_bits_match_reference_and_widen_exactly():
    rng = np.random.default_rng(1)
    u = rng.integers(0, 2**32, size=(257, 131), dtype=np.uint64).astype(np.uint32)
    u &= ~np.uint32(0x40000000)  # keep exponents below 0x7F: finite, no overflow
    u[::7] &= np.uint32(0x807FFFFF)  # many subnormals
    u[::5, ::3] = (u[::5, ::3] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # many ties
    w = u.view(np.float32)
    p = lowbit.pack_one(w, "bfloat16", "w")
    assert p.format == "bfloat16" and p.shape == w.shape and p.exponents is None
    bits = np.asarray(p.data)
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bits, numpy_bf16(w))
    wide = np.asarray(p.to_float32())
    np.testing.assert_array_equal(wide.view(np.uint32), bits.astype(np.uint32) << 16)
    # packing the expansion again is the identity
    again = np.asarray(lowbit.pack_one(wide, "bfloat16").data)
    np.testing.assert_array_equal(again, bits)


# --------------------------------------------------------------------------- int8
def int8(row):
    p = lowbit.pack_one(np.asarray([row], np.float32), "int8")
    return list(np.asarray(p.data)[0]), int(np.asarray(p.exponents)[0]), np.asarray(p.to_float32())[0]


@pytest.mark.parametrize("row, codes, e", [
    ([1.0, -0.5, 0.25], [64, -32, 16], -6),                # absmax 1: e = 0 - 6
    ([1.9999999, 0.0], [127, 0], -6),                      # 127.99 rounds to 128: clamped
    ([-1.9999999, 1.0], [-127, 64], -6),
    ([2.5 / 64, 3.5 / 64, -2.5 / 64, 1.0], [2, 4, -2, 64], -6),  # ties to even
    ([0.5 / 64, 1.5 / 64, 1.0], [0, 2, 64], -6),
    ([100.0, 1.0], [100, 1], 0),                           # floor(log2 100) = 6
    ([0.0, -0.0, 0.0], [0, 0, 0], -149),                   # all-zero row
    ([f32(1), 0.0], [1, 0], -149),                         # 2^-149: exponent floored
    ([2.0 ** -140, 2.0 ** -149], [64, 0], -146),           # 2^-149 * 2^146 = 1/8 rounds to 0
    ([f32(0x7F7FFFFF)], [127], 121),                       # largest float: e = 127 - 6
])
def test_int8_exponent_rounding_clamp(row, codes, e):
    got_codes, got_e, wide = int8(row)
    assert (got_codes, got_e) == (codes, e)
    assert lowbit.int8_row_reference([np.float32(v).item() for v in row]) == (codes, e)
    # dequantization is code * 2^e exactly
    assert [float(v) for v in wide] == [math.ldexp(c, e) for c in codes]


def test_int8_random_rows_match_reference_and_expand_exactly():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((64, 77)) * np.exp(rng.uniform(-30, 30, (64, 1)))).astype(np.float32)
    w[3] = 0.0
    w[5, :] = np.float32(2.0 ** -145) * rng.integers(-3, 4, 77)
    p = lowbit.pack_one(w, "int8", "w")
    codes, ex = np.asarray(p.data), np.asarray(p.exponents)
    assert codes.dtype == np.int8 and ex.dtype == np.int32 and ex.shape == (64,)
    assert codes.min() >= -127
    for r in range(64):
        c, e = lowbit.int8_row_reference([float(v) for v in w[r]])
        assert list(codes[r]) == c and ex[r] == e, r
    wide = np.asarray(p.to_float32())
    exact = codes.astype(np.float64) * np.ldexp(1.0, ex.astype(np.int64))[:, None]
    np.testing.assert_array_equal(wide.astype(np.float64), exact)
    # re-packing the expansion reproduces codes and exponents
    q = lowbit.pack_one(wide, "int8")
    np.testing.assert_array_equal(np.asarray(q.data), codes)
    np.testing.assert_array_equal(np.asarray(q.exponents), ex)


def test_pack_is_independent_of_thread_count(threads):
    w = np.random.default_rng(3).standard_normal((600, 300)).astype(np.float32)
    out = {}
    for n in (1, 2):
        threads(n)
        out[n] = [bytes(memoryview(lowbit.pack_one(w, f).data).cast("B"))
                  for f in ("bfloat16", "int8")]
    assert out[1] == out[2]


# --------------------------------------------------------------------------- API
def test_api_pack_one_is_packed_format_of():
    w = np.random.default_rng(4).standard_normal((8, 4)).astype(np.float32)
    for fmt in ("bfloat16", "int8"):
        p = lowbit.pack_one(w, fmt, "x_proj.weight")
        assert lowbit.is_packed(p) and lowbit.format_of(p) == fmt
        assert lowbit.pack_one(p, fmt) is p
        with pytest.raises(TypeError):
            memoryview(p)  # not a buffer: never mistaken for float32
        assert p.nbytes == (64 if fmt == "bfloat16" else 32 + 32)
        assert "PackedWeight" in repr(p)
        r = pickle.loads(pickle.dumps(p))
        assert_same_bits(r.to_float32(), p.to_float32())
    f = lowbit.pack_one(w, "float32")
    assert not lowbit.is_packed(f) and lowbit.format_of(f) == "float32"
    assert_same_bits(f, w)
    assert not lowbit.is_packed(w) and lowbit.format_of(w) == "float32"
    assert lowbit.format_of(array("f", [1.0])) == "float32"
    # converting between formats goes through the exact expansion
    b = lowbit.pack_one(lowbit.pack_one(w, "int8"), "bfloat16")
    assert b.format == "bfloat16"


def test_api_refusals():
    w = np.ones((2, 2), np.float32)
    with raises_naming(ValueError, "format", "'fp8'"):
        lowbit.pack_one(w, "fp8")
    with raises_naming(TypeError, "in_proj.weight", "float64"):
        lowbit.pack_one(w.astype(np.float64), "int8", "in_proj.weight")
    with raises_naming(ValueError, "D", "2-D"):
        lowbit.pack_one(np.ones(4, np.float32), "int8", "D")
    bad = w.copy()
    bad[1, 0] = np.nan
    with raises_naming(ValueError, "out_proj.weight", "flat index 2"):
        lowbit.pack_one(bad, "bfloat16", "out_proj.weight")
    with raises_naming(ValueError, "format", "'int4'"):
        lowbit.pack({}, "int4")


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "q4_0", "q8_0"])
@pytest.mark.parametrize("shape", [(0, 40), (3, 0), (0, 0)])
def test_empty_weights_pack_expand_and_pickle(fmt, shape):
    p = lowbit.pack_one(np.zeros(shape, np.float32), fmt, "w")
    assert p.shape == shape and np.asarray(p.to_float32()).shape == shape
    assert pickle.loads(pickle.dumps(p)).shape == shape
    if fmt in ("q4_0", "q8_0"):
        assert lowbit.from_ggml(fmt, b"", shape).shape == shape


def test_packed_weight_from_parts():
    codes = np.array([[1, -2], [127, 0]], np.int8)
    p = lowbit.PackedWeight("int8", codes, np.array([-3, 5], np.int32))
    np.testing.assert_array_equal(np.asarray(p.to_float32()), [[0.125, -0.25], [127 * 32, 0]])
    with raises_naming(ValueError, "int8 codes", "[-127, 127]", "-128"):
        lowbit.PackedWeight("int8", np.array([[-128]], np.int8), np.array([0], np.int32))
    with raises_naming(ValueError, "exponents[0]", "-150"):
        lowbit.PackedWeight("int8", codes, np.array([-150, 0], np.int32))
    with raises_naming(ValueError, "exponents"):
        lowbit.PackedWeight("int8", codes)
    with raises_naming(TypeError, "data", "int8"):
        lowbit.PackedWeight("int8", codes.astype(np.int16), np.array([0, 0], np.int32))
    b = lowbit.PackedWeight("bfloat16", np.array([[0x3F80, 0xC000]], np.uint16))
    np.testing.assert_array_equal(np.asarray(b.to_float32()), [[1.0, -2.0]])
    with raises_naming(ValueError, "format", "'float32'"):
        lowbit.PackedWeight("float32", np.ones((1, 1), np.float32))


def test_pack_unpack_dicts():
    w = mamba1_weights(16, seed=1)
    for fmt in ("bfloat16", "int8"):
        p = lowbit.pack(w, fmt)
        packed = sorted(k for k, v in p.items() if lowbit.is_packed(v))
        assert packed == ["dt_proj.weight", "in_proj.weight", "out_proj.weight", "x_proj.weight"]
        assert p["A_log"] is w["A_log"] and p["conv1d.weight"] is w["conv1d.weight"]
        assert lowbit.format_of(p) == fmt
        u, got = lowbit.unpack(p)
        assert got == fmt and set(u) == set(w)
        assert all(not lowbit.is_packed(v) for v in u.values())
        assert_same_bits(u["in_proj.weight"], p["in_proj.weight"].to_float32())
        assert_same_bits(lowbit.pack(p, "float32")["in_proj.weight"], u["in_proj.weight"])
    u, got = lowbit.unpack(w)
    assert got == "float32" and lowbit.format_of(w) == "float32"


def test_mixed_formats_are_reported_not_refused():
    """Mixes were refused before blocks kept a format per projection; now
    they are 'mixed' (tests/test_lowbit_mixed.py checks the bits)."""
    w = mamba1_weights(16, seed=1)
    mixed = dict(w, **{"in_proj.weight": lowbit.pack_one(w["in_proj.weight"], "bfloat16")})
    assert lowbit.unpack(mixed)[1] == "mixed"
    block = mojolearn.Mamba1Block(mixed)
    assert block.weight_format == "mixed"
    assert block.weight_formats == {"in_proj.weight": "bfloat16", "x_proj.weight": "float32",
                                    "dt_proj.weight": "float32", "out_proj.weight": "float32"}
    two = lowbit.pack(w, "int8")
    two["out_proj.weight"] = lowbit.pack_one(w["out_proj.weight"], "bfloat16")
    assert lowbit.format_of(two) == "mixed"
    assert lowbit.formats_of(two)["out_proj.weight"] == "bfloat16"
    assert mojolearn.Mamba1Block(two).weight_formats["x_proj.weight"] == "int8"


# --------------------------------------------------------------------------- blocks
def _blocks():
    out = [("Mamba1Block", mamba1_weights(16, seed=5), 16),
           ("Mamba3Block", mamba3_weights(32, seed=6), 32)]
    out.append(("Mamba2Block", mamba2_weights(32, seed=7), 32))
    return out


@pytest.mark.parametrize("cls, w, d", _blocks(), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "q4_0", "q8_0"])
def test_block_on_packed_weights_gives_same_bytes(cls, w, d, fmt):
    Block = getattr(mojolearn, cls)
    packed = lowbit.pack(w, fmt)
    expanded, got = lowbit.unpack(packed)
    assert got == fmt
    b_packed = Block(packed)
    b_plain = Block(expanded)
    x = random_input(2, 5, d, seed=9)
    assert_same_bits(b_packed.forward(x), b_plain.forward(x))
    s1, s2 = b_packed.allocate_state(2), b_plain.allocate_state(2)
    b_packed.forward(x, s1)
    b_plain.forward(x, s2)
    assert_same_bits(b_packed.step(x[:, 0], s1), b_plain.step(x[:, 0], s2))
    # the packed values differ from the float32 originals: the block really used them
    assert bytes(memoryview(b_plain.forward(x))) != bytes(memoryview(Block(w).forward(x)))
    assert b_packed.weight_format == fmt and b_plain.weight_format == "float32"
    # params keep the format and the bits
    p = b_packed.get_params()
    assert lowbit.format_of(p["weights"]) == fmt
    b_packed.set_params(**p)
    assert b_packed.weight_format == fmt
    assert_same_bits(b_packed.forward(x), b_plain.forward(x))


def test_block_refuses_bad_packed_values_by_name():
    w = lowbit.pack(mamba1_weights(16, seed=1), "bfloat16")
    bits = np.asarray(w["out_proj.weight"].data).copy()
    bits[0, 3] = 0x7F80  # infinity
    w["out_proj.weight"] = lowbit.PackedWeight("bfloat16", bits)
    with raises_naming(ValueError, "out_proj.weight", "flat index 3"):
        mojolearn.Mamba1Block(w)
    w["out_proj.weight"] = lowbit.pack_one(np.ones((3, 3), np.float32), "bfloat16")
    with raises_naming(ValueError, "out_proj.weight must have shape", "(3, 3)"):
        mojolearn.Mamba1Block(w)


def test_lowbit_and_safetensors_without_numpy_or_torch(tmp_path):
    """A fresh interpreter with NumPy and PyTorch blocked packs weights,
    builds a block on them and reads a safetensors file."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path
    pkg_parent = str(Path(mojolearn.__file__).resolve().parent.parent)
    code = textwrap.dedent("""
        import sys, struct, json
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("numpy", "torch"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        from array import array
        import mojolearn
        from mojolearn import lowbit
        d, di, r = 16, 32, 1
        def buf(shape, seed):
            n = 1
            for s in shape:
                n *= s
            a = array("f", [((i * 7919 + seed * 104729) % 1000) / 5000.0 - 0.1 for i in range(n)])
            return memoryview(a).cast("B").cast("f", shape)
        w = {"norm.weight": buf((d,), 1), "in_proj.weight": buf((2 * di, d), 2),
             "conv1d.weight": buf((di, 4), 3), "conv1d.bias": buf((di,), 4),
             "x_proj.weight": buf((r + 32, di), 5), "dt_proj.weight": buf((di, r), 6),
             "dt_proj.bias": buf((di,), 7), "A_log": buf((di, 16), 8), "D": buf((di,), 9),
             "out_proj.weight": buf((d, di), 10)}
        x = buf((1, 3, d), 11)
        for fmt in ("bfloat16", "int8", "q4_0", "q8_0"):
            p = lowbit.pack(w, fmt)
            a = mojolearn.Mamba1Block(p)
            b = mojolearn.Mamba1Block(lowbit.unpack(p)[0])
            assert a.weight_format == fmt
            assert bytes(memoryview(a.forward(x))) == bytes(memoryview(b.forward(x)))
        raw = struct.pack("<2H", 0x3F80, 0xC000)
        h = json.dumps({"t": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}).encode()
        path = sys.argv[1]
        open(path, "wb").write(struct.pack("<Q", len(h)) + h + raw)
        t = mojolearn.read_safetensors(path)["t"]
        assert t.tolist() == [1.0, -2.0], t.tolist()
        assert "numpy" not in sys.modules and "torch" not in sys.modules
        print("ok")
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "t.safetensors")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]
