"""CPU binary variants and the recorded digests (tests/digests.json).

Every CPU binary this machine can run (the portable baseline always; a
variant such as x86-64-v4 when installed and the CPU has its features)
must reproduce every recorded digest of the bench/gpu_cases.py matrix
byte for byte; and the loader picks the variant the CPU can run (or the
one asked for). Regenerate the file only on purpose:
``python -m bench.gpu_cases --write-digests``."""
import importlib.util
import json
from pathlib import Path

import pytest

from mojolearn import _abi, _loader
from bench import gpu_cases, math_cases
from tests.errors import raises_naming

ROOT = Path(__file__).resolve().parent.parent
DIGESTS = ROOT / "tests" / "digests.json"
# Op ids whose calls write nothing to compare (none so far): every other op
# of _abi.py must be run by some recorded case.
NO_OUTPUT_OPS: set = set()
_runs: dict = {}
# the cases draw their inputs with NumPy (mojolearn.reference)
needs_numpy = pytest.mark.skipif(importlib.util.find_spec("numpy") is None,
                                 reason="the case matrix needs NumPy")


def _recorded():
    return json.loads(DIGESTS.read_text())


def _run(target, perturb=False):
    # one child per binary and mode, shared by the tests below
    key = (target, perturb)
    if key not in _runs:
        _runs[key] = gpu_cases.run_binary(target, perturb=perturb)
    return _runs[key]


def _have_variant(target):
    flags = _loader.cpu_flags() or set()
    names = [d / f"libmojolearn_cpu_{target}.so" for d in _loader.lib_dirs()]
    return any(p.is_file() for p in names) and set(_loader.CPU_VARIANT_FLAGS[target]) <= flags


@needs_numpy
@pytest.mark.parametrize("target", gpu_cases.runnable_cpu_targets())
def test_binary_reproduces_the_recorded_digests(target):
    got = _run(target)
    want = "libmojolearn_cpu.so" if target == "baseline" else f"libmojolearn_cpu_{target}.so"
    assert got["binary"] == want and got["threads"] == gpu_cases.THREADS
    rec = _recorded()
    diff = gpu_cases.compare(rec["digests"], got["digests"])
    assert not any(diff.values()), (
        f"{want} ({got['arch']}) differs from tests/digests.json: "
        f"{gpu_cases.describe_diff(diff)}")
    # the file's op coverage is what the cases run today
    assert gpu_cases._ops_by_op(got["ops"]) == rec["ops"], (
        f"the ops the cases run changed; {gpu_cases.REGENERATE}")


@needs_numpy
def test_recorded_digests_see_a_one_ulp_change():
    # negative control: every input x one ulp away changes every case that
    # reads x; the cases that read weights only keep their digests
    target = gpu_cases.runnable_cpu_targets()[-1]
    rec = _recorded()["digests"]
    got = _run(target, perturb=True)["digests"]
    assert list(got) == list(rec)
    same = [k for k in rec if got[k] == rec[k] and not gpu_cases.perturbation_exempt(k)]
    moved = [k for k in rec if got[k] != rec[k] and gpu_cases.perturbation_exempt(k)]
    assert not same, f"unchanged by the perturbation: {same}"
    assert not moved, f"read no perturbed input but changed: {moved}"
    assert sum(not gpu_cases.perturbation_exempt(k) for k in rec) > 0.9 * len(rec)


def test_every_op_has_recorded_digests():
    rec = _recorded()
    ops = set(_abi.op_names())
    covered = {o for o, cases in rec["ops"].items()
               if any(c in rec["digests"] for c in cases)}
    missing = sorted(ops - NO_OUTPUT_OPS - covered)
    assert not missing, f"ops no recorded case runs: {missing} ({gpu_cases.REGENERATE})"
    assert set(rec["ops"]) <= ops, "the file names ops _abi.py no longer has"


def test_every_math_function_has_recorded_digests():
    # math_eval writes NaN for an id past the last function: a new function
    # without a case fails here
    np = pytest.importorskip("numpy")
    lib = _loader.library()
    x = np.linspace(-3, 3, 64, dtype=np.float32)
    for fn in range(math_cases.MATH_FUNCTIONS):
        y = np.frombuffer(math_cases.math_values(lib, x, fn, 1), np.float32)
        assert not np.isnan(y).all(), fn
        assert f"math fn{fn}" in _recorded()["digests"]
    y = np.frombuffer(math_cases.math_values(lib, x, math_cases.MATH_FUNCTIONS, 1), np.float32)
    assert np.isnan(y).all()


def test_digests_are_written_only_when_the_binaries_agree(monkeypatch, tmp_path):
    runs = {"baseline": {"binary": "a.so", "arch": "a", "threads": 2, "seconds": 0,
                         "digests": {"c1": "00", "c2": "11"}, "ops": {"c1": ["OP_MATH_EVAL"]}}}
    runs["v"] = dict(runs["baseline"], binary="b.so", digests={"c1": "00", "c2": "12"})
    monkeypatch.setattr(gpu_cases, "runnable_cpu_targets", lambda: list(runs))
    monkeypatch.setattr(gpu_cases, "run_binary", lambda t: runs[t])
    path = tmp_path / "digests.json"
    assert gpu_cases.main(["--write-digests", "--file", str(path)]) == 1
    assert not path.exists()
    runs["v"]["digests"] = runs["baseline"]["digests"]
    assert gpu_cases.main(["--write-digests", "--file", str(path)]) == 0
    rec = json.loads(path.read_text())
    assert rec["digests"] == {"c1": "00", "c2": "11"} and rec["ops"] == {"OP_MATH_EVAL": ["c1"]}
    assert set(rec["made_with"]) == {"baseline", "v"}


def test_digest_file_says_how_to_regenerate():
    rec = _recorded()
    assert gpu_cases.REGENERATE in rec["regenerate"]
    assert rec["cases"] == len(rec["digests"]) and "baseline" in rec["made_with"]


def test_unknown_cpu_target_is_refused(monkeypatch):
    monkeypatch.setenv("MOJOLEARN_CPU_TARGET", "pentium")
    with raises_naming(ValueError, "MOJOLEARN_CPU_TARGET='pentium'"):
        _loader.library_path("cpu")


def test_variant_the_cpu_cannot_run_is_never_chosen(monkeypatch):
    monkeypatch.setattr(_loader, "cpu_flags", lambda: {"avx2", "fma", "bmi2", "f16c"})
    monkeypatch.delenv("MOJOLEARN_CPU_TARGET", raising=False)
    assert _loader.library_path("cpu").name == "libmojolearn_cpu.so"
    monkeypatch.setenv("MOJOLEARN_CPU_TARGET", "x86-64-v4")
    with raises_naming(_loader.BinaryNotFoundError, "MOJOLEARN_CPU_TARGET=x86-64-v4", "'avx512f'",
                       "lacks"):
        _loader.library_path("cpu")


def test_baseline_can_be_forced(monkeypatch):
    monkeypatch.setenv("MOJOLEARN_CPU_TARGET", "baseline")
    assert _loader.library_path("cpu").name == "libmojolearn_cpu.so"


@pytest.mark.skipif(not _have_variant("x86-64-v4"),
                    reason="no x86-64-v4 binary installed or this CPU lacks AVX-512")
def test_best_variant_is_the_default(monkeypatch):
    monkeypatch.delenv("MOJOLEARN_CPU_TARGET", raising=False)
    assert _loader.library_path("cpu").name == "libmojolearn_cpu_x86-64-v4.so"
