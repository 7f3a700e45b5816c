"""Plots of the benchmark results for the documentation (docs/guide/benchmarks.rst).

Reads every bench/out/*.json written with ``--out`` by the benchmark scripts
(the schema of bench_mamba1.py: lists ``prefill`` and ``decode``; and
bench_lm.py's ``rows``: decode tokens/s per format and batch against the
floor and transformers) and writes,
per file, PNG bar charts of tokens/s, mojolearn against the other
implementation, into docs/bench/, plus docs/bench/manifest.json (the command,
the source files and the plots), which the documentation page reads. With no
results it says so and writes nothing.

    PYTHONPATH=python:. python bench/plots.py                  # bench/out -> docs/bench
    python bench/plots.py --results DIR --out DIR

Needs matplotlib (not a dependency of mojolearn; ``pip install matplotlib``).
Run it offline after the benchmarks; CI does not.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import sys
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _label(row: dict) -> str:
    parts = [f"d={row['d']}", f"B={row['B']}"]
    if "L" in row:
        parts.append(f"L={row['L']}")
    return " ".join(parts)


def lm_series(result: dict) -> list:
    """bench_lm.py rows: per model kind, decode tokens/s (all rows) of each
    format and batch, the floor's tokens/s (B / the floor's step time) and
    transformers' where it was measured (else no bar)."""
    out = []
    kinds = []
    for r in result.get("rows", []):
        if r.get("kind") not in kinds:
            kinds.append(r["kind"])
    for kind in kinds:
        rows = [r for r in result["rows"] if r["kind"] == kind]
        labels = [f"{r['format']} B={r['B']}" for r in rows]
        bars = {"mojolearn": [r["ours"]["decode_tok_s"] for r in rows],
                "floor (bytes / DRAM read)": [r["B"] / r["ours"]["floor_step_s"] for r in rows],
                "transformers generate (float32)": [
                    r["theirs"]["decode_tok_s"] if r.get("theirs") else float("nan") for r in rows]}
        out.append((f"{kind} decode", labels, bars))
    return out


def series(result: dict) -> list:
    """(title, labels, {name: tokens/s list}) per phase found in one result file."""
    if "rows" in result:
        return lm_series(result)
    out = []
    prefill = [r for r in result.get("prefill", []) if "ours_tok_s" in r]
    if prefill:
        bars = {"mojolearn": [r["ours_tok_s"] for r in prefill]}
        if all("hf_tok_s" in r for r in prefill):
            bars["transformers (PyTorch CPU)"] = [r["hf_tok_s"] for r in prefill]
        out.append(("prefill", [_label(r) for r in prefill], bars))
    decode = [r for r in result.get("decode", []) if "ours_session_ms" in r]
    if decode:
        def tok_s(r, key):
            return r["B"] * 1e3 / r[key]
        bars = {"mojolearn session.step": [tok_s(r, "ours_session_ms") for r in decode]}
        if all("ours_step_ms" in r for r in decode):
            bars["mojolearn block.step"] = [tok_s(r, "ours_step_ms") for r in decode]
        if all("hf_cached_ms" in r for r in decode):
            bars["transformers cached step"] = [tok_s(r, "hf_cached_ms") for r in decode]
        out.append(("decode", [_label(r) for r in decode], bars))
    return out


def plot(title: str, labels: list, bars: dict, path: str, subtitle: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, k = len(labels), len(bars)
    width = 0.8 / k
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * n + 2), 3.6), dpi=100)
    for i, (name, values) in enumerate(bars.items()):
        xs = [j + (i - (k - 1) / 2) * width for j in range(n)]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(n))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (log scale)")
    ax.set_title(f"{title}: {subtitle}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=os.path.join(ROOT, "bench", "out"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    args = ap.parse_args(argv)

    files = sorted(glob.glob(os.path.join(args.results, "*.json")))
    if not files:
        print(f"no results yet: no *.json in {args.results} "
              "(run e.g. bench/bench_mamba1.py --out bench/out/mamba1.json)")
        return 0
    os.makedirs(args.out, exist_ok=True)
    plots, sources = [], []
    for f in files:
        try:
            with open(f) as fh:
                result = json.load(fh)
        except (OSError, ValueError) as e:
            print(f"skipping {f}: {e}", file=sys.stderr)
            continue
        found = series(result) if isinstance(result, dict) else []
        if not found:
            print(f"skipping {f}: no prefill/decode rows")
            continue
        stem = os.path.splitext(os.path.basename(f))[0]
        threads = result.get("threads", "?")
        cpu = (result.get("machine") or {}).get("Model name", "") or result.get("cpu", "")
        subtitle = f"{stem}, {threads} thread(s), {cpu}".rstrip(", ")
        sources.append({"file": os.path.relpath(f, ROOT), "command": result.get("command"),
                        "date": result.get("date"), "loadavg_start": result.get("loadavg_start")})
        for title, labels, bars in found:
            name = f"{stem}_{title}.png".replace(" ", "_")
            plot(title, labels, bars, os.path.join(args.out, name), subtitle)
            plots.append({"file": name.replace(" ", "_"), "title": f"{stem}: {title} tokens/s",
                          "source": os.path.relpath(f, ROOT)})
            print(f"wrote {os.path.join(args.out, name)}")
    # plots of result files not read this time stay listed (their PNGs are kept)
    old = os.path.join(args.out, "manifest.json")
    if os.path.isfile(old):
        with open(old) as fh:
            before = json.load(fh)
        done = {s["file"] for s in sources}
        plots += [p for p in before.get("plots", []) if p.get("source") not in done
                  and os.path.isfile(os.path.join(args.out, p.get("file", "")))]
        sources += [s for s in before.get("sources", []) if s.get("file") not in done
                    and any(p.get("source") == s.get("file") for p in plots)]
    command = " ".join(["python bench/plots.py"] + [shlex.quote(a) for a in (argv or sys.argv[1:])])
    manifest = {"command": command,
                "made": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "sources": sources, "plots": plots}
    with open(os.path.join(args.out, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
