"""arm64 check, the Python half (tools/arm64_check.sh runs it; README, "arm64").

Runs the fixed case matrix of bench/gpu_cases.py on this machine's x86-64
CPU binary with the host layer's op recorder on (_native.set_record_dir,
python/native/record.h), one case at a time, and replays each case's records
with every runner given: tools/abi_replay/replay.c built natively against the
x86 binary, and built for aarch64 under qemu-user against the aarch64 binary.
A runner passes a case when every result byte of every op equals the bytes
the x86 run recorded. The matrix covers every op of the ABI that Python
runs: for all three blocks forward, ragged rows, prefill + decode steps,
continued prefills, decode sessions, batch-8 decode, backward, blocks on
bfloat16/int8 weights with the lowbit pack/unpack/extract ops, the weight
preparation and transposed panels, the finiteness check op and the own
transcendentals (math_eval).

Negative control: before the first replay, a record whose op writes two or
more buffers is copied once per compared buffer with one byte of that
buffer flipped (a random offset and bit; the seed is printed and can be
given with --control-seed), and every runner must report each copy as a
DIFF of exactly that buffer: a replay comparing only some bytes (every
8th, a prefix) or only the first written buffer is caught.

Not recorded: an op with an argument pointing at memory the host layer does
not know of (bench/gpu_cases.py's finiteness-check case passes NumPy
addresses straight through `ctypes`; the extra case "nonfinite (known
addresses)" here runs the same calls through `_native.address`). They are
listed, never silently dropped. Cases that only read what earlier ops wrote
(a block's reports, a state) have no op of their own: their bytes are among
the earlier ops' recorded outputs. Direct exports (ml_first_nonfinite,
ml_describe, ...) are not ops and are not replayed.

    python tools/arm64_check.py --runner 'x86-64=REPLAY_X86 LIB_X86' \\
        --runner 'aarch64=qemu-aarch64 -L /usr/aarch64-linux-gnu REPLAY_ARM LIB_ARM'

Exit status 0 when every runner reproduced every record, 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _op_names() -> dict:
    from mojolearn import _abi
    return {v: k for k, v in vars(_abi).items() if k.startswith("OP_")}


def record_buffers(path: Path) -> list:
    """The buffers of an op record (record.h layout), in record order: dicts
    of index, flags (1 in, 2 out, 0 scratch), bytes, and ``after``, the file
    offset of the buffer's recorded bytes after the run (what replay.c
    compares)."""
    d = Path(path).read_bytes()
    pos = 8 + 8  # magic, abi
    op, nargs, nbufs = struct.unpack_from("<3q", d, pos)
    pos += 24 + 8 * nargs
    bufs = []
    for i in range(nbufs):
        n, flags, nslots = struct.unpack_from("<3q", d, pos)
        pos += 24 + 16 * nslots
        bufs.append({"index": i, "flags": flags, "bytes": n, "op": op})
    pos += sum((b["bytes"] + 7) // 8 * 8 for b in bufs)  # the bytes before the run
    for b in bufs:
        b["after"] = pos
        pos += (b["bytes"] + 7) // 8 * 8
    if pos != len(d):
        raise ValueError(f"{path}: {len(d)} bytes, but its layout ends at {pos}")
    return bufs


def written_buffers(path: Path) -> list:
    """The buffers of a record that its op writes (flags & 2, not empty)."""
    return [b for b in record_buffers(path) if b["flags"] & 2 and b["bytes"] > 0]


def flipped_copies(record: Path, out: Path, rng) -> list:
    """One copy of the record per compared buffer (every buffer but scratch,
    written ones and read-only ones), each with one bit of one byte of that
    buffer's after-run bytes flipped at an offset drawn from rng (a
    random.Random). Returns (copy path, buffer index, byte offset) triples."""
    data = Path(record).read_bytes()
    made = []
    for b in record_buffers(record):
        if b["flags"] == 0 or b["bytes"] == 0:
            continue
        off = rng.randrange(b["bytes"])
        bad = bytearray(data)
        bad[b["after"] + off] ^= 1 << rng.randrange(8)
        path = Path(out) / f"flip-{Path(record).stem}-buf{b['index']}-at{off}.mlrec"
        path.write_bytes(bytes(bad))
        made.append((path, b["index"], off))
    return made


def unseen_flips(cmd: list, flips: list) -> list:
    """Replays the flipped copies with one replay command; returns a line per
    copy whose flip was not reported as a DIFF of exactly that buffer (empty:
    every flip seen)."""
    r = subprocess.run(cmd + [str(p) for p, _, _ in flips], capture_output=True, text=True)
    out = r.stdout + r.stderr
    seen = {}
    for line in out.splitlines():
        m = re.match(r"DIFF (\S+): op -?\d+ buffer (\d+) ", line)
        if m:
            seen.setdefault(m.group(1), []).append(int(m.group(2)))
    problems = [] if r.returncode == 1 or not flips else [f"exit {r.returncode}: {out[-500:]}"]
    for path, index, off in flips:
        if seen.get(str(path)) != [index]:
            problems.append(f"buffer {index}, byte {off} of {path.name}: reported buffers "
                            f"{seen.get(str(path), [])}")
    return problems


def _nonfinite_known(lib, native):
    """bench/gpu_cases.py's OP_FIRST_NONFINITE case, with every address taken
    through _native.address (so the recorder knows the arrays)."""
    import numpy as np
    from mojolearn import _abi
    b, l, inner = 3, 7, 37
    lens = np.array([7, 3, 1], np.int64)
    for i, pos in enumerate([None, (0, 6, 36), (1, 2, 0), (1, 3, 5), (2, 0, 17), (2, 4, 1)]):
        a = np.random.default_rng(13 + i).standard_normal((b, l, inner)).astype(np.float32)
        if pos is not None:
            a[pos] = np.nan if i % 2 else -np.inf
        got = np.full(1, -7, np.int64)
        lib.run(_abi.OP_FIRST_NONFINITE, [native.address(a), b, l, inner, native.address(lens),
                                          native.address(got, True)])
    return "nonfinite (known addresses)", b""


def _cases(mojolearn, lib, native):
    """(name, bytes) of bench/gpu_cases.py's matrix, then the extra case."""
    from bench import gpu_cases
    yield from gpu_cases.iter_cases(mojolearn)
    yield _nonfinite_known(lib, native)


