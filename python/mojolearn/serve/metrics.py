"""/metrics: the engine's counters in Prometheus' text format (version 0.0.4).

Counters only grow; gauges are the value now. Names start with
``mojolearn_``.
"""
from __future__ import annotations

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, type, help, key in Engine.snapshot() / the server's own counts)
METRICS = [
    ("requests_total", "counter", "Requests admitted to the engine.", "requests"),
    ("requests_rejected_total", "counter", "Requests refused (400s and 503s).", "rejected"),
    ("requests_cancelled_total", "counter", "Requests cancelled (client gone or stop string).",
     "cancelled"),
    ("request_errors_total", "counter", "Requests ended by an engine error.", "errors"),
    ("prompt_tokens_total", "counter", "Prompt tokens admitted.", "prompt_tokens"),
    ("generation_tokens_total", "counter", "Tokens generated.", "generated_tokens"),
    ("prefix_cache_hits_total", "counter", "Prompt lookups that found a cached prefix state.",
     "prefix_cache_hits"),
    ("prefix_cache_misses_total", "counter", "Prompt lookups that found none.",
     "prefix_cache_misses"),
    ("prefix_cache_requests_total", "counter", "Requests that started from a cached prefix.",
     "cached_requests"),
    ("prefix_cache_tokens_total", "counter", "Prompt tokens not prefilled thanks to the cache.",
     "cached_tokens"),
    ("engine_steps_total", "counter", "Engine steps run.", "steps"),
    ("engine_step_seconds_total", "counter", "Seconds spent in engine steps.", "step_seconds"),
    ("engine_last_step_seconds", "gauge", "Duration of the last engine step.",
     "last_step_seconds"),
    ("queue_length", "gauge", "Requests waiting for a row.", "queue_length"),
    ("batch_size", "gauge", "Requests in the batch (being prefilled or decoded).", "batch_size"),
    ("prefilling_requests", "gauge", "Requests in the batch still prefilling their prompt.",
     "prefilling_requests"),
    ("prefix_cache_bytes", "gauge", "Bytes held by the prefix-state cache.",
     "prefix_cache_bytes"),
    ("prefix_cache_entries", "gauge", "Prefix states held by the cache.",
     "prefix_cache_entries"),
]


def render(values: dict) -> str:
    """The exposition text of ``values`` (missing keys are left out)."""
    lines = []
    for name, kind, text, key in METRICS:
        if key not in values:
            continue
        full = "mojolearn_" + name
        v = values[key]
        lines += [f"# HELP {full} {text}", f"# TYPE {full} {kind}",
                  f"{full} {v:.6g}" if isinstance(v, float) else f"{full} {int(v)}"]
    return "\n".join(lines) + "\n"
