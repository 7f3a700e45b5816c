"""python -m mojolearn generate FOLDER ...: generate from a checkpoint folder,
printing tokens as they come and a final line with prefill and decode speed.

With --prompt TEXT (or text output) the folder must hold a tokenizer.json
and the optional `tokenizers` package must be installed; --prompt-ids needs
neither.
"""
from __future__ import annotations

import argparse
import sys
import time


def _parser():
    ap = argparse.ArgumentParser(prog="python -m mojolearn generate",
                                 description="Generate tokens from a Mamba checkpoint folder.")
    ap.add_argument("folder", help="config.json + model.safetensors (transformers' "
                    "save_pretrained layout; Mamba-3: docs/checkpoints.md)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--prompt", help="text (needs tokenizer.json and the tokenizers package)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sample", action="store_true", help="sample (default: greedy)")
    ap.add_argument("--temperature", type=float, default=None,
                    help="sampling temperature (implies --sample; default 1.0 when sampling)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-ids", default="", help="comma-separated token ids that end generation")
    ap.add_argument("--weight-format", default="float32", choices=["float32", "bfloat16", "int8"])
    ap.add_argument("--threads", type=int, default=None)
    return ap


def _ids(text: str, what: str) -> list:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"{what} must be comma-separated integers, got {text!r}") from None


def _tokenizer(folder):
    from pathlib import Path
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(str(path))


def main(argv) -> int:
    args = _parser().parse_args(argv)
    import mojolearn
    if args.threads is not None:
        mojolearn.set_num_threads(args.threads)
    tok = _tokenizer(args.folder)
    if args.prompt is not None:
        if tok is None:
            raise SystemExit("--prompt needs tokenizer.json in the folder and the `tokenizers` "
                             "package (pip install tokenizers); or give --prompt-ids")
        prompt = tok.encode(args.prompt).ids
    else:
        prompt = _ids(args.prompt_ids, "--prompt-ids")
    sample = args.sample or args.temperature is not None
    temperature = (1.0 if args.temperature is None else args.temperature) if sample else 0.0
    t0 = time.perf_counter()
    lm = mojolearn.MambaLM(args.folder, weight_format=args.weight_format)
    print(f"loaded {lm} in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    b = lm.batcher()
    req = b.submit(prompt, max_new_tokens=args.max_new_tokens, temperature=temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                   stop_tokens=_ids(args.stop_ids, "--stop-ids"))
    times, shown = [], ""
    while b.busy:
        t = time.perf_counter()
        b.step()
        times.append(time.perf_counter() - t)
        if tok is not None:
            text = tok.decode(req.tokens)
            sys.stdout.write(text[len(shown):])
            shown = text
        else:
            sys.stdout.write(f"{req.tokens[-1]} ")
        sys.stdout.flush()
    print()
    prefill, decode = times[0], sum(times[1:])
    n_dec = len(req.tokens) - 1
    rate = f"{n_dec / decode:.1f} tokens/s" if decode > 0 else "n/a"
    print(f"prefill {len(prompt)} tokens in {prefill:.3f} s ({len(prompt) / prefill:.1f} "
          f"tokens/s, first token included); decode {n_dec} tokens in {decode:.3f} s ({rate})")
    return 0
