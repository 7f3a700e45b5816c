#!/usr/bin/env bash
# Prepares what bench/gpu_check.py needs on a GPU machine that has Python
# 3.12, NumPy and PyTorch but no Mojo (bench/README.md, "GPU check"):
#   python/mojolearn/lib/                CPU binaries + libmojolearn_cuda_<arch>.so
#   python/mojolearn/_native.cpython-312-*.so   host layer for that Python
#   build/gpu_runtime/                   the Mojo runtime libraries + libNVPTX.so
# Everything is git-ignored; carry these three paths (< 64 MiB with one arch).
#   GPU_ARCHS   default "sm_90" (one arch keeps the carry small: 12 MB each)
#   PY312       Python 3.12 to build the host layer for (default: pyenv's)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv_py=${PYTHON:-$root/.venv/bin/python}
archs=${GPU_ARCHS:-sm_90}
py312=${PY312:-$(ls -d "$(pyenv root 2>/dev/null || echo ~/.pyenv)"/versions/3.12*/bin/python 2>/dev/null | tail -1)}
[ -x "$py312" ] || { echo "no Python 3.12 found; set PY312" >&2; exit 1; }

# CPU binaries, the GPU binaries and the host layer for the build Python.
GPU_ARCHS="$archs" PYTHON="$venv_py" bash "$root/scripts/dev_build.sh"

# The host layer for Python 3.12 (nanobind's CMake files from the build venv).
nb_dir=$("$venv_py" -m nanobind --cmake_dir)
cmake -S "$root" -B "$root/build/py312" -DPython_EXECUTABLE="$py312" -Dnanobind_DIR="$nb_dir" \
      -DMOJO="$(dirname "$venv_py")/mojo" -DCMAKE_BUILD_TYPE=Release -DML_CPU_VARIANTS= -DML_GPU_ARCHS= >/dev/null
cmake --build "$root/build/py312" --target _native -j 2
cp "$root"/build/py312/_native.cpython-312-*.so "$root/python/mojolearn/"

# The Mojo runtime a GPU binary needs (its RUNPATH names the build venv).
modlib=$(ls -d "$(dirname "$venv_py")"/../lib/python3*/site-packages/modular/lib | head -1)
rt="$root/build/gpu_runtime"
rm -rf "$rt" && mkdir -p "$rt"
for f in libKGENCompilerRTShared.so libAsyncRTMojoBindings.so libAsyncRTRuntimeGlobals.so \
         libMSupportGlobals.so libNVPTX.so; do
  cp "$modlib/$f" "$rt/"
done
du -shc "$root/python/mojolearn/lib" "$root"/python/mojolearn/_native.cpython-312-*.so "$rt"
cat <<EOF
Carry: python/mojolearn/lib  python/mojolearn/_native.cpython-312-x86_64-linux-gnu.so  build/gpu_runtime
Run there (repository root):
  LD_LIBRARY_PATH=\$PWD/build/gpu_runtime MODULAR_NVPTX_LIBRARY_PATH=\$PWD/build/gpu_runtime/libNVPTX.so \\
    PYTHONPATH=python:. python3.12 bench/gpu_check.py
EOF
