"""python -m mojolearn serve: a server in a child process on 127.0.0.1 and a
free port, driven with the official openai client. Every response is
compared with generating its prompt alone in this process (the same model
folder), token for token; the child is always killed at the end."""
from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

import mojolearn

from .text_model import TEXT, child_env, text_folder, text_lm, tokenizer  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

NAME = "tiny"
SERVER_ARGS = ["--max-rows", 8, "--max-queue", 64, "--max-prompt-tokens", 96,
               "--max-tokens", 20000, "--prefill-chunk", 16, "--prefix-cache-mb", 8]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


class ServerProcess:
    """`python -m mojolearn serve` in a child process, its log in a file (a
    pipe nobody reads would fill and stop the server)."""

    def __init__(self, folder, *args):
        import tempfile
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.logfile = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mojolearn", "serve", str(folder), "--model-name", NAME,
             "--host", "127.0.0.1", "--port", str(self.port), *map(str, args)],
            stdout=subprocess.DEVNULL, stderr=self.logfile, text=True, env=child_env())
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.log()}")
            try:
                if _get(self.url + "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("the server did not come up in 120 s")
            time.sleep(0.1)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.logfile.close()

    def log(self) -> str:
        self.logfile.seek(0)
        return self.logfile.read()


@pytest.fixture(scope="module")
def server(text_folder):
    srv = ServerProcess(text_folder, *SERVER_ARGS)
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=60)


def _alone(lm, prompt, max_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=0, stop=None):
    return lm.generate([prompt], max_new_tokens=max_tokens, temperature=temperature,
                       top_p=top_p, top_k=top_k, seed=seed, stop_tokens=stop)[0]


def _ids(choice):
    return choice.model_extra["token_ids"]


CASES = [  # (prompt, max_tokens, sampling)
    (TEXT[0], 12, dict(temperature=0.0)),
    (TEXT[1], 10, dict(temperature=0.8, top_p=0.9, seed=7)),
    ([5, 9, 200, 17], 9, dict(temperature=1.3, top_k=20, seed=3)),
    (TEXT[2] + TEXT[3], 14, dict(temperature=0.0)),
]


def _request(prompt, max_tokens, kw):
    extra = {"return_token_ids": True}
    if "top_k" in kw:
        extra["top_k"] = kw["top_k"]
    return dict(model=NAME, prompt=prompt, max_tokens=max_tokens, extra_body=extra,
                **{k: v for k, v in kw.items() if k != "top_k"})


@pytest.mark.parametrize("case", range(len(CASES)))
def test_completions_and_streams_give_the_tokens_and_text_of_a_run_alone(client, text_lm, case):
    prompt, n, kw = CASES[case]
    tok = tokenizer()
    ids = tok.encode(prompt).ids if isinstance(prompt, str) else prompt
    want = _alone(text_lm, ids, n, **{"temperature": 1.0, **kw})
    text = tok.decode(want[:-1] if want and want[-1] in text_lm.eos_token_ids else want)
    r = client.completions.create(**_request(prompt, n, kw))
    assert _ids(r.choices[0]) == want
    assert r.choices[0].text == text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
    assert r.choices[0].finish_reason == ("length" if len(want) == n else "stop")
    pieces, got = [], []
    for chunk in client.completions.create(**_request(prompt, n, kw), stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            got += chunk.choices[0].model_extra.get("token_ids") or []
    assert got == want and "".join(pieces) == text


def test_stop_strings_and_stop_ids_end_the_text_like_openai(client, text_lm):
    tok = tokenizer()
    ids = tok.encode(TEXT[3]).ids
    full = _alone(text_lm, ids, 40, temperature=0.0, stop=())
    text = tok.decode(full)
    # a stop string: the first 3 characters from position 10 that occur nowhere before
    at = next(i for i in range(10, len(text) - 3) if text.find(text[i:i + 3]) == i)
    stop = text[at:at + 3]
    for stream in (False, True):
        kw = dict(model=NAME, prompt=TEXT[3], max_tokens=40, temperature=0, stop=[stop, "\x00\x01"],
                  extra_body={"stop_token_ids": []})
        if stream:
            chunks = list(client.completions.create(**kw, stream=True))
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            c = client.completions.create(**kw).choices[0]
            got, reason = c.text, c.finish_reason
        assert got == text[:at] and reason == "stop"
    # text ending in the first characters of a stop string: held back, then shown at the end
    tail_stop = text[-2:] + "\U0010ffff"
    for stream in (False, True):
        kw = dict(model=NAME, prompt=TEXT[3], max_tokens=40, temperature=0, stop=tail_stop,
                  extra_body={"stop_token_ids": []})
        if stream:
            got = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)
                          if c.choices)
        else:
            got = client.completions.create(**kw).choices[0].text
        assert got == text
    # a stop token: generation ends with it, its text is not shown
    k = 6
    r = client.completions.create(model=NAME, prompt=TEXT[3], max_tokens=40, temperature=0,
                                  extra_body={"stop_token_ids": [full[k]],
                                              "return_token_ids": True}).choices[0]
    first = full.index(full[k])
    assert _ids(r) == full[:first + 1] and r.finish_reason == "stop"
    assert r.text == tok.decode(full[:first])


