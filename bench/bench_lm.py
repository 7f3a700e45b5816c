"""Whole-model generation: mojolearn.MambaLM against transformers' generate
and against the machine's floor, on a 130M-shaped model.

    PYTHONPATH=python:. python bench/bench_lm.py [--kinds mamba,mamba2]
        [--formats float32,bfloat16,int8,q8_0,q4_0] [--batches 1,8,32] [--threads 2]
        [--decode-steps 32] [--prompt 512] [--session-cache on,off]
        [--quick] [--out bench/out/lm.json]

The model: 24 layers, d_model 768, vocabulary 50280 (tied), transformers'
random initialisation, written once with save_pretrained into
bench/out/lm_<kind>/ (reused by later runs). Every measurement runs in a
fresh child process (its peak RSS is the model's), the same thread count on
every side.

Per (kind, format, B), mojolearn:
- prefill tokens/s: one prompt of --prompt tokens through the model and
  its first token (Batcher.step on a fresh request);
- decode tokens/s (aggregate): B requests with 16-token prompts, then
  --decode-steps batched steps, tokens / seconds;
- the floor: the bytes one decode step must read (every weight in its
  format, the head, the B rows' states read and written) over the DRAM
  read bandwidth measured in the same run (bench/limits.weight_read_seconds
  on a buffer of that size), and ours / floor;
- the prefill's achieved GFLOP/s and its fraction of sgemm: the
  multiply-adds of every projection of a block for the prompt's tokens
  (bench/limits.flop_model's 'proj': 2*M*K*N per matmul, M = --prompt),
  times the layers, over the prefill's time; the scan, conv, norms,
  embedding and the head's one row are not counted (so the fraction is a
  lower bound of the projections' own). sgemm: NumPy float32 on the same
  (M, K, N) shapes with --threads threads (bench/limits.sgemm_gflops),
  measured once per kind in the same run;
- peak RSS against the weights' bytes plus the states, and per stream:
  (peak RSS - RSS right after loading) / B (0 when loading was the peak);
- each of --session-cache (the Batcher's session_cache: 'on'
  keeps the decode sessions' speed cache, 'off' does not), each in its own
  child (the cache's bytes are in the table).
transformers (float32 only, B = 1 and 8): prefill (a forward of the
prompt) and decode (generate with max_new_tokens = steps + 1 minus
generate with 1, greedy, no stop token).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
D, LAYERS, VOCAB = 768, 24, 50280
SHORT = 16  # decode rounds' prompt length


def model_folder(kind: str, quick: bool) -> Path:
    """The checkpoint folder, made with transformers on first use."""
    layers = 2 if quick else LAYERS
    folder = OUT / f"lm_{kind}_{layers}"
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers
    torch.manual_seed(0)
    if kind == "mamba":
        cfg = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=layers)
        model = transformers.MambaForCausalLM(cfg)
    else:
        cfg = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=layers,
                                        head_dim=64, num_heads=2 * D // 64, n_groups=1,
                                        state_size=128, expand=2, chunk_size=256,
                                        tie_word_embeddings=True)
        model = transformers.Mamba2ForCausalLM(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return folder


def _status_mb(field: str):
    """A /proc/self/status field in MiB (VmHWM, VmRSS), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _peak_rss_mb() -> float:
    """This process image's peak RSS (VmHWM: ru_maxrss would include the
    parent's RSS at the fork, which can be the benchmark driver's whole
    transformers model)."""
    peak = _status_mb("VmHWM")
    if peak is None:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return peak


def _rss_now_mb() -> float:
    """This process's RSS now (VmRSS), or its peak where that is unknown."""
    now = _status_mb("VmRSS")
    return _peak_rss_mb() if now is None else now


