"""Corrupted checkpoint files, parsed in a child process: every case either
loads, or fails with a ValueError / TypeError carrying a message; never
another exception, a crash or a hang (the child has a time limit).

Cases (seeded, bounded): byte flips and truncations of model.safetensors
(header and data), pytorch_model.bin (a torch.save zip), config.json and a
GGUF file, JSON-level edits of config.json and the safetensors header, and
count / length / offset fields of the GGUF header set to random values.
"""
import json
import shutil

import pytest

import mojolearn
from mojolearn.save import save_checkpoint

from .child import run_python

CASES = 500

CHILD = r"""
import json, random, shutil, struct, sys, traceback
from pathlib import Path
import mojolearn
from mojolearn.checkpoints import _loaded

pristine, work, n_cases = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
# (folder, file): transformers layout + safetensors; mamba_ssm layout + pytorch_model.bin
CASE_FILES = [("st", "model.safetensors"), ("st", "config.json"),
              ("ssm", "pytorch_model.bin"), ("ssm", "config.json"), ("gguf", "model.gguf")]
SSM_OPTIONS = ["layer", "d_state", "d_conv", "expand", "dt_rank", "headdim", "ngroups",
               "is_mimo", "rope_fraction", "dt_limit", "chunk_size", "bias"]

def corrupt(rng, case):
    if work.exists():
        shutil.rmtree(work)
    where, name = CASE_FILES[case % len(CASE_FILES)]
    shutil.copytree(pristine / where, work)
    path = work / name
    data = bytearray(path.read_bytes())
    how = rng.choice(["flip", "flip_head", "truncate", "json", "zero_run"])
    if how == "json" and name.endswith(".gguf"):
        how = "gguf_count"  # a count, length or offset field set to a random value
        at = rng.choice([8, 16, 24, 24 + rng.randrange(200)])
        data[at:at + 8] = struct.pack("<Q", rng.choice([0, 1, 2 ** 31, 2 ** 63 - 1,
                                                         rng.randrange(2 ** 64)]))
    elif how == "json" and name != "pytorch_model.bin":
        if name == "config.json":
            cfg = json.loads(data)
            value = rng.choice([None, -1, 0, 2 ** 40, "x", [1, 2], {"a": 1}, 1.5, True,
                                "Mamba2", "Mamba3", [0, "inf"]])
            if where == "ssm" and rng.random() < 0.5:
                cfg["ssm_cfg"][rng.choice(SSM_OPTIONS)] = value
            else:
                cfg[rng.choice(sorted(cfg))] = value
            data = bytearray(json.dumps(cfg).encode())
        else:
            n = struct.unpack("<Q", data[:8])[0]
            head = json.loads(data[8:8 + n])
            k = rng.choice(sorted(head))
            field = rng.choice(["dtype", "shape", "data_offsets"])
            head[k][field] = rng.choice([None, "F64", "I8", [1, 2], [-1], [0, 10 ** 12], 7])
            raw = json.dumps(head).encode()
            data = bytearray(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    elif how == "truncate":
        data = data[:rng.randrange(len(data))]
    elif how == "zero_run":
        at, k = rng.randrange(len(data)), rng.randrange(1, 64)
        data[at:at + k] = bytes(len(data[at:at + k]))
    else:
        span = min(len(data), 600) if how == "flip_head" else len(data)
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(span)] = rng.randrange(256)
    path.write_bytes(bytes(data))
    return f"{name}:{how}"

out = []
for case in range(n_cases):
    rng = random.Random(case)
    what = corrupt(rng, case)
    try:
        src = work / "model.gguf" if what.startswith("model.gguf") else work
        ck = mojolearn.load_checkpoint(src, lazy=bool(case % 2))
        for i in range(ck.n_layers):
            ck.block(i)
        _loaded(ck.embeddings); _loaded(ck.final_norm); _loaded(ck.lm_head)
        out.append([case, what, "ok", ""])
    except (ValueError, TypeError) as e:
        out.append([case, what, type(e).__name__, str(e)[:300]])
    except BaseException as e:
        out.append([case, what, "BAD " + type(e).__name__, traceback.format_exc()[-1500:]])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    torch = pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("pristine")
    ws = [mojolearn.init_weights("mamba", 32, seed=1, n_layers=1)]
    emb = mojolearn.init_weights("mamba", 32, seed=2)["in_proj.weight"]  # (128, 32)
    norm = ws[0]["norm.weight"]
    st = save_checkpoint(root / "st", "mamba", ws, emb, norm)
    # the same model in mamba_ssm's layout, weights in a torch.save zip
    from safetensors.torch import load_file
    sd = {k.replace("embeddings", "embedding"): v
          for k, v in load_file(str(st / "model.safetensors")).items()}
    (root / "ssm").mkdir()
    torch.save(sd, root / "ssm" / "pytorch_model.bin")
    (root / "ssm" / "config.json").write_text(json.dumps({
        "d_model": 32, "n_layer": 1, "vocab_size": 128, "ssm_cfg": {}, "rms_norm": True,
        "residual_in_fp32": True, "pad_vocab_size_multiple": 8, "tie_embeddings": True}))
    # and as a GGUF file written as llama.cpp's converter writes it
    import numpy as np
    from .gguf_files import write_gguf
    layer = {k: np.array(memoryview(v)) for k, v in ws[0].items()}
    (root / "gguf").mkdir()
    write_gguf(root / "gguf" / "model.gguf", "mamba", [layer], np.array(memoryview(emb)),
               np.array(memoryview(norm)), eos=2)
    mojolearn.load_checkpoint(root / "ssm")  # every pristine copy loads
    mojolearn.load_checkpoint(st)
    mojolearn.load_checkpoint(root / "gguf" / "model.gguf")
    return root


def test_corrupted_checkpoints_fail_cleanly_in_a_child(pristine, tmp_path):
    out = run_python(CHILD, pristine, tmp_path / "w", CASES, timeout=600)
    results = json.loads(out.strip().splitlines()[-1])
    assert len(results) == CASES
    bad = [r for r in results if r[2].startswith("BAD")]
    assert not bad, "\n".join(f"case {c} {w}: {k}\n{m}" for c, w, k, m in bad[:5])
    assert all(m for _, _, k, m in results if k != "ok"), "an error without a message"
    kinds = {k for _, _, k, _ in results}
    assert kinds <= {"ok", "ValueError", "TypeError", "PickleRefused"}, kinds  # our own errors
    assert "ValueError" in kinds  # the corruptions are seen (and some cases still load)
    assert sum(k != "ok" for _, _, k, _ in results) > CASES // 4
    refused = {w.split(":")[0] for _, w, k, _ in results if k != "ok"}
    assert refused == {"model.safetensors", "config.json", "pytorch_model.bin", "model.gguf"}
    gguf = [r for r in results if r[1].startswith("model.gguf")]
    assert sum("model.gguf" in m for _, _, k, m in gguf if k != "ok") > len(gguf) // 2
