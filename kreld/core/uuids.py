"""UUIDs (boot ids) as text and as 16 bytes, without the ``uuid`` module,
whose import (``platform``, ``_uuid``) costs kreldctl a few milliseconds on
every command that reads the store.  Accepts what :class:`uuid.UUID` accepts
from a string: hex digits with or without hyphens, in braces or after
``urn:uuid:``; the text form is the canonical lowercase one."""

from __future__ import annotations

__all__ = ["canonical", "to_bytes", "to_text"]

_HEX = frozenset("0123456789abcdefABCDEF")


def to_bytes(text: str) -> bytes:
    """The 16 bytes of the UUID *text* (:class:`ValueError` if it is none)."""
    h = text.replace("urn:", "").replace("uuid:", "").strip("{}").replace("-", "")
    if len(h) != 32 or not _HEX.issuperset(h):
        raise ValueError(f"badly formed UUID string: {text[:64]!r}")
    return bytes.fromhex(h)


def to_text(raw: bytes) -> str:
    """The canonical text of the 16 bytes *raw*."""
    if len(raw) != 16:
        raise ValueError(f"a UUID is 16 bytes, not {len(raw)}")
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def canonical(text: str) -> str:
    """*text* in the canonical form (:class:`ValueError` if it is no UUID)."""
    return to_text(to_bytes(text))
