#!/usr/bin/env bash
# Development build: compiles the host layer and the Mojo CPU binary with
# CMake and places them inside python/mojolearn/ (git-ignored), so that
# `PYTHONPATH=python pytest` runs against the working tree. Users and CI use
# `pip install .` instead (README.md).
#   BUILD_DIR  build folder (default build/dev)
#   LIB_DIR    where the kernel binary goes (default python/mojolearn/lib);
#              point MOJOLEARN_LIB_DIR at it when it is not the default
#   ENTRY      Mojo entry file (default mojo/entry_cpu.mojo)
#   GPU_ARCHS  GPU binaries to build too, e.g. "sm_90;gfx942" (default none;
#              docs/gpu.md)
#   CPU_VARIANTS  extra CPU targets to build (default: CMake's, x86-64-v4 on
#              x86-64, also after an earlier run that set it; empty for the
#              baseline only). Variants not built are
#              removed from LIB_DIR so the loader cannot pick a stale one.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
build=${BUILD_DIR:-$root/build/dev}
libdir=${LIB_DIR:-$root/python/mojolearn/lib}
entry=${ENTRY:-$root/mojo/entry_cpu.mojo}
# unset: forget a list an earlier run left in the CMake cache (CMake's default)
if [ "${CPU_VARIANTS+set}" ]; then variants=(-DML_CPU_VARIANTS="$CPU_VARIANTS")
else variants=(-UML_CPU_VARIANTS); fi
cmake -S "$root" -B "$build" -DPython_EXECUTABLE="$py" -DCMAKE_BUILD_TYPE=Release \
      -DML_ENTRY="$entry" "${variants[@]}" \
      -DML_GPU_ARCHS="${GPU_ARCHS:-}" >/dev/null
cmake --build "$build" -j 2
mkdir -p "$libdir"
# Replace atomically (copy, then rename): overwriting a loaded .so in place
# crashes every process that has it mapped.
place() { cp "$1" "$2.tmp.$$" && mv -f "$2.tmp.$$" "$2"; }
for f in "$build"/_native*.so; do place "$f" "$root/python/mojolearn/$(basename "$f")"; done
rm -f "$libdir"/libmojolearn_cpu_*.so
for f in "$build"/libmojolearn_cpu*.so; do
  variant=${f#"$build"/libmojolearn_cpu}; variant=${variant%.so}; variant=${variant#_}
  # a variant left in the build folder from an earlier configuration is stale
  if [ -n "$variant" ] && ! grep -q "ML_CPU_VARIANTS:STRING=.*$variant" "$build/CMakeCache.txt"; then continue; fi
  place "$f" "$libdir/$(basename "$f")"
done
# GPU binaries: exactly the ones this configuration builds.
rm -f "$libdir"/libmojolearn_cuda_*.so "$libdir"/libmojolearn_hip_*.so "$libdir"/libmojolearn_metal_*.so
gpu_tags=" $(grep '^ML_GPU_ARCHS:STRING=' "$build/CMakeCache.txt" | cut -d= -f2- | tr -d '_-' | tr ';' ' ') "
for f in "$build"/libmojolearn_cuda_*.so "$build"/libmojolearn_hip_*.so "$build"/libmojolearn_metal_*.so; do
  [ -f "$f" ] || continue
  tag=${f##*_}; tag=${tag%.so}
  case "$gpu_tags" in *" $tag "*) place "$f" "$libdir/$(basename "$f")";; esac
done
