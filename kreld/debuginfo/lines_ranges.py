"""Line program rows as address ranges: the rows of units read apart joined
into one sorted list of ranges, cut to the address ranges a caller wants
(:mod:`kreld.debuginfo.lines_dwarf` reads the rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kreld.debuginfo.lines import NONE

if TYPE_CHECKING:
    from numpy.typing import NDArray

__all__ = ["Cols", "ProgramLines", "Rows", "Within", "cut", "joined", "ranges"]


@dataclass(frozen=True)
class ProgramLines:
    """Ranges of the line programs read: ``starts`` (absolute addresses,
    sorted, one per start), each range's ``file`` (an index of ``paths``,
    ``NONE`` past a sequence's end) and ``line``."""

    starts: NDArray[np.uint64]
    file: NDArray[np.uint32]
    line: NDArray[np.uint32]
    paths: list[str]


Cols = list[tuple["NDArray[np.uint64]", "NDArray[np.int64]", "NDArray[np.int64]", int]]
# Address ranges: their starts and their ends.
Within = tuple["NDArray[np.uint64]", "NDArray[np.uint64]"]


def ranges(cols: Cols, paths: list[str]) -> ProgramLines:
    """One range per start address: at an address a sequence ends and
    another starts, the start; among rows at one address, the last; none
    for a row at its own sequence's end."""
    if not cols:
        return ProgramLines(np.zeros(0, np.uint64), np.zeros(0, np.uint32),
                            np.zeros(0, np.uint32), paths)  # fmt: skip
    addr = np.concatenate([a for a, _, _, _ in cols])
    raw = np.concatenate([f for _, f, _, _ in cols])
    shift = np.concatenate([np.full(len(f), s, dtype=np.int64) for _, f, _, s in cols])
    line = np.concatenate([n for _, _, n, _ in cols])
    # A row at its sequence's end address covers nothing: dropped, lest it
    # reach on to the next sequence's start.
    ends = np.flatnonzero(raw == -2)
    if len(ends):
        nxt = ends[np.minimum(np.searchsorted(ends, np.arange(len(addr))), len(ends) - 1)]
        keep = (raw == -2) | (addr != addr[nxt])
        addr, raw, line = addr[keep], raw[keep], line[keep]
        shift = shift[keep]
    kind = (raw != -2).astype(np.int64)  # a sequence's end sorts before a row at its address
    order = np.lexsort((np.arange(len(addr)), kind, addr))
    addr, raw, shift, line = addr[order], raw[order], shift[order], line[order]
    last = np.ones(len(addr), dtype=bool)
    last[:-1] = addr[1:] != addr[:-1]
    addr, raw, shift, line = addr[last], raw[last], shift[last], line[last]
    file = np.where(raw >= 0, raw + shift, NONE).astype(np.uint32)
    line = np.where(raw >= 0, np.clip(line, 0, NONE), 0).astype(np.uint32)
    return ProgramLines(addr, file, line, paths)


Rows = tuple["NDArray[np.uint64]", "NDArray[np.uint32]", "NDArray[np.uint32]"]


def cut(p: ProgramLines, starts: NDArray[np.uint64], ends: NDArray[np.uint64]) -> Rows:
    """The ranges of *p* within [*starts*, *ends*): each start given the
    range of *p* it lies in, each end ending it."""
    if not len(p.starts):
        return p.starts, p.file, p.line
    j = np.searchsorted(ends, p.starts, side="right")  # the first cut ending after it
    inside = (j < len(ends)) & (starts[np.minimum(j, len(ends) - 1)] <= p.starts)
    k = np.searchsorted(p.starts, starts, side="right").astype(np.int64) - 1
    kk = np.maximum(k, 0)
    none = np.full(len(ends), NONE, np.uint32)
    at = np.concatenate([p.starts[inside], starts, ends])
    file = np.concatenate([p.file[inside], np.where(k >= 0, p.file[kk], NONE), none])
    line = np.concatenate([p.line[inside], np.where(k >= 0, p.line[kk], 0), none * 0])
    return at, file.astype(np.uint32), line.astype(np.uint32)


def joined(parts: list[Rows], paths: list[str]) -> ProgramLines:
    """Ranges of units apart as one: at an address where one's range ends
    and another's starts, the start."""
    if not parts:
        return ProgramLines(np.zeros(0, np.uint64), np.zeros(0, np.uint32),
                            np.zeros(0, np.uint32), paths)  # fmt: skip
    at, file, line = (np.concatenate([part[c] for part in parts]) for c in range(3))
    order = np.lexsort((np.arange(len(at)), file != NONE, at))  # an end before a start
    at, file, line = at[order], file[order], line[order]
    last = np.ones(len(at), dtype=bool)
    last[:-1] = at[1:] != at[:-1]
    return ProgramLines(at[last], file[last], line[last], paths)
