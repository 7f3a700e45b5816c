"""Debug switches: where an op's time goes, phase by phase.

An op runs as a sequence of phases (each a set of independent tasks spread
over the threads). With timing on, the host layer adds the wall time of
every phase of every op to a table, per (op, phase):

    MOJOLEARN_PHASE_TIMES=1 python ...        # on from the start, or
    with mojolearn.debug.timing_phases() as t:
        session.step(x)
    print(mojolearn.debug.format_phase_times(t.result))

Timing adds two clock reads and a lock per phase (well under a microsecond;
a d=768 decode step has 5-9 phases), so it stays off unless asked for.
Bits never depend on it. `bench/phases.py` prints the phase tables quoted
in bench/RESULTS.md.

Forward phases: Mamba-1 and Mamba-2 run phase 0 (load the state), then
stages in chunks of tokens (phase 1 + chunk * stages + stage), then one
phase saving the state; Mamba-3 runs its stages per chunk from phase 0.
`STAGES` names the stages in order.
"""
from __future__ import annotations

from contextlib import contextmanager

from . import _abi
from ._loader import native

__all__ = ["set_phase_timing", "phase_times", "reset_phase_times", "timing_phases",
           "format_phase_times", "STAGES"]

# Forward stages in phase order (mojo/mojolearn_kernels/mamba1/forward.mojo,
# mamba2/layout.mojo, mamba3/layout.mojo: the ST_* constants).
# STAGES maps the op ids the binary gives these ops (read on first use: the
# import loads no binary).
_STAGES = {
    "m1_forward": ("norm", "in_proj", "conv", "x_proj", "bcdt_norm", "dt_proj", "scan",
                   "out_proj"),
    "m2_forward": ("norm", "in_proj", "conv", "cb", "ssd", "gated_norm", "out_proj"),
    "m3_forward": ("norm", "in_proj", "bc_norm_gates", "scan", "out_proj"),
}


def __getattr__(name):
    if name == "STAGES":
        ids = _abi.op_ids()
        return {ids[op]: stages for op, stages in _STAGES.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def set_phase_timing(on: bool) -> None:
    """Turn per-phase timing on or off (process-wide)."""
    native().set_phase_timing(bool(on))


def reset_phase_times() -> None:
    """Forget every recorded phase time."""
    native().reset_phase_times()


def phase_times() -> list[dict]:
    """Recorded phases since the last reset: dicts with op (name), op_id,
    phase, calls and seconds (total wall time over the calls)."""
    names = {v: k for k, v in _abi.op_ids().items()}
    return [{"op": names.get(op, str(op)), "op_id": op, "phase": ph, "calls": n,
             "seconds": s} for op, ph, n, s in native().phase_times()]


class _Timing:
    result: list


@contextmanager
def timing_phases():
    """Time every phase run inside the block; `.result` holds phase_times()
    of the block alone afterwards. Timing is off again on exit."""
    t = _Timing()
    reset_phase_times()
    set_phase_timing(True)
    try:
        yield t
    finally:
        set_phase_timing(False)
        t.result = phase_times()
        reset_phase_times()


def stage_of(op_id: int, phase: int) -> str:
    """Name of a forward phase's stage when a single chunk ran (a decode
    step or a short pass); the phase number otherwise."""
    op = {v: k for k, v in _abi.op_ids().items()}.get(op_id)
    names = _STAGES.get(op)
    if names is None:
        return f"phase {phase}"
    first = 0 if op == "m3_forward" else 1
    k = phase - first
    if 0 <= k < len(names):
        return names[k]
    return "load state" if k < 0 else "save state"


def format_phase_times(rows: list[dict]) -> str:
    """A table of mean microseconds per call of each phase."""
    lines = [f"{'op':<14}{'phase':>6}  {'stage':<15}{'calls':>7}{'us/call':>10}"]
    for r in rows:
        us = r["seconds"] / max(r["calls"], 1) * 1e6
        lines.append(f"{r['op']:<14}{r['phase']:>6}  {stage_of(r['op_id'], r['phase']):<15}"
                     f"{r['calls']:>7}{us:>10.1f}")
    return "\n".join(lines)
