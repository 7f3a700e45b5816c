"""What the command-line tools share: errors reported in one line, the
model folder of a folder or Hub id, and its tokenizer."""
from __future__ import annotations

import sys
from pathlib import Path


def report_errors(run, *, prog: str, debug: bool) -> int:
    """Call run() and return its exit status; an exception becomes one line
    on stderr and status 2 (with ``debug`` it propagates, traceback and all)."""
    try:
        return run()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # every library error: one line, no traceback
        if debug:
            raise
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2


def one_line(e: BaseException) -> str:
    """An exception as one line: its message (with the class for anything
    that is not a plain ValueError/TypeError), newlines folded."""
    msg = " ".join(str(e).split()) or "(no message)"
    if isinstance(e, FileNotFoundError) and e.filename is not None and e.strerror:
        msg = f"{e.strerror}: {e.filename}"
    if type(e) in (ValueError, TypeError):
        return msg
    return f"{type(e).__name__}: {msg}"


def model_folder(source: str, *, download: bool = False) -> str:
    """The folder of ``source``: itself when it is a folder, else a Hub id
    "org/name" resolved through huggingface_hub's cache (downloaded only
    with ``download``). Anything else is returned unchanged, for MambaLM to
    refuse by name."""
    if Path(source).is_dir():
        return source
    try:
        from . import hub
    except ImportError:  # a build without Hub support: MambaLM says what it takes
        return source
    if hub.is_hub_id(source):
        return str(hub.resolve(source, download=download, _allow="--download"))
    return source


def load_tokenizer(folder, *, required: bool = False):
    """The model's tokenizer as a ``tokenizers.Tokenizer``: the folder's
    tokenizer.json; for a .gguf file the tokenizer.json beside it, else the
    tokenizer the file carries (mojolearn.gguf.read_tokenizer). None when
    there is none (or, unless ``required``, when the ``tokenizers`` package is
    missing or the file's tokenizer is not one that is read); with
    ``required`` a missing tokenizer is an error that says what to add."""
    source = Path(folder)
    gguf_file = source.suffix == ".gguf" and source.is_file()
    path = (source.parent if gguf_file else source) / "tokenizer.json"
    if gguf_file and not path.is_file():
        return _gguf_tokenizer(source, required)
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"text needs a tokenizer.json in {folder} (or give token ids)")
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        if not required:
            return None
        raise ImportError(f"{path} needs the `tokenizers` package "
                          "(pip install tokenizers)") from None
    return Tokenizer.from_file(str(path))


def _gguf_tokenizer(path: Path, required: bool):
    """The tokenizer a GGUF file carries; without ``required`` None when it
    cannot be read (the model itself may still serve token ids)."""
    from .gguf import read_tokenizer
    try:
        return read_tokenizer(path)
    except (ValueError, ImportError) as e:
        if not required:
            return None
        if isinstance(e, ImportError):
            raise
        raise ValueError(f"{e}; text needs the model's tokenizer: put its tokenizer.json "
                         f"beside {path.name} (or give token ids)") from None


def parse_ids(text: str, what: str) -> list:
    """Comma-separated integers; ValueError naming ``what`` otherwise."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
