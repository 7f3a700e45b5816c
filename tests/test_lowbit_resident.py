"""Packed projection weights stay packed in a block (bfloat16 / int8 / q4_0 /
q8_0 panels widened exactly by the GEMM on load) and give the bytes of the block built on
``lowbit.unpack(weights)``: forward, ragged, state continuation, step, decode
sessions, thread counts and backward; with negative controls showing the
kernels read the packed codes."""
import numpy as np
import pytest

import mojolearn
from mojolearn import lowbit
from mojolearn.lowbit import BLOCK_BYTES
from tests.bits import assert_bits_differ, assert_same_bits
from mojolearn.reference.weights import (mamba1_weights, mamba2_weights, mamba3_weights,
                                         random_input)

FORMATS = ("bfloat16", "int8", "q4_0", "q8_0")
# d=20 for Mamba-1: out_proj / x_proj row counts that are not a multiple of
# the 16-row panel (padding lanes in the int8 scales and bf16 codes), and
# q4_0 / q8_0 rows of 20 and 2 columns (one short block each).
BLOCKS = [("Mamba1Block", mamba1_weights, 20), ("Mamba2Block", mamba2_weights, 64),
          ("Mamba3Block", mamba3_weights, 64)]
PROJ = {"Mamba1Block": ("in_proj.weight", "x_proj.weight", "dt_proj.weight", "out_proj.weight"),
        "Mamba2Block": ("in_proj.weight", "out_proj.weight"),
        "Mamba3Block": ("in_proj.weight", "out_proj.weight")}
# every array of each block's state (all must match, none may be absent)
STATE = {"Mamba1Block": ("conv_window", "h"),
         "Mamba2Block": ("conv_window", "h", "buffer_xbc", "buffer_dtraw"),
         "Mamba3Block": ("theta", "h", "buffer_qrot", "buffer_krot", "buffer_v", "buffer_dt",
                         "buffer_sig", "buffer_adt", "pending_k", "pending_v")}


def _pair(cls, make, d, fmt, seed=3):
    block_cls = getattr(mojolearn, cls)
    packed = lowbit.pack(make(d, seed=seed), fmt)
    return block_cls(packed), block_cls(lowbit.unpack(packed)[0]), packed


def _perturbed(packed, name, index=0):
    """packed with one code of weight `name` changed (bf16: the top mantissa
    bit flipped; int8, q8_0: the code moved by 32 towards zero's other side;
    q4_0: the code's top bit flipped; the block formats: the first code
    of the row's first block)."""
    p = packed[name]
    data = np.array(p.data, copy=True)
    flat = data.reshape(-1)
    if p.format == "bfloat16":
        flat[index] ^= 0x0040
        return dict(packed, **{name: lowbit.PackedWeight("bfloat16", data)})
    if p.format in ("q4_0", "q8_0"):
        i = index + 2  # past the block's float16 scale
        if p.format == "q4_0":
            flat[i] ^= 0x08
        else:
            c = int(data.view(np.int8).reshape(-1)[i])
            flat[i] = np.uint8((c - 32 if c >= 0 else c + 32) & 0xFF)
        return dict(packed, **{name: lowbit.PackedWeight(p.format, data, cols=p.shape[1])})
    flat[index] = flat[index] - 32 if flat[index] >= 0 else flat[index] + 32
    return dict(packed, **{name: lowbit.PackedWeight("int8", data, np.asarray(p.exponents))})


