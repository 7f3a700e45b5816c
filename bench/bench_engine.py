"""The Batcher as a serving engine: step times of running streams while a
long prompt joins (whole-prompt prefill against chunked prefill), and the
time to a second turn's first token with and without the prefix cache.

    PYTHONPATH=python python bench/bench_engine.py [--kind mamba2] [--d 256]
        [--layers 8] [--vocab 4096] [--streams 8] [--long 4096] [--chunk 256]
        [--threads 2]

The model: random weights (mojolearn.init_weights), written once into a
temporary folder. Steps:
1. --streams requests with 16-token prompts decode; the median step time
   over 20 steps is the baseline;
2. a --long-token prompt joins; every step until it has its first token is
   timed (the running streams get a token at each of them): the largest
   step, with prefill_chunk None (the whole prompt in one step) and
   --chunk;
3. a first turn (--long // 2 tokens) runs to its end, then a second turn
   (first turn + reply + 32 new tokens): seconds to its first token with
   prefix_cache_bytes 0 and 1 GiB.
Timings only; every request's tokens are the same in all configurations
(tests/test_engine_*.py check the bits).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def _model(args):
    import mojolearn
    from _harness import write_random_model
    folder = write_random_model(tempfile.mkdtemp(prefix="bench_engine_"), args.kind, args.d,
                                args.layers, args.vocab, emb_scale=0.1)
    return mojolearn.MambaLM(folder)


def _prompt(n, salt):
    return [(7 * i + 13 * salt + 1) % 4000 for i in range(n)]


def join_long(lm, args, chunk):
    """(median baseline step, largest step while the long prompt joins,
    steps it took) in seconds."""
    b = lm.batcher(prefill_chunk=chunk)
    for s in range(args.streams):
        b.submit(_prompt(16, s), max_new_tokens=10_000, temperature=0.8, seed=s)
    b.step()
    b.step()
    base = []
    for _ in range(20):
        t = time.perf_counter()
        b.step()
        base.append(time.perf_counter() - t)
    long = b.submit(_prompt(args.long, 99), max_new_tokens=1)
    worst, steps = 0.0, 0
    while not long.done:
        t = time.perf_counter()
        b.step()
        worst = max(worst, time.perf_counter() - t)
        steps += 1
    return statistics.median(base), worst, steps


def second_turn(lm, args, cache_bytes):
    """Seconds from submitting the second turn to its first token."""
    b = lm.batcher(prefill_chunk=args.chunk, prefix_cache_bytes=cache_bytes)
    first = _prompt(args.long // 2, 5)
    r1 = b.submit(first, max_new_tokens=16)
    list(b.run())
    t = time.perf_counter()
    r2 = b.submit(first + r1.tokens + _prompt(32, 6), max_new_tokens=1)
    list(b.run())
    return time.perf_counter() - t, r2.cached_tokens


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    from _harness import add_model_options
    add_model_options(p, kind="mamba2", d=256, layers=8, vocab=4096)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--long", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    import mojolearn
    mojolearn.set_num_threads(args.threads)
    lm = _model(args)
    print(f"{lm}, {args.streams} streams, a {args.long}-token prompt joins, "
          f"{args.threads} threads")
    print(f"{'prefill_chunk':>14} {'median step ms':>15} {'largest step ms':>16} "
          f"{'steps to join':>14}")
    for chunk in (None, args.chunk):
        base, worst, steps = join_long(lm, args, chunk)
        print(f"{str(chunk):>14} {base * 1e3:15.2f} {worst * 1e3:16.2f} {steps:14d}")
    print(f"{'prefix cache':>14} {'2nd turn first token ms':>24} {'cached tokens':>14}")
    for cache in (0, 1 << 30):
        sec, cached = second_turn(lm, args, cache)
        print(f"{('on' if cache else 'off'):>14} {sec * 1e3:24.1f} {cached:14d}")


if __name__ == "__main__":
    main()
