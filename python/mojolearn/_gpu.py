"""GPU binaries: which are installed, and which one this machine can use.

A GPU binary is `libmojolearn_<vendor>_<arch>.so` (vendor cuda, hip or
metal; built with MOJOLEARN_GPU_ARCHS, see docs/gpu.md). Loading one is
safe without a device: its device count is read first (0 when the driver is
missing) and nothing else of it runs. The loader (_loader.library) asks
`pick` before falling back to the CPU binary.
"""
from __future__ import annotations

import re
from pathlib import Path

GPU_VENDORS = ("cuda", "hip", "metal")  # the order tried when none is asked for


def candidates(dirs, vendor: str | None = None) -> list[Path]:
    """Installed GPU binaries (of `vendor`, or all), in the order tried:
    by GPU_VENDORS, then newest architecture, then earlier folder."""
    found = []
    for rank, v in enumerate(GPU_VENDORS):
        if vendor not in (None, v):
            continue
        for di, d in enumerate(dirs):
            if Path(d).is_dir():
                for p in Path(d).glob(f"libmojolearn_{v}_*.so"):
                    found.append((rank, di, _arch_key(p.stem), p))
    found.sort(key=lambda t: (t[0], [-k for k in t[2]], t[1]))
    return [t[3] for t in found]


def _arch_key(stem: str) -> list[int]:
    """Numbers in the name (sm90 -> [90]) to sort newer architectures first."""
    return [int(n) for n in re.findall(r"\d+", stem)] or [0]


def arch_fits(binary_arch: str, device_arch: str) -> bool:
    """Whether a binary built for binary_arch runs on device_arch.

    CUDA: Mojo's sm_90 PTX targets sm_90a (Hopper only); sm_80 PTX is
    JIT-compiled for any newer GPU. HIP: the exact gfx target. Unknown device
    arch (empty): trust the device count.
    """
    if not device_arch:
        return True
    b, d = binary_arch.lower(), device_arch.lower()
    bm, dm = re.match(r"sm_?(\d+)", b), re.match(r"sm_?(\d+)", d)
    if bm and dm:
        bv, dv = int(bm.group(1)), int(dm.group(1))
        return dv == bv if bv >= 90 else dv >= bv
    if b.startswith("gfx"):
        return d.split(":")[0] == b
    return True


def probe(lib, describe) -> tuple[int, str]:
    """(device count, why not usable or '') of a loaded GPU binary."""
    n = lib.device_count
    if n <= 0:
        return n, "no device of this vendor is present"
    arch = describe(lib).get("arch", "")
    dev = lib.device_arch
    if not arch_fits(arch, dev):
        return n, f"built for {arch}, the device is {dev}"
    return n, ""
