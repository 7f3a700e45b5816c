"""GGUF files (llama.cpp's format) of Mamba, Falcon-Mamba and Mamba-2
models, written by llama.cpp's own writer (the `gguf` package) the way its
converter writes them (tests/gguf_files.py), read by mojolearn's parser.

What the bit comparisons compare: MambaLM.logits bytes of the GGUF file
against the same weights read from a safetensors folder. GGUF stores
A = -exp(A_log) (the converter's torch float32 exp), which the blocks take
as is (weight "A"); the safetensors model computes -exp(A_log) in its
prepare op. So (1) a file whose ssm_a holds the kernels' own -exp(A_log)
gives the bytes of the safetensors model itself, and (2) a file as the
converter writes it (torch's -exp) gives the bytes of the safetensors
checkpoint whose layers are handed that same A. Each has a negative control.
"""
from __future__ import annotations

import struct

import numpy as np
import pytest

import mojolearn
from mojolearn import lowbit
from mojolearn.gguf import read_gguf
from mojolearn.save import save_checkpoint

from .errors import raises_naming
from .gguf_files import kernel_neg_exp, model, torch_neg_exp, write_gguf

gguf = pytest.importorskip("gguf")  # in the test extra
T = gguf.GGMLQuantizationType

IDS = [[1, 5, 9, 3, 0, 47, 2], [4, 4, 8, 63, 1, 2, 7]]
# (kind, d_model, Falcon-Mamba, tied head)
MODELS = [("mamba", 32, False, True), ("mamba", 32, True, False), ("mamba2", 64, False, False)]


def _bytes(a) -> bytes:
    return bytes(memoryview(a).cast("B"))


def _folder(tmp_path, kind, layers, emb, norm, head, falcon):
    cfg = {"model_type": "falcon_mamba", "mixer_rms_eps": 1e-5} if falcon else None
    return save_checkpoint(tmp_path / "st", kind, layers, emb, norm, head, config=cfg)


@pytest.mark.parametrize("kind, d, falcon, tied", MODELS)
def test_kernel_a_gives_the_bytes_of_the_safetensors_model(tmp_path, kind, d, falcon, tied):
    layers, emb, norm, head = model(kind, d, tied=tied)
    folder = _folder(tmp_path, kind, layers, emb, norm, head, falcon)
    path = tmp_path / "m.gguf"
    write_gguf(path, kind, layers, emb, norm, head, falcon=falcon, a_of=kernel_neg_exp)
    lm_st, lm = mojolearn.MambaLM(folder), mojolearn.MambaLM(path)
    want = _bytes(lm_st.logits(IDS))
    assert _bytes(lm.logits(IDS)) == want
    # decode (sessions, one token at a time) reads the same A from the blob
    gen = dict(max_new_tokens=5, stop_tokens=(), return_logits=True)
    (tokens, logits), (tokens_st, logits_st) = lm.generate(IDS, **gen), lm_st.generate(IDS, **gen)
    assert tokens == tokens_st
    assert [[_bytes(x) for x in row] for row in logits] == \
        [[_bytes(x) for x in row] for row in logits_st]
    # negative control: layer 1's A 1% larger (a one-ulp change of A is
    # usually below the resolution of exp(dt * A) at these small dt)
    def nudged(a_log):
        return kernel_neg_exp(a_log) * np.float32(1.01)
    bad = tmp_path / "bad.gguf"
    write_gguf(bad, kind, layers, emb, norm, head, falcon=falcon,
               a_of=lambda al: nudged(al) if al is layers[1]["A_log"] else kernel_neg_exp(al))
    assert _bytes(mojolearn.MambaLM(bad).logits(IDS)) != want


