"""JSON from checkpoint files with the nesting depth bounded.

Python's json parser recurses once per nested array or object, so a file
of a few thousand '[' raises RecursionError (or worse, with a raised
recursion limit, overflows the C stack). Every JSON a checkpoint brings
(config.json, generation_config.json, shard indexes, safetensors headers)
goes through ``loads``, which measures the depth first without recursing.
"""
from __future__ import annotations

import json
import re

MAX_DEPTH = 64  # a Mamba config nests 3 deep; safetensors headers 3

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_INNERMOST = re.compile(r"\[\]|\{\}")


def depth_exceeds(text: str, limit: int = MAX_DEPTH) -> bool:
    """Whether the brackets of JSON text (outside strings) nest deeper than
    limit. Each pass removes the innermost pairs, so at most limit passes."""
    rest = _NOT_BRACKET.sub("", _STRING.sub("", text))
    for _ in range(limit):
        rest, n = _INNERMOST.subn("", rest)
        if not n:
            break
    if _INNERMOST.search(rest):
        return True  # pairs left after limit passes: deeper than limit
    # what is left never closes; json.loads would still recurse into it
    return rest.count("[") + rest.count("{") > limit


def loads(raw, where: str):
    """The value of JSON text or bytes; ValueError naming ``where`` for
    invalid text or nesting deeper than MAX_DEPTH."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 text ({e})") from None
    if depth_exceeds(text):
        raise ValueError(f"{where} nests JSON arrays/objects deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{where} is not valid JSON ({e})") from None
    except RecursionError:  # pragma: no cover - the depth check comes first
        raise ValueError(f"{where} nests JSON too deeply") from None
