"""Streaming text out of generated tokens: incremental detokenisation that
never shows a partial character, and stop strings cut the way OpenAI's API
cuts them.

A byte-level BPE token can end in the middle of a UTF-8 sequence ("é" or
"日" split over two tokens, an emoji over up to four), so decoding the
tokens so far shows U+FFFD for the unfinished tail. ``IncrementalDecoder``
decodes a short window of recent tokens, emits only the text that follows
the window's already-shown part and holds the rest back while it ends in an
unfinished sequence; ``finish`` flushes what is held. The pieces join to the
text of decoding all tokens at once.

``StopText`` watches the streamed text for stop strings: it holds back any
tail that could still become one, and once one appears the text ends just
before it (the stop string itself is not part of the output).

Thread safety: each object serves one stream and is used by one thread at a
time.
"""
from __future__ import annotations

_REPLACEMENT = "\ufffd"
# Tokens held back while the text ends unfinished, at most: a UTF-8
# sequence is 4 bytes and every byte-level token holds at least one, so a
# longer unfinished run is a real decoding error and is shown as it is.
_MAX_HELD = 8


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces that are whole characters.

    Parameters
    ----------
    tokenizer : object with ``decode(ids, skip_special_tokens=...)``
        A ``tokenizers.Tokenizer`` (or anything with that method).
    skip_special_tokens : bool, default True
        Leave special tokens (end of text, ...) out of the text.

    Examples
    --------
    >>> from mojolearn.textstream import IncrementalDecoder
    >>> class Bytes:                      # a tokenizer whose tokens are bytes
    ...     def decode(self, ids, skip_special_tokens=True):
    ...         return bytes(ids).decode("utf-8", errors="replace")
    >>> dec = IncrementalDecoder(Bytes())
    >>> [dec.add(b) for b in "é!".encode()]      # é is two bytes: held, then shown whole
    ['', 'é', '!']
    >>> dec.finish(), dec.text
    ('', 'é!')
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = bool(skip_special_tokens)
        self._ids = []
        self._start = 0  # window start: tokens before it are shown and never decoded again
        self._shown = 0  # tokens up to here are shown (the window's shown part is [start, shown))
        self._pieces = []

    def _decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=self._skip)

    def add(self, token: int) -> str:
        """Take one token; return the newly finished text ('' if none yet)."""
        self._ids.append(int(token))
        shown = self._decode(self._ids[self._start:self._shown])
        text = self._decode(self._ids[self._start:])
        unfinished = text.endswith(_REPLACEMENT) and len(self._ids) - self._shown < _MAX_HELD
        if len(text) <= len(shown) or unfinished:
            return ""
        piece = text[len(shown):]
        self._start, self._shown = self._shown, len(self._ids)
        self._pieces.append(piece)
        return piece

    def finish(self) -> str:
        """Flush what is held back (even an unfinished sequence, as U+FFFD)."""
        shown = self._decode(self._ids[self._start:self._shown])
        text = self._decode(self._ids[self._start:])
        piece = text[len(shown):]
        self._start = self._shown = len(self._ids)
        if piece:
            self._pieces.append(piece)
        return piece

    @property
    def tokens(self) -> list:
        """All tokens taken so far."""
        return list(self._ids)

    @property
    def text(self) -> str:
        """The text emitted so far (the pieces joined)."""
        return "".join(self._pieces)


class StopText:
    """Cuts streamed text at the first stop string.

    Parameters
    ----------
    stops : sequence of str
        Non-empty strings; the output ends just before the first one that
        appears (none: text passes through unchanged).

    Examples
    --------
    >>> from mojolearn.textstream import StopText
    >>> s = StopText(["END"])
    >>> s.feed("abc E"), s.feed("N"), s.feed("Dx"), s.stopped
    ('abc ', '', '', True)
    >>> t = StopText(["END"]); t.feed("abc EN"), t.finish()
    ('abc ', 'EN')
    """

    def __init__(self, stops):
        self._stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Take more text; return what is safe to show (never part of a stop
        string). After a stop string appears, everything is dropped."""
        if self.stopped:
            return ""
        if not self._stops:
            return piece
        buf = self._held + piece
        cut = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held, self.stopped = "", True
            return buf[:cut]
        keep = 0  # the longest tail of buf that begins some stop string
        for n in range(min(self._longest - 1, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                keep = n
                break
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def finish(self) -> str:
        """The held tail at the end of generation (it never became a stop string)."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held
