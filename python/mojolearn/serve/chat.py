"""Chat templates: the Jinja template a model folder ships for turning
messages into a prompt (transformers keeps it in tokenizer_config.json's
``chat_template``, or in chat_template.jinja; llama.cpp's converter copies it
into a .gguf file's ``tokenizer.chat_template``), rendered in Jinja's sandbox.
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
    """The chat template of a model folder or a llama.cpp .gguf file, or None
    when it has none.

    A folder: tokenizer_config.json's ``chat_template`` (the default of a
    list of named ones), else chat_template.jinja. A .gguf file: those of
    the folder it is in when it has one (as a tokenizer.json beside the file
    is preferred to the file's tokenizer), else the file's
    ``tokenizer.chat_template``, its bos/eos token texts from the file's
    token ids. A malformed template key is a ValueError naming it.
    """
    path = Path(folder)
    if path.suffix == ".gguf" and path.is_file():
        return _folder_template(path.parent) or _gguf_template(path)
    return _folder_template(path)


def _folder_template(folder: Path) -> ChatTemplate | None:
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


def _gguf_template(path: Path) -> ChatTemplate | None:
    from .._gguf_tokenizer import gguf_chat_template
    from ..gguf import read_gguf
    found = gguf_chat_template(read_gguf(path).metadata, path)
    return None if found is None else ChatTemplate(*found)
