"""Values a caller gave, in messages: whatever they are, naming one never raises."""

from __future__ import annotations

_MAX_CHARS = 80


def shown(value: object) -> str:
    """``repr(value)`` for a message, cut to about 80 characters: an int too large for
    the interpreter to write in decimal (it limits that) in hex, and an object whose
    ``repr`` raises by its type."""
    try:
        big = isinstance(value, int) and value.bit_length() > 2048
        text = hex(value) if big else repr(value)  # type: ignore[arg-type]
    except Exception:
        return f"<a {type(value).__name__}>"
    if len(text) <= _MAX_CHARS:
        return text
    return f"{text[:40]}...{text[-20:]} ({len(text)} chars)"
