"""Chat templates: the Jinja template a model folder ships for turning
messages into a prompt (transformers keeps it in tokenizer_config.json's
``chat_template``, or in chat_template.jinja), rendered in Jinja's sandbox.
"""
from __future__ import annotations

import json
from pathlib import Path


class ChatTemplate:
    """A folder's chat template.

    Parameters
    ----------
    source : str
        The Jinja template text.
    special : dict
        Extra names the template may use (bos_token, eos_token).
    """

    def __init__(self, source: str, special: dict | None = None):
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source)
        self._special = dict(special or {})

    def render(self, messages: list) -> str:
        """The prompt text for ``messages`` with the assistant's turn opened."""
        return self._template.render(messages=messages, add_generation_prompt=True,
                                     **self._special)


def _raise(message):
    raise ValueError(message)


def _token_text(v):
    return v.get("content") if isinstance(v, dict) else v


def load_chat_template(folder) -> ChatTemplate | None:
    """The folder's chat template, or None when it has none."""
    folder = Path(folder)
    config = {}
    path = folder / "tokenizer_config.json"
    if path.is_file():
        config = json.loads(path.read_text(encoding="utf-8"))
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: take the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    jinja = folder / "chat_template.jinja"
    if source is None and jinja.is_file():
        source = jinja.read_text(encoding="utf-8")
    if not isinstance(source, str) or not source:
        return None
    special = {k: _token_text(config.get(k)) or "" for k in ("bos_token", "eos_token")}
    return ChatTemplate(source, special)
