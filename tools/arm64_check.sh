#!/usr/bin/env bash
# arm64 check (README.md, "arm64"), run by CI after the test suite:
#  1. cross-compiles the Mojo kernels for aarch64 (mojo build --emit object
#     --target-triple aarch64-unknown-linux-gnu; `--emit shared-lib` cannot
#     link for another triple) and links them with Debian's aarch64 cross
#     toolchain into build/arm64/libmojolearn_cpu.so;
#  2. compiles the host layer (python/native/native.cpp) for aarch64, to an
#     object: no x86-only code may be left unguarded;
#  3. builds the ABI replay driver (tools/abi_replay/replay.c) natively and
#     for aarch64, records every op of the fixed case matrix on the x86-64
#     binary through the installed mojolearn, and replays the records with
#     the x86-64 driver and, under qemu-user, the aarch64 one: every result
#     byte must equal x86's (tools/arm64_check.py).
# Needs: an x86-64 Linux machine, the mojolearn package built from this tree
# (./run.sh test installs it into .venv) with NumPy, gcc-aarch64-linux-gnu,
# g++-aarch64-linux-gnu and qemu-user (Debian/Ubuntu packages). Missing tools are installed with apt-get when this
# runs as root (or with passwordless sudo); otherwise the check prints
# "arm64 check SKIPPED: ..." and exits 0, or 3 with ARM64_CHECK_REQUIRED=1.
# Arguments are passed on to tools/arm64_check.py (e.g. --only CASE,
# --control-seed N: the negative control's flips, whose seed each run prints).
# Exit status: 0 passed (or skipped), 1 failed.
#   PYTHON          interpreter with mojolearn and mojo (default .venv/bin/python,
#                   else python3 on PATH, e.g. a pixi environment's)
#   ARM64_CPU       --target-cpu of the aarch64 binary (default generic: the
#                   target a native arm64 build uses, CMakeLists.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
PY=${PYTHON:-$root/.venv/bin/python}
if [ -z "${PYTHON:-}" ] && [ ! -x "$PY" ]; then PY=$(command -v python3 || echo "$PY"); fi
cpu=${ARM64_CPU:-generic}
out=$root/build/arm64
sysroot=/usr/aarch64-linux-gnu

skip() {
  echo "arm64 check SKIPPED: $*" >&2
  if [ "${ARM64_CHECK_REQUIRED:-0}" = 1 ]; then exit 3; fi
  exit 0
}
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# The records come from the x86-64 binary; on arm64 the test suite itself
# checks the native binary (tests/test_cpu_variants.py, tests/digests.json).
[ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] ||
  skip "runs on x86-64 Linux only (it compares aarch64 with x86-64); this is $(uname -s)-$(uname -m)"
[ -x "$PY" ] || skip "no Python at $PY (run ./run.sh test first, or set PYTHON)"
"$PY" -c "import mojolearn, numpy" 2>/dev/null ||
  skip "$PY cannot import mojolearn and numpy (run ./run.sh test first, or set PYTHON)"
MOJO=$(dirname "$PY")/mojo
[ -x "$MOJO" ] || MOJO=$(command -v mojo || true)
[ -n "$MOJO" ] && [ -x "$MOJO" ] || skip "no mojo next to $PY or on PATH (pip install mojo==1.2.0)"

# ---- tools -------------------------------------------------------------
have_tools() {
  command -v aarch64-linux-gnu-gcc >/dev/null && command -v aarch64-linux-gnu-g++ >/dev/null &&
    command -v qemu-aarch64 >/dev/null && [ -e "$sysroot/lib/ld-linux-aarch64.so.1" ]
}
packages="gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user"
if ! have_tools; then
  if ! command -v apt-get >/dev/null; then
    skip "needs aarch64-linux-gnu-gcc/g++ and qemu-aarch64 (Debian/Ubuntu: $packages); no apt-get here"
  fi
  if [ "$(id -u)" = 0 ]; then sudo=""
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo="sudo -n"
  else skip "needs $packages; not root and no passwordless sudo to apt-get install them"
  fi
  echo "arm64 check: installing $packages with apt-get" >&2
  t=$(now)
  log=$(mktemp)
  if ! { $sudo apt-get install -y -qq $packages >"$log" 2>&1 ||
         { $sudo apt-get update -qq >>"$log" 2>&1 &&
           $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $packages >>"$log" 2>&1; }; }; then
    tail -5 "$log" >&2
    rm -f "$log"
    skip "apt-get could not install $packages"
  fi
  rm -f "$log"
  have_tools || skip "$packages installed, but the tools are still missing"
  echo "arm64 check: tools installed in $(since "$t") s" >&2
fi
mkdir -p "$out"

# ---- 1. kernels for aarch64 ----------------------------------------------
lib=$out/libmojolearn_cpu.so
stamp=$out/target-cpu
if [ -f "$lib" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$cpu" ] &&
   [ -z "$(find mojo -name '*.mojo' -newer "$lib" | head -1)" ]; then
  echo "arm64 check: kernels for aarch64 ($cpu) up to date: $lib"
else
  t=$(now)
  rm -f "$out/mojolearn_cpu_aarch64.o"
  echo "arm64 check: compiling the kernels for aarch64 ($cpu)"
  # (the same flags as CMakeLists.txt's ml_cpu_binary, another triple)
  if ! "$MOJO" build --emit object --fp-mode contract=off \
      --target-triple aarch64-unknown-linux-gnu --target-cpu "$cpu" \
      -D "ML_ARCH=$cpu" -D ML_FEATURES=baseline -I mojo \
      -o "$out/mojolearn_cpu_aarch64.o" mojo/entry_cpu.mojo; then
    echo "arm64 check FAILED: the aarch64 compile of the kernels" >&2
    exit 1
  fi
  aarch64-linux-gnu-gcc -shared -o "$lib.tmp" "$out/mojolearn_cpu_aarch64.o"
  mv -f "$lib.tmp" "$lib"
  echo "$cpu" >"$stamp"
  echo "arm64 check: kernels compiled for aarch64 ($cpu) and linked in $(since "$t") s: $lib"
fi

# ---- 2. the host layer compiles for aarch64 -------------------------------
t=$(now)
nb=$("$PY" -c "import nanobind, os; print(os.path.dirname(nanobind.__file__))")
pyinc=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
aarch64-linux-gnu-g++ -std=c++20 -O2 -fPIC -Wall -Wextra -I"$nb/include" \
  -I"$nb/ext/robin_map/include" -I"$pyinc" -c python/native/native.cpp -o "$out/native_aarch64.o"
echo "arm64 check: the host layer compiles for aarch64 ($(since "$t") s)"

# ---- 3. record on x86-64, replay on both ------------------------------------
cc=${CC:-cc}
"$cc" -O2 -std=c99 -Wall -Wextra -o "$out/replay-x86_64" tools/abi_replay/replay.c -ldl
aarch64-linux-gnu-gcc -O2 -std=c99 -Wall -Wextra -o "$out/replay-aarch64" \
  tools/abi_replay/replay.c -ldl
x86lib=$(MOJOLEARN_VENDOR=cpu MOJOLEARN_CPU_TARGET=baseline "$PY" -c \
  "from mojolearn import _loader; print(_loader.library().path)")
t=$(now)
status=0
"$PY" tools/arm64_check.py \
  --runner "x86-64=$out/replay-x86_64 $x86lib" \
  --runner "aarch64=qemu-aarch64 -L $sysroot $out/replay-aarch64 $lib" "$@" || status=$?
echo "arm64 check: record and replay took $(since "$t") s"
exit $status