@pytest.mark.parametrize("kind, d, falcon, tied", MODELS)
def test_converter_a_gives_the_bytes_of_the_checkpoint_given_that_a(tmp_path, kind, d,
                                                                     falcon, tied):
    layers, emb, norm, head = model(kind, d, tied=tied, seed=1)
    folder = _folder(tmp_path, kind, layers, emb, norm, head, falcon)
    path = tmp_path / "m.gguf"
    write_gguf(path, kind, layers, emb, norm, head, falcon=falcon, a_of=torch_neg_exp)
    ck = mojolearn.load_checkpoint(folder)
    for w in ck.layers:  # the same A, given to the safetensors model's blocks
        w["A"] = torch_neg_exp(np.array(memoryview(w.pop("A_log"))))
    got = _bytes(mojolearn.MambaLM(path).logits(IDS))
    assert got == _bytes(mojolearn.MambaLM(ck).logits(IDS))
    ck2 = mojolearn.load_checkpoint(folder)
    ck2.layers[0]["D"] = np.array(memoryview(ck2.layers[0]["D"])) + np.float32(1e-3)
    for w in ck2.layers:
        w["A"] = torch_neg_exp(np.array(memoryview(w.pop("A_log"))))
    assert got != _bytes(mojolearn.MambaLM(ck2).logits(IDS))  # negative control


@pytest.mark.parametrize("kind, d, falcon, tied", MODELS)
def test_metadata_becomes_the_config(tmp_path, kind, d, falcon, tied):
    layers, emb, norm, head = model(kind, d, tied=tied, n_layers=3)
    path = tmp_path / "m.gguf"
    write_gguf(path, kind, layers, emb, norm, head, falcon=falcon, eos=7)
    ck = mojolearn.load_checkpoint(path, lazy=True)
    assert (ck.kind, ck.format, ck.d_model, ck.n_layers, ck.vocab_size) == \
        (kind, "gguf", d, 3, 64)
    assert ck.tie_word_embeddings is tied
    assert ck.eos_token_ids == (7,)
    # llama.cpp norms Falcon-Mamba's dt, B and C with the layer norm's eps
    assert ck.bcdt_rms_eps == (1e-5 if falcon else None)
    assert ck.dt_limit == ((0.0, float("inf")) if kind == "mamba2" else None)
    assert ("A" in ck.layers[0]) and "A_log" not in ck.layers[0]
    lm = mojolearn.MambaLM(path)
    assert (lm.kind, lm.d_model, lm.n_layers, lm.vocab_size, lm.eos_token_ids) == \
        (kind, d, 3, 64, (7,))
    assert [b.bcdt_rms_eps for b in lm.blocks if kind == "mamba"] == \
        [1e-5 if falcon else None] * (3 if kind == "mamba" else 0)


def _widened(values, qtype) -> np.ndarray:
    """The exact float32 values of `values` stored in ggml type qtype
    (llama.cpp's own dequantization for the block formats)."""
    if qtype == T.F16:
        return values.astype(np.float16).astype(np.float32)
    q = gguf.quants.quantize(values, qtype)
    return gguf.quants.dequantize(q, qtype).astype(np.float32).reshape(values.shape)


