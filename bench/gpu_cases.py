"""The fixed case matrix whose output bytes every binary must reproduce, and
the recorded SHA-256 digests of it (tests/digests.json).

`run_cases(mojolearn)` runs every case on the binary the process uses and
returns {case name: output bytes}; `digests(mojolearn)` gives their SHA-256.
The cases: the own transcendentals (OP_MATH_EVAL, every function and SIMD
width), the finiteness check op, and for all three blocks forward, the
reports (h_last_, ...), ragged rows, prefill + decode steps, a prefill split
in two and continued, decode sessions (with and without the speed cache), batch-8 steps, the state arrays after
prefill and after decode, backward (every gradient; Mamba-1 also a ragged
forward from a state and a backward from a state with final-state
cotangents and ragged rows; Mamba-2 a backward from a state with an open
chunk and final-state cotangents, and a ragged one), and blocks on packed
bfloat16/int8 weights (codes, read-back, expansion, forward, decode,
backward), and whole language models (bench/lm_cases.py); then the block
options (VARIANTS: Falcon-Mamba's B/C/dt norms, Mamba-2's groups), through
the same shape, packed and batch-8 cases under their own names; then the
packed and LM cases of the q4_0 / q8_0 formats; last, blocks whose
projections mix formats (MIXED). Sizes cross each chunk (Mamba-2: 256,
Mamba-3: 64) and Mamba-1's
256-row workspace chunks. Needs NumPy (weights from mojolearn.reference).

Users: tests/test_cpu_variants.py (every CPU binary against the file),
bench/gpu_check.py (a GPU binary against the CPU one and the file),
tests/test_device_staging.py (staged buffers against direct runs).

Commands (repository root; the installed mojolearn, or PYTHONPATH=python):
    python -m bench.gpu_cases --check          # this machine's CPU binaries vs the file
    python -m bench.gpu_cases --write-digests  # regenerate it (on purpose only)
--write-digests runs every CPU binary this machine can run, each in its own
process at 2 threads, and writes only if they all agree. Say in the commit
why the bits changed.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.math_cases import math_cases

ROOT = Path(__file__).resolve().parent.parent
DIGESTS = ROOT / "tests" / "digests.json"
REGENERATE = "python -m bench.gpu_cases --write-digests"
THREADS = 2

# (block, d_model, B, L, ragged lengths): small, but crossing each block's
# chunk size once (Mamba-2: 256, Mamba-3: 64) and the B x L chunking of
# Mamba-1's workspace (256 rows); d 40: widths that are no multiple of the
# GEMM's 16-column panels (Mamba-1 only takes any d).
SHAPES = [
    (1, 32, 1, 5, None), (1, 64, 3, 100, [100, 37, 1]), (1, 40, 2, 30, [30, 9]),
    (2, 32, 1, 5, None), (2, 64, 2, 300, [300, 41]),
    (3, 32, 1, 5, None), (3, 64, 2, 90, [90, 13]),
]
DECODE_STEPS = 3
SESSION_STEPS = 4
CHUNK = {1: None, 2: 256, 3: 64}
# Blocks on packed projection weights (mojolearn.lowbit): (block, d, B, L).
PACKED = [(1, 64, 2, 20), (2, 64, 2, 20), (3, 64, 2, 20)]
BLOCK_FORMATS = ("q4_0", "q8_0")  # their packed and LM cases come last
# Blocks whose projections mix formats, per block kind: (label, {name: format}),
# the names not listed float32. Mamba-1: llama.cpp's q4_0 files (x_proj and
# dt_proj stay float32).
MIXED = {1: ("mixed-llama-q4_0", {"in_proj.weight": "q4_0", "out_proj.weight": "q4_0"}),
         2: ("mixed-q8_0-bfloat16", {"in_proj.weight": "q8_0", "out_proj.weight": "bfloat16"}),
         3: ("mixed-float32-q4_0", {"out_proj.weight": "q4_0"})}
# Batch-8 decode (x86-64-v4 runs 8-row products as one pass): (block, d).
BATCH8 = [(1, 64), (2, 64), (3, 64)]
B8_PREFILL, B8_STEPS = 5, 3

# Block options, each with its own cases (names "m<kind>-<variant> ..."),
# appended after every case above so that the older names keep their order:
# variant -> (kind, constructor options, shapes, packed, batch8).
VARIANTS = {
    "falcon": (1, {"bcdt_rms_eps": 1e-6},
               [(1, 40, 2, 30, [30, 9]), (1, 64, 3, 100, [100, 37, 1])],
               [(1, 64, 2, 20)], [(1, 64)]),
    # Mamba-2 with groups of B and C (Mamba-Codestral: 8): d 128 puts two
    # heads in each of two groups, d 256 one head in each of eight
    "groups": (2, {"n_groups": 2},
               [(2, 128, 2, 300, [300, 57]), (2, 128, 3, 5, None)],
               [(2, 128, 2, 20)], [(2, 128)]),
    "groups8": (2, {"n_groups": 8}, [(2, 256, 2, 260, [260, 3])], [], []),
}


# Negative control (--perturb): every element of every block input x and
# math input one ulp away. Cases that read no x (weights and check op only) keep their
# digests; all others must change.
_PERTURB = False


def perturbation_exempt(name: str) -> bool:
    """Whether case `name` reads no perturbed input (its digest stays)."""
    return name == "nonfinite" or name.endswith(" weights")


def _weights(kind: int, d: int, variant=None):
    from mojolearn.reference.weights import mamba1_weights, mamba2_weights, mamba3_weights
    groups = _options(variant).get("n_groups")  # Mamba-2's weights depend on it
    if groups is not None:
        return mamba2_weights(d, seed=kind, n_groups=groups)
    return {1: mamba1_weights, 2: mamba2_weights, 3: mamba3_weights}[kind](d, seed=kind)


def _input(b, l, d, seed):
    import numpy as np
    from mojolearn.reference.weights import random_input
    x = random_input(b, l, d, seed=seed)
    if _PERTURB:  # every element: one element's ulp can vanish in a rounding
        x = np.nextafter(x, np.float32(np.inf))
    return x


def _input_unperturbed(b, l, d, seed):  # gradients: the control moves x only
    from mojolearn.reference.weights import random_input
    return random_input(b, l, d, seed=seed)


def _bytes(a) -> bytes:
    import numpy as np
    return np.ascontiguousarray(np.asarray(a)).tobytes()


def _options(variant) -> dict:
    return {} if variant is None else VARIANTS[variant][1]


def _tag(kind, variant) -> str:
    return f"m{kind}" if variant is None else f"m{kind}-{variant}"


def block_for(mojolearn, kind: int, d: int, variant=None, weights=None):
    cls = {1: mojolearn.Mamba1Block, 2: mojolearn.Mamba2Block, 3: mojolearn.Mamba3Block}[kind]
    return cls(_weights(kind, d, variant) if weights is None else weights, **_options(variant))


# State fields in a fixed order; ints/bools are hashed as "name=value".
_STATE_FIELDS = {
    1: ("conv_window", "h", "absolute_position"),
    2: ("conv_window", "h", "buffer_xbc", "buffer_dtraw", "buffered_tokens"),
    3: ("theta", "h", "buffer_qrot", "buffer_krot", "buffer_v", "buffer_dt", "buffer_sig",
        "buffer_adt", "pending_k", "pending_v", "buffered_tokens", "pending"),
}


def _state_bytes(kind, state) -> bytes:
    parts = []
    for n in _STATE_FIELDS[kind]:
        v = getattr(state, n)
        parts.append(f"{n}={v}".encode() if isinstance(v, int) else _bytes(v))
    return b"".join(parts)


def _reports(kind, block) -> bytes:
    """The block's reports of its last call (Mamba-2 h_last_; Mamba-3
    h/k/v/theta_last_); read right after the call (they go stale)."""
    if kind == 2:
        return _bytes(block.h_last_)
    if kind == 3:
        return b"".join(_bytes(getattr(block, n))
                        for n in ("h_last_", "k_last_", "v_last_", "theta_last_"))
    return b""


def _shape_cases(mojolearn, kind, d, b, l, lengths, variant=None):
    """(name, bytes) of one shape, in a fixed order."""
    import numpy as np
    block = block_for(mojolearn, kind, d, variant)
    x = _input(b, l, d, seed=7)
    tag = f"{_tag(kind, variant)} d{d} B{b} L{l}"
    yield f"{tag} forward", _bytes(block.forward(x))
    if kind != 1:
        yield f"{tag} forward state", _reports(kind, block)
    # prefill + steps (the strided x[:, t] takes the full intake)
    pre = l - DECODE_STEPS
    state = block.allocate_state(b)
    ys = [_bytes(block.forward(x[:, :pre], state))]
    yield f"{tag} prefill state", _state_bytes(kind, state) + _reports(kind, block)
    for t in range(pre, l):
        ys.append(_bytes(block.step(x[:, t], state)))
    yield f"{tag} decode", b"".join(ys)
    yield f"{tag} decode state", _state_bytes(kind, state) + _reports(kind, block)
    # the same prefill split in two (the second part crosses a chunk), then steps
    a = max(1, pre * 2 // 3)
    state = block.allocate_state(b)
    ys = [_bytes(block.forward(x[:, :a], state)), _bytes(block.forward(x[:, a:pre], state))]
    for t in range(pre, l):
        ys.append(_bytes(block.step(x[:, t], state)))
    yield f"{tag} continue", b"".join(ys) + _state_bytes(kind, state) + _reports(kind, block)
    if lengths is not None:
        yield f"{tag} ragged", _bytes(block.forward(x, lengths=lengths))
        if kind != 1:
            yield f"{tag} ragged state", _reports(kind, block)
    # decode session from a prefill ending 2 tokens before a chunk boundary:
    # its steps cross it; a sync_state halfway, the state after close
    yield f"{tag} session", _session_bytes(block, kind, x, b, l)
    if kind != 1:  # without the sessions' speed cache (the uncached step path)
        yield f"{tag} session no cache", _session_bytes(block, kind, x, b, l, cache=False)
    if kind == 3:  # a reference Input_States continuation (the pending path)
        rng = np.random.default_rng(11)
        h = block.nheads
        st = block.allocate_state(b)
        st.set_input_states(rng.uniform(0, 6, (b, h, 32)).astype(np.float32),
                            (0.1 * rng.standard_normal((b, h, 64, 128))).astype(np.float32),
                            rng.standard_normal((b, h, 128)).astype(np.float32),
                            rng.standard_normal((b, h, 64)).astype(np.float32))
        m = max(1, l // 2)
        ys = [_bytes(block.forward(x[:, :m], st)), _bytes(block.step(x[:, m], st))]
        yield f"{tag} input states", b"".join(ys) + _state_bytes(kind, st) + _reports(kind, block)
    g = _input_unperturbed(b, l, d, seed=8)
    grads = block.backward(x, g)
    yield f"{tag} backward", b"".join(_bytes(grads[k]) for k in sorted(grads))
    if kind == 1 and lengths is not None:
        # through the state: a ragged forward from a state (each row's state
        # at its length), and backward from that state with final-state
        # cotangents (another prefill's state arrays) and the lengths
        start = block.allocate_state(b)
        block.forward(x[:, :pre], start)
        cot = block.allocate_state(b)
        block.forward(x[:, pre:], cot)
        st = start.copy()
        y = block.forward(x, st, lengths=lengths)
        yield f"{tag} ragged from state", _bytes(y) + _state_bytes(kind, st)
        grads = block.backward(x, g, start, grad_state=cot, lengths=lengths)
        yield f"{tag} backward state", b"".join(_bytes(grads[k]) for k in sorted(grads))
    if kind == 2 and lengths is not None:
        # through the state: backward from a state with an open chunk (the
        # prefill of `pre` tokens) over the whole x (crossing the chunk end),
        # with final-state cotangents (that state's own arrays); and ragged
        # rows without a state
        start = block.allocate_state(b)
        block.forward(x[:, :pre], start)
        grads = block.backward(x, g, start, grad_state=start)
        yield f"{tag} backward state", b"".join(_bytes(grads[k]) for k in sorted(grads))
        grads = block.backward(x, g, lengths=lengths)
        yield f"{tag} backward ragged", b"".join(_bytes(grads[k]) for k in sorted(grads))


def _session_bytes(block, kind, x, b, l, **kw) -> bytes:
    """A decode session from a prefill ending 2 tokens before a chunk
    boundary: its steps cross it; a sync_state halfway, the state after
    close (kw: the session's options)."""
    import numpy as np
    q = CHUNK[kind]
    p = l - SESSION_STEPS if q is None else max(1, min(q - 2, l - SESSION_STEPS))
    state = block.allocate_state(b)
    ys = [_bytes(block.forward(x[:, :p], state))]
    with block.decode_session(state, **kw) as s:
        for i, t in enumerate(range(p, p + SESSION_STEPS)):
            xt = x[:, t] if i == SESSION_STEPS - 1 else np.ascontiguousarray(x[:, t])
            ys.append(_bytes(s.step(xt)))  # the last, strided: the fallback intake
            if i == 1:
                ys.append(_state_bytes(kind, s.sync_state()))
    return b"".join(ys) + _state_bytes(kind, state)


def run_case(mojolearn, kind, d, b, l, lengths, variant=None) -> dict:
    """Output bytes of one shape: forward (+ reports), prefill + decode steps
    and the states, a continued split prefill, ragged rows, a decode
    session, Mamba-3's input states, backward (every gradient)."""
    return dict(_shape_cases(mojolearn, kind, d, b, l, lengths, variant))


def _packed_cases(mojolearn, kind, d, b, l, variant=None, formats=("bfloat16", "int8")):
    import numpy as np
    x = _input(b, l, d, seed=9)
    for fmt in formats:
        # a format, or (label, {name: format}): a mix (MIXED)
        label, how = (fmt, fmt) if isinstance(fmt, str) else fmt
        tag = f"{_tag(kind, variant)} d{d} B{b} L{l} {label}"
        # the codes (OP_LOWBIT_PACK), read back from the blob (OP_PANELS_EXTRACT)
        # and expanded (OP_LOWBIT_UNPACK)
        packed = mojolearn.lowbit.pack(_weights(kind, d, variant), how)
        block = block_for(mojolearn, kind, d, variant, weights=packed)
        back = block.get_params()["weights"]
        parts = []
        for n in sorted(packed):
            for p in (packed[n], back[n]):
                if mojolearn.lowbit.is_packed(p):
                    parts.append(_bytes(p.data))
                    parts.append(b"" if p.exponents is None else _bytes(p.exponents))
            if mojolearn.lowbit.is_packed(packed[n]):
                parts.append(_bytes(packed[n].to_float32()))
        yield f"{tag} weights", b"".join(parts)
        yield f"{tag} forward", _bytes(block.forward(x))
        state = block.allocate_state(b)
        ys = [_bytes(block.forward(x[:, : l - DECODE_STEPS], state))]
        for t in range(l - DECODE_STEPS, l):
            ys.append(_bytes(block.step(x[:, t], state)))
        yield f"{tag} decode", b"".join(ys)
        grads = block.backward(x, _input_unperturbed(b, l, d, seed=10))
        yield f"{tag} backward", b"".join(_bytes(np.asarray(grads[k])) for k in sorted(grads))


def run_packed(mojolearn, kind, d, b, l, variant=None) -> dict:
    """A block built on bfloat16 and int8 packed weights (the blob keeps them
    packed; the GEMM widens them on load): its codes, forward, decode and
    backward."""
    return dict(_packed_cases(mojolearn, kind, d, b, l, variant))


def _batch8_cases(mojolearn, kind, d, variant=None):
    import numpy as np
    block = block_for(mojolearn, kind, d, variant)
    x = _input(8, B8_PREFILL + B8_STEPS, d, seed=12)
    for via in ("steps", "session"):
        state = block.allocate_state(8)
        ys = [_bytes(block.forward(x[:, :B8_PREFILL], state))]
        steps = range(B8_PREFILL, B8_PREFILL + B8_STEPS)
        if via == "steps":
            ys += [_bytes(block.step(x[:, t], state)) for t in steps]
            ys.append(_reports(kind, block))
        else:
            with block.decode_session(state) as s:
                ys += [_bytes(s.step(np.ascontiguousarray(x[:, t]))) for t in steps]
        yield f"{_tag(kind, variant)} d{d} B8 {via}", b"".join(ys) + _state_bytes(kind, state)


def iter_cases(mojolearn, shapes=SHAPES, packed=PACKED, batch8=BATCH8, lm=True):
    """(name, bytes) of every case, in the matrix order."""
    from mojolearn import _loader
    from bench.lm_cases import lm_cases
    lib = _loader.library()
    yield from math_cases(lib, perturb=_PERTURB)
    for s in shapes:
        yield from _shape_cases(mojolearn, *s)
    for s in batch8:
        yield from _batch8_cases(mojolearn, *s)
    for s in packed:
        yield from _packed_cases(mojolearn, *s)
    if lm:
        yield from lm_cases(mojolearn, perturb=_PERTURB)
    for variant, (kind, _opts, v_shapes, v_packed, v_batch8) in VARIANTS.items():
        for s in v_shapes:
            assert s[0] == kind
            yield from _shape_cases(mojolearn, *s, variant=variant)
        for s in v_batch8:
            yield from _batch8_cases(mojolearn, *s, variant=variant)
        for s in v_packed:
            yield from _packed_cases(mojolearn, *s, variant=variant)
    # llama.cpp's block formats (added after the cases above: older names keep their order)
    for s in packed:
        yield from _packed_cases(mojolearn, *s, formats=BLOCK_FORMATS)
    if lm:
        yield from lm_cases(mojolearn, perturb=_PERTURB, formats=BLOCK_FORMATS)
    for s in packed:  # projections in mixed formats (added last, likewise)
        yield from _packed_cases(mojolearn, *s, formats=(MIXED[s[0]],))


def run_cases(mojolearn, shapes=SHAPES, packed=PACKED, batch8=BATCH8) -> dict:
    out = {}
    for name, data in iter_cases(mojolearn, shapes, packed, batch8):
        assert name not in out, name
        out[name] = data
    return out


class _OpRecorder:
    """Stands in for the loaded binary and notes the op ids run through it."""

    def __init__(self, lib):
        self._lib = lib
        self.ops = set()

    def run(self, op, args):
        self.ops.add(op)
        return self._lib.run(op, args)

    def run_step(self, op, *args):
        ran = self._lib.run_step(op, *args)
        if ran:
            self.ops.add(op)
        return ran

    def __getattr__(self, name):
        return getattr(self._lib, name)


@contextlib.contextmanager
def _recording():
    # blocks and lowbit take the binary from the loader's cache: swap it
    from mojolearn import _loader
    lib = _loader.library()
    keys = [k for k, v in _loader._libraries.items() if v is lib]
    rec = _OpRecorder(lib)
    for k in keys:
        _loader._libraries[k] = rec
    try:
        yield rec
    finally:
        for k in keys:
            _loader._libraries[k] = lib


def digests(mojolearn, record_ops=False):
    """({case: sha256 hex}, {case: op names run while making it}) on the
    binary this process uses (ops only with record_ops)."""
    from mojolearn import _abi
    names = {v: k for k, v in _abi.op_names().items()}
    out, ops = {}, {}
    with (_recording() if record_ops else contextlib.nullcontext()) as rec:
        it = iter_cases(mojolearn)
        while True:
            if rec is not None:
                rec.ops = set()
            try:
                name, data = next(it)
            except StopIteration:
                break
            assert name not in out, name
            out[name] = hashlib.sha256(data).hexdigest()
            if rec is not None:
                ops[name] = sorted(names.get(o, f"OP_{o}") for o in rec.ops)
    return out, ops


# -- CPU binaries, each in its own process ---------------------------------
def runnable_cpu_targets() -> list:
    """'baseline' and every installed CPU variant whose features this CPU has."""
    from mojolearn import _loader
    flags = _loader.cpu_flags() or set()
    out = ["baseline"]
    for t, need in _loader.CPU_VARIANT_FLAGS.items():
        names = [d / f"libmojolearn_cpu_{t}.so" for d in _loader.lib_dirs()]
        if set(need) <= flags and any(p.is_file() for p in names):
            out.append(t)
    return out


def run_binary(target: str, perturb: bool = False, timeout: float = 600) -> dict:
    """The digests of CPU binary `target` ('baseline' or a variant), computed
    in a child process (MOJOLEARN_CPU_TARGET, THREADS threads) that imports
    the mojolearn this process uses: {binary, arch, threads, seconds,
    digests, ops}."""
    import mojolearn
    pkg_parent = Path(mojolearn.__file__).resolve().parent.parent
    env = dict(os.environ, MOJOLEARN_VENDOR="cpu", MOJOLEARN_CPU_TARGET=target,
               MOJOLEARN_NUM_THREADS=str(THREADS),
               PYTHONPATH=os.pathsep.join([str(pkg_parent), str(ROOT)]))
    cmd = [sys.executable, "-m", "bench.gpu_cases", "--print"] + (["--perturb"] if perturb else [])
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{target}: {' '.join(cmd)} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def compare(expected: dict, got: dict) -> dict:
    """{'changed'|'missing'|'extra': [case names]}, empty lists when equal."""
    return {"changed": [k for k in expected if k in got and got[k] != expected[k]],
            "missing": [k for k in expected if k not in got],
            "extra": [k for k in got if k not in expected]}


def describe_diff(diff: dict) -> str:
    return "; ".join(f"{k} ({len(v)}): {', '.join(v)}" for k, v in diff.items() if v)


def load(path=DIGESTS) -> dict:
    return json.loads(Path(path).read_text())


def _ops_by_op(case_ops: dict) -> dict:
    by = {}
    for case, ops in case_ops.items():
        for o in ops:
            by.setdefault(o, []).append(case)
    return dict(sorted(by.items()))


def _write(path, runs: dict):
    ref = next(iter(runs.values()))
    header = {
        "about": "SHA-256 of the output bytes of every case of bench/gpu_cases.py (block "
                 "outputs, reports, states, gradients, packed codes, math and check op "
                 "results): the bits every binary must reproduce, CPU (x86-64-v3, "
                 "x86-64-v4, arm64) and GPU. Checked by tests/test_cpu_variants.py for "
                 "every CPU binary the machine can run, and by bench/gpu_check.py.",
        "regenerate": f"{REGENERATE} (repository root): runs every CPU binary this "
                      "machine can run and writes only if they all agree. Only on "
                      "purpose; say in the commit why the bits changed.",
        "made_with": {t: f"{r['binary']} ({r['arch']})" for t, r in runs.items()},
        "threads": THREADS,
        "cases": len(ref["digests"]),
    }
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in header.items()]
    lines.append(' "ops": {')
    ops = _ops_by_op(ref["ops"])
    lines += [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in ops.items()]
    lines[-1] = lines[-1].rstrip(",")
    lines.append(" },")
    lines.append(' "digests": {')
    lines += [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in ref["digests"].items()]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" }", "}"]
    text = "\n".join(lines) + "\n"
    json.loads(text)  # well formed
    Path(path).write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Recorded output digests (tests/digests.json).")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--check", action="store_true",
                   help="compare every CPU binary this machine can run with the file")
    g.add_argument("--write-digests", action="store_true",
                   help="regenerate the file (only if those binaries all agree)")
    g.add_argument("--print", action="store_true",
                   help="print this process's binary's digests as JSON (one line)")
    p.add_argument("--perturb", action="store_true",
                   help="with --print: every input x one ulp away (negative control)")
    p.add_argument("--file", default=str(DIGESTS))
    a = p.parse_args(argv)

    if a.print:
        global _PERTURB
        _PERTURB = a.perturb
        import mojolearn
        from mojolearn import _loader
        lib = _loader.library()
        t = time.perf_counter()
        dg, ops = digests(mojolearn, record_ops=True)
        print(json.dumps({"binary": Path(lib.path).name, "arch": _loader.describe(lib).get("arch"),
                          "threads": mojolearn.get_num_threads(),
                          "seconds": round(time.perf_counter() - t, 2),
                          "digests": dg, "ops": ops}))
        return 0

    runs = {}
    for t in runnable_cpu_targets():
        runs[t] = run_binary(t)
        print(f"{t}: {runs[t]['binary']} ({runs[t]['arch']}), {len(runs[t]['digests'])} "
              f"cases in {runs[t]['seconds']} s at {runs[t]['threads']} threads")
    if a.check:
        saved = load(a.file)["digests"]
        bad = 0
        for t, r in runs.items():
            d = compare(saved, r["digests"])
            bad += any(d.values())
            print(f"{t}: {'same digests as ' + a.file if not any(d.values()) else describe_diff(d)}")
        return 1 if bad else 0

    first, ref = next(iter(runs.items()))
    disagree = False
    for t, r in runs.items():
        d = compare(ref["digests"], r["digests"])
        if any(d.values()) or r["ops"] != ref["ops"]:
            disagree = True
            print(f"{t} differs from {first}: {describe_diff(d) or 'ops run'}")
    if disagree:
        print(f"not written: the CPU binaries disagree", file=sys.stderr)
        return 1
    if len(runs) == 1:
        print("note: only one CPU binary runs here; nothing to cross-check it with")
    path = Path(a.file)
    if path.is_file():
        d = compare(load(path)["digests"], ref["digests"])
        print(f"against the old file: {describe_diff(d) or 'no digest changed'}")
    _write(path, runs)
    print(f"wrote {len(ref['digests'])} digests to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
