#!/usr/bin/env bash
# The project's two commands (README.md):
#   ./run.sh demo   set up, build, and run the demo (prefill vs decode, bits, speed)
#   ./run.sh test   set up, build, and run the whole test suite
#   ./run.sh gpu-check  set up, build, and compile every GPU target (checks
#                   the compiled code; minutes per target; CI runs it too)
# Needs only Python 3.10+ with pip and venv (and a C++ compiler). Everything
# else comes from PyPI into ./.venv. Set PYTHON to choose the interpreter.
set -euo pipefail
cd "$(dirname "$0")"
what=${1:-}
case "$what" in demo|test|gpu-check) ;; *) echo "usage: ./run.sh demo|test|gpu-check [pytest args]" >&2; exit 2;; esac
shift || true

PY=${PYTHON:-python3}
VENV=${MOJOLEARN_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
# Build tools first (the package is built without isolation so the ~600 MB
# Mojo toolchain is installed once, not per build), then the package itself.
"$VPY" -m pip install -q --disable-pip-version-check \
  "mojo==1.2.0" "scikit-build-core>=0.10" "nanobind>=2.0" "cmake>=3.18"
if [ "$what" = demo ]; then extra=""; else extra="[test]"; fi
echo "run.sh: building and installing mojolearn (the first build compiles the Mojo" \
     "kernels, one binary per CPU target: several minutes; later builds reuse build/)" >&2
"$VPY" -m pip install -q --disable-pip-version-check --no-build-isolation ".$extra"
echo "run.sh: installed; running $what" >&2

if [ "$what" = demo ]; then
  exec "$VPY" examples/demo.py "$@"
fi
# pytest exits 5 when nothing was collected, so an empty selection fails.
if [ "$what" = gpu-check ]; then
  echo "run.sh: compiling the four GPU targets (CUDA sm_80/sm_90, HIP gfx942," \
       "Metal): about a minute each on 2 cores, more where ptxas is installed" >&2
  exec "$VPY" -m pytest --gpu-build "$@"
fi
exec "$VPY" -m pytest "$@"
