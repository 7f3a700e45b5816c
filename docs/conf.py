"""Sphinx configuration for the mojolearn documentation.

Build (warnings are errors)::

    python -m sphinx -W -b html docs docs/_build/html
    python -m sphinx -W -b doctest docs docs/_build/doctest   # runs every example

mojolearn is imported as installed (or from PYTHONPATH); when it is not
importable, from the working tree's python/ (the dev build of
scripts/dev_build.sh). The examples' weights come from mojolearn.reference.weights.
"""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_root = os.path.dirname(_here)
# The installed package (./run.sh test, pixi), or the working tree's dev build
# (scripts/dev_build.sh; PYTHONPATH=python) when nothing is installed.
try:
    import mojolearn
except ImportError:
    sys.path.insert(0, os.path.join(_root, "python"))
    import mojolearn

project = "mojolearn"
author = "the mojolearn authors"
copyright = "2026, the mojolearn authors"
release = version = mojolearn.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path = []
html_theme = "alabaster"
html_static_path = []
html_title = f"mojolearn {release}"

# One docstring style: numpydoc, rendered by napoleon (no extra package).
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_ivar = True          # "Attributes" render as "Variables"
napoleon_use_rtype = False
napoleon_use_param = True
napoleon_preprocess_types = False

autodoc_member_order = "bysource"
autodoc_typehints = "none"        # shapes and dtypes live in the numpydoc sections
autodoc_default_options = {"members": True}
autosummary_generate = False
add_module_names = True

# docs/*.md are the design notes and the numerics contract, written by
# whoever owns each part; they link to source files outside docs/ and use
# free heading levels, which MyST would report.
myst_heading_anchors = 3
# Shape words in numpydoc types ("shape (B, d_inner, 4)") are read by
# Sphinx as cross-references; d_model and d_inner are also the blocks'
# documented properties, found on every block class, so such a word has
# several targets ("ref.python": ambiguity only; it links the first).
suppress_warnings = ["myst.header", "myst.xref_missing", "ref.python"]

# Every example in the docs runs under `-b doctest` (tests/test_docs.py).
# The setup imports NumPy and mojolearn, and writes a tiny checkpoint folder
# (lm_folder) for the language-model pages.
doctest_global_setup = """
import numpy as np
import mojolearn
from mojolearn.reference.weights import mamba1_weights, mamba2_weights, mamba3_weights, random_input
# No weights are predefined: every page's examples make theirs in plain
# sight (mojolearn.init_weights), so each can be copied and run as written.
import tempfile
from mojolearn.save import save_checkpoint
lm_folder = save_checkpoint(               # a tiny 2-layer Mamba language model, vocab 64
    tempfile.mkdtemp(prefix="mojolearn_doc_lm_"), "mamba",
    [mamba1_weights(32, seed=1, scale=4.0), mamba1_weights(32, seed=2, scale=4.0)],
    np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32),
    np.ones(32, np.float32))
"""
doctest_test_doctest_blocks = "default"


# -- the benchmark plots ------------------------------------------------------
# bench/plots.py (run offline, needs matplotlib) writes PNGs and manifest.json
# into docs/bench/. The ``bench-plots`` directive shows whatever is there, or
# says that there are no results yet, so the build never depends on them.
from docutils import nodes  # noqa: E402
from docutils.statemachine import StringList  # noqa: E402
from sphinx.util.docutils import SphinxDirective  # noqa: E402
import json  # noqa: E402


class BenchPlots(SphinxDirective):
    has_content = False

    def run(self):
        folder = os.path.join(_here, "bench")
        manifest = {}
        try:
            with open(os.path.join(folder, "manifest.json")) as f:
                manifest = json.load(f)
        except (OSError, ValueError):
            pass
        plots = [p for p in manifest.get("plots", [])
                 if os.path.isfile(os.path.join(folder, p.get("file", "")))]
        self.env.note_dependency(os.path.join(folder, "manifest.json"))
        if not plots:
            lines = ["No benchmark results yet: run a benchmark with ``--out`` into",
                     "``bench/out/`` and then ``python bench/plots.py`` (see above)."]
        else:
            def lit(text):
                text = " ".join(str(text or "?").split()).replace("`", "'")
                return f"``{text}``"
            lines = [f"Plots made {manifest.get('made', '?')} by {lit(manifest.get('command'))}",
                     "from these runs:", ""]
            for s in manifest.get("sources", []):
                lines.append(f"- {lit(s.get('file'))} ({s.get('date', '?')}): {lit(s.get('command'))}")
            lines.append("")
            for p in plots:
                lines += [f".. figure:: /bench/{p['file']}", "   :width: 100%", "",
                          f"   {p['title']}", ""]
        node = nodes.container()
        self.state.nested_parse(StringList(lines, source="bench-plots"), self.content_offset, node)
        return node.children


def setup(app):
    app.add_directive("bench-plots", BenchPlots)
    return {"parallel_read_safe": True}
