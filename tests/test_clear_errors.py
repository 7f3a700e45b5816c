"""Errors that name the file, the field and the way out (checkpoints, the
CPU binary choice), and `python -m mojolearn info` saying why a binary was
not chosen."""
import json
import struct
import subprocess
import sys

import pytest

import mojolearn
from mojolearn import _loader
from tests.errors import raises_naming


def _safetensors(path, header, data=bytes(8)):
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


@pytest.mark.parametrize("text,problem", [("{not json", "not valid JSON"),
                                          ("[1, 2]", "must be a JSON object")])
def test_config_that_is_not_a_json_object_names_the_file(tmp_path, text, problem):
    (tmp_path / "config.json").write_text(text)
    with raises_naming(ValueError, str(tmp_path / "config.json"), problem):
        mojolearn.load_checkpoint(tmp_path)


@pytest.mark.parametrize("entry,problem", [
    ({"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}, "data_offsets must be two ints"),
    ({"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}, "shape must be a list"),
    ({"dtype": 5, "shape": [2], "data_offsets": [0, 8]}, "dtype must be a string"),
    ({"dtype": "F32", "shape": [2]}, "data_offsets must be two ints"),
    ([1], "not a JSON object"),
])
def test_malformed_safetensors_entry_names_file_and_tensor(tmp_path, entry, problem):
    f = tmp_path / "m.safetensors"
    _safetensors(f, {"w.weight": entry})
    with raises_naming(ValueError, str(f), "w.weight", problem):
        mojolearn.read_safetensors(f)


def test_well_formed_safetensors_still_reads(tmp_path):
    f = tmp_path / "m.safetensors"
    _safetensors(f, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                 struct.pack("<2f", 1.5, -2.0))
    assert mojolearn.read_safetensors(f)["w"].tolist() == [1.5, -2.0]


def test_bad_shard_index_names_the_file(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{oops")
    from mojolearn.checkpoints import _folder_tensors
    with raises_naming(ValueError, "model.safetensors.index.json", "not valid JSON"):
        _folder_tensors(tmp_path)


def test_hub_id_says_it_is_not_downloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache (tests/test_hub_ids.py)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with raises_naming(ValueError, "state-spaces/mamba-130m-hf", "Hub cache",
                       "download=True"):
        mojolearn.load_checkpoint("state-spaces/mamba-130m-hf")
    # control: a missing local path gets no Hub hint
    with pytest.raises(ValueError) as e:
        mojolearn.load_checkpoint("./no/such/folder")
    assert "Hub" not in str(e.value)


def test_forced_variant_lists_only_the_missing_features(monkeypatch):
    monkeypatch.setattr(_loader, "cpu_flags", lambda: {"avx2", "fma", "bmi2", "f16c", "avx512f"})
    monkeypatch.setenv("MOJOLEARN_CPU_TARGET", "x86-64-v4")
    with pytest.raises(_loader.BinaryNotFoundError) as e:
        _loader.library_path("cpu")
    msg = str(e.value)
    assert "avx512bw" in msg and "avx512vl" in msg
    assert "'avx512f'" not in msg and "'avx2'" not in msg


def test_info_says_why_a_variant_was_skipped(monkeypatch):
    names = [p.name for p in _loader.find_binaries()]
    if "libmojolearn_cpu_x86-64-v4.so" not in names:
        pytest.skip("no x86-64-v4 binary installed (built on x86-64 only)")
    monkeypatch.setattr(_loader, "cpu_flags", lambda: {"avx2", "fma", "bmi2", "f16c"})
    assert _loader.skipped_variants() == [
        ("libmojolearn_cpu_x86-64-v4.so",
         "this CPU lacks ['avx512f', 'avx512bw', 'avx512cd', 'avx512dq', 'avx512vl']")]
    monkeypatch.setattr(_loader, "cpu_flags", lambda: set(_loader.CPU_VARIANT_FLAGS["x86-64-v4"]))
    assert _loader.skipped_variants() == []
    monkeypatch.setenv("MOJOLEARN_CPU_TARGET", "baseline")
    assert _loader.skipped_variants() == [("libmojolearn_cpu_x86-64-v4.so",
                                           "MOJOLEARN_CPU_TARGET=baseline")]
    r = subprocess.run([sys.executable, "-m", "mojolearn", "info"], capture_output=True,
                       text=True, env={**__import__("os").environ,
                                       "MOJOLEARN_CPU_TARGET": "baseline"})
    assert "skipped: libmojolearn_cpu_x86-64-v4.so (MOJOLEARN_CPU_TARGET=baseline)" in r.stdout


# One rule for the exception class (docs/guide/errors.rst), every block class.
CLASSES = [f"Mamba{k}{s}" for k in (1, 2, 3) for s in ("Block", "BlockInference")]


def _block(name):
    from mojolearn.reference.weights import mamba1_weights, mamba2_weights, mamba3_weights
    make = {"1": mamba1_weights, "2": mamba2_weights, "3": mamba3_weights}[name[5]]
    return getattr(mojolearn, name)(make(32, seed=0))


@pytest.mark.parametrize("name", CLASSES)
def test_not_a_buffer_is_a_type_error_for_every_class(name):
    import numpy as np
    torch = pytest.importorskip("torch")
    block = _block(name)
    state = block.allocate_state(1)
    for bad in ([[[0.0] * 32]], None, torch.zeros((1, 2, 32), dtype=torch.float32),
                torch.zeros((1, 2, 32), dtype=torch.float64)):
        with raises_naming(TypeError, "x"):
            block.forward(bad)
        with raises_naming(TypeError, "x"):
            block.step(bad, state)
    with raises_naming(TypeError, "torch.Tensor", "tensor.numpy()"):
        block.forward(torch.zeros((1, 2, 32), dtype=torch.float32))
    # control: the same values as a float32 buffer are accepted
    block.forward(np.zeros((1, 2, 32), np.float32))
    with raises_naming(TypeError, "state"):
        block.step(np.zeros((1, 32), np.float32), {"h": None})


@pytest.mark.parametrize("name", [n for n in CLASSES if n[5] in "23"])
def test_stale_report_is_a_value_error_for_every_class(name):
    import numpy as np
    from mojolearn.reference.weights import random_input
    block = _block(name)
    state = block.allocate_state(1)
    x = random_input(1, 3, 32, seed=1)
    block.forward(x, state)
    block.h_last_  # fine while the state is where the call left it
    block.forward(x, state)
    other = _block(name)
    other.forward(x, state)  # another block advances the state
    with raises_naming(ValueError, "h_last_", "no longer available"):
        block.h_last_
    fresh = _block(name)
    with pytest.raises(AttributeError):
        fresh.h_last_
    assert np.asarray(other.h_last_).shape[0] == 1
