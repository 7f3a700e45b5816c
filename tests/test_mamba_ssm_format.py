"""mamba_ssm-format checkpoint folders (MambaLMHeadModel.save_pretrained's
layout) for Mamba-1, Mamba-2 and Mamba-3, and the restricted reader of
pytorch_model.bin.

A folder is written here in mamba_ssm's layout (key names as mamba_ssm's
MixerModel / Mamba / Mamba2 / Mamba3 modules name their parameters; the
names are spelled out below, not taken from mojolearn) from the same
weights as a mojolearn/transformers-layout folder: the two give the same
logits bytes. The .bin is written by torch.save and read in a child process
where torch cannot be imported. Pickles that name anything but tensor
records are refused by name, and nothing in them runs.
"""
import hashlib
import io
import json
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest

import mojolearn
from mojolearn.save import save_checkpoint

from .child import run_python
from .errors import raises_naming

torch = pytest.importorskip("torch")

IDS = [[1, 5, 9, 3, 0, 47, 2], [4, 4, 8, 63, 1, 2, 7]]
VOCAB, PAD = 50, 16  # the padded vocabulary: 64 rows

# mamba_ssm's parameter names per mixer module (modules/mamba_simple.py,
# mamba2.py, mamba3.py), and the layer norm of its Block
MIXER_NAMES = {
    "Mamba1": ["in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight",
               "dt_proj.weight", "dt_proj.bias", "A_log", "D", "out_proj.weight"],
    "Mamba2": ["in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
               "norm.weight", "out_proj.weight"],
    "Mamba3": ["in_proj.weight", "dt_bias", "B_bias", "C_bias", "B_norm.weight",
               "C_norm.weight", "D", "out_proj.weight"],
}
KIND = {"Mamba1": "mamba", "Mamba2": "mamba2", "Mamba3": "mamba3"}
INPUT_NORM = {"Mamba1": "norm.weight", "Mamba2": "block_norm.weight",
              "Mamba3": "block_norm.weight"}


def _np(a):
    return np.frombuffer(memoryview(a).cast("B"), np.float32).reshape(a.shape).copy()


