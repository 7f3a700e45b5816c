"""Python code run in a child process with the package this process imported
on the path (for tests that block an import, or that must survive a crash)."""
import subprocess
import sys
from pathlib import Path

import mojolearn

ROOT = Path(__file__).resolve().parents[1]
# the folder holding the package this process runs (the installed one, or the
# working tree's python/ in a development build): the child imports the same
PACKAGE_PARENT = Path(mojolearn.__file__).resolve().parents[1]


def run_python(code: str, *args, timeout: float = 300, cwd=None) -> str:
    """stdout of `python -c code args...`; AssertionError with its stderr
    when the child fails (a crash included)."""
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                         text=True, timeout=timeout, cwd=cwd or ROOT,
                         env={"PYTHONPATH": str(PACKAGE_PARENT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, f"the child failed ({out.returncode}): {out.stderr[-3000:]}"
    return out.stdout
