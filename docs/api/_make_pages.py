"""Regenerate the per-object API pages (docs/api/*.rst).

Run from the repository root after adding a public name:
    PYTHONPATH=python python docs/api/_make_pages.py
The pages are committed; the Sphinx build does not run this script.
"""
import inspect
import os

import mojolearn

HERE = os.path.dirname(os.path.abspath(__file__))

CLASSES = ["Array",
           "Mamba1Block", "Mamba1BlockInference", "Mamba1State", "Mamba1DecodeSession",
           "Mamba2Block", "Mamba2BlockInference", "Mamba2State", "Mamba2DecodeSession",
           "Mamba3Block", "Mamba3BlockInference", "Mamba3State", "Mamba3DecodeSession",
           "MambaLM"]
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
SETUP = {"Mamba1": ("mamba1", "Mamba1Block"), "Mamba2": ("mamba2", "Mamba2Block"),
         "Mamba3": ("mamba3", "Mamba3Block")}


def testsetup(name):
    if name[:6] not in SETUP:
        return []
    kind, block = SETUP[name[:6]]
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
