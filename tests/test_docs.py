"""The documentation builds with warnings as errors, and every example in it runs.

Runs Sphinx in a subprocess (the same command as ``pixi run docs``) into a
temporary folder: ``-b html`` for the site, ``-b doctest`` for the examples
(every ``>>>`` block in docs/ and in the docstrings autodoc pulls in).
Sphinx and MyST-Parser come with the ``test`` extra.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _sphinx(builder: str, tmp_path: Path) -> subprocess.CompletedProcess:
    out = tmp_path / builder
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-E",
           "-b", builder, "-d", str(tmp_path / "doctrees"), str(DOCS), str(out)]
    env = dict(os.environ)
    env.setdefault("MOJOLEARN_NUM_THREADS", "2")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("builder", ["html", "doctest"])
def test_docs_build_without_warnings(builder, tmp_path):
    pytest.importorskip("numpy")  # the examples build their weights with NumPy
    r = _sphinx(builder, tmp_path)
    report = ""
    if builder == "doctest" and (tmp_path / builder / "output.txt").is_file():
        report = (tmp_path / builder / "output.txt").read_text()
    assert r.returncode == 0, (
        f"sphinx -b {builder} failed (rc {r.returncode}):\n"
        f"{r.stdout[-6000:]}\n{r.stderr[-6000:]}\n{report[-6000:]}")
    assert "WARNING" not in r.stderr and "ERROR" not in r.stderr, r.stderr[-6000:]
    if builder == "html":
        for page in ["index.html", "api/mojolearn.Mamba1Block.html",
                     "guide/blocks.html", "numerics.html"]:
            assert (tmp_path / builder / page).is_file(), page
    else:
        ran = re.search(r"^\s*(\d+) tests$", report, re.M)
        assert ran and int(ran.group(1)) >= 50, report[-3000:]  # the examples did run
        assert " 0 failures in tests" in report, report[-3000:]
