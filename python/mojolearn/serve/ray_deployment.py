"""mojolearn.serve as a Ray Serve deployment: N replicas, each with its own
model and engine thread, behind Ray Serve's HTTP proxy.

    from mojolearn.serve.ray_deployment import deployment
    from ray import serve
    serve.run(deployment("path/or/org-name", num_replicas=2), route_prefix="/")

Each replica is a ``Server`` (mojolearn.serve.app): the same endpoints,
limits, metrics and errors as ``python -m mojolearn serve``.

Keeping a conversation on one replica: a replica's prefix-state cache only
helps requests that reach it. Ray Serve routes requests that carry the
header ``serve_multiplexed_model_id`` preferably to a replica that has
already "loaded" that id (model multiplexing). A client that sends its
conversation id in that header is therefore routed back to the replica that
served the conversation's earlier turns, whose cache holds their states;
the "model" loaded per id is only a marker (the replica serves one model),
at most ``max_conversations`` per replica (least recently used first out,
as Ray Serve evicts them). Without the header Ray Serve balances requests
freely.

Ray is imported only here and only when ``deployment`` is called; it is not
a dependency of mojolearn (pip install "ray[serve]").
"""
from __future__ import annotations


def deployment(model, *, num_replicas: int = 1, max_conversations: int = 1024,
               threads: int | None = None, model_name: str | None = None,
               limits: dict | None = None, batcher_options: dict | None = None,
               download: bool = False, ray_actor_options: dict | None = None):
    """A bound Ray Serve application serving ``model`` from ``num_replicas``
    replicas (pass it to ``ray.serve.run``).

    Parameters
    ----------
    model : str
        A checkpoint folder every replica can read, or a Hub id.
    num_replicas : int
        Replicas, each with its own copy of the model and its own engine.
    max_conversations : int
        Conversation ids each replica keeps routing to itself (Ray Serve's
        multiplexed ids, see the module's notes).
    threads : int or None
        Kernel threads per replica (mojolearn.set_num_threads); also the
        CPUs each replica reserves from Ray unless ``ray_actor_options``
        says otherwise.
    model_name, limits, batcher_options
        As for ``mojolearn.serve.app.Server`` (limits: the fields of
        ``mojolearn.serve.schemas.Limits``).
    download : bool
        Download a Hub id missing from a replica's cache.
    ray_actor_options : dict or None
        Passed to ``serve.deployment`` (e.g. {"num_cpus": 8}).
    """
    from ray import serve

    actor = dict(ray_actor_options or {"num_cpus": threads or 1})
    settings = dict(model=str(model), threads=threads, model_name=model_name,
                    limits=dict(limits or {}), batcher_options=dict(batcher_options or {}),
                    download=download)

    @serve.deployment(num_replicas=num_replicas, ray_actor_options=actor)
    class MojolearnReplica:
        def __init__(self, settings):
            self.server = build_server(**settings)

        @serve.multiplexed(max_num_models_per_replica=max_conversations)
        async def conversation(self, conversation_id: str):
            return conversation_id  # a marker: this replica holds the conversation's states

        async def __call__(self, request):
            cid = serve.get_multiplexed_model_id()
            if cid:
                await self.conversation(cid)
            return await self.server.dispatch(request)

    return MojolearnReplica.bind(settings)


def build_server(model, *, threads=None, model_name=None, limits=None, batcher_options=None,
                 download=False):
    """One replica's Server: the model loaded, its tokenizer and chat
    template read (what ``python -m mojolearn serve`` does before serving)."""
    from pathlib import Path

    import mojolearn

    from .._cli_common import load_tokenizer, model_folder
    from .app import Server
    from .chat import load_chat_template
    from .schemas import Limits
    if threads is not None:
        mojolearn.set_num_threads(threads)
    folder = model_folder(model, download=download)
    name = model_name or (Path(model).name if Path(model).is_dir() else model)
    return Server(mojolearn.MambaLM(folder), tokenizer=load_tokenizer(folder),
                  chat_template=load_chat_template(folder), model_name=name,
                  limits=Limits(**(limits or {})), batcher_options=batcher_options)
