"""Checkpoint loading and saving under misuse: weight errors name the full
weight, configs are checked against the weights before anything is
allocated, JSON nesting is bounded, safetensors data offsets must tile the
data, save_checkpoint is all-or-nothing, and eos_token_ids is read and
checked."""
import json
import struct
import time
from array import array

import pytest

import mojolearn
from mojolearn import save as save_mod
from mojolearn.save import save_checkpoint

from .errors import raises_naming

D, VOCAB = 32, 16


def _arr(shape, value=0.5):
    a = mojolearn.Array(shape, zero=False)
    n = 1
    for s in shape:
        n *= s
    memoryview(a).cast("B")[:] = array("f", [value] * n).tobytes()
    return a


def parts(kind="mamba", layers=2):
    ws = [mojolearn.init_weights(kind, D, seed=i, n_layers=layers) for i in range(layers)]
    return ws, _arr((VOCAB, D), 0.25), _arr((D,), 1.0)


def folder_of(tmp_path, kind="mamba", layers=2, name="ck", **config):
    ws, emb, norm = parts(kind, layers)
    return save_checkpoint(tmp_path / name, kind, ws, emb, norm, config=config or None)


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


# --------------------------------------------------------------------------- weight names
def test_nan_in_a_layer_weight_names_the_full_weight(tmp_path):
    ws, emb, norm = parts("mamba2", 2)
    d = memoryview(ws[1]["D"]).cast("B").cast("f")
    d[0] = float("nan")
    folder = save_checkpoint(tmp_path / "nan", "mamba2", ws, emb, norm)
    with raises_naming(ValueError, "backbone.layers.1.mixer.D", "non-finite"):
        mojolearn.MambaLM(folder)
    with raises_naming(ValueError, "backbone.layers.1.mixer.D"):
        mojolearn.MambaLM(folder, weight_format="bfloat16")
    # the input norm, whose block name differs from its checkpoint key
    ws, emb, norm = parts("mamba3", 1)
    memoryview(ws[0]["block_norm.weight"]).cast("B").cast("f")[3] = float("inf")
    folder = save_checkpoint(tmp_path / "inf", "mamba3", ws, emb, norm)
    with raises_naming(ValueError, "backbone.layers.0.norm.weight"):
        mojolearn.MambaLM(folder)


# --------------------------------------------------------------------------- config vs weights
def test_huge_layer_count_fails_fast_naming_the_field(tmp_path):
    folder = folder_of(tmp_path)
    edit_config(folder, num_hidden_layers=2 ** 40)
    t0 = time.process_time()
    with raises_naming(ValueError, "num_hidden_layers", "layers 0..1"):
        mojolearn.load_checkpoint(folder)
    assert time.process_time() - t0 < 30  # not 2**40 of anything (a loose guard, not a timing test)


@pytest.mark.parametrize("n", [1, 3])
def test_layer_count_must_match(tmp_path, n):
    folder = folder_of(tmp_path)
    edit_config(folder, num_hidden_layers=n)
    with raises_naming(ValueError, "num_hidden_layers", f"{n}"):
        mojolearn.load_checkpoint(folder)


def test_vocab_size_must_match_the_embedding_rows(tmp_path):
    folder = folder_of(tmp_path)
    edit_config(folder, vocab_size=VOCAB + 1)
    with raises_naming(ValueError, "vocab_size", f"{VOCAB + 1}", f"{VOCAB}"):
        mojolearn.load_checkpoint(folder)
    edit_config(folder, vocab_size=0)
    with raises_naming(ValueError, "vocab_size"):
        mojolearn.load_checkpoint(folder)
    edit_config(folder, vocab_size=VOCAB)  # control
    assert mojolearn.load_checkpoint(folder).vocab_size == VOCAB


def test_empty_embedding_refused(tmp_path):
    ws, _, norm = parts()
    with raises_naming(ValueError, "embeddings"):
        save_checkpoint(tmp_path / "e", "mamba", ws, mojolearn.Array((0, D)), norm)


# --------------------------------------------------------------------------- JSON depth
DEEP = "[" * 100000 + "]" * 100000


@pytest.mark.parametrize("file", ["config.json", "generation_config.json"])
def test_deep_json_is_a_value_error(tmp_path, file):
    folder = folder_of(tmp_path)
    if file == "config.json":
        (folder / file).write_text('{"model_type": "mamba", "x": ' + DEEP + "}")
    else:
        (folder / file).write_text('{"eos_token_id": ' + DEEP + "}")
    with raises_naming(ValueError, file, "deeper"):
        mojolearn.load_checkpoint(folder)


def test_deep_shard_index_is_a_value_error(tmp_path):
    folder = folder_of(tmp_path)
    (folder / "model.safetensors").rename(folder / "shard1.safetensors")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ' + DEEP + "}")
    with raises_naming(ValueError, "model.safetensors.index.json", "deeper"):
        mojolearn.load_checkpoint(folder)


