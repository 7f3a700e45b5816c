"""Hugging Face Hub ids ("org/name") resolved to a local checkpoint folder.

Resolution goes through ``huggingface_hub`` (optional; ``pip install
mojolearn[hub]``): its cache first, without any network access; a download
only when the caller allows it (``download=True``) and the environment
does not forbid it (``HF_HUB_OFFLINE=1`` always does). The cache folder is
the one huggingface_hub uses (``HF_HUB_CACHE``, ``HUGGINGFACE_HUB_CACHE``,
``HF_HOME/hub``), read when the call is made.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["is_hub_id", "resolve"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# the files a checkpoint folder needs (weights in any format mojolearn reads)
_PATTERNS = ["config.json", "generation_config.json", "*.safetensors",
             "model.safetensors.index.json", "pytorch_model.bin"]


def is_hub_id(source) -> bool:
    """Whether source reads as "org/name" and is not a local path."""
    if not isinstance(source, str) or not _HUB_ID.match(source) or ".." in source:
        return False
    return not Path(source).exists()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _cache_dir():
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return os.environ[var]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None  # huggingface_hub's default


def resolve(repo_id: str, *, download: bool = False, _allow: str = "download=True") -> Path:
    """The local snapshot folder of a Hub model id.

    Parameters
    ----------
    repo_id : str
        "org/name".
    download : bool, default False
        Fetch the checkpoint files when the cache lacks them (never with
        HF_HUB_OFFLINE=1).

    Raises
    ------
    ValueError naming the id: huggingface_hub is not installed; the model is
    not in the cache and downloading is not allowed (the message says how to
    allow it); the download failed.
    """
    try:
        import huggingface_hub
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise ValueError(f"{repo_id!r} is not a local folder, and reading Hub ids needs "
                         "huggingface_hub (pip install huggingface_hub), or pass the "
                         "folder of a downloaded copy") from None
    cache = _cache_dir()
    try:
        return Path(huggingface_hub.snapshot_download(
            repo_id, cache_dir=cache, local_files_only=True, allow_patterns=_PATTERNS))
    except LocalEntryNotFoundError:
        pass
    where = cache or "huggingface_hub's default cache"
    if _offline():
        raise ValueError(f"{repo_id!r} is not a local folder, nor in the Hub cache ({where}), "
                         "and HF_HUB_OFFLINE=1 "
                         f"forbids downloading it: unset HF_HUB_OFFLINE and pass "
                         f"{_allow}, or pass a local folder") from None
    if not download:
        raise ValueError(f"{repo_id!r} is not a local folder, nor in the Hub cache ({where}): "
                         f"pass {_allow} "
                         "to fetch it, or pass a local folder") from None
    try:
        return Path(huggingface_hub.snapshot_download(
            repo_id, cache_dir=cache, allow_patterns=_PATTERNS))
    except Exception as e:  # network, authentication, unknown repository
        raise ValueError(f"downloading {repo_id!r} from the Hub failed "
                         f"({type(e).__name__}: {e})") from None
