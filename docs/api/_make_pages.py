"""Regenerate the per-object API pages (docs/api/*.rst).

Run from the repository root after adding a public name:
    PYTHONPATH=python python docs/api/_make_pages.py
The pages are committed; the Sphinx build does not run this script.
"""
import inspect
import os

import mojolearn
from mojolearn.families import FAMILIES, exported_classes, kinds

HERE = os.path.dirname(os.path.abspath(__file__))

# every family's block, forward-only block, state and decode session come
# from the family registry
CLASSES = ["Array"] + list(exported_classes()) + ["MambaLM"]
FUNCTIONS = ["load_checkpoint", "read_safetensors", "set_num_threads", "get_num_threads",
             "vendor_used", "numeric_mode_used"]
EXCEPTIONS = ["BinaryNotFoundError"]


def public_members(cls):
    methods, props = [], []
    for klass in cls.__mro__:
        if klass is object or klass.__module__.startswith("mojolearn._native"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in methods or name in props:
                continue
            if isinstance(value, property):
                props.append(name)
            elif callable(value):
                methods.append(name)
    return sorted(methods), sorted(props)


# The examples in the docstrings run under `sphinx -b doctest` (tests/test_docs.py);
# each page gives them the weights of its block (docs/conf.py builds them).
# The class docstring's example makes them in plain sight (init_weights); the
# setup repeats that for the pages' other examples (methods read top to bottom).
# {class name prefix ('Mamba2'): (kind spelling, block class name)}
SETUP = {}
for _f in FAMILIES:
    _prefix = _f.block.rpartition(".")[2][:-len("Block")]
    SETUP[_prefix] = (_prefix.lower() if _prefix.lower() in kinds() else _f.kind,
                      f"{_prefix}Block")


def testsetup(name):
    prefix = next((p for p in SETUP if name.startswith(p)), None)
    if prefix is None:
        return []
    kind, block = SETUP[prefix]
    return [".. testsetup::", "", f"   weights = mojolearn.init_weights({kind!r}, 32, seed=0)",
            f"   block = mojolearn.{block}(weights)",
            "   x = random_input(2, 16, 32, seed=1)", ""]


def class_page(name):
    cls = getattr(mojolearn, name)
    methods, _ = public_members(cls)
    title = f"mojolearn.{name}"
    lines = [title, "=" * len(title), ""] + testsetup(name) + [".. currentmodule:: mojolearn", "",
             f".. autoclass:: {name}", "   :members:", "   :inherited-members:",
             "   :member-order: groupwise", ""]
    if methods:
        lines += ["   .. rubric:: Methods", "", "   .. autosummary::", ""]
        lines += [f"      ~{name}.{m}" for m in methods]
        lines.append("")
    return "\n".join(lines)


def function_page(name, kind="autofunction"):
    title = f"mojolearn.{name}"
    return "\n".join([title, "=" * len(title), "", ".. currentmodule:: mojolearn", "",
                      f".. {kind}:: {name}", ""])


def main():
    for name in CLASSES:
        with open(os.path.join(HERE, f"mojolearn.{name}.rst"), "w") as f:
            f.write(class_page(name))
    for name in FUNCTIONS:
        with open(os.path.join(HERE, f"mojolearn.{name}.rst"), "w") as f:
            f.write(function_page(name))
    for name in EXCEPTIONS:
        with open(os.path.join(HERE, f"mojolearn.{name}.rst"), "w") as f:
            f.write(function_page(name, "autoexception"))


if __name__ == "__main__":
    main()