def _safetensors(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def test_deep_safetensors_header_is_a_value_error(tmp_path):
    from mojolearn.safetensors import read_safetensors
    raw = ('{"a": ' + DEEP + "}").encode()
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    with raises_naming(ValueError, "x.safetensors", "deeper"):
        read_safetensors(tmp_path / "x.safetensors")


@pytest.mark.parametrize("offsets,word", [
    ({"a": [0, 8], "b": [4, 12]}, "overlaps"),
    ({"a": [0, 8], "b": [12, 20]}, "gap"),
    ({"a": [0, 8], "b": [8, 16]}, None),          # control: tiles the data
    ({"a": [0, 8], "b": [0, 8]}, "overlaps"),     # two names over the same bytes
])
def test_safetensors_offsets_must_tile_the_data(tmp_path, offsets, word):
    from mojolearn.safetensors import read_safetensors
    header = {k: {"dtype": "F32", "shape": [2], "data_offsets": v} for k, v in offsets.items()}
    end = max(v[1] for v in offsets.values())
    (tmp_path / "x.safetensors").write_bytes(_safetensors(header, bytes(end)))
    if word is None:
        assert sorted(read_safetensors(tmp_path / "x.safetensors")) == ["a", "b"]
    else:
        with raises_naming(ValueError, "b", word):
            read_safetensors(tmp_path / "x.safetensors")


def test_size_bounds(tmp_path, monkeypatch):
    from mojolearn import configs, safetensors
    folder = folder_of(tmp_path)
    monkeypatch.setattr(safetensors, "MAX_HEADER_BYTES", 64)
    with raises_naming(ValueError, "model.safetensors", "limit"):
        mojolearn.load_checkpoint(folder)
    monkeypatch.setattr(configs, "MAX_JSON_BYTES", 64)
    with raises_naming(ValueError, "config.json", "larger"):
        mojolearn.load_checkpoint(folder)
    monkeypatch.undo()  # control
    assert mojolearn.load_checkpoint(folder).n_layers == 2


def test_safetensors_trailing_bytes_refused(tmp_path):
    from mojolearn.safetensors import read_safetensors
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    (tmp_path / "x.safetensors").write_bytes(_safetensors(header, bytes(12)))
    with raises_naming(ValueError, "x.safetensors", "tail"):
        read_safetensors(tmp_path / "x.safetensors")


# --------------------------------------------------------------------------- save_checkpoint
def _listing(path):
    return sorted((p.relative_to(path).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in path.rglob("*"))


@pytest.mark.parametrize("bad", ["kind", "layer_name", "layer_shape", "norm", "config"])
def test_refused_save_leaves_nothing(tmp_path, bad):
    ws, emb, norm = parts()
    kind, config = "mamba", None
    if bad == "kind":
        kind = "mamba9"
    elif bad == "layer_name":
        ws[1]["extra"] = ws[1].pop("D")
    elif bad == "layer_shape":
        ws[1]["D"] = _arr((3,))
    elif bad == "norm":
        norm = _arr((D + 1,))
    else:
        config = {"x": object()}
    exc = TypeError if bad == "config" else ValueError
    with pytest.raises(exc):
        save_checkpoint(tmp_path / "new" / "ck", kind, ws, emb, norm, config=config)
    assert list(tmp_path.iterdir()) == []  # no folder, no parent, no temporary
    existing = folder_of(tmp_path, name="old")
    before = _listing(existing)
    with pytest.raises(exc):
        save_checkpoint(existing, kind, ws, emb, norm, config=config)
    assert _listing(existing) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]


def test_interrupted_save_leaves_the_target_as_it_was(tmp_path, monkeypatch):
    ws, emb, norm = parts()
    existing = folder_of(tmp_path, name="old")
    before = _listing(existing)

    def broken(path, tensors):
        path.write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(save_mod, "write_safetensors", broken)
    for target in (tmp_path / "fresh", existing):
        with pytest.raises(KeyboardInterrupt):
            save_checkpoint(target, "mamba", ws, emb, norm)
    assert not (tmp_path / "fresh").exists()
    assert _listing(existing) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    monkeypatch.undo()  # control: the same save goes through
    save_checkpoint(tmp_path / "fresh", "mamba", ws, emb, norm)
    assert mojolearn.load_checkpoint(tmp_path / "fresh").n_layers == 2


def test_save_replaces_files_in_an_existing_folder(tmp_path):
    ws, emb, norm = parts()
    folder = folder_of(tmp_path)
    (folder / "notes.txt").write_text("kept")
    save_checkpoint(folder, "mamba1", ws[:1], emb, norm)
    assert mojolearn.load_checkpoint(folder).n_layers == 1
    assert (folder / "notes.txt").read_text() == "kept"


# --------------------------------------------------------------------------- EOS
def test_eos_token_ids(tmp_path):
    folder = folder_of(tmp_path)
    assert mojolearn.load_checkpoint(folder).eos_token_ids == ()
    edit_config(folder, eos_token_id=3)
    assert mojolearn.load_checkpoint(folder).eos_token_ids == (3,)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2, 5]}))
    assert mojolearn.load_checkpoint(folder).eos_token_ids == (5, 2)  # generation config first
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert mojolearn.load_checkpoint(folder).eos_token_ids == (3,)


@pytest.mark.parametrize("value", [VOCAB, -1, True, "2", [1, 99], 2.0])
def test_bad_eos_refused_by_name(tmp_path, value):
    folder = folder_of(tmp_path)
    edit_config(folder, eos_token_id=value)
    with raises_naming(ValueError, "eos_token_id"):
        mojolearn.load_checkpoint(folder)
