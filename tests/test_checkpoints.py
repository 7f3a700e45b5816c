"""mojolearn.load_checkpoint: transformers Mamba / Mamba-2 checkpoints, end to end.

A small random MambaForCausalLM (and Mamba2ForCausalLM) is saved with
save_pretrained, loaded with mojolearn (no PyTorch in the loader), run as a
stack of blocks on the embeddings and compared layer by layer with
transformers' own model run in verified float64 (tests/reference/hf_mamba.py),
then used for 32 greedy tokens by step() against
transformers' float32 generate().
"""
from pathlib import Path
import json
import math
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mojolearn  # noqa: E402
from mojolearn import checkpoints, lowbit  # noqa: E402
from tests.bits import assert_same_bits  # noqa: E402
from tests.errors import raises_naming  # noqa: E402
from tests.reference import hf_mamba  # noqa: E402
from tests.reference.hf_build import build, load  # noqa: E402

ATOL, RTOL = 1e-6, 1e-5
NEW_TOKENS = 32


def _perturb_(model, seed, out_scale):
    """Make every parameter matter: HF initialises norms and D to ones, and
    its small out_proj leaves the residual stream (and so the greedy token
    of a tied head) dominated by the input embedding."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight") or \
                    name.endswith(".D"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            if name.endswith("out_proj.weight"):
                p.mul_(out_scale)


def make_model(kind, folder, *, seed=0, layers=3, d=None, dtype=None, out_scale=None):
    from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM
    if kind == "mamba":
        cfg = MambaConfig(vocab_size=64, hidden_size=d or 32, num_hidden_layers=layers,
                          use_mambapy=False, use_associative_scan=False)
        model = build(MambaForCausalLM, cfg, seed=seed)
    else:
        d = d or 64
        cfg = Mamba2Config(vocab_size=64, hidden_size=d, num_hidden_layers=layers,
                           num_heads=2 * d // 64, head_dim=64, n_groups=1, state_size=128,
                           chunk_size=256, tie_word_embeddings=False)
        model = build(Mamba2ForCausalLM, cfg, seed=seed)
    _perturb_(model, seed + 1, out_scale if out_scale is not None else
              (16.0 if kind == "mamba" else 1.0))
    model.eval()
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder)
    return model


# --------------------------------------------------------------------------- references
def hf_layers_float64(kind, folder, ids, inputs):
    """transformers' model in verified float64: its embeddings, each of its
    layers run on the given float32 layer inputs, and its own chained layer
    outputs (the whole model in float64)."""
    from transformers import Mamba2ForCausalLM, MambaForCausalLM
    cls = MambaForCausalLM if kind == "mamba" else Mamba2ForCausalLM
    model = load(cls, folder, residual_in_fp32=False).to(torch.float64).eval()
    chained = []
    hooks = [layer.register_forward_hook(lambda mod, inp, out: chained.append(out))
             for layer in model.backbone.layers]
    module = hf_mamba._hf_m1 if kind == "mamba" else hf_mamba._hf_m2
    try:
        with hf_mamba._float64_run(cls.__name__, module, True):
            emb = model.backbone.embeddings(torch.tensor(ids))
            model(torch.tensor(ids), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    per_layer = []
    with hf_mamba._float64_run(cls.__name__, module, True):
        for layer, x in zip(model.backbone.layers, inputs):
            per_layer.append(layer(torch.from_numpy(np.asarray(x, np.float64))))
    return emb.numpy(), [o.numpy() for o in per_layer], [o.numpy() for o in chained]


def hf_greedy(kind, folder, ids):
    """transformers' float32 greedy generate: tokens and the smallest top-2 margin."""
    from transformers import Mamba2ForCausalLM, MambaForCausalLM
    cls = MambaForCausalLM if kind == "mamba" else Mamba2ForCausalLM
    model = load(cls, folder).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=None, eos_token_id=None)
    scores = torch.stack(out.scores, 1)  # (B, T, vocab)
    top2 = scores.topk(2, dim=-1).values
    margin = float((top2[..., 0] - top2[..., 1]).min())
    return out.sequences[:, len(ids[0]):].numpy(), margin


