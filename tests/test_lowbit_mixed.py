"""Blocks whose projection weights mix formats (docs/checkpoints.md, "Mixed
formats"): each projection stays packed in its own format (or float32) and
the block gives the bytes of the block built on ``lowbit.unpack(weights)``:
forward, ragged rows, continuation, step, decode sessions and backward; with
negative controls showing each projection's own codes are read."""
import numpy as np
import pytest

import mojolearn
from mojolearn import lowbit
from mojolearn.reference.weights import (mamba1_weights, mamba2_weights, mamba3_weights,
                                         random_input)
from tests.bits import assert_bits_differ, assert_same_bits
from tests.errors import raises_naming
from tests.test_lowbit_resident import PROJ, _check_state_paths, _perturbed, assert_codes_read

# llama.cpp's Mamba-1 q4_0 file: in_proj / out_proj q4_0, x_proj / dt_proj
# float32 (it never quantises ssm_x / ssm_dt).
LLAMA_CPP_Q4_0 = {"in_proj.weight": "q4_0", "out_proj.weight": "q4_0"}
# d = 20 for Mamba-1: rows and columns that are not multiples of 16 / 32.
MIXES = [
    ("Mamba1Block", mamba1_weights, 20, LLAMA_CPP_Q4_0),
    ("Mamba1Block", mamba1_weights, 20,
     {"in_proj.weight": "bfloat16", "x_proj.weight": "int8", "dt_proj.weight": "q8_0"}),
    ("Mamba2Block", mamba2_weights, 32, {"in_proj.weight": "q4_0"}),
    ("Mamba2Block", mamba2_weights, 32, {"in_proj.weight": "int8", "out_proj.weight": "q8_0"}),
    ("Mamba3Block", mamba3_weights, 32, {"out_proj.weight": "q4_0"}),
    ("Mamba3Block", mamba3_weights, 32,
     {"in_proj.weight": "q8_0", "out_proj.weight": "bfloat16"}),
]
IDS = [f"{m[0]}-" + "-".join(f"{n.split('_')[0]}:{f}" for n, f in m[3].items()) for m in MIXES]


def _mixed_pair(cls, make, d, mix, seed=3):
    block_cls = getattr(mojolearn, cls)
    w = lowbit.pack(make(d, seed=seed), mix)
    return block_cls(w), block_cls(lowbit.unpack(w)[0]), w


@pytest.mark.parametrize("cls, make, d, mix", MIXES, ids=IDS)
def test_mixed_block_gives_the_bytes_of_the_unpacked_block(cls, make, d, mix):
    bm, bu, w = _mixed_pair(cls, make, d, mix)
    assert bm.weight_format == "mixed" and bu.weight_format == "float32"
    assert bm.weight_formats == {n: mix.get(n, "float32") for n in PROJ[cls]}
    x = random_input(3, 19, d, seed=4)
    y = bm.forward(x)
    assert_same_bits(y, bu.forward(x), "forward")
    lengths = [19, 7, 1]
    assert_same_bits(bm.forward(x, lengths=lengths), bu.forward(x, lengths=lengths), "ragged")
    _check_state_paths(bm, bu, d, seed=5)
    g = random_input(3, 19, d, seed=6)
    gm, gu = bm.backward(x, g), bu.backward(x, g)
    assert sorted(gm) == sorted(gu)
    for name in gm:
        assert_same_bits(gm[name], gu[name], f"backward {name}")
    assert_same_bits(bm.forward(x), y, "forward after a backward")  # still packed
    # negative control: the block on the plain weights is not the block on
    # its rounded ones (the comparison above can fail)
    plain = getattr(mojolearn, cls)(make(d, seed=3))
    assert_bits_differ(plain.forward(x), y, "forward on the unrounded weights")


@pytest.mark.parametrize("cls, make, d, mix", MIXES, ids=IDS)
def test_each_projection_reads_its_own_codes(cls, make, d, mix):
    """Negative control: one code changed in any packed projection changes
    forward and step."""
    bm, _, w = _mixed_pair(cls, make, d, mix)
    assert_codes_read(bm, w, list(mix))


