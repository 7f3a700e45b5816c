"""Load test of `python -m mojolearn serve` over loopback: streams at several
concurrency levels, one long prompt joining mid-run, with and without
chunked prefill and the prefix-state cache.

    PYTHONPATH=python:. python bench/bench_serve.py [--model FOLDER]
        [--d 768] [--layers 24] [--vocab 50280] [--kind mamba]
        [--concurrency 1,8,32] [--streams-per-level 32] [--max-tokens 64]
        [--prompt-min 16] [--prompt-max 512] [--shared-prefix 128]
        [--long-prompt 4096] [--threads 2] [--out bench/out/serve.json]
    # a smoke run in seconds:
    PYTHONPATH=python:. python bench/bench_serve.py --d 64 --layers 2 --vocab 512 \\
        --concurrency 1,4 --streams-per-level 4 --max-tokens 8 --prompt-max 64 \\
        --long-prompt 256

Without --model a random model of the given shape is written once into
bench/out/serve_<kind>_<d>_<layers>/. Per configuration (prefill chunks of
256, 'auto' or whole prompts; prefix cache 256 MiB or none) one server runs in a
child process on 127.0.0.1; per concurrency level N, N client threads keep
N streams open (--streams-per-level requests in all, random prompt lengths,
each prompt starting with a shared --shared-prefix so the cache can hit),
and once the streams run, one --long-prompt request joins. Reported per
(configuration, N): generated tokens/s over the level, time to first token
p50/p99, inter-token latency p50/p99 of the short streams, and their p99
while the long prompt was being prefilled, over the median (the target:
within 3x with chunked prefill).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
CONFIGS = [("auto+cache", "auto", 256), ("auto", "auto", 0), ("chunked+cache", 256, 256),
           ("chunked", 256, 0), ("whole+cache", 0, 256), ("whole", 0, 0)]


def make_model(kind, d, layers, vocab) -> Path:
    folder = OUT / f"serve_{kind}_{d}_{layers}_{vocab}"
    if (folder / "config.json").is_file():
        return folder
    from _harness import write_random_model
    write_random_model(folder, kind, d, layers, vocab, emb_scale=0.02)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder, port, chunk, cache_mb, args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"),
                                                       os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "mojolearn", "serve", str(folder), "--port", str(port),
           "--model-name", "bench", "--prefill-chunk", str(chunk), "--prefix-cache-mb",
           str(cache_mb), "--max-rows", str(max(args.concurrency) + 1), "--max-queue", "256",
           "--max-prompt-tokens", str(max(args.long_prompt, args.prompt_max) + 1),
           "--max-tokens", str(args.max_tokens), "--log-level", "warning"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited at start")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start")


def stream(port, prompt, max_tokens, seed):
    """One streaming completion: (submit time, [(arrival time, tokens)])."""
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.8, "seed": seed, "stream": True,
                       "stop_token_ids": [], "return_token_ids": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    events = []
    for line in r:
        if line.startswith(b"data: {"):
            ch = json.loads(line[6:])["choices"]
            n = len(ch[0].get("token_ids") or []) if ch else 0
            if n:
                events.append((time.perf_counter(), n))
    c.close()
    return t0, events


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def run_level(port, n, args, rng):
    """N concurrent streams until --streams-per-level are done, a long prompt
    joining once the first streams have their first token."""
    prefix = [rng.randrange(1, args.vocab) for _ in range(args.shared_prefix)]
    todo = [prefix + [rng.randrange(1, args.vocab) for _ in range(
        rng.randrange(args.prompt_min, args.prompt_max + 1))] for _ in range(
        args.streams_per_level)]
    results, lock = [], threading.Lock()
    started = threading.Event()
    long_window = []

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                prompt = todo.pop()
            res = stream(port, prompt, args.max_tokens, rng.randrange(1 << 30))
            started.set()
            with lock:
                results.append(res)

    def long_prompt():
        started.wait()
        prompt = [rng.randrange(1, args.vocab) for _ in range(args.long_prompt)]
        t0, ev = stream(port, prompt, 2, 0)
        long_window.extend([t0, ev[0][0] if ev else time.perf_counter()])

    t_start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(n)]
    threads.append(threading.Thread(target=long_prompt))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_start
    ttft = [ev[0][0] - t0 for t0, ev in results if ev]
    itl, itl_join = [], []
    a, b = long_window if long_window else (0.0, 0.0)
    for _, ev in results:
        for (t1, _), (t2, k) in zip(ev, ev[1:]):
            gap = (t2 - t1) / k
            itl.append(gap)
            if t2 >= a and t1 <= b:  # the gap overlaps the long prompt's prefill
                itl_join.append(gap)
    tokens = sum(k for _, ev in results for _, k in ev)
    med = pct(itl, 50)
    return {"streams": n, "tokens_per_s": tokens / wall, "ttft_p50": pct(ttft, 50),
            "ttft_p99": pct(ttft, 99), "itl_p50": med, "itl_p99": pct(itl, 99),
            "itl_p99_during_long_prefill": pct(itl_join, 99),
            "join_p99_over_median": pct(itl_join, 99) / med if itl_join and med else None,
            "long_prompt_ttft": b - a}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    from _harness import add_model_options
    add_model_options(ap, kind="mamba", d=768, layers=24, vocab=50280)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--streams-per-level", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--shared-prefix", type=int, default=128)
    ap.add_argument("--long-prompt", type=int, default=4096)
    ap.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(OUT / "serve.json"))
    args = ap.parse_args()
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    folder = Path(args.model) if args.model else make_model(args.kind, args.d, args.layers,
                                                            args.vocab)
    from _harness import cpu_name
    rows = []
    print(f"# {cpu_name()}; model {folder}; threads {args.threads or 'default'}")
    print(f"{'config':>14} {'N':>3} {'tok/s':>8} {'ttft p50':>9} {'ttft p99':>9} "
          f"{'itl p50':>8} {'itl p99':>8} {'join p99/med':>12} {'long ttft':>9}")
    wanted = args.configs.split(",")
    for name, chunk, cache in [c for c in CONFIGS if c[0] in wanted]:
        port = free_port()
        proc = start_server(folder, port, chunk, cache, args)
        try:
            for n in args.concurrency:
                r = run_level(port, n, args, random.Random(n))
                r["config"] = name
                rows.append(r)
                ratio = r["join_p99_over_median"]
                print(f"{name:>14} {n:>3} {r['tokens_per_s']:8.1f} {r['ttft_p50']:9.3f} "
                      f"{r['ttft_p99']:9.3f} {r['itl_p50'] * 1e3:7.1f}m {r['itl_p99'] * 1e3:7.1f}m "
                      f"{'-' if ratio is None else f'{ratio:.2f}':>12} "
                      f"{r['long_prompt_ttft']:9.3f}", flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": cpu_name(), "model": str(folder),
                                          "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