def model_weights(layer, d=32, n_layers=2, seed=0):
    """(layers, embeddings, final_norm, lm_head) as float32 NumPy arrays."""
    rng = np.random.default_rng(seed)
    layers = []
    for i in range(n_layers):
        w = {k: _np(v) for k, v in mojolearn.init_weights(
            KIND[layer], d, seed=seed + i, n_layers=n_layers).items()}
        for k in w:  # ones and zeros would hide a swapped or ignored weight
            if k.endswith("norm.weight") or k in ("D", "B_bias", "C_bias"):
                w[k] = (w[k] + 0.1 * rng.standard_normal(w[k].shape)).astype(np.float32)
            if k == "out_proj.weight":
                w[k] *= 8
        layers.append(w)
    rows = VOCAB + (-VOCAB % PAD)
    emb = rng.standard_normal((rows, d)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    head = rng.standard_normal((rows, d)).astype(np.float32)
    return layers, emb, norm, head


def mamba_ssm_state_dict(layer, layers, emb, norm, head):
    """The state_dict MambaLMHeadModel would hold (torch tensors)."""
    sd = {"backbone.embedding.weight": torch.from_numpy(emb)}
    for i, w in enumerate(layers):
        sd[f"backbone.layers.{i}.norm.weight"] = torch.from_numpy(w[INPUT_NORM[layer]])
        for name in MIXER_NAMES[layer]:
            t = torch.from_numpy(w[name])
            if layer == "Mamba3" and name in ("B_bias", "C_bias"):
                t = t.reshape(t.shape[0], 1, t.shape[1])  # (nheads, mimo_rank = 1, d_state)
            sd[f"backbone.layers.{i}.mixer.{name}"] = t
    sd["backbone.norm_f.weight"] = torch.from_numpy(norm)
    sd["lm_head.weight"] = sd["backbone.embedding.weight"] if head is None \
        else torch.from_numpy(head)
    return sd


def write_mamba_ssm_folder(folder, layer, weights, *, fmt="bin", tie=False, ssm_cfg=None,
                           **config):
    layers, emb, norm, head = weights
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"d_model": emb.shape[1], "d_intermediate": 0, "n_layer": len(layers),
           "vocab_size": VOCAB, "ssm_cfg": dict({"layer": layer}, **(ssm_cfg or {})),
           "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
           "fused_add_norm": True, "pad_vocab_size_multiple": PAD, "tie_embeddings": tie}
    cfg.update(config)
    (folder / "config.json").write_text(json.dumps(cfg))
    sd = mamba_ssm_state_dict(layer, layers, emb, norm, None if tie else head)
    if fmt == "bin":
        torch.save(sd, folder / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file
        save_file({k: v.contiguous().clone() for k, v in sd.items()},
                  str(folder / "model.safetensors"))
    return folder


def write_reference_folder(folder, layer, weights, tie=False):
    layers, emb, norm, head = weights
    return save_checkpoint(folder, KIND[layer], layers, emb, norm, None if tie else head)


def logits_bytes(folder) -> bytes:
    return bytes(memoryview(mojolearn.MambaLM(folder).logits(IDS)).cast("B"))


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2", "Mamba3"])
@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_same_logits_as_the_reference_layout(tmp_path, layer, fmt):
    d = 32
    weights = model_weights(layer, d)
    tie = layer == "Mamba2"
    ref = logits_bytes(write_reference_folder(tmp_path / "ref", layer, weights, tie))
    ck = mojolearn.load_checkpoint(write_mamba_ssm_folder(tmp_path / "ssm", layer, weights,
                                                          fmt=fmt, tie=tie))
    assert (ck.format, ck.kind, ck.vocab_size) == ("mamba_ssm", KIND[layer], 64)
    assert logits_bytes(tmp_path / "ssm") == ref
    # negative control: one weight of the last layer changed in the file
    other = model_weights(layer, d)
    other[0][-1]["D"][0] += 0.5
    assert logits_bytes(write_mamba_ssm_folder(tmp_path / "neg", layer, other, fmt=fmt,
                                               tie=tie)) != ref


def test_bin_read_with_torch_blocked(tmp_path):
    weights = model_weights("Mamba2", 32)
    want = hashlib.sha256(logits_bytes(write_reference_folder(tmp_path / "r", "Mamba2",
                                                              weights))).hexdigest()
    folder = write_mamba_ssm_folder(tmp_path / "ssm", "Mamba2", weights)
    code = ("import sys, hashlib; sys.modules['torch'] = None\n"
            "import mojolearn\n"
            f"lm = mojolearn.MambaLM({str(folder)!r})\n"
            f"b = bytes(memoryview(lm.logits({IDS!r})).cast('B'))\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "print(hashlib.sha256(b).hexdigest())\n")
    assert run_python(code).strip() == want


def test_bfloat16_bin_widened_exactly(tmp_path):
    weights = model_weights("Mamba1", 32)
    # round every value to bfloat16 first, so the float32 folder holds the widened values
    rounded = ([{k: _bf16(v) for k, v in w.items()} for w in weights[0]],) + \
        tuple(_bf16(a) for a in weights[1:])
    ref = logits_bytes(write_reference_folder(tmp_path / "r", "Mamba1", rounded))
    folder = write_mamba_ssm_folder(tmp_path / "ssm", "Mamba1", rounded)
    sd = torch.load(folder / "pytorch_model.bin")
    torch.save({k: v.to(torch.bfloat16) for k, v in sd.items()}, folder / "pytorch_model.bin")
    assert logits_bytes(folder) == ref


def _bf16(a):
    return torch.from_numpy(a).to(torch.bfloat16).to(torch.float32).numpy()


@pytest.mark.parametrize("layer,field,value", [
    ("Mamba3", "is_mimo", True), ("Mamba3", "rope_fraction", 1.0),
    ("Mamba3", "is_outproj_norm", True), ("Mamba3", "ngroups", 2),
    ("Mamba3", "d_state", 64), ("Mamba3", "headdim", 32), ("Mamba3", "A_floor", 1e-3),
    ("Mamba2", "ngroups", 8), ("Mamba2", "d_state", 64), ("Mamba2", "headdim", 32),
    ("Mamba2", "expand", 3), ("Mamba2", "d_conv", 3), ("Mamba2", "D_has_hdim", True),
    ("Mamba2", "norm_before_gate", True), ("Mamba2", "rmsnorm", False),
    ("Mamba2", "d_ssm", 32), ("Mamba2", "bias", True), ("Mamba2", "chunk_size", 128),
    ("Mamba1", "d_state", 8), ("Mamba1", "d_conv", 2), ("Mamba1", "dt_rank", 5),
    ("Mamba1", "conv_bias", False), ("Mamba1", "some_new_option", 1),
])
def test_unrepresentable_ssm_options_refused_by_name(tmp_path, layer, field, value):
    folder = write_mamba_ssm_folder(tmp_path, layer, model_weights(layer, 32, n_layers=1),
                                    ssm_cfg={field: value})
    with raises_naming(ValueError, f"ssm_cfg.{field}"):
        mojolearn.load_checkpoint(folder)


@pytest.mark.parametrize("field,value", [
    ("attn_layer_idx", [1]), ("d_intermediate", 64), ("rms_norm", False),
    ("pad_vocab_size_multiple", 0), ("n_layer", 0), ("tie_embeddings", "yes"),
])
def test_unrepresentable_model_options_refused_by_name(tmp_path, field, value):
    folder = write_mamba_ssm_folder(tmp_path, "Mamba1", model_weights("Mamba1", 32, 1),
                                    **{field: value})
    with raises_naming(ValueError, field):
        mojolearn.load_checkpoint(folder)


def test_accepted_options_that_do_not_change_the_function(tmp_path):
    weights = model_weights("Mamba2", 32, n_layers=1)
    folder = write_mamba_ssm_folder(tmp_path, "Mamba2", weights, ssm_cfg={
        "d_state": 128, "headdim": 64, "ngroups": 1, "dt_min": 0.01, "A_init_range": [1, 8],
        "use_mem_eff_path": False, "dt_limit": [0.0, 0.5]})
    ck = mojolearn.load_checkpoint(folder)
    assert ck.dt_limit == (0.0, 0.5)


def test_dt_limit_reaches_the_blocks(tmp_path):
    weights = model_weights("Mamba2", 32)
    limited = write_mamba_ssm_folder(tmp_path / "ssm", "Mamba2", weights,
                                     ssm_cfg={"dt_limit": [0.0, 0.002]})
    layers, emb, norm, head = weights
    ref = save_checkpoint(tmp_path / "ref", "mamba2", layers, emb, norm, head,
                          config={"time_step_limit": [0.0, 0.002]})
    assert logits_bytes(limited) == logits_bytes(ref)
    # control: the limit changes the logits
    assert logits_bytes(limited) != logits_bytes(write_reference_folder(tmp_path / "free",
                                                                        "Mamba2", weights))


def test_padded_vocab_must_match_the_embedding(tmp_path):
    folder = write_mamba_ssm_folder(tmp_path, "Mamba1", model_weights("Mamba1", 32, 1),
                                    pad_vocab_size_multiple=8)  # 56 rows, the file has 64
    with raises_naming(ValueError, "vocab_size", "pad_vocab_size_multiple", "64"):
        mojolearn.load_checkpoint(folder)


# --------------------------------------------------------------------------- hostile .bin
def _bin_with_pickle(path, data: bytes, extra=None):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data)
        z.writestr("archive/byteorder", "little")
        for k, v in (extra or {}).items():
            z.writestr(f"archive/data/{k}", v)
    return path


class Evil:
    def __reduce__(self):
        return (print, ("executed",))


@pytest.mark.parametrize("payload,name", [
    (b"cos\nsystem\n(S'touch MARKER'\ntR.", "os.system"),
    (b"cbuiltins\neval\n(S'open(\"MARKER\", \"w\")'\ntR.", "builtins.eval"),
    (b"cposix\nsystem\n(S'touch MARKER'\ntR.", "posix.system"),
    (pickle.dumps(Evil(), protocol=4), "builtins.print"),
    (b"c__main__\nEvil\n)R.", "__main__.Evil"),
    (b"ctorch\nDoubleStorage\n.", "torch.DoubleStorage"),
    (b"ccollections\nOrderedDict\n(S'touch MARKER'\ntR.", "collections.OrderedDict"),
])
def test_pickle_calling_anything_else_refused_by_name(tmp_path, monkeypatch, payload, name):
    monkeypatch.chdir(tmp_path)
    from mojolearn.pytorch_bin import read_pytorch_bin
    path = _bin_with_pickle(tmp_path / "pytorch_model.bin", payload)
    with raises_naming(ValueError, name):
        read_pytorch_bin(path)
    assert not (tmp_path / "MARKER").exists()


def test_a_state_dict_pickle_is_accepted(tmp_path):
    """Positive control of the refusals: a real torch.save zip goes through."""
    from mojolearn.pytorch_bin import read_pytorch_bin
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    torch.save({"w": t, "p": torch.nn.Parameter(t[1].clone())}, tmp_path / "a.bin")
    got = read_pytorch_bin(tmp_path / "a.bin")
    assert bytes(memoryview(got["w"].load()).cast("B")) == t.numpy().tobytes()
    assert got["p"].shape == (3,)


def test_legacy_and_non_contiguous_refused(tmp_path):
    from mojolearn.pytorch_bin import read_pytorch_bin
    torch.save({"w": torch.ones(2)}, tmp_path / "old.bin", _use_new_zipfile_serialization=False)
    with raises_naming(ValueError, "legacy"):
        read_pytorch_bin(tmp_path / "old.bin")
    torch.save({"w": torch.ones(3, 2).t()}, tmp_path / "t.bin")
    with raises_naming(ValueError, "w", "row-major"):
        read_pytorch_bin(tmp_path / "t.bin")
    torch.save({"w": torch.ones(2, dtype=torch.float64)}, tmp_path / "d.bin")
    with raises_naming(ValueError, "torch.DoubleStorage"):
        read_pytorch_bin(tmp_path / "d.bin")
    bad = io.BytesIO()
    (tmp_path / "junk.bin").write_bytes(b"PK\x03\x04 not really a zip")
    with raises_naming(ValueError, "junk.bin"):
        read_pytorch_bin(tmp_path / "junk.bin")
    del bad