@pytest.mark.parametrize("cls, make, d, mix", MIXES, ids=IDS)
def test_mixed_weights_stay_packed_and_come_back_as_given(cls, make, d, mix):
    bm, bu, w = _mixed_pair(cls, make, d, mix)
    assert sorted(bm._packed_shapes) == sorted(PROJ[cls])
    assert not set(PROJ[cls]) & set(bm._weights)  # no float32 copy next to the panels
    assert bm._blob.nbytes < bu._blob.nbytes
    params = bm.get_params()
    for name in PROJ[cls]:
        got, want = params["weights"][name], w[name]
        if name in mix:
            assert lowbit.is_packed(got) and got.format == mix[name] and got.shape == want.shape
            assert bytes(memoryview(got.data)) == bytes(memoryview(want.data)), name
            if got.format == "int8":
                assert bytes(memoryview(got.exponents)) == bytes(memoryview(want.exponents))
        else:
            assert not lowbit.is_packed(got)
            assert_same_bits(got, want, name)
    rebuilt = getattr(mojolearn, cls)(**params)
    assert rebuilt.weight_formats == bm.weight_formats
    x = random_input(2, 5, d, seed=11)
    assert_same_bits(rebuilt.forward(x), bm.forward(x))
    assert_same_bits(bm.set_params(numeric_mode="identical").forward(x), rebuilt.forward(x))


def test_llama_cpp_mix_from_ggml_bytes():
    """The Mamba-1 mix as a GGUF reader builds it: q4_0 tensors from their
    raw bytes (from_ggml), x_proj / dt_proj float32."""
    w = mamba1_weights(32, seed=21)
    for name in LLAMA_CPP_Q4_0:
        raw = bytes(memoryview(lowbit.pack_one(w[name], "q4_0").data))
        w[name] = lowbit.from_ggml("q4_0", raw, w[name].shape)
    block = mojolearn.Mamba1Block(w)
    assert block.weight_formats == {"in_proj.weight": "q4_0", "x_proj.weight": "float32",
                                    "dt_proj.weight": "float32", "out_proj.weight": "q4_0"}
    bu = mojolearn.Mamba1Block(lowbit.unpack(w)[0])
    x = random_input(2, 7, 32, seed=22)
    assert_same_bits(block.forward(x), bu.forward(x), "forward")
    _check_state_paths(block, bu, 32, seed=23)
    # negative control: all four in q4_0 is another model
    all_q4 = mojolearn.Mamba1Block(lowbit.pack(lowbit.unpack(w)[0], "q4_0"))
    assert all_q4.weight_format == "q4_0"
    assert_bits_differ(all_q4.forward(x), block.forward(x), "all four projections q4_0")


def test_pack_with_a_format_per_name():
    w = mamba1_weights(16, seed=1)
    p = lowbit.pack(w, {"in_proj.weight": "q4_0", "dt_proj.weight": "int8"})
    assert lowbit.formats_of(p) == {"in_proj.weight": "q4_0", "x_proj.weight": "float32",
                                    "dt_proj.weight": "int8", "out_proj.weight": "float32"}
    assert lowbit.format_of(p) == "mixed"
    assert p["x_proj.weight"] is w["x_proj.weight"] and p["A_log"] is w["A_log"]
    u, fmt = lowbit.unpack(p)
    assert fmt == "mixed" and not any(lowbit.is_packed(v) for v in u.values())
    assert_same_bits(u["in_proj.weight"], p["in_proj.weight"].to_float32())
    # a packed value named again: repacked in the new format ('float32' expands)
    q = lowbit.pack(p, {"in_proj.weight": "float32"})
    assert not lowbit.is_packed(q["in_proj.weight"]) and q["dt_proj.weight"] is p["dt_proj.weight"]
    assert_same_bits(q["in_proj.weight"], u["in_proj.weight"])
    one = lowbit.pack(w, {n: "q8_0" for n in PROJ["Mamba1Block"]})
    assert lowbit.format_of(one) == "q8_0"
    assert lowbit.pack(w, {}) == dict(w)


