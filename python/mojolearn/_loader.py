"""Finding and loading the compiled binaries.

Nothing here runs at `import mojolearn`: the host layer (`_native`) and a
kernel binary are loaded on first use. Binaries live in `mojolearn/lib/`
(or in the folder named by MOJOLEARN_LIB_DIR) as `libmojolearn_<vendor>.so`;
each says what it is (vendor, numeric mode, ABI version), and that is what
the loader believes, not the file name.

Choice of binary: MOJOLEARN_VENDOR (cpu, cuda, hip, metal) if set, else the
first installed GPU binary with a usable device (_gpu.py), else the host CPU
binary. For the CPU there is a portable baseline `libmojolearn_cpu.so` and
optional faster variants `libmojolearn_cpu_<target>.so` (e.g. x86-64-v4)
built from the same formula code, so with the same bits; the best one whose
CPU features this machine has is used, or the one MOJOLEARN_CPU_TARGET names
('baseline' for the portable one).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

from . import _abi


class BinaryNotFoundError(ImportError):
    """No usable compiled binary: the install is incomplete."""


_lock = threading.Lock()
_libraries: dict = {}
_native_module = None


def native():
    """The host layer extension module, imported on first use."""
    global _native_module
    if _native_module is None:
        try:
            from . import _native as mod
        except ImportError as e:
            raise BinaryNotFoundError(
                "mojolearn's host layer (mojolearn._native) is not installed or "
                f"cannot be loaded ({e}); reinstall with `pip install .` from a "
                "source checkout (see README.md)") from e
        _native_module = mod
    return _native_module


def lib_dirs() -> list[Path]:
    dirs = []
    env = os.environ.get("MOJOLEARN_LIB_DIR")
    if env:
        dirs.append(Path(env))
    dirs.append(Path(__file__).resolve().parent / "lib")
    return dirs


def find_binaries() -> list[Path]:
    """Every kernel binary file found, in search order."""
    found = []
    for d in lib_dirs():
        if d.is_dir():
            found.extend(sorted(d.glob("libmojolearn_*.so")))
    return found


def requested_vendor() -> str:
    v = os.environ.get("MOJOLEARN_VENDOR", "").strip().lower()
    if v and v not in _abi.VENDORS.values():
        raise ValueError(f"MOJOLEARN_VENDOR={v!r} is not one of "
                         f"{sorted(_abi.VENDORS.values())}")
    return v or "cpu"


# CPU target of a variant binary -> the /proc/cpuinfo flags it needs. The
# check happens before loading: running any code of a binary built for a
# newer ISA on an older CPU could fault.
CPU_VARIANT_FLAGS = {
    "x86-64-v4": ("avx2", "fma", "bmi2", "f16c", "avx512f", "avx512bw",
                  "avx512cd", "avx512dq", "avx512vl"),
}


def requested_cpu_target() -> str | None:
    """MOJOLEARN_CPU_TARGET: 'baseline' or a key of CPU_VARIANT_FLAGS."""
    t = os.environ.get("MOJOLEARN_CPU_TARGET", "").strip().lower()
    if not t:
        return None
    if t != "baseline" and t not in CPU_VARIANT_FLAGS:
        raise ValueError(f"MOJOLEARN_CPU_TARGET={t!r} is not one of "
                         f"{['baseline', *sorted(CPU_VARIANT_FLAGS)]}")
    return t


def _cpu_names() -> list[tuple[str, str]]:
    """(target, file name) of the CPU binaries to try, best first."""
    flags = cpu_flags()
    want = requested_cpu_target()
    names = []
    for target, need in CPU_VARIANT_FLAGS.items():
        if want in (None, target) and flags is not None and set(need) <= flags:
            names.append((target, f"libmojolearn_cpu_{target}.so"))
    if want in (None, "baseline"):
        names.append(("baseline", "libmojolearn_cpu.so"))
    if want not in (None, "baseline") and not names:
        raise BinaryNotFoundError(
            f"mojolearn: MOJOLEARN_CPU_TARGET={want} needs CPU features "
            f"{variant_missing_features(want)} that this machine lacks")
    return names


def variant_missing_features(target: str) -> list[str]:
    """The CPU features of variant `target` this machine lacks (all of them
    when the features cannot be read)."""
    flags = cpu_flags()
    need = CPU_VARIANT_FLAGS[target]
    return list(need) if flags is None else [f for f in need if f not in flags]


def skipped_variants() -> list[tuple[str, str]]:
    """(file name, reason) of each installed CPU variant binary that the
    loader does not choose by default on this machine."""
    try:
        want = requested_cpu_target()
    except ValueError:
        want = None
    readable = cpu_flags() is not None
    out = []
    for target in CPU_VARIANT_FLAGS:
        name = f"libmojolearn_cpu_{target}.so"
        if not any((d / name).is_file() for d in lib_dirs()):
            continue
        missing = variant_missing_features(target)
        if want is not None and want != target:
            out.append((name, f"MOJOLEARN_CPU_TARGET={want}"))
        elif not readable:
            out.append((name, "the CPU's features cannot be read (/proc/cpuinfo)"))
        elif missing:
            out.append((name, f"this CPU lacks {missing}"))
    return out


def library_path(vendor: str | None = None) -> Path:
    """Path of the binary that would be used for `vendor` (default: chosen)."""
    vendor = vendor or requested_vendor()
    names = [n for _, n in _cpu_names()] if vendor == "cpu" else [f"libmojolearn_{vendor}.so"]
    for d in lib_dirs():  # a folder earlier in the search order wins
        for name in names:
            p = d / name
            if p.is_file():
                return p
    raise BinaryNotFoundError(
        f"mojolearn: no compiled kernel binary {' or '.join(names)} found (looked in "
        f"{', '.join(str(d) for d in lib_dirs())}); the package was installed "
        "without its binaries. Reinstall with `pip install .` from a source "
        "checkout with the Mojo compiler available (see README.md).")


def library(numeric_mode: str = "identical"):
    """The loaded kernel binary (a `_native.Library`) for numeric_mode:
    a usable GPU binary if one is installed (or the one MOJOLEARN_VENDOR
    names), else the CPU binary."""
    requested_vendor()  # refuses an unknown MOJOLEARN_VENDOR
    key = (os.environ.get("MOJOLEARN_VENDOR", "").strip().lower(), numeric_mode)
    lib = _libraries.get(key)
    if lib is not None:
        return lib
    with _lock:
        lib = _libraries.get(key)
        if lib is None:
            lib = _load_gpu(key[0], numeric_mode)
            if lib is None:
                lib = _load(library_path("cpu"), "cpu", numeric_mode)
            _libraries[key] = lib
    return lib


def _load_gpu(asked: str, numeric_mode: str):
    """The first usable GPU binary (of the vendor `asked` names, if a GPU
    one), or None to use the CPU. A GPU vendor asked for but unusable raises."""
    from . import _gpu
    if asked == "cpu":
        return None
    vendor = asked or None
    why = []
    for path in _gpu.candidates(lib_dirs(), vendor):
        try:
            lib = _load(path, path.name.split("_")[1], numeric_mode)
            reason = _gpu.probe(lib, describe)[1]
        except BinaryNotFoundError as e:
            reason = str(e)
        if not reason:
            return lib
        why.append(f"{path.name}: {reason}")
    if vendor is None:
        return None
    raise BinaryNotFoundError(
        f"mojolearn: MOJOLEARN_VENDOR={vendor} but no usable {vendor} binary: "
        + ("; ".join(why) if why else
           f"none installed (libmojolearn_{vendor}_<arch>.so in "
           f"{', '.join(str(d) for d in lib_dirs())}); build one with "
           "MOJOLEARN_GPU_ARCHS (docs/gpu.md)"))


def vendor_used(numeric_mode: str = "identical") -> str:
    """The vendor of the binary that runs the blocks, read from the binary.

    Loads the binary if needed: a usable GPU binary if one is installed (or
    the one ``MOJOLEARN_VENDOR`` names), else the CPU binary.

    Returns
    -------
    str
        ``'cpu'``, ``'cuda'``, ``'hip'`` or ``'metal'``.

    Examples
    --------
    >>> mojolearn.vendor_used() in ('cpu', 'cuda', 'hip', 'metal')
    True
    """
    return _abi.VENDORS[library(numeric_mode).vendor]


def numeric_mode_used(numeric_mode: str = "identical") -> str:
    """The numeric mode of the binary that runs the blocks, read from it.

    Returns
    -------
    str
        ``'identical'`` (``'fast'`` once a fast binary exists).
    """
    return _abi.NUMERIC_MODES[library(numeric_mode).numeric_mode]


def cpu_flags() -> set | None:
    """The host CPU's feature flags (Linux /proc/cpuinfo), or None if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


