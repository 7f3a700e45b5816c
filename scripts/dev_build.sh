#!/usr/bin/env bash
# Development build: compiles the host layer and the Mojo CPU binary with
# CMake and places them inside python/mojolearn/ (git-ignored), so that
# `PYTHONPATH=python pytest` runs against the working tree. Users and CI use
# `pip install .` instead (README.md).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
cmake -S "$root" -B "$root/build/dev" -DPython_EXECUTABLE="$py" \
      -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$root/build/dev" -j 2
mkdir -p "$root/python/mojolearn/lib"
cp "$root"/build/dev/_native*.so "$root/python/mojolearn/"
cp "$root/build/dev/libmojolearn_cpu.so" "$root/python/mojolearn/lib/"