def test_pack_per_name_refusals():
    w = mamba1_weights(16, seed=1)
    with raises_naming(ValueError, "'in_proj'", "not in weights"):
        lowbit.pack(w, {"in_proj": "int8"})
    with raises_naming(ValueError, "'A_log'", "projection"):
        lowbit.pack(w, {"A_log": "int8"})
    with raises_naming(ValueError, "fmt['x_proj.weight']", "'int4'"):
        lowbit.pack(w, {"in_proj.weight": "int8", "x_proj.weight": "int4"})
    with raises_naming(ValueError, "format must be one of"):
        lowbit.pack(w, "int4")


def test_packed_non_projection_weight_refused():
    w = mamba3_weights(32, seed=2)
    w["B_bias"] = lowbit.pack_one(w["B_bias"], "bfloat16")
    with raises_naming(ValueError, "B_bias", "projection"):
        mojolearn.Mamba3Block(w)


def test_prepare_op_refuses_a_bad_formats_word():
    """The prepare op checks every 4-bit format of its wfmt word, and that
    nothing lies above the block's projections."""
    from mojolearn import _abi
    lib = mojolearn.Mamba2Block(mamba2_weights(32, seed=1))._lib
    op = _abi.OP_M2_PREPARE
    spec = _abi.op_spec(lib, op)
    assert lib.workspace_bytes(op, spec.pack(d=32, wfmt=0x43)) > 0  # out q8_0, in q4_0
    for bad in (0x53, 0x35, 0x100, -1):
        with pytest.raises(RuntimeError):
            lib.workspace_bytes(op, spec.pack(d=32, wfmt=bad))


def _untied_lm_checkpoint(root):
    from mojolearn.checkpoints import load_checkpoint
    from mojolearn.save import save_checkpoint
    rng = np.random.default_rng(5)
    d, v = 32, 48
    layers = [mamba3_weights(d, seed=10, scale=4.0)]
    emb = rng.standard_normal((v, d)).astype(np.float32)
    head = rng.standard_normal((v, d)).astype(np.float32) * 0.5
    norm = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    return load_checkpoint(save_checkpoint(root, "mamba3", layers, emb, norm, head))


def _lm_on(ck, monkeypatch, given):
    """MambaLM(ck) whose vocabulary matrices are the packed values `given`
    (as the GGUF reader hands them over), kept as they are (weight_format
    None)."""
    with monkeypatch.context() as m:
        m.setattr(ck, "lm_head", given["lm_head.weight"])
        m.setattr(ck, "embeddings", given["embeddings.weight"])
        return mojolearn.MambaLM(ck)


def test_lm_head_and_embedding_each_in_its_own_format(tmp_path, monkeypatch):
    """The vocabulary blob keeps the head and an untied embedding each in
    its own format (lm.mojo's formats word): the bits of the model on their
    expansions."""
    ck = _untied_lm_checkpoint(tmp_path)
    given = {"lm_head.weight": lowbit.pack_one(ck.lm_head, "q8_0"),
             "embeddings.weight": lowbit.pack_one(ck.embeddings, "q4_0")}
    mixed = _lm_on(ck, monkeypatch, given)
    ck.lm_head = given["lm_head.weight"].to_float32()
    ck.embeddings = given["embeddings.weight"].to_float32()
    ref = mojolearn.MambaLM(ck)
    assert not ref.tied and mixed._blob.nbytes < ref._blob.nbytes
    tokens = [[1, 5, 9, 3, 47], [2, 2, 8, 0, 40]]
    emb = np.asarray(mixed.embed(tokens))
    assert_same_bits(emb, ref.embed(tokens), "embed")
    logits = np.asarray(mixed.logits(tokens))
    assert_same_bits(logits, ref.logits(tokens), "logits")
    # negative controls: one code of either matrix changed (byte 90: in the
    # embedding, row 5's first block, a token above; in the head, row 2)
    for name in given:
        other = _lm_on(ck, monkeypatch, _perturbed(given, name, index=90))
        assert_bits_differ(np.asarray(other.logits(tokens)), logits, f"{name} perturbed")