def _check_state_paths(bp, bu, d, seed):
    """Prefill + continuation + step + decode session on both blocks."""
    x = random_input(2, 70, d, seed=seed)  # crosses Mamba-3's 64-token chunk
    sp, su = bp.allocate_state(2), bu.allocate_state(2)
    assert_same_bits(bp.forward(x[:, :33], sp), bu.forward(x[:, :33], su), "prefill")
    assert_same_bits(bp.forward(x[:, 33:66], sp), bu.forward(x[:, 33:66], su), "continuation")
    assert_same_bits(bp.step(x[:, 66], sp), bu.step(x[:, 66], su), "step")
    with bp.decode_session(sp) as a, bu.decode_session(su) as b:
        for t in range(67, 70):
            assert_same_bits(a.step(x[:, t]), b.step(x[:, t]), f"session step {t}")
    for name in STATE[type(bp).__name__]:
        assert_same_bits(getattr(sp, name), getattr(su, name), f"state.{name}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cls, make, d", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_packed_block_gives_the_bytes_of_the_unpacked_block(cls, make, d, fmt):
    bp, bu, _ = _pair(cls, make, d, fmt)
    x = random_input(3, 19, d, seed=4)
    assert_same_bits(bp.forward(x), bu.forward(x), "forward")
    lengths = [19, 7, 1]
    assert_same_bits(bp.forward(x, lengths=lengths), bu.forward(x, lengths=lengths), "ragged")
    _check_state_paths(bp, bu, d, seed=5)
    assert bp.weight_format == fmt and bu.weight_format == "float32"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cls, make", [(b[0], b[1]) for b in BLOCKS], ids=[b[0] for b in BLOCKS])
def test_packed_weights_stay_packed(cls, make, fmt):
    bp, bu, _ = _pair(cls, make, 128, fmt)
    # The blob holds the only copy of the projections, packed or float32
    # (no float32 copy next to the panels, no second packed copy).
    for b in (bp, bu):
        assert sorted(b._packed_shapes) == sorted(PROJ[cls])
        assert not set(PROJ[cls]) & set(b._weights)
    # The projections dominate: half (bf16) or about a quarter (int8: codes
    # plus one float32 scale per row) of the float32 panel bytes.
    # q8_0: 8.5 bits a value; q4_0: 4.5 bits (plus the small weights)
    limit = {"bfloat16": 0.6, "int8": 0.4, "q8_0": 0.4, "q4_0": 0.25}[fmt]
    assert bp._blob.nbytes < limit * bu._blob.nbytes
    assert bp._held_bytes() < limit * bu._held_bytes()


@pytest.mark.parametrize("cls, make", [(b[0], b[1]) for b in BLOCKS], ids=[b[0] for b in BLOCKS])
def test_float32_block_holds_one_copy_until_a_backward(cls, make):
    """A float32 block holds its projections once (in the blob); get_params
    reads back the given bytes; a backward keeps a float32 copy from then on
    (and the same gradients as a fresh block)."""
    _, bu, _ = _pair(cls, make, 128, "bfloat16")
    blob = bu._blob.nbytes
    small = sum(v.nbytes for v in bu._weights.values())
    assert bu._held_bytes() == blob + small
    w = bu.get_params()["weights"]
    fresh = type(bu)(w)
    for n in PROJ[cls]:
        assert np.asarray(w[n]).dtype == np.float32
    again = fresh.get_params()["weights"]
    for n in w:
        assert_same_bits(np.asarray(again[n]), np.asarray(w[n]), n)
    x = np.random.default_rng(3).standard_normal((1, 9, 128)).astype(np.float32)
    g = np.random.default_rng(4).standard_normal((1, 9, 128)).astype(np.float32)
    first = fresh.backward(x, g)
    assert fresh._held_bytes() > blob + small  # the kept copy (and transposed panels)
    second = fresh.backward(x, g)
    for n in first:
        assert_same_bits(np.asarray(second[n]), np.asarray(first[n]), f"repeated backward {n}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cls, make, d", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_one_changed_code_changes_the_bytes(cls, make, d, fmt):
    """Negative control: the kernels read the packed codes of every projection."""
    bp, _, packed = _pair(cls, make, d, fmt)
    assert_codes_read(bp, packed, PROJ[cls])


def assert_codes_read(bp, packed, names):
    """Forward and step of block bp (built on `packed`) change when one code
    of any of the packed weights `names` changes."""
    block_cls, d = type(bp), bp.d_model
    x = random_input(2, 9, d, seed=6)
    y = bp.forward(x)
    s = bp.allocate_state(2)
    bp.forward(x[:, :8], s)
    ys = bp.step(x[:, 8], s)
    for name in names:
        other = block_cls(_perturbed(packed, name))
        assert_bits_differ(other.forward(x), y, f"forward, {name} perturbed")
        s2 = other.allocate_state(2)
        other.forward(x[:, :8], s2)
        assert_bits_differ(other.step(x[:, 8], s2), ys, f"step, {name} perturbed")


def test_int8_scale_change_changes_the_bytes():
    """Negative control for the per-row scales: one exponent + 1 in out_proj."""
    bp, _, packed = _pair("Mamba2Block", mamba2_weights, 64, "int8")
    p = packed["out_proj.weight"]
    ex = np.array(p.exponents, copy=True)
    ex[5] += 1
    other = mojolearn.Mamba2Block(dict(packed, **{
        "out_proj.weight": lowbit.PackedWeight("int8", np.asarray(p.data), ex)}))
    x = random_input(1, 4, 64, seed=7)
    y0, y1 = np.asarray(bp.forward(x)), np.asarray(other.forward(x))
    assert_bits_differ(y0, y1)
    assert np.array_equal(np.flatnonzero((y0 != y1).any(axis=(0, 1))), [5])  # only row 5


# the last: llama.cpp's Mamba-1 mix (x_proj, dt_proj float32; tests/test_lowbit_mixed.py)
@pytest.mark.parametrize("fmt", FORMATS + ({"in_proj.weight": "q4_0", "out_proj.weight": "q4_0"},),
                         ids=FORMATS + ("mixed",))
def test_thread_count_does_not_change_packed_bits(fmt):
    bp, _, _ = _pair("Mamba1Block", mamba1_weights, 64, fmt)
    x = random_input(7, 13, 64, seed=8)
    before = mojolearn.get_num_threads()
    try:
        mojolearn.set_num_threads(1)
        y1 = bp.forward(x)
        mojolearn.set_num_threads(3)
        y3 = bp.forward(x)
    finally:
        mojolearn.set_num_threads(before)
    assert_same_bits(y1, y3)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_block_scale_change_changes_only_its_row(fmt):
    """Negative control for the block scales: one float16 scale of out_proj
    (row 5, its second block) moved by one unit in the last place."""
    bp, _, packed = _pair("Mamba2Block", mamba2_weights, 64, fmt)
    p = packed["out_proj.weight"]
    data = np.array(p.data, copy=True)
    data[5, BLOCK_BYTES[fmt]] ^= 0x01  # the low byte of block 1's scale
    other = mojolearn.Mamba2Block(dict(packed, **{
        "out_proj.weight": lowbit.PackedWeight(fmt, data, cols=p.shape[1])}))
    x = random_input(1, 4, 64, seed=7)
    y0, y1 = np.asarray(bp.forward(x)), np.asarray(other.forward(x))
    assert_bits_differ(y0, y1)
    assert np.array_equal(np.flatnonzero((y0 != y1).any(axis=(0, 1))), [5])  # only row 5


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_ggml_bytes_with_subnormal_scales_give_the_expanded_bits(fmt):
    """Weights made from raw block bytes (float16 subnormal and negative
    scales, every code; q8_0 also -128), not from pack: the GEMM and the
    embedding-free paths widen them as the expansion does."""
    w = mamba2_weights(64, seed=18)
    rng = np.random.default_rng(19)
    for name in ("in_proj.weight", "out_proj.weight"):
        rows, cols = w[name].shape
        nb = cols // 32
        blocks = rng.integers(0, 256, (rows * nb, BLOCK_BYTES[fmt]), dtype=np.uint8)
        scales = rng.integers(0x0100, 0x2000, rows * nb).astype(np.uint16)  # about 2^-22 .. 2^-8
        scales[::5] &= 0x03FF  # subnormal
        scales[1::3] |= 0x8000
        blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
        w[name] = lowbit.from_ggml(fmt, blocks.tobytes(), (rows, cols))
    bp = mojolearn.Mamba2Block(w)
    bu = mojolearn.Mamba2Block(lowbit.unpack(w)[0])
    x = random_input(2, 5, 64, seed=20)
    assert_same_bits(bp.forward(x), bu.forward(x), "forward")
    s1, s2 = bp.allocate_state(2), bu.allocate_state(2)
    bp.forward(x, s1)
    bu.forward(x, s2)
    assert_same_bits(bp.step(x[:, 0], s1), bu.step(x[:, 0], s2), "step")


def test_int8_subnormal_and_tiny_rows_expand_exactly():
    """Rows with e = -149 (and subnormal dequantized values): the float32
    scale 2^e is subnormal; code * 2^e must still be exact."""
    w = mamba1_weights(32, seed=9)
    out = np.array(w["out_proj.weight"], copy=True)
    out[3] = (out[3].astype(np.float64) / np.abs(out[3]).max() * 2.0 ** -145).astype(np.float32)
    out[4] = out[4] * np.float32(2.0 ** -120)  # codes * 2^-126.. mixes normal and subnormal
    w["out_proj.weight"] = out
    packed = lowbit.pack(w, "int8")
    assert np.asarray(packed["out_proj.weight"].exponents)[3] == -149
    bp = mojolearn.Mamba1Block(packed)
    bu = mojolearn.Mamba1Block(lowbit.unpack(packed)[0])
    x = random_input(2, 6, 32, seed=10)
    x[:, :, 3:5] = 0.0  # so that y[..., 3:5] is the tiny out_proj result itself
    y = np.asarray(bp.forward(x))
    assert np.count_nonzero(y[:, :, 3]) >= 6 and np.all(np.abs(y[:, :, 3]) < 2.0 ** -126)  # subnormal
    assert_same_bits(y, bu.forward(x))
    s1, s2 = bp.allocate_state(2), bu.allocate_state(2)
    bp.forward(x, s1)
    bu.forward(x, s2)
    assert_same_bits(bp.step(x[:, 0], s1), bu.step(x[:, 0], s2))
    got = bp.get_params()["weights"]["out_proj.weight"]  # the scale 2^-149 reads back
    assert bytes(memoryview(got.exponents)) == bytes(memoryview(packed["out_proj.weight"].exponents))


def test_get_params_keeps_codes_that_pack_would_not_produce():
    """Codes are kept as given (small codes with a large exponent are not
    re-normalised), through the panels and back."""
    w = lowbit.pack(mamba1_weights(16, seed=16), "int8")
    rows, cols = w["x_proj.weight"].shape
    codes = (np.arange(rows * cols) % 7 - 3).astype(np.int8).reshape(rows, cols)
    exps = np.arange(rows, dtype=np.int32) - 20
    w["x_proj.weight"] = lowbit.PackedWeight("int8", codes, exps)
    block = mojolearn.Mamba1Block(w)
    got = block.get_params()["weights"]["x_proj.weight"]
    assert np.array_equal(np.asarray(got.data), codes)
    assert np.array_equal(np.asarray(got.exponents), exps)
    x = random_input(2, 4, 16, seed=17)
    assert_same_bits(block.forward(x), mojolearn.Mamba1Block(lowbit.unpack(w)[0]).forward(x))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cls, make, d", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_get_params_returns_the_packed_weights(cls, make, d, fmt):
    bp, _, packed = _pair(cls, make, d, fmt)
    p, p2 = bp.get_params(), bp.get_params()
    x = random_input(2, 5, d, seed=11)
    rebuilt = getattr(mojolearn, cls)(**p)
    assert rebuilt.weight_format == fmt
    assert_same_bits(rebuilt.forward(x), bp.forward(x))
    for name in PROJ[cls]:
        got, want = p["weights"][name], packed[name]
        assert lowbit.is_packed(got) and got.format == fmt
        assert bytes(memoryview(got.data)) == bytes(memoryview(want.data))
        assert got.shape == want.shape
        if fmt == "int8":
            assert bytes(memoryview(got.exponents)) == bytes(memoryview(want.exponents))
        else:
            assert got.exponents is None
        again = p2["weights"][name]  # every call returns new arrays
        assert again.data.address != got.data.address
        memoryview(got.data).cast("B")[:] = bytes(got.data.nbytes)
        assert bytes(memoryview(again.data)) == bytes(memoryview(want.data))


def test_caller_edits_after_construction_are_not_seen():
    w = lowbit.pack(mamba1_weights(16, seed=12), "int8")
    block = mojolearn.Mamba1Block(w)
    x = random_input(1, 3, 16, seed=13)
    y = block.forward(x)
    memoryview(w["in_proj.weight"].data).cast("B")[0:8] = bytes(8)
    assert_same_bits(block.forward(x), y)
    assert bytes(memoryview(block.get_params()["weights"]["in_proj.weight"].data))[:8] != bytes(8)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cls, make, d", [("Mamba1Block", mamba1_weights, 20),
                                          ("Mamba2Block", mamba2_weights, 32),
                                          ("Mamba3Block", mamba3_weights, 32)],
                         ids=["Mamba1Block", "Mamba2Block", "Mamba3Block"])