def _ours(spec: dict) -> dict:
    import mojolearn
    mojolearn.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    lm = mojolearn.MambaLM(spec["folder"], weight_format=spec["format"])
    load_s = time.perf_counter() - t0
    rss_loaded = _peak_rss_mb()
    out = {"load_s": load_s, "rss_after_load_mb": rss_loaded, "rss_loaded_now_mb": _rss_now_mb()}
    prompt = [(7 * i + 3) % VOCAB for i in range(spec["prompt"])]
    best = float("inf")
    for _ in range(2):
        b = lm.batcher(prefill_chunk=None)  # whole prompts in the first step, as timed
        b.submit(prompt, max_new_tokens=1)
        t = time.perf_counter()
        b.step()
        best = min(best, time.perf_counter() - t)
    out["prefill_tok_s"] = len(prompt) / best
    B, steps = spec["B"], spec["steps"]
    cache = {"on": True, "off": False, "auto": "auto"}[spec.get("cache", "on")]
    times = []
    for _ in range(2):
        b = lm.batcher(prefill_chunk=None, session_cache=cache)  # whole prompts first, as timed
        for r in range(B):
            b.submit([(11 * r + 5 * i + 1) % VOCAB for i in range(SHORT)], max_new_tokens=steps + 2)
        b.step()  # prefill
        b.step()  # the groups' sessions open
        out["session_cache_bytes"] = b.stats.session_cache_bytes
        t = time.perf_counter()
        for _ in range(steps):
            b.step()
        times.append(time.perf_counter() - t)
    out["decode_step_s"] = min(times) / steps
    out["decode_tok_s"] = B / out["decode_step_s"]
    out["peak_rss_mb"] = _peak_rss_mb()
    states = lm.allocate_state(B)
    out["state_bytes"] = sum(memoryview(getattr(s, n)).nbytes for s in states
                             for n in type(s)._ARRAYS)
    out["weight_bytes"] = lm._blob.nbytes + sum(blk._held_bytes() for blk in lm.blocks)
    return out


def _theirs(spec: dict) -> dict:
    import torch
    import transformers
    torch.set_num_threads(spec["threads"])
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["folder"]).eval()
    prompt = torch.tensor([[(7 * i + 3) % VOCAB for i in range(spec["prompt"])]])
    out = {}
    with torch.inference_mode():
        model(prompt[:, :8])
        t = time.perf_counter()
        model(prompt)
        out["prefill_tok_s"] = prompt.shape[1] / (time.perf_counter() - t)
        B, steps = spec["B"], spec["steps"]
        ids = torch.tensor([[(11 * r + 5 * i + 1) % VOCAB for i in range(SHORT)] for r in range(B)])
        mask = torch.ones_like(ids)

        def gen(n):
            t = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                           pad_token_id=0, eos_token_id=None)
            return time.perf_counter() - t
        gen(2)
        one, many = gen(1), gen(steps + 1)
    out["decode_step_s"] = (many - one) / steps
    out["decode_tok_s"] = B / out["decode_step_s"]
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


def _child(spec: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'python'}:{ROOT}",
               OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]),
               OPENBLAS_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{spec} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _floor_s(step_bytes: int, threads: int) -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    from limits import weight_read_seconds
    return weight_read_seconds(step_bytes, threads, reps=5)


_LIMITS_KIND = {"mamba": "mamba1", "mamba2": "mamba2"}


