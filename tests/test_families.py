"""mojolearn.families: one registry entry per family, read by checkpoints,
init, save and mojolearn.torch; kind aliases; importing it loads nothing."""
import re

import pytest

import mojolearn
from mojolearn import families
from mojolearn.families import FAMILIES, family

from .child import ROOT, run_python
from .errors import raises_naming



def test_importing_the_registry_loads_no_block_binary_or_torch():
    code = ("import sys, mojolearn.families as f\n"
            "fam = [x.kind for x in f.FAMILIES]\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('mojolearn.mamba')\n"
            "       or m.startswith('mojolearn._native') or m == 'mojolearn._loader']\n"
            "print(bad)\n")
    assert run_python(code, timeout=120).strip() == "[]"


def test_kind_names_and_aliases():
    assert [f.kind for f in FAMILIES] == ["mamba", "mamba2", "mamba3"]
    assert family("mamba1") is family("mamba")
    assert family("mamba1").block_class is mojolearn.Mamba1Block
    for bad in ("Mamba", "mamba0", None, 1):
        with raises_naming(ValueError, "kind", "mamba1"):
            family(bad)


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.kind)
def test_entries_agree_with_the_blocks(fam):
    block = fam.block_class
    shapes = fam.weight_shapes(64)
    assert set(shapes) == set(block._runner.spec.weight_order)
    assert fam.input_norm in shapes
    assert fam.state_class.__name__ == block.__name__.replace("Block", "State")
    assert fam.session_class.__name__ == block.__name__.replace("Block", "DecodeSession")
    assert fam.row_positions == (fam.kind != "mamba")
    # the saved weight names round-trip through the checkpoint name map
    for name in shapes:
        assert fam.block_name(fam.checkpoint_name(name)) == name
    # the initializer draws exactly the block's weights in the block's shapes
    w = mojolearn.init_weights(fam.kind, 64, seed=0)
    assert {k: v.shape for k, v in w.items()} == {
        k: (s[0] if isinstance(s[0], tuple) else s) for k, s in shapes.items()}


def test_aliases_give_the_same_bytes():
    a = mojolearn.init_weights("mamba", 32, seed=4)
    b = mojolearn.init_weights("mamba1", 32, seed=4)
    assert all(bytes(memoryview(a[k])) == bytes(memoryview(b[k])) for k in a)
    c = mojolearn.init_weights("mamba1", 32, seed=5)  # control
    assert any(bytes(memoryview(a[k])) != bytes(memoryview(c[k])) for k in a)


def test_save_accepts_both_spellings(tmp_path):
    from mojolearn.save import save_checkpoint
    ws = [mojolearn.init_weights("mamba", 32, seed=0)]
    emb = mojolearn.Array((8, 32))
    for kind in ("mamba", "mamba1"):
        ck = mojolearn.load_checkpoint(save_checkpoint(tmp_path / kind, kind, ws, emb,
                                                       ws[0]["norm.weight"]))
        assert ck.kind == "mamba" and ck.family is family("mamba1")


def test_torch_modules_come_from_the_registry():
    pytest.importorskip("torch")
    for fam in FAMILIES:
        cls = fam.torch_class
        assert cls._FAMILY is fam and cls._BLOCK is fam.block_class


def test_no_other_kind_to_class_map_in_the_loading_modules():
    """Only families.py maps kinds to classes: the loading modules hold no
    dict keyed by a kind name and import no block module."""
    kind_key = re.compile(r"""[{,]\s*["']mamba[123]?["']\s*:""")
    block_import = re.compile(r"(from|import)\s+[.\w]*mamba\.(mamba[123]|sessions)\b")
    for rel in ("checkpoints.py", "configs.py", "_assemble.py", "_mamba_ssm_config.py",
                "init.py", "save.py", "torch/modules.py"):
        text = (ROOT / "python" / "mojolearn" / rel).read_text()
        assert not kind_key.search(text), rel
        assert not block_import.search(text), rel
    # control: the patterns find the old forms
    assert kind_key.search('{"mamba": x}') and block_import.search("from ..mamba.mamba1 import")


def test_reference_is_reachable_from_the_registry():
    pytest.importorskip("numpy")
    fam = family("mamba2")
    w = fam.reference_weight_maker(32, 0)
    assert set(w) == set(fam.weight_shapes(32))
    assert callable(fam.reference_forward)
    assert families.by_ssm_layer("Mamba3") is family("mamba3")


def test_public_class_names_come_from_the_registry():
    """mojolearn and mojolearn.mamba export each family's block, its
    forward-only block, state and decode session, read from the registry
    (a new family's classes are exported by its entry alone)."""
    names = families.exported_classes()
    assert len(names) == 4 * len(FAMILIES)
    for fam in FAMILIES:
        for cls in (fam.block_class, fam.state_class, fam.session_class):
            assert getattr(mojolearn, cls.__name__) is cls
            assert getattr(mojolearn.mamba, cls.__name__) is cls
        inference = getattr(mojolearn, fam.block_class.__name__ + "Inference")
        assert issubclass(inference, fam.block_class)
    assert set(names) <= set(mojolearn.__all__)
    assert set(names) == set(mojolearn.mamba.__all__)
    with pytest.raises(AttributeError):  # control: a name no family has
        mojolearn.mamba.Mamba0Block


def test_torch_exports_each_family_module_named_by_the_registry(monkeypatch):
    """mojolearn.torch lists every family's module, and one that lives in a
    module of its own (a new family's) resolves through the registry."""
    import dataclasses
    pytest.importorskip("torch")
    import mojolearn.torch as mt
    assert mt.__all__ == [f.torch_module.rpartition(".")[2] for f in FAMILIES]
    elsewhere = dataclasses.replace(family("mamba2"),
                                    torch_module="mojolearn.torch.modules.Mamba2")
    monkeypatch.setitem(mt._BY_NAME, "Mamba2Elsewhere", elsewhere)
    assert mt.Mamba2Elsewhere is mt.Mamba2
    with pytest.raises(AttributeError):  # control: no family names it
        mt.Mamba0