def logits(ck, h):
    """Final RMSNorm (eps 1e-5) and LM head in float64 NumPy, (B, d) -> (B, vocab)."""
    h = np.asarray(h, np.float64).reshape(h.shape[0], -1)
    r = 1.0 / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-5)
    y = np.asarray(ck.final_norm, np.float64) * (h * r)
    return y @ np.asarray(ck.lm_head, np.float64).T


def greedy(ck, blocks, ids, n):
    """Prefill the prompt with carried states, then n greedy tokens by step()."""
    states = [b.allocate_state(len(ids)) for b in blocks]
    x = ck.embed(ids)
    for b, s in zip(blocks, states):
        x = b.forward(x, s)
    tok = logits(ck, np.asarray(x)[:, -1]).argmax(-1)
    out = [tok]
    for _ in range(n - 1):
        x = ck.embed([[int(t)] for t in tok])
        for b, s in zip(blocks, states):
            x = b.step(x, s)
        tok = logits(ck, np.asarray(x)[:, 0]).argmax(-1)
        out.append(tok)
    return np.stack(out, 1)


def _check_close(y, ref, label, scale=1):
    y = np.asarray(y, np.float64)
    err = np.abs(y - ref)
    ratio = float((err / (scale * (ATOL + RTOL * np.abs(ref)))).max())
    assert ratio <= 1.0, f"{label}: max |err| {err.max():.3g}, worst err/bound {ratio:.3g}"


PROMPT = [[3, 17, 42, 8, 8, 21, 5, 60, 1, 33, 12], [7, 7, 30, 2, 55, 41, 19, 23, 4, 9, 63]]


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_end_to_end_against_transformers(kind, tmp_path):
    make_model(kind, tmp_path, seed=3)
    ck = mojolearn.load_checkpoint(tmp_path)
    assert ck.kind == kind and ck.n_layers == 3 and ck.vocab_size == 64
    assert ck.tie_word_embeddings == (kind == "mamba")
    blocks = ck.blocks()
    assert all(type(b).__name__ == ("Mamba1Block" if kind == "mamba" else "Mamba2Block")
               for b in blocks)

    # layer by layer against the float64 model: each transformers layer runs
    # on the same float32 input as ours (the block tolerance applies per
    # layer); the chained float64 model is checked with a 10x looser bound,
    # since float32 rounding of earlier layers propagates
    x = ck.embed(PROMPT)
    inputs, outputs = [], []
    for b in blocks:
        inputs.append(x)
        x = b.forward(x)
        outputs.append(x)
    emb, ref_layers, chained = hf_layers_float64(kind, tmp_path, PROMPT, inputs)
    np.testing.assert_array_equal(np.asarray(inputs[0], np.float64), emb)  # exact rows
    for i, (y, ref, ref_chain) in enumerate(zip(outputs, ref_layers, chained)):
        _check_close(y, ref, f"{kind} layer {i}")
        _check_close(y, ref_chain, f"{kind} layer {i} (chained)", scale=10)

    # greedy decoding with the caller's states
    want, margin = hf_greedy(kind, tmp_path, PROMPT)
    assert margin > 1e-3, f"argmax margin {margin:.3g} too small for a float32 comparison"
    got = greedy(ck, blocks, PROMPT, NEW_TOKENS)
    np.testing.assert_array_equal(got, want)


def test_state_dict_and_folder_give_the_same_weights(tmp_path):
    model = make_model("mamba", tmp_path, seed=1, layers=2)
    a = mojolearn.load_checkpoint(tmp_path)
    b = mojolearn.load_checkpoint(model.state_dict())  # torch tensors, config inferred
    c = mojolearn.load_checkpoint({k: v.numpy() for k, v in model.state_dict().items()},
                                  config=model.config)
    for other in (b, c):
        assert other.kind == "mamba" and other.n_layers == 2
        for la, lb in zip(a.layers, other.layers):
            assert set(la) == set(lb)
            for k in la:
                assert_same_bits(la[k], lb[k], k)
        assert_same_bits(a.embeddings, other.embeddings)
        assert_same_bits(a.final_norm, other.final_norm)
        assert_same_bits(a.lm_head, other.lm_head)
    # blocks built from either run identically
    x = a.embed([[1, 2, 3, 4]])
    assert_same_bits(a.blocks()[0].forward(x), c.blocks()[0].forward(x))


