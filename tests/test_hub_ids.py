"""Hub ids ("org/name") in load_checkpoint and MambaLM, resolved through a
huggingface_hub cache folder laid out as the hub lays it out (no network:
a download is replaced by a stand-in that records it)."""
import json
from pathlib import Path

import pytest

import mojolearn
from mojolearn.save import save_checkpoint

from .child import run_python
from .errors import raises_naming

huggingface_hub = pytest.importorskip("huggingface_hub")

REPO, COMMIT = "tiny-org/tiny-mamba", "0123456789abcdef0123456789abcdef01234567"
IDS = [[1, 2, 3, 4]]


def _model(folder):
    ws = [mojolearn.init_weights("mamba2", 32, seed=i, n_layers=2) for i in range(2)]
    emb = mojolearn.Array((24, 32))
    mv = memoryview(emb).cast("B").cast("f")
    for i in range(len(mv)):
        mv[i] = ((i * 7919) % 101) / 101.0 - 0.5
    norm = ws[0]["block_norm.weight"]
    return save_checkpoint(folder, "mamba2", ws, emb, norm)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty hub cache folder, named by HF_HUB_CACHE; downloads forbidden
    unless a test installs its own stand-in."""
    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    real = huggingface_hub.snapshot_download
    calls = []

    def guarded(repo_id, **kw):
        calls.append(kw)
        if not kw.get("local_files_only"):
            raise AssertionError("a download was attempted")
        return real(repo_id, **kw)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", guarded)
    return root, calls


def _put_in_cache(root, source_folder):
    repo = root / ("models--" + REPO.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for f in Path(source_folder).iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


def test_cached_hub_id_loads_the_same_model(tmp_path, cache):
    root, calls = cache
    folder = _model(tmp_path / "local")
    _put_in_cache(root, folder)
    want = bytes(memoryview(mojolearn.MambaLM(folder).logits(IDS)).cast("B"))
    lm = mojolearn.MambaLM(REPO)
    assert bytes(memoryview(lm.logits(IDS)).cast("B")) == want
    assert mojolearn.load_checkpoint(REPO).n_layers == 2
    assert calls and all(c.get("local_files_only") for c in calls)


def test_missing_from_cache_says_how_to_download(cache):
    with raises_naming(ValueError, repr(REPO), "download=True"):
        mojolearn.load_checkpoint(REPO)
    with raises_naming(ValueError, repr(REPO), "download=True"):
        mojolearn.MambaLM(REPO)
    # the CLI names its own flag, not the Python keyword
    from mojolearn._cli_common import model_folder
    with pytest.raises(ValueError) as e:
        model_folder(REPO)
    assert "--download" in str(e.value) and "download=True" not in str(e.value)


def test_offline_forbids_the_download(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with raises_naming(ValueError, "HF_HUB_OFFLINE"):
        mojolearn.load_checkpoint(REPO, download=True)


def test_download_when_allowed(tmp_path, cache, monkeypatch):
    folder = _model(tmp_path / "remote")
    real = huggingface_hub.snapshot_download  # the fixture's guard: local reads only
    calls = []

    def fake(repo_id, **kw):  # what a download leaves behind: the cache entry
        calls.append(kw)
        if kw.get("local_files_only"):
            return real(repo_id, **kw)
        assert "config.json" in kw["allow_patterns"]
        return str(_put_in_cache(Path(kw["cache_dir"]), folder))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    lm = mojolearn.MambaLM(REPO, download=True)
    assert lm.n_layers == 2
    assert [c.get("local_files_only", False) for c in calls] == [True, False]


def test_without_huggingface_hub(tmp_path):
    code = ("import sys; sys.modules['huggingface_hub'] = None\n"
            "import mojolearn\n"
            "try:\n"
            f"    mojolearn.load_checkpoint({REPO!r})\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    out = run_python(code, timeout=120, cwd=tmp_path)
    assert "huggingface_hub" in out and REPO in out


def test_a_local_folder_wins_over_a_hub_id(tmp_path, cache, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _model(tmp_path / "tiny-org" / "tiny-mamba")
    assert mojolearn.load_checkpoint(REPO).n_layers == 2
    assert cache[1] == []  # the hub was not asked
    json.loads((tmp_path / REPO / "config.json").read_text())