def test_chat_completions_use_the_chat_template(client, text_lm):
    tok = tokenizer()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Café? 日本 🙂"}]
    prompt = "<|system|>Be brief.\n<|user|>Café? 日本 🙂\n<|assistant|>"  # CHAT_TEMPLATE's text
    want = _alone(text_lm, tok.encode(prompt).ids, 10, temperature=0.0)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                       temperature=0)
    eos = want and want[-1] in text_lm.eos_token_ids
    assert r.choices[0].message.content == tok.decode(want[:-1] if eos else want)
    assert r.usage.completion_tokens == len(want)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].message.content


def test_concurrent_streams_joining_and_leaving_each_give_their_alone_run(client, server, text_lm):
    """16 streaming clients start at random times; 5 close their stream early
    (a long request, so the close, not the length, ends it) and one more
    client stops waiting for a whole response. Every finished one equals its
    run alone; the ones that left are cancelled on the server."""
    rng = random.Random(1)
    tok = tokenizer()
    before = _metric(server, "requests_cancelled_total")
    jobs = []
    for i in range(16):
        text = rng.choice(TEXT)
        cut = rng.randrange(5, len(text))
        cancel = i in (1, 4, 7, 10, 13)
        jobs.append(dict(prompt=text[:cut], n=20000 if cancel else rng.randrange(4, 24),
                         t=rng.choice([0.0, 0.9]), seed=rng.randrange(1000), cancel=cancel,
                         delay=rng.random() * 0.3))
    results = [None] * len(jobs)

    def run(i, job):
        time.sleep(job["delay"])
        stream = client.completions.create(
            model=NAME, prompt=job["prompt"], max_tokens=job["n"], temperature=job["t"],
            seed=job["seed"], stream=True, extra_body={"return_token_ids": True})
        got = []
        for chunk in stream:
            if chunk.choices:
                got += chunk.choices[0].model_extra.get("token_ids") or []
            if job["cancel"] and len(got) >= 3:
                stream.close()  # the client goes away
                break
        results[i] = got

    def leaves():  # a non-streaming client that gives up waiting
        impatient = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                  timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model=NAME, prompt=[1, 2], max_tokens=20000)

    threads = [threading.Thread(target=run, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads + [threading.Thread(target=leaves)]:
        t.start()
    for t in threads:
        t.join(120)
    n_cancel = sum(j["cancel"] for j in jobs) + 1
    assert n_cancel == 6
    for job, got in zip(jobs, results):
        want = _alone(text_lm, tok.encode(job["prompt"]).ids, job["n"] if not job["cancel"] else 3,
                      temperature=job["t"], seed=job["seed"])
        assert got is not None
        assert (got[:3] == want[:3]) if job["cancel"] else (got == want)
    # The server sees the closes and frees the rows. The bound is a liveness
    # bound, not a speed one: generous, so that a loaded 2-core machine (one
    # run missed 30 s there) does not fail a server that does cancel.
    deadline = time.monotonic() + 120
    while _metric(server, "requests_cancelled_total") - before < n_cancel:
        assert time.monotonic() < deadline, "closed streams were not cancelled"
        time.sleep(0.1)
    deadline = time.monotonic() + 120
    while _metric(server, "batch_size") != 0:
        assert time.monotonic() < deadline, "rows still busy after every client left"
        time.sleep(0.1)


def _metric(server, name) -> float:
    text = _get(server.url + "/metrics")[1]
    for line in text.splitlines():
        if line.startswith(f"mojolearn_{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name} in {text!r}")


def test_a_prompt_extending_a_cached_prefix_has_the_bits_of_a_cold_run(client, server, text_lm):
    tok = tokenizer()
    base = tok.encode(TEXT[1] + TEXT[0]).ids[:40]
    longer = base + tok.encode(TEXT[2]).ids[:12]
    hits = _metric(server, "prefix_cache_hits_total")
    first = client.completions.create(model=NAME, prompt=base, max_tokens=6, temperature=0,
                                      extra_body={"return_token_ids": True})
    assert _ids(first.choices[0]) == _alone(text_lm, base, 6, temperature=0.0)
    for prompt in (longer, base):  # extends a cached prefix; equals one
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0.7,
                                      seed=5, extra_body={"return_token_ids": True})
        assert r.usage.prompt_tokens_details.cached_tokens > 0  # it really was a hit
        assert _ids(r.choices[0]) == _alone(text_lm, prompt, 6, temperature=0.7, seed=5)
    assert _metric(server, "prefix_cache_hits_total") >= hits + 2


BAD = [  # (body, the field the 400 names)
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": 20001}, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": "3"}, "max_tokens"),
    ({"prompt": [1, 2], "temperature": -1}, "temperature"),
    ({"prompt": [1, 2], "temperature": "hot"}, "temperature"),
    ({"prompt": [1, 2], "top_p": 0}, "top_p"),
    ({"prompt": [1, 2], "top_p": 1e-60}, "top_p"),
    ({"prompt": [1, 2], "temperature": 1e-60}, "temperature"),
    ({"prompt": [1, 2], "top_k": -1}, "top_k"),
    ({"prompt": [1, 2], "seed": 2 ** 70}, "seed"),
    ({"prompt": [1, 2], "stop": 5}, "stop"),
    ({"prompt": [1, 2], "stop": [""]}, "stop"),
    ({"prompt": [1, 2], "stop_token_ids": [400]}, "stop_token_ids"),
    ({"prompt": [1, 2], "n": 2}, "n"),
    ({"prompt": [1, 2], "logprobs": 3}, "logprobs"),
    ({"prompt": [1, 2], "stream": "yes"}, "stream"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [1, 320]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": list(range(97))}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
]