@pytest.mark.parametrize("qtype", [T.F16, T.BF16, T.Q8_0, T.Q4_0])
def test_each_tensor_type_is_widened_exactly(tmp_path, qtype):
    layers, emb, norm, head = model("mamba", 32, tied=False)
    names = ["blk.0.ssm_in.weight", "blk.1.ssm_out.weight", "token_embd.weight",
             "output.weight", "blk.0.ssm_d"]
    types = {n: qtype for n in names}
    if qtype in (T.Q8_0, T.Q4_0):
        types.pop("blk.0.ssm_d")  # 64 values: would be 2 blocks, fine, but keep a 1-D F32
    path = tmp_path / "m.gguf"
    written = write_gguf(path, "mamba", layers, emb, norm, head, types=types)
    g = read_gguf(path)
    for name, qt in types.items():
        t = g.tensors[name]
        assert t.ggml_type == qt.name
        want = _widened(written[name], qt)
        assert _values(t.load(), qt).tobytes() == want.tobytes(), name
        assert want.tobytes() != written[name].tobytes()  # the type did round something
        if len(t.shape) == 2:  # a row range reads the same values
            assert _values(t.rows(1, 3), qt).tobytes() == want[1:3].tobytes()
    # the model on the file is the model on the widened values
    wide = {n: _widened(written[n], qt) for n, qt in types.items()}
    plain = tmp_path / "plain.gguf"
    lw = [dict(w) for w in layers]
    lw[0]["in_proj.weight"] = wide["blk.0.ssm_in.weight"]
    lw[1]["out_proj.weight"] = wide["blk.1.ssm_out.weight"]
    if "blk.0.ssm_d" in wide:
        lw[0]["D"] = wide["blk.0.ssm_d"]
    write_gguf(plain, "mamba", lw, wide["token_embd.weight"], norm, wide["output.weight"])
    want = _bytes(mojolearn.MambaLM(plain).logits(IDS))
    lm = mojolearn.MambaLM(path)
    assert _bytes(lm.logits(IDS)) == want
    packed = qt in (T.Q8_0, T.Q4_0)
    # the block formats stay packed beside float32 matrices (llama.cpp's mix)
    assert lm.weight_format == ("mixed" if packed else "float32")
    if packed:
        fmt = {T.Q8_0: "q8_0", T.Q4_0: "q4_0"}[qt]
        assert lm.blocks[0].weight_formats["in_proj.weight"] == fmt
        assert lm.blocks[0].weight_formats["x_proj.weight"] == "float32"
        wide_lm = mojolearn.MambaLM(path, weight_format="float32")
        assert wide_lm.weight_format == "float32"
        assert _bytes(wide_lm.logits(IDS)) == want


def _values(value, qtype):
    """The float32 values of a tensor read from a file: a block type is kept
    packed with the file's own bytes, widened here by mojolearn.lowbit."""
    if qtype in (T.Q8_0, T.Q4_0):
        assert lowbit.is_packed(value) and value.format == qtype.name.lower()
        value = value.to_float32()
    return np.array(memoryview(value))


@pytest.mark.parametrize("qtype, name", [(T.F64, "F64"), (T.Q4_1, "Q4_1"), (T.Q5_0, "Q5_0")])
def test_other_tensor_types_are_refused_by_name(tmp_path, qtype, name):
    layers, emb, norm, head = model("mamba", 32)
    path = tmp_path / "m.gguf"
    write_gguf(path, "mamba", layers, emb, norm, head, types={"blk.1.ssm_x.weight": qtype})
    with raises_naming(TypeError, "blk.1.ssm_x.weight", name):
        mojolearn.load_checkpoint(path)


@pytest.mark.parametrize("edit, names", [
    (dict(arch="llama"), ["general.architecture", "'llama'"]),
    (dict(eps=1e-6), ["mamba.attention.layer_norm_rms_epsilon"]),
    (dict(extra={"mamba.ssm.state_size": (32, "U32")}), ["mamba.ssm.state_size"]),
    (dict(extra={"mamba.ssm.inner_size": (96, "U32")}), ["mamba.ssm.inner_size"]),
    (dict(extra={"mamba.block_count": (5, "U32")}), ["mamba.block_count", "layers 0..1"]),
    (dict(skip=("blk.1.ssm_a",)), ["blk.1.ssm_a"]),
    (dict(skip=("output_norm.weight",)), ["output_norm.weight"]),
    (dict(eos=999), ["tokenizer.ggml.eos_token_id"]),
])
def test_configs_and_tensors_the_blocks_cannot_take_are_refused_by_name(tmp_path, edit,
                                                                         names):
    layers, emb, norm, head = model("mamba", 32)
    path = tmp_path / "m.gguf"
    extra = {k: (v, getattr(gguf.GGUFValueType, {"U32": "UINT32"}[t]))
             for k, (v, t) in edit.pop("extra", {}).items()}
    if extra:  # the writer adds each key once: drop the helper's own value first
        real = gguf.GGUFWriter.add_key_value

        def once(self, key, val, vtype, *a, **k):
            if key in extra and (val, vtype) != extra[key]:
                return None
            return real(self, key, val, vtype, *a, **k)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gguf.GGUFWriter, "add_key_value", once)
            write_gguf(path, "mamba", layers, emb, norm, head, extra=extra, **edit)
    else:
        write_gguf(path, "mamba", layers, emb, norm, head, **edit)
    with raises_naming(ValueError, str(path), *names):
        mojolearn.load_checkpoint(path)