def _replay(cmd: list, files: list) -> tuple[int, str, float]:
    t = time.perf_counter()
    r = subprocess.run(cmd + [str(f) for f in files], capture_output=True, text=True)
    return r.returncode, (r.stdout + r.stderr).strip(), time.perf_counter() - t


def _negative_control(runners: dict, files: list, tmp: Path, seed: int) -> tuple:
    """Each runner must report every flip of flipped_copies for a record
    whose op writes two or more buffers (so a byte of a buffer that is not
    the first written one is flipped too). Returns (failures, what was
    flipped), or None when no record of these files has two written buffers."""
    record = next((f for f in files if len(written_buffers(f)) >= 2), None)
    if record is None:
        return None
    ctl = tmp / "control"
    ctl.mkdir(exist_ok=True)
    flips = flipped_copies(record, ctl, random.Random(seed))
    failures = []
    for name, cmd in runners.items():
        failures += [f"{name}: a flipped byte went unseen: {p}" for p in unseen_flips(cmd, flips)]
    shutil.rmtree(ctl, ignore_errors=True)
    where = ", ".join(f"buffer {i} byte {o}" for _, i, o in flips)
    return failures, f"{record.name} (seed {seed}: {where})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runner", action="append", required=True, metavar="NAME=COMMAND",
                   help="a replay command (binary, kernel library); the record files are appended")
    p.add_argument("--records", help="folder for the records (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the records (default: delete each "
                   "case's records once replayed; the whole matrix is about 0.5 GB)")
    p.add_argument("--only", default="", help="run only the cases whose name contains this")
    p.add_argument("--control-seed", type=int, default=None,
                   help="seed of the negative control's byte offsets (default: a new one, "
                   "printed)")
    a = p.parse_args(argv)
    runners = {}
    for r in a.runner:
        name, _, cmd = r.partition("=")
        runners[name] = shlex.split(cmd)

    # The x86 reference: the portable baseline CPU binary, at 2 threads (the
    # records come from the ordinary multi-threaded path).
    os.environ.setdefault("MOJOLEARN_VENDOR", "cpu")
    os.environ.setdefault("MOJOLEARN_CPU_TARGET", "baseline")
    os.environ.setdefault("MOJOLEARN_NUM_THREADS", "2")
    sys.path.insert(0, str(ROOT))  # bench.gpu_cases (mojolearn: installed or PYTHONPATH)
    import mojolearn
    from mojolearn import _loader

    native, lib = _loader.native(), _loader.library()
    if not hasattr(native, "set_record_dir"):
        print("arm64 check: this mojolearn's host layer has no op recorder; rebuild it",
              file=sys.stderr)
        return 1
    names = _op_names()
    seed = a.control_seed if a.control_seed is not None else random.SystemRandom().randrange(
        1 << 32)
    tmp = Path(a.records) if a.records else Path(tempfile.mkdtemp(prefix="mojolearn-arm64-"))
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"reference: {lib.path} ({lib.description}), {mojolearn.get_num_threads()} threads")
    print(f"records: {tmp}")

    failures, unrecorded = [], []
    ops_replayed, seconds = Counter(), Counter()
    n_cases = n_records = 0
    controlled = False
    it = _cases(mojolearn, lib, native)
    index = 0
    try:
        while True:
            prefix = f"c{index:03d}"
            native.set_record_dir(str(tmp), prefix)
            skipped_before = native.record_status()[1]
            t = time.perf_counter()
            try:
                case, _ = next(it)
            except StopIteration:
                break
            seconds["record (x86, Python)"] += time.perf_counter() - t
            index += 1
            written, skipped, why = native.record_status()
            if skipped > skipped_before:
                unrecorded.append(f"{case}: {skipped - skipped_before} op runs ({why})")
            files = sorted(tmp.glob(f"{prefix}-*.mlrec"))
            if a.only not in case:
                for f in files:
                    f.unlink()
                continue
            if not files:
                if skipped == skipped_before:
                    print(f"--   {case}: no op of its own (reads what the ops above wrote)")
                else:
                    print(f"--   {case}: not recorded ({skipped - skipped_before} op runs: {why})")
                continue
            if not controlled:
                result = _negative_control(runners, files, tmp, seed)
                if result is not None:
                    bad, what = result
                    failures += bad
                    controlled = True
                    print(f"negative control: one byte flipped in each compared buffer of "
                          f"{what}, one at a time: "
                          f"{'every runner reports each' if not bad else 'NOT ALL REPORTED'}")
            ops = Counter(names.get(int(f.stem.rsplit("op", 1)[1]), f.stem) for f in files)
            verdicts = []
            for name, cmd in runners.items():
                rc, out, dt = _replay(cmd, files)
                seconds[f"replay ({name})"] += dt
                if rc == 0:
                    verdicts.append(f"{name} identical")
                else:
                    verdicts.append(f"{name} DIFFERS" if rc == 1 else f"{name} ERROR")
                    failures.append(f"{case} on {name} (exit {rc}):\n{out}")
                if "scratch" in out.splitlines()[-1]:
                    verdicts[-1] += " (scratch differed, not compared)"
            ok = all(v.split()[1] == "identical" for v in verdicts)
            n_cases += 1
            n_records += len(files)
            ops_replayed.update(ops)
            oplist = ", ".join(f"{o[3:]} x{n}" if n > 1 else o[3:] for o, n in sorted(ops.items()))
            print(f"{'ok  ' if ok else 'FAIL'} {case}: {len(files)} ops ({oplist}); {'; '.join(verdicts)}")
            if not a.keep:
                for f in files:
                    f.unlink()
    finally:
        native.set_record_dir("", "")
        if not a.records and not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n{n_cases} cases, {n_records} op runs replayed by {', '.join(runners)}")
    print("op runs per op: " + ", ".join(f"{o} {n}" for o, n in sorted(ops_replayed.items())))
    missing = sorted(set(names.values()) - set(ops_replayed))
    if missing:
        print(f"ops in no record: {', '.join(missing)}")
    for u in unrecorded:
        print(f"not recorded (not replayed): {u}")
    print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()))
    for f in failures:
        print(f"\nFAILED: {f}")
    if not controlled:
        msg = "negative control: no replayed record has two written buffers"
        if a.only:
            print(f"note: {msg} (--only)")
        else:
            failures.append(msg)
    if failures or n_records == 0:
        print(f"\narm64 check: FAILED ({len(failures)} problems)")
        return 1
    print(f"\narm64 check: passed, every result byte of every replayed op equals x86's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
