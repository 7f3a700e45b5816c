"""python -m mojolearn generate MODEL ...: generate from a checkpoint folder,
a GGUF file or a Hub id, printing tokens (or text) as they come and a final line with
prefill and decode speed and why generation stopped.

With --prompt TEXT (or text output) the model folder must hold a
tokenizer.json and the optional `tokenizers` package must be installed;
for a .gguf file the tokenizer.json beside it, else the tokenizer the file
carries (mojolearn.gguf.read_tokenizer). --prompt-ids needs neither. Text
is streamed whole characters at a time (mojolearn.textstream). Any error is one line on stderr and exit status 2
(--debug: the traceback).
"""
from __future__ import annotations

import argparse
import sys
import time

from . import lowbit
from ._cli_common import load_tokenizer, model_folder, parse_ids, report_errors

PROG = "python -m mojolearn generate"


def _parser():
    ap = argparse.ArgumentParser(prog=PROG, description="Generate tokens from a Mamba checkpoint "
                                 "folder or Hub id.")
    ap.add_argument("model", help="a folder (config.json + weights: docs/checkpoints.md), a "
                    "llama.cpp .gguf file or a Hub id org/name (from huggingface_hub's cache; "
                    "see --download)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--prompt", help="text (needs the tokenizers package and the model's "
                     "tokenizer.json; for a .gguf file without one beside it, the tokenizer "
                     "the file carries)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sample", action="store_true", help="sample (default: greedy)")
    ap.add_argument("--temperature", type=float, default=None,
                    help="sampling temperature (implies --sample; default 1.0 when sampling)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-ids", default=None,
                    help="comma-separated token ids that end generation (default: the model's "
                    "end-of-text ids; '' for none)")
    ap.add_argument("--weight-format", default=None, choices=list(lowbit.FORMATS),
                    help="format the weights are kept in (default: as the checkpoint "
                         "stores them)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--download", action="store_true",
                    help="download a Hub id missing from the cache")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    return ap


def main(argv) -> int:
    args = _parser().parse_args(argv)
    return report_errors(lambda: _run(args), prog=PROG, debug=args.debug)


def _run(args) -> int:
    import mojolearn
    from .textstream import IncrementalDecoder
    if args.threads is not None:
        mojolearn.set_num_threads(args.threads)
    prompt_ids = None if args.prompt_ids is None else parse_ids(args.prompt_ids, "--prompt-ids")
    stop = None if args.stop_ids is None else parse_ids(args.stop_ids, "--stop-ids")
    folder = model_folder(args.model, download=args.download)
    tok = load_tokenizer(folder, required=args.prompt is not None)
    prompt = tok.encode(args.prompt).ids if prompt_ids is None else prompt_ids
    sample = args.sample or args.temperature is not None
    temperature = (1.0 if args.temperature is None else args.temperature) if sample else 0.0
    t0 = time.perf_counter()
    lm = mojolearn.MambaLM(folder, weight_format=args.weight_format)
    print(f"loaded {lm} in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    if stop is None:
        stop = getattr(lm, "eos_token_ids", ())
    b = lm.batcher()
    req = b.submit(prompt, max_new_tokens=args.max_new_tokens, temperature=temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_tokens=stop)
    dec = None if tok is None else IncrementalDecoder(tok)
    times, first = [], None  # step times; the step that gave the first token
    while b.busy:
        t = time.perf_counter()
        got = b.step()
        times.append(time.perf_counter() - t)
        if first is None and req.tokens:
            first = len(times)  # a chunked prefill takes several steps
        for _, token in got:
            sys.stdout.write(dec.add(token) if dec is not None else f"{token} ")
        sys.stdout.flush()
    if dec is not None:
        sys.stdout.write(dec.finish())
    print()
    first = first or len(times)
    prefill, decode = sum(times[:first]), sum(times[first:])
    n_dec = len(req.tokens) - 1
    rate = f"{n_dec / decode:.1f} tokens/s" if decode > 0 else "n/a"
    print(f"prefill {len(prompt)} tokens in {prefill:.3f} s ({len(prompt) / prefill:.1f} "
          f"tokens/s, first token included); decode {n_dec} tokens in {decode:.3f} s ({rate}); "
          f"stopped: {req.finish_reason}")
    return 0