def prefill_flops(kind: str, tokens: int, layers: int) -> float:
    """FLOPs of the projections of a prefill of `tokens` tokens through
    `layers` blocks (bench/limits.flop_model's 'proj', 2 per multiply-add)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from limits import flop_model
    return layers * flop_model(_LIMITS_KIND[kind], D, 1, tokens)["proj"]


def _sgemm_rate(kind: str, tokens: int, threads: int) -> float:
    """GFLOP/s of NumPy sgemm on one block's projection shapes with M = tokens."""
    sys.path.insert(0, str(ROOT / "bench"))
    from limits import proj_shapes, sgemm_gflops
    return sgemm_gflops(proj_shapes(_LIMITS_KIND[kind], D, tokens), threads)["gflops"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="mamba,mamba2")
    ap.add_argument("--formats", default="float32,bfloat16,int8,q8_0,q4_0")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--session-cache", default="on,off",
                    help="the decode sessions' speed cache: on, off or both (on,off)")
    ap.add_argument("--quick", action="store_true", help="2 layers, B=1, float32: a smoke run")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        spec = json.loads(a.child)
        print(json.dumps(_ours(spec) if spec["side"] == "ours" else _theirs(spec)))
        return 0
    sys.path.insert(0, str(ROOT / "bench"))
    from _harness import cpu_name
    formats = ["float32"] if a.quick else a.formats.split(",")
    batches = [1] if a.quick else [int(b) for b in a.batches.split(",")]
    rows, raw = [], []
    print(f"# MambaLM generation, {'2' if a.quick else LAYERS} layers, d_model {D}, vocab "
          f"{VOCAB}; {cpu_name()}, {a.threads} threads; load {os.getloadavg()[0]:.2f}")
    for kind in a.kinds.split(","):
        folder = str(model_folder(kind, a.quick))
        sgemm = _sgemm_rate(kind, a.prompt, a.threads)
        flops = prefill_flops(kind, a.prompt, 2 if a.quick else LAYERS)
        theirs = {}
        if not a.no_transformers:
            for B in [b for b in batches if b in (1, 8)]:
                theirs[B] = _child({"side": "theirs", "folder": folder, "B": B,
                                    "steps": max(4, a.decode_steps // 4), "prompt": a.prompt,
                                    "threads": a.threads})
        caches = a.session_cache.split(",")
        for fmt, B, cache in [(f, B, c) for f in formats for B in batches for c in caches]:
            ours = _child({"side": "ours", "folder": folder, "format": fmt, "B": B,
                           "steps": a.decode_steps, "prompt": a.prompt,
                           "threads": a.threads, "cache": cache})
            step_bytes = ours["weight_bytes"] + 2 * ours["state_bytes"]
            floor = _floor_s(step_bytes, a.threads)
            ours["floor_step_s"] = floor["seconds"]
            ours["read_gbps"] = floor["gbps"]
            ours["step_bytes"] = step_bytes
            ours["prefill_gflops"] = flops / a.prompt * ours["prefill_tok_s"] / 1e9
            ours["sgemm_gflops"] = sgemm
            t = theirs.get(B) if fmt == "float32" else None
            raw.append({"kind": kind, "format": fmt, "B": B, "session_cache": cache,
                        "ours": ours, "theirs": t})
            per_stream = (ours["peak_rss_mb"] - ours["rss_loaded_now_mb"]) / B
            rows.append(
                f"| {kind} | {fmt} | {B} | {cache} | {ours['prefill_tok_s']:.0f} | "
                f"{ours['prefill_gflops']:.0f} / {sgemm:.0f} "
                f"({ours['prefill_gflops'] / sgemm:.0%}) | "
                f"{ours['decode_tok_s']:.1f} | {ours['decode_step_s'] * 1e3:.2f} | "
                f"{floor['seconds'] * 1e3:.2f} ({floor['gbps']:.1f} GB/s) | "
                f"{ours['decode_step_s'] / floor['seconds']:.2f} | "
                + (f"{t['prefill_tok_s']:.0f} / {t['decode_tok_s']:.1f} | "
                   f"{ours['decode_tok_s'] / t['decode_tok_s']:.1f}x | " if t else "- | - | ")
                + f"{ours['peak_rss_mb']:.0f} / "
                f"{(ours['weight_bytes'] + ours['state_bytes']) / 2**20:.0f} | "
                f"{per_stream:.1f} / {ours['state_bytes'] / B / 2**20:.1f} / "
                f"{ours['session_cache_bytes'] / B / 2**20:.1f} |")
            print(rows[-1], flush=True)
    header = ("| kind | format | B | session cache | prefill tok/s | "
              "prefill proj GFLOP/s / sgemm (fraction) | decode tok/s (all rows) | "
              "ms/step | floor ms/step (read GB/s) | step / floor | "
              "transformers prefill / decode tok/s | decode vs transformers | "
              "peak RSS MB / weights+states MB | per stream MB: peak RSS / states / cache |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    table = header + "\n" + "\n".join(rows)
    print(table)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"cpu": cpu_name(), "threads": a.threads,
                                           "command": " ".join(sys.argv), "rows": raw,
                                           "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
