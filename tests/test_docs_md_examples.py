"""Every ```python example in docs/*.md runs (the .rst pages are run by
Sphinx's doctest builder in test_docs.py), and README.md's as written:
with nothing predefined."""
import re
from pathlib import Path

import numpy as np
import pytest

import mojolearn
from mojolearn.reference.weights import mamba1_weights, random_input

DOCS = Path(__file__).resolve().parent.parent / "docs"
README = DOCS.parent / "README.md"
BLOCKS = [(p.name, i, code) for p in sorted(DOCS.glob("*.md")) + [README]
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", p.read_text(), re.S))]


def test_there_are_examples():
    assert BLOCKS, "no python examples found in docs/*.md"


@pytest.mark.parametrize("name,index,code", BLOCKS, ids=[f"{n}-{i}" for n, i, _ in BLOCKS])
def test_markdown_example_runs(name, index, code, tmp_path):
    from tests.test_checkpoints import make_model
    folder = tmp_path / "model"
    if "path/to/folder" in code:
        make_model("mamba", folder, seed=3, layers=2)
        code = code.replace("path/to/folder", str(folder))
    env = {"mojolearn": mojolearn, "np": np, "weights": mamba1_weights(32, 0),
           "x": random_input(2, 5, 32, 1)}
    if name == "README.md":
        env = {}  # copied as written
    exec(compile(code, f"{name} example {index}", "exec"), env)