def test_backward_on_packed_weights_gives_the_unpacked_gradients(cls, make, d, fmt):
    """backward expands packed weights for the call (it reads float32 panels)."""
    bp, bu, _ = _pair(cls, make, d, fmt)
    x = random_input(2, 6, d, seed=14)
    g = random_input(2, 6, d, seed=15)
    gp, gu = bp.backward(x, g), bu.backward(x, g)
    assert sorted(gp) == sorted(gu)
    for name in gp:
        assert_same_bits(gp[name], gu[name], name)
    blob_bytes = bp._blob.nbytes
    assert_same_bits(bp.forward(x), bu.forward(x))  # still packed afterwards
    assert bp._blob.nbytes == blob_bytes and "in_proj.weight" not in bp._weights


@pytest.mark.parametrize("cls, make, d", [("Mamba1Block", mamba1_weights, 16),
                                          ("Mamba2Block", mamba2_weights, 32),
                                          ("Mamba3Block", mamba3_weights, 32)],
                         ids=["Mamba1Block", "Mamba2Block", "Mamba3Block"])
def test_backward_op_refuses_a_packed_blob(cls, make, d):
    """The backward kernels read float32 panels: a packed blob is refused
    (the blob names its format) instead of being misread."""
    from mojolearn import _abi
    op = getattr(_abi, f"OP_M{cls[5]}_BACKWARD")
    bp, bu, _ = _pair(cls, make, d, "bfloat16")

    def args(blob):
        return _abi.op_spec(bu._lib, op).pack(b=1, l=4, d=d, blob=blob)
    assert bu._lib.workspace_bytes(op, args(bu._blob)) > 0
    with pytest.raises(RuntimeError):
        bp._lib.workspace_bytes(op, args(bp._blob))
