"""Text read from a pipe, bounded: lines of at most :data:`MAX_LINE` bytes, any
bytes at all.

``kreldctl symbolize`` reads ``perf script`` output (or addresses) from standard
input, which may be anything: invalid UTF-8 under a UTF-8 locale, a line of
megabytes with no newline.  Lines are read as bytes, at most :data:`MAX_LINE`
at a time, and decoded as UTF-8 with ``surrogateescape``, so that every byte
comes back out as it went in (write them to a stream that encodes the same
way: :func:`transparent`).  A line longer than the limit arrives in pieces
marked not whole; a reader copies those unchanged instead of parsing them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import IO, TextIO

__all__ = ["MAX_LINE", "Line", "bounded_lines", "stdin_lines", "transparent"]

# perf script's longest lines are a sample's first line and a frame with its
# DSO path (PATH_MAX 4096): 64 KiB is far past both.
MAX_LINE = 64 << 10

Line = tuple[str, bool]  # (text with its newline, whole: not a piece of a longer line)


def bounded_lines(raw: IO[bytes], limit: int = MAX_LINE) -> Iterator[Line]:
    """The lines of *raw*, each at most *limit* bytes; longer ones in pieces."""
    piece = False  # within a line longer than the limit
    while True:
        b = raw.readline(limit)
        if not b:
            return
        ends = b.endswith(b"\n")
        whole = not piece and (ends or len(b) < limit)
        yield b.decode("utf-8", "surrogateescape"), whole
        piece = not ends and len(b) == limit


def stdin_lines(limit: int = MAX_LINE) -> Iterator[Line]:
    """Standard input's lines through :func:`bounded_lines` (a text stream
    without a binary buffer, as tests substitute, is read as it is)."""
    raw = getattr(sys.stdin, "buffer", None)
    if raw is not None:
        yield from bounded_lines(raw, limit)
        return
    for line in sys.stdin:
        yield line, len(line) <= limit


def transparent(out: TextIO) -> TextIO:
    """*out*, set to write what :func:`bounded_lines` decoded back as the same
    bytes (a stream that cannot be reconfigured is returned as it is)."""
    reconfigure = getattr(out, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(encoding="utf-8", errors="surrogateescape")
    return out