@pytest.mark.parametrize("dtype, st", [("bfloat16", "BF16"), ("float16", "F16")])
def test_half_precision_checkpoints_widen_exactly(tmp_path, dtype, st):
    model = make_model("mamba", tmp_path, seed=2, layers=1, dtype=getattr(torch, dtype))
    header = _header(tmp_path / "model.safetensors")
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {st}
    ck = mojolearn.load_checkpoint(tmp_path)
    sd = model.state_dict()
    for k, v in ck.layers[0].items():
        key = "backbone.layers.0." + (k if k == "norm.weight" else "mixer." + k)
        want = sd[key].float().numpy()  # torch's widening is exact too
        np.testing.assert_array_equal(np.asarray(v), want.reshape(np.asarray(v).shape))
    # the same bits from a torch state_dict in that dtype
    ck2 = mojolearn.load_checkpoint(sd)
    assert_same_bits(ck.layers[0]["in_proj.weight"], ck2.layers[0]["in_proj.weight"])
    ck.blocks()  # finite, right shapes


def test_blocks_with_packed_formats(tmp_path):
    make_model("mamba", tmp_path, seed=4, layers=2)
    ck = mojolearn.load_checkpoint(tmp_path)
    for fmt in ("bfloat16", "int8"):
        blocks = ck.blocks(weight_format=fmt)
        assert [b.weight_format for b in blocks] == [fmt, fmt]
        plain = [type(b)(lowbit.unpack(lowbit.pack(w, fmt))[0]) for b, w in zip(blocks, ck.layers)]
        x = ck.embed(PROMPT)
        assert_same_bits(blocks[1].forward(blocks[0].forward(x)),
                         plain[1].forward(plain[0].forward(x)))


# --------------------------------------------------------------------------- safetensors
def _header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def _write_st(path, tensors):
    """Minimal safetensors writer: {name: (dtype, shape, raw bytes)}."""
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dt, shape, raw) in tensors.items():
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_read_safetensors_formats(tmp_path):
    f32 = np.array([[1.5, -2.25], [3e-41, -0.0]], np.float32)
    bf = np.array([0x3F80, 0xC049, 0x0001, 0x8000, 0x7F7F], np.uint16)
    f16 = np.array([1.0, -65504.0, 6e-8, 0.333], np.float16)
    p = tmp_path / "t.safetensors"
    _write_st(p, {"a": ("F32", (2, 2), f32.tobytes()), "b": ("BF16", (5,), bf.tobytes()),
                  "c": ("F16", (2, 2), f16.tobytes())})
    out = mojolearn.read_safetensors(p)
    assert set(out) == {"a", "b", "c"}
    assert_same_bits(out["a"], f32)
    np.testing.assert_array_equal(np.asarray(out["b"]).view(np.uint32), bf.astype(np.uint32) << 16)
    np.testing.assert_array_equal(np.asarray(out["c"]), f16.astype(np.float32).reshape(2, 2))
    assert list(checkpoints.read_safetensors(p, ["b"])) == ["b"]


def test_read_safetensors_refusals(tmp_path):
    p = tmp_path / "t.safetensors"
    _write_st(p, {"w64": ("F64", (2,), np.ones(2).tobytes())})
    with raises_naming(TypeError, "w64", "F64"):
        mojolearn.read_safetensors(p)
    _write_st(p, {"w": ("F32", (3,), np.ones(2, np.float32).tobytes())})
    with raises_naming(ValueError, "w", "offsets"):
        mojolearn.read_safetensors(p)
    p.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with raises_naming(ValueError, "not a safetensors file"):
        mojolearn.read_safetensors(p)
    with raises_naming(ValueError, "no tensors named ['v']"):
        _write_st(p, {"w": ("F32", (1,), np.ones(1, np.float32).tobytes())})
        mojolearn.read_safetensors(p, ["v"])


def test_state_dict_dtype_refused_by_name():
    with raises_naming(TypeError, "backbone.embeddings.weight", "float64"):
        checkpoints._to_float32(torch.zeros(2, 2, dtype=torch.float64),
                                "backbone.embeddings.weight")
    with raises_naming(TypeError, "x", "float64"):
        checkpoints._to_float32(np.zeros(2), "x")


