"""Guards of tests/reference/hf_build.py: every transformers module the tests
build is seeded, initialised and finite, so no test reads uninitialised memory.

- No test file constructs a transformers Mamba module or calls from_pretrained
  other than through hf_build (a source scan, with a negative control).
- An uninitialised MambaBlock (its mixer's A_log and D come from torch.empty)
  is refused by name, on every run: the construction fills torch.empty with NaN.
- Every kind of module the tests build comes out finite and reproducible
  (the same bytes from the same seed; another seed differs).
"""
import ast
import inspect
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.models.mamba import modeling_mamba as hf_m1  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2 as hf_m2  # noqa: E402

from tests.reference import hf_build, hf_mamba  # noqa: E402

TESTS = Path(__file__).resolve().parent
HELPER = TESTS / "reference" / "hf_build.py"


def _module_classes() -> set:
    """Names of the nn.Module classes of transformers' Mamba and Mamba-2 code."""
    names = set()
    for mod in (hf_m1, hf_m2):
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, torch.nn.Module) and \
                    obj.__module__ == mod.__name__:
                names.add(name)
    return names


def _mojolearn_names(tree) -> set:
    """Names a file binds to mojolearn (its Mamba2Block shares a name with
    transformers')."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names
                         if a.name.split(".")[0] == "mojolearn")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == \
                "mojolearn":
            names.update(a.asname or a.name for a in node.names)
    return names


def _root(f):
    while isinstance(f, ast.Attribute):
        f = f.value
    return f.id if isinstance(f, ast.Name) else None


def direct_constructions(source: str, classes: set) -> list:
    """(line, text) of each call that builds a transformers module without
    hf_build: a call of one of `classes` (by name or attribute, unless
    reached through mojolearn) or any ``.from_pretrained(...)`` but a
    tokenizer's (``AutoTokenizer.from_pretrained``: no module, no weights)."""
    tree = ast.parse(source)
    ours = _mojolearn_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) \
            else None
        tokenizer = (name == "from_pretrained" and isinstance(f.value, ast.Name)
                     and f.value.id.endswith(("Tokenizer", "TokenizerFast")))
        if (name in classes and _root(f) not in ours) or (name == "from_pretrained"
                                                          and not tokenizer):
            found.append((node.lineno, ast.get_source_segment(source, node)))
    return sorted(found)


def test_no_test_builds_a_transformers_module_another_way():
    classes = _module_classes()
    assert {"MambaBlock", "MambaMixer", "Mamba2Block", "Mamba2Mixer", "MambaForCausalLM",
            "Mamba2ForCausalLM"} <= classes
    offenders = []
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 40
    for path in files:
        if path == HELPER:
            continue
        for line, text in direct_constructions(path.read_text(), classes):
            offenders.append(f"{path.relative_to(TESTS)}:{line}: {text}")
    assert not offenders, ("build transformers modules with tests/reference/hf_build.py "
                           "(build / load):\n" + "\n".join(offenders))
    # negative control: the scan sees each way of building one directly
    snippet = ("import transformers\nimport mojolearn\n"
               "a = hf._hf_m1.MambaBlock(cfg, layer_idx=0)\n"
               "b = transformers.Mamba2ForCausalLM(cfg)\n"
               "c = MambaMixer(cfg, 0)\n"
               "d = cls.from_pretrained(folder)\n"
               "e = build(hf._hf_m1.MambaBlock, cfg, layer_idx=0, seed=1)\n"
               "f = mojolearn.Mamba2Block(w)\n"
               "g = AutoTokenizer.from_pretrained(folder)\n"
               "h = AutoModel.from_pretrained(folder)\n")
    assert [line for line, _ in direct_constructions(snippet, classes)] == [3, 4, 5, 6, 10]


def test_an_uninitialised_block_is_refused_by_name():
    """The flaky case: MambaBlock builds its mixer without initialising
    A_log and D. Built without the mixer's own initialisation, the guard
    names the tensor, on every run (torch.empty gave NaN); built normally
    it passes with transformers' values (A_log = log(1..16), D = 1)."""
    cfg = hf_mamba._mamba1_config(32, False)
    with pytest.raises(hf_build.NonFiniteTensorError, match=r"mixer\.A_log holds 1024 non-fin"):
        hf_build.build(hf_m1.MambaBlock, cfg, layer_idx=0, seed=1, _own_init=False)
    block = hf_build.build(hf_m1.MambaBlock, cfg, layer_idx=0, seed=1)
    want = torch.log(torch.arange(1, 17, dtype=torch.float32)).expand(64, 16)
    assert torch.equal(block.mixer.A_log.detach(), want)
    assert torch.equal(block.mixer.D.detach(), torch.ones(64))


def test_a_non_finite_value_anywhere_is_named():
    block = hf_build.build(hf_m2.Mamba2Block, hf_mamba._mamba2_config(64, (0.0, math.inf), False),
                           layer_idx=0, seed=2)
    hf_build.check_finite(block)
    for name, value in (("mixer.dt_bias", float("nan")), ("norm.weight", float("inf"))):
        with torch.no_grad():
            t = dict(block.named_parameters())[name]
            saved = t.clone()
            t.view(-1)[1] = value
        with pytest.raises(hf_build.NonFiniteTensorError, match=rf"{name} holds 1 non-finite.*"
                                                               r"flat index 1"):
            hf_build.check_finite(block)
        with torch.no_grad():
            t.copy_(saved)
    hf_build.check_finite(block)


def _kinds():
    import transformers
    m1 = hf_mamba._mamba1_config(32, False)
    m2 = hf_mamba._mamba2_config(64, (0.0, math.inf), False)
    small1 = transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2)
    small2 = transformers.Mamba2Config(vocab_size=64, hidden_size=64, num_hidden_layers=2,
                                       head_dim=64, num_heads=2, n_groups=1, state_size=128,
                                       chunk_size=256)
    return {
        "MambaBlock": (hf_m1.MambaBlock, (m1,), {"layer_idx": 0}),
        "MambaMixer": (hf_m1.MambaMixer, (m1,), {"layer_idx": 0}),
        "Mamba2Block": (hf_m2.Mamba2Block, (m2,), {"layer_idx": 0}),
        "Mamba2Mixer": (hf_m2.Mamba2Mixer, (m2,), {"layer_idx": 0}),
        "MambaForCausalLM": (transformers.MambaForCausalLM, (small1,), {}),
        "Mamba2ForCausalLM": (transformers.Mamba2ForCausalLM, (small2,), {}),
    }


def _bytes(module) -> bytes:
    return b"".join(t.detach().numpy().tobytes() for _, t in
                    sorted(list(module.state_dict().items())))


@pytest.mark.parametrize("kind", list(_kinds()))
def test_every_kind_of_module_the_tests_build_is_finite_and_reproducible(kind):
    cls, args, kw = _kinds()[kind]
    a = hf_build.build(cls, *args, seed=5, **kw)
    b = hf_build.build(cls, *args, seed=5, **kw)
    assert _bytes(a) == _bytes(b)
    assert _bytes(hf_build.build(cls, *args, seed=6, **kw)) != _bytes(a)  # control