def test_a_block_given_a_refuses_positive_a_and_backward(tmp_path):
    layers, emb, norm, head = model("mamba2", 64, n_layers=1)
    path = tmp_path / "m.gguf"
    write_gguf(path, "mamba2", layers, emb, norm, head)
    block = mojolearn.load_checkpoint(path).block(0)
    x = np.random.default_rng(0).standard_normal((1, 4, 64)).astype(np.float32)
    with raises_naming(ValueError, "backward", "A", "A_log"):
        block.backward(x, x)
    w = block.get_params()["weights"]
    assert "A" in w and "A_log" not in w  # get_params gives back what it was given
    bad = dict(w)
    a = np.array(memoryview(bad["A"]))
    a[1] = 0.5
    bad["A"] = a
    with raises_naming(ValueError, "A", "A[1]"):
        mojolearn.Mamba2Block(bad)


def _header(kv=b"", n_kv=0, tensors=b"", n_t=0, version=3):
    return b"GGUF" + struct.pack("<IQQ", version, n_t, n_kv) + kv + tensors


def _s(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def _tensor(name, dims, gtype, offset):
    return (_s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
            + struct.pack("<IQ", gtype, offset))


def _arch(value="mamba"):
    return _s("general.architecture") + struct.pack("<I", 8) + _s(value)


def _padded(head, data, align=32):
    return head + bytes(-len(head) % align) + data


@pytest.mark.parametrize("raw, names", [
    (b"GGML" + bytes(40), ["magic"]),
    (_header(version=1) + bytes(8), ["version 1"]),
    (_header(n_kv=2 ** 60) + bytes(8), ["metadata count"]),
    (_header(struct.pack("<Q", 2 ** 40) + bytes(16), n_kv=1),
     ["metadata key", "1099511627776"]),
    (_header(_s("k") + struct.pack("<I", 77), n_kv=1), ["'k'", "value type 77"]),
    (_header(_s("k") + struct.pack("<IIQ", 9, 4, 2 ** 40), n_kv=1), ["'k'", "elements"]),
    (_header(_s("k") + struct.pack("<IIQ", 9, 9, 1), n_kv=1) + bytes(16), ["'k'"]),
    (_header(_arch() + _arch(), n_kv=2), ["general.architecture", "twice"]),
    (_header(_s("general.alignment") + struct.pack("<II", 4, 24), n_kv=1),
     ["general.alignment"]),
    (_header(_s("k") + struct.pack("<IB", 7, 3), n_kv=1) + bytes(8), ["'k'", "bool"]),
    (_header(n_t=2 ** 50) + bytes(8), ["tensor count"]),
    (_padded(_header(_arch(), 1, _tensor("w", [4, 2, 1, 1, 1], 0, 0), 1), bytes(32)),
     ["w", "dimensions"]),
    (_padded(_header(_arch(), 1, _tensor("w", [8], 0, 4), 1), bytes(64)), ["w", "alignment"]),
    (_padded(_header(_arch(), 1, _tensor("w", [64], 0, 0), 1), bytes(32)),
     ["w", "data section"]),
    (_padded(_header(_arch(), 1, _tensor("w", [2 ** 62, 8], 0, 0), 1), bytes(32)),
     ["w", "data section"]),
    (_padded(_header(_arch(), 1, _tensor("w", [0], 0, 0), 1), bytes(32)), ["w", "size 0"]),
    (_padded(_header(_arch(), 1, _tensor("w", [16], 8, 0), 1), bytes(64)),
     ["w", "Q8_0", "multiple"]),
    (_padded(_header(_arch(), 1, _tensor("a", [16], 0, 0) + _tensor("b", [8], 0, 32), 2),
             bytes(96)), ["a", "b", "overlap"]),
    (_padded(_header(_arch(), 1, _tensor("a", [8], 0, 0) + _tensor("a", [8], 0, 32), 2),
             bytes(64)), ["a", "twice"]),
])
def test_malformed_headers_are_refused_naming_the_file_and_the_part(tmp_path, raw, names):
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw)
    with raises_naming(ValueError, str(path), *names):
        read_gguf(path)