# binary feature name -> /proc/cpuinfo flag
_FLAG_NAMES = {f: f for f in ("avx2", "fma", "bmi2", "f16c", "avx512f", "avx512bw",
                               "avx512cd", "avx512dq", "avx512vl")}


def missing_cpu_features(lib) -> list[str]:
    """Features the binary needs that this CPU lacks (empty if unknown)."""
    flags = cpu_flags()
    if flags is None:
        return []
    need = describe(lib).get("features", "")
    return [f for f in need.split(",") if f in _FLAG_NAMES and _FLAG_NAMES[f] not in flags]


def _load(path: Path, vendor: str, numeric_mode: str):
    try:
        lib = native().Library(str(path))
    except RuntimeError as e:
        raise BinaryNotFoundError(f"mojolearn: cannot use {path}: {e}") from e
    missing = missing_cpu_features(lib)
    if missing:
        raise BinaryNotFoundError(
            f"mojolearn: {path} needs CPU features {missing} that this machine "
            "lacks; rebuild with -DML_CPU_TARGET=<an older target>")
    if lib.abi_version != _abi.ABI_VERSION:
        raise BinaryNotFoundError(
            f"mojolearn: {path} has ABI version {lib.abi_version}, this Python "
            f"package needs {_abi.ABI_VERSION}; rebuild the package")
    got_vendor = _abi.VENDORS.get(lib.vendor, f"unknown({lib.vendor})")
    if got_vendor != vendor:
        raise BinaryNotFoundError(
            f"mojolearn: {path} reports vendor {got_vendor!r}, expected {vendor!r}")
    got_mode = _abi.NUMERIC_MODES.get(lib.numeric_mode, f"unknown({lib.numeric_mode})")
    if got_mode != numeric_mode:
        raise BinaryNotFoundError(
            f"mojolearn: {path} runs numeric mode {got_mode!r}, expected "
            f"{numeric_mode!r}")
    return lib


def describe(lib) -> dict:
    """The binary's self-description as a dict."""
    out = {}
    for part in lib.description.split(";"):
        if "=" in part:
            k, v = part.split("=", 1)
            out[k] = v
    return out


def available_modes() -> list[str]:
    """Numeric modes for which a binary exists (only 'identical' so far)."""
    return ["identical"]


def set_num_threads(n: int) -> None:
    """Threads the kernels use (default: MOJOLEARN_NUM_THREADS or all cores).

    Results are bit-identical for every thread count. n must be an int from
    1 to 1024 (ValueError otherwise); MOJOLEARN_NUM_THREADS, when set, must
    be a whole number in the same range, or the first kernel call (and
    get_num_threads) raises ValueError naming it.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"number of threads must be an int, got {type(n).__name__}")
    top = native().MAX_THREADS
    if not 1 <= n <= top:
        raise ValueError(f"number of threads must be from 1 to {top}, got {n}")
    native().set_num_threads(n)


def get_num_threads() -> int:
    """Threads the kernels use (see set_num_threads).

    Returns
    -------
    int
        At least 1.
    """
    return native().get_num_threads()
