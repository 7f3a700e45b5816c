"""Which GPU binary the loader tries, in what order, and on which device
architecture it fits (python/mojolearn/_gpu.py; no binary is loaded)."""
from mojolearn import _gpu


def _touch(d, *names):
    d.mkdir(exist_ok=True)
    for n in names:
        (d / n).write_bytes(b"")


def test_candidates_order_vendor_then_newest_arch_then_folder(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _touch(a, "libmojolearn_hip_gfx942.so", "libmojolearn_cuda_sm80.so", "libmojolearn_cpu.so")
    _touch(b, "libmojolearn_cuda_sm90.so", "libmojolearn_metal_applem3.so")
    names = [p.name for p in _gpu.candidates([a, b])]
    assert names == ["libmojolearn_cuda_sm90.so", "libmojolearn_cuda_sm80.so",
                     "libmojolearn_hip_gfx942.so", "libmojolearn_metal_applem3.so"]
    assert [p.name for p in _gpu.candidates([a, b], "hip")] == ["libmojolearn_hip_gfx942.so"]
    assert _gpu.candidates([tmp_path / "missing"]) == []


def test_arch_fits():
    assert _gpu.arch_fits("sm_90", "sm_90a") and _gpu.arch_fits("sm_90", "sm_90")
    assert not _gpu.arch_fits("sm_90", "sm_80")      # sm_90a PTX: Hopper only
    assert not _gpu.arch_fits("sm_90", "sm_100")
    assert _gpu.arch_fits("sm_80", "sm_90") and _gpu.arch_fits("sm_80", "sm_86")
    assert not _gpu.arch_fits("sm_80", "sm_75")
    assert _gpu.arch_fits("gfx942", "gfx942:sramecc+:xnack-")
    assert not _gpu.arch_fits("gfx942", "gfx90a")
    assert _gpu.arch_fits("sm_90", "")               # unknown: trust the count


class _FakeLib:
    def __init__(self, count, arch):
        self.device_count, self.device_arch = count, arch


def test_probe_reasons():
    desc = lambda lib: {"arch": "sm_90"}  # noqa: E731
    assert _gpu.probe(_FakeLib(0, ""), desc) == (0, "no device of this vendor is present")
    assert _gpu.probe(_FakeLib(1, "sm_90a"), desc) == (1, "")
    n, why = _gpu.probe(_FakeLib(2, "sm_80"), desc)
    assert n == 2 and "built for sm_90" in why
