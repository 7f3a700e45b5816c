"""mojolearn.serve on a local Ray Serve instance: 2 replicas on 127.0.0.1,
checked against generating alone, and a conversation kept on one replica.

    pip install "ray[serve]"
    PYTHONPATH=python:. python bench/serve_ray.py [--model FOLDER] [--replicas 2]
        [--conversations 4] [--turns 4] [--turn-gap 1.0]

Without --model a tiny random model with a byte-level tokenizer is written
to a temporary folder. The script
- sends completions to the Ray Serve proxy and compares each with
  ``MambaLM.generate`` of the same prompt in this process (token ids);
- runs --conversations conversations of --turns turns, each turn's prompt
  extending the previous turn's prompt and answer, with the conversation id
  in the ``serve_multiplexed_model_id`` header, and counts the turns after
  the first whose prompt came partly from a replica's prefix cache
  (usage.prompt_tokens_details.cached_tokens > 0): with affinity, all of
  them; then the same without the header, for comparison.

It is not part of the test suite: Ray is a large install, and starting a
local cluster with two replicas takes tens of seconds and several hundred
MB per process, more than the suite's time budget on a 2-core runner
allows.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def post(url, body, headers=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-gap", type=float, default=1.0,
                    help="seconds between turns (a replica reports the ids it holds to the "
                    "routers periodically, so back-to-back turns may miss it)")
    args = ap.parse_args()
    import ray
    from ray import serve

    import mojolearn
    from mojolearn.serve.ray_deployment import deployment
    sys.path.insert(0, str(ROOT))
    if args.model is None:
        from tests.text_model import write_model
        folder = write_model(tempfile.mkdtemp(prefix="mojolearn_ray_"))
    else:
        folder = Path(args.model)
    lm = mojolearn.MambaLM(folder)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    ray.init(num_cpus=max(2, args.replicas), include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": ":".join(sys.path)}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(deployment(str(folder), num_replicas=args.replicas, threads=1,
                         model_name="tiny", batcher_options={"prefix_cache_bytes": 8 << 20},
                         ray_actor_options={"num_cpus": 0.5}), route_prefix="/")
    url = f"http://127.0.0.1:{port}/v1/completions"
    print(f"ray serve up with {args.replicas} replicas in {time.perf_counter() - t0:.1f} s")
    try:
        same = 0
        for i in range(8):
            prompt = [1 + i, 7, 9 + i, 30]
            r = post(url, {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.9,
                           "seed": i, "return_token_ids": True, "stop_token_ids": []})
            want = lm.generate([prompt], max_new_tokens=8, temperature=0.9, seed=i,
                               stop_tokens=())[0]
            same += r["choices"][0]["token_ids"] == want
        print(f"completions equal to generating alone: {same}/8")
        for affinity in (True, False):
            hits = 0
            for c in range(args.conversations):
                prompt = [2 + c, 3, 4]
                for turn in range(args.turns):
                    headers = {"serve_multiplexed_model_id": f"conv-{c}"} if affinity else {}
                    r = post(url, {"model": "tiny", "prompt": prompt, "max_tokens": 6,
                                   "temperature": 0, "return_token_ids": True,
                                   "stop_token_ids": []}, headers)
                    if turn and r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0:
                        hits += 1
                    prompt = prompt + r["choices"][0]["token_ids"] + [5 + turn]
                    time.sleep(args.turn_gap)
            total = args.conversations * (args.turns - 1)
            print(f"{'with' if affinity else 'without'} the conversation header: "
                  f"{hits}/{total} later turns started from a cached prefix")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