def _post(server, path, body):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def test_bad_requests_get_400s_naming_the_field_and_disturb_nothing(client, server, text_lm):
    tok = tokenizer()
    ids = tok.encode(TEXT[2]).ids
    want = _alone(text_lm, ids, 30, temperature=0.9, seed=11)
    got = []

    def good():
        for chunk in client.completions.create(model=NAME, prompt=ids, max_tokens=30,
                                               temperature=0.9, seed=11, stream=True,
                                               extra_body={"return_token_ids": True}):
            got.extend(chunk.choices[0].model_extra.get("token_ids") or [] if chunk.choices
                       else [])

    t = threading.Thread(target=good)
    t.start()
    for body, field in BAD:
        status, err, _ = _post(server, "/v1/completions", dict(body, model=NAME))
        assert status == 400, (body, err)
        assert err["error"]["param"] == field and field in err["error"]["message"], (body, err)
        assert err["error"]["type"] == "invalid_request_error"
    status, err, _ = _post(server, "/v1/completions", b"{not json")
    assert status == 400 and "JSON" in err["error"]["message"]
    status, err, _ = _post(server, "/v1/completions", {"model": "other", "prompt": [1]})
    assert status == 404 and err["error"]["param"] == "model"
    status, err, _ = _post(server, "/v1/chat/completions", {"model": NAME, "messages": []})
    assert status == 400 and err["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:  # the client sees the same
        client.completions.create(model=NAME, prompt=[1], max_tokens=1, top_p=5.0)
    assert e.value.body["param"] == "top_p"
    t.join(60)
    assert got == want
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=30, temperature=0.9,
                                  seed=11, extra_body={"return_token_ids": True})
    assert _ids(r.choices[0]) == want


def test_models_health_and_metrics(server):
    status, body = _get(server.url + "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [NAME]
    assert _get(server.url + "/health") == (200, '{"status":"ok"}')
    for name in ("requests_total", "generation_tokens_total", "prompt_tokens_total",
                 "queue_length", "batch_size", "prefix_cache_hits_total",
                 "engine_last_step_seconds", "engine_step_seconds_total"):
        assert _metric(server, name) >= 0


def test_memory_is_stable_over_rounds_of_requests(server, client):
    """3 rounds of 200 short requests (8 at a time): the server's RSS after
    the third round is within 16 MiB of after the first."""
    psutil = pytest.importorskip("psutil")
    from concurrent.futures import ThreadPoolExecutor
    proc = psutil.Process(server.proc.pid)
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randrange(1, 40))] for _ in range(200)]

    def one(i):
        stream = i % 2 == 0
        r = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=4,
                                      temperature=0, stream=stream)
        return list(r) if stream else r

    rss = []
    with ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            list(pool.map(one, range(200)))
            rss.append(proc.memory_info().rss)
    print("server RSS after each round:", [f"{r / 2**20:.1f} MiB" for r in rss])
    assert rss[2] - rss[0] < 16 * 2**20, [f"{r / 2**20:.1f} MiB" for r in rss]


def test_sigterm_lets_requests_in_flight_finish_and_exits_0(text_folder, text_lm):
    srv = ServerProcess(text_folder, *SERVER_ARGS)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        stream = c.completions.create(model=NAME, prompt=[3, 4, 5], max_tokens=2000,
                                      temperature=0, stream=True,
                                      extra_body={"return_token_ids": True})
        got, reasons = [], []
        for chunk in stream:
            if chunk.choices:
                got += chunk.choices[0].model_extra.get("token_ids") or []
                reasons.append(chunk.choices[0].finish_reason)
            if len(got) == 1:
                srv.proc.terminate()  # SIGTERM with the request in flight
        assert srv.proc.wait(60) == 0, srv.log()
        lines = [ln for ln in srv.log().splitlines() if "/v1/completions status=" in ln]
        assert len(lines) == 1 and "status=200" in lines[0] and "completion_tokens=" in lines[0]
        assert got == _alone(text_lm, [3, 4, 5], 2000, temperature=0.0)
        assert reasons[-1] in ("length", "stop")
        with pytest.raises(OSError):
            _get(srv.url + "/health")
    finally:
        srv.kill()
