"""Error-message checks that can fail: a name must appear in the message as a
whole token, not inside another word (a plain match="x" was once satisfied
by "explicitly" and "index" in every message).

    with raises_naming(ValueError, "x", "index 3"):
        block.forward(bad)

A name is escaped (a literal, never a regex) and bounded where it starts or
ends with a word character: not next to another word character, and not
glued to a neighbour by a dot, so "h" is not found in "state.h" or "h_last_",
"x" not in "x_proj" or "x.y", "3" not in "37" or "0.3"; a sentence-ending
"." after a name is fine. Names made of symbols ("B/C", "lengths[0]",
"(2, 5, 64)", ">f4") are matched literally at their symbol ends.
"""
from __future__ import annotations

import contextlib
import re

import pytest

__all__ = ["name_pattern", "assert_names", "assert_not_names", "raises_naming"]


def name_pattern(name: str) -> str:
    """The regex that finds `name` as a whole token."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a name must be a non-empty str, got {name!r}")
    pat = re.escape(name)
    if re.match(r"\w", name):
        pat = r"(?<![\w.])" + pat
    if re.search(r"\w$", name):
        pat += r"(?!\w|\.\w)"
    return pat


def assert_names(msg: str, *names: str) -> str:
    """Assert every name is in msg as a whole token; returns msg."""
    missing = [n for n in names if not re.search(name_pattern(n), msg)]
    assert not missing, f"message {msg!r} does not name {missing!r}"
    return msg


def assert_not_names(msg: str, *names: str) -> str:
    """Assert no name is in msg as a whole token; returns msg."""
    found = [n for n in names if re.search(name_pattern(n), msg)]
    assert not found, f"message {msg!r} names {found!r}"
    return msg


@contextlib.contextmanager
def raises_naming(exc, *names: str):
    """pytest.raises(exc) whose message must name every one of `names`;
    yields pytest's ExceptionInfo."""
    if not names:
        raise TypeError("raises_naming needs at least one name (else use pytest.raises)")
    with pytest.raises(exc) as info:
        yield info
    assert_names(str(info.value), *names)