# --------------------------------------------------------------------------- configs
M1 = {"model_type": "mamba", "hidden_size": 32, "num_hidden_layers": 2, "state_size": 16,
      "conv_kernel": 4, "expand": 2, "use_bias": False, "use_conv_bias": True,
      "hidden_act": "silu", "time_step_rank": 2, "layer_norm_epsilon": 1e-5,
      "intermediate_size": 64, "vocab_size": 64, "tie_word_embeddings": True}
M2 = {"model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 2, "state_size": 128,
      "conv_kernel": 4, "expand": 2, "use_bias": False, "use_conv_bias": True,
      "hidden_act": "silu", "layer_norm_epsilon": 1e-5, "num_heads": 2, "head_dim": 64,
      "n_groups": 1, "chunk_size": 256, "time_step_limit": [0.0, math.inf],
      "vocab_size": 64, "tie_word_embeddings": False}


@pytest.mark.parametrize("base, field, value", [
    (M1, "state_size", 8), (M1, "conv_kernel", 3), (M1, "expand", 3), (M1, "use_bias", True),
    (M1, "use_conv_bias", False), (M1, "hidden_act", "gelu"), (M1, "time_step_rank", 4),
    (M1, "layer_norm_epsilon", 1e-6), (M1, "intermediate_size", 96), (M1, "model_type", "llama"),
    (M1, "hidden_size", 0), (M1, "num_hidden_layers", 0),
    (M2, "state_size", 64), (M2, "head_dim", 32), (M2, "n_groups", 8), (M2, "chunk_size", 128),
    (M2, "num_heads", 4), (M2, "hidden_size", 48), (M2, "use_bias", True),
    (M2, "use_conv_bias", False), (M2, "rms_norm", False), (M2, "norm_before_gate", True),
    (M2, "time_step_limit", [1.0, 0.5]), (M2, "hidden_act", "relu"), (M2, "expand", 4),
])
def test_config_refusals_name_the_field(base, field, value, tmp_path):
    cfg = dict(base, **{field: value})
    with raises_naming(ValueError, f"{field} = {value!r}"):  # the field and its value
        checkpoints.check_config(cfg)
    # from a folder: refused before any tensor is read
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with raises_naming(ValueError, f"{field} = {value!r}"):
        mojolearn.load_checkpoint(tmp_path)


def test_configs_accepted():
    s1 = checkpoints.check_config(M1)
    assert s1["kind"] == "mamba" and s1["dt_limit"] is None and s1["tie"]
    s2 = checkpoints.check_config(dict(M2, time_step_limit=[0.0, 0.1], norm_before_gate=False,
                                       rms_norm=True))
    assert s2["kind"] == "mamba2" and s2["dt_limit"] == (0.0, 0.1)
    assert checkpoints.check_config(dict(M1, time_step_rank="auto"))["d_model"] == 32


def test_tensor_problems_named(tmp_path):
    model = make_model("mamba", tmp_path, seed=5, layers=1)
    sd = dict(model.state_dict())
    cfg = model.config
    with raises_naming(ValueError, "missing", "layers.0.mixer.D"):
        mojolearn.load_checkpoint({k: v for k, v in sd.items() if not k.endswith(".D")}, cfg)
    with raises_naming(ValueError, "do not use", "extra"):
        mojolearn.load_checkpoint(dict(sd, extra=torch.zeros(1)), cfg)
    bad = dict(sd)
    bad["backbone.layers.0.mixer.A_log"] = torch.zeros(64, 8)
    with raises_naming(ValueError, "backbone.layers.0.mixer.A_log", "shape", "(64, 8)"):
        mojolearn.load_checkpoint(bad, cfg)
    # inferred config: a different state size is refused by field name
    with raises_naming(ValueError, "state_size"):
        mojolearn.load_checkpoint(bad)
    with raises_naming(ValueError, "no model.safetensors"):
        (tmp_path / "model.safetensors").unlink()
        mojolearn.load_checkpoint(tmp_path)


def test_example_runs(tmp_path, capsys):
    import runpy
    make_model("mamba", tmp_path, seed=3, layers=2)
    mod = runpy.run_path(str(Path(__file__).resolve().parent.parent / "examples" / "load_checkpoint.py"),
                         run_name="example")
    assert mod["main"]([str(tmp_path), "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "mojolearn greedy" in out and "same tokens" in out