def test_a_well_formed_hand_written_header_is_read(tmp_path):
    # the malformed cases above are one edit away from this one
    path = tmp_path / "ok.gguf"
    vals = struct.pack("<8f", *range(8))
    path.write_bytes(_padded(_header(_arch(), 1, _tensor("a", [8], 0, 0) +
                                     _tensor("b", [8], 0, 32), 2), vals + vals))
    g = read_gguf(path)
    assert g.metadata == {"general.architecture": "mamba"} and list(g.tensors) == ["a", "b"]
    assert list(memoryview(g.tensors["b"].load())) == list(range(8))


def test_truncated_data_is_refused_by_name(tmp_path):
    layers, emb, norm, head = model("mamba", 32, n_layers=1)
    path = tmp_path / "m.gguf"
    write_gguf(path, "mamba", layers, emb, norm, head)
    raw = path.read_bytes()
    path.write_bytes(raw[:-100])
    with raises_naming(ValueError, str(path), "output_norm.weight"):
        mojolearn.load_checkpoint(path)


def test_the_cli_generates_from_a_gguf_file(tmp_path):
    from .text_model import run_cli
    layers, emb, norm, head = model("mamba2", 64, n_layers=1)
    path = tmp_path / "m.gguf"
    write_gguf(path, "mamba2", layers, emb, norm, head)
    want = mojolearn.MambaLM(path).generate([[1, 2, 3]], max_new_tokens=6, stop_tokens=())[0]
    r = run_cli("generate", path, "--prompt-ids", "1,2,3", "--max-new-tokens", 6,
                "--stop-ids", "")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0].split() == [str(t) for t in want]
    r = run_cli("generate", tmp_path / "missing.gguf", "--prompt-ids", "1")
    assert r.returncode == 2 and "missing.gguf" in r.stderr


def test_mamba2_groups_give_the_bytes_of_the_safetensors_model(tmp_path):
    """A Codestral-shaped Mamba-2 file (ssm.group_count 2, the gated norm
    stored per group) reads as the safetensors folder of the same weights
    (A as the kernels compute it); control: the same file said to have one
    group is refused by name (its in_proj has two groups' B and C)."""
    from mojolearn.reference.weights import mamba2_weights
    d, g = 128, 2
    rng = np.random.default_rng(3)
    layers = [{k: np.asarray(v, np.float32) for k, v in
               mamba2_weights(d, seed=10 + i, n_groups=g).items()} for i in range(2)]
    emb = rng.standard_normal((64, d)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    folder = save_checkpoint(tmp_path / "st", "mamba2", layers, emb, norm)
    path = tmp_path / "m.gguf"
    write_gguf(path, "mamba2", layers, emb, norm, n_groups=g, a_of=kernel_neg_exp)
    lm = mojolearn.MambaLM(path)
    assert [b.n_groups for b in lm.blocks] == [g, g]
    assert _bytes(lm.logits(IDS)) == _bytes(mojolearn.MambaLM(folder).logits(IDS))
    one = tmp_path / "one.gguf"
    write_gguf(one, "mamba2", layers, emb, norm, n_groups=1, a_of=kernel_neg_exp)
    with raises_naming(ValueError, "blk.0.ssm_in.weight"):
        mojolearn.MambaLM(one)
