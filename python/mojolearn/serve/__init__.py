"""mojolearn.serve: an OpenAI-compatible HTTP server over continuous batching.

``python -m mojolearn serve MODEL`` runs it (docs/guide/serve.rst). The
pieces, each its own module:

- ``app``: the endpoints on Starlette (``Server``, ``Server.app()``)
- ``engine``: the one thread that drives the Batcher (``Engine``)
- ``schemas``: request bodies checked field by field, OpenAI-shaped errors
- ``metrics``: the Prometheus text of /metrics
- ``chat``: chat templates
- ``ray_deployment``: replicas under Ray Serve

Needs the ``serve`` extra (starlette, uvicorn, jinja2); importing this
package alone needs none of them.
"""
