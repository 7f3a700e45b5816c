"""mojolearn.serve.ray_deployment wired to a stand-in for ray.serve (Ray
itself is not in the test extra: bench/serve_ray.py runs the deployment on
a real local Ray instance). The stand-in records what the deployment asks
of Ray Serve: replicas, the multiplexed conversation ids, and that requests
reach the replica's Server."""
from __future__ import annotations

import asyncio
import json
import sys
import types

import pytest

from .text_model import write_model

pytest.importorskip("starlette")


class _FakeServe(types.ModuleType):
    def __init__(self):
        super().__init__("ray.serve")
        self.options, self.loaded, self.header = {}, [], None

    def deployment(self, **options):
        self.options = options

        def wrap(cls):
            cls.bind = classmethod(lambda c, *a: c(*a))
            return cls
        return wrap

    def multiplexed(self, max_num_models_per_replica):
        self.options["max_models"] = max_num_models_per_replica

        def wrap(fn):
            async def load(replica, cid):
                self.loaded.append(cid)
                return await fn(replica, cid)
            return load
        return wrap

    def get_multiplexed_model_id(self):
        return self.header or ""


def test_replicas_serve_the_api_and_register_conversation_ids(tmp_path, monkeypatch):
    from starlette.requests import Request
    fake = _FakeServe()
    ray = types.ModuleType("ray")
    ray.serve = fake
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.serve", fake)
    from mojolearn.serve.ray_deployment import deployment
    replica = deployment(str(write_model(tmp_path / "m")), num_replicas=3,
                         max_conversations=7, model_name="tiny")
    assert fake.options["num_replicas"] == 3 and fake.options["max_models"] == 7
    body = json.dumps({"model": "tiny", "prompt": [1, 2], "max_tokens": 3, "temperature": 0,
                       "return_token_ids": True}).encode()

    async def call():
        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
                 "query_string": b""}
        return await replica(Request(scope, receive))
    try:
        fake.header = "conv-1"
        r = asyncio.run(call())
        assert r.status_code == 200 and fake.loaded == ["conv-1"]
        want = replica.server.model.generate([[1, 2]], max_new_tokens=3)[0]
        assert json.loads(r.body)["choices"][0]["token_ids"] == want
        fake.header = None
        assert asyncio.run(call()).status_code == 200 and fake.loaded == ["conv-1"]
    finally:
        replica.server.close()
