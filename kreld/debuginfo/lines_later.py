"""The lines of gcc's merged functions, read when first asked.

Where the SymCache names a symbol without a line (a function gcc merged with
``-fipa-icf``: :mod:`kreld.debuginfo.lines_program`), the table takes the
line from the unit's line program.  Which units those are is known only
once the reader's SymCache is, and decoding their programs all takes most
of a second for a kernel (150 of its 2,800 units, on one core, after the
reader): the longest part of a first use after the reader's.

So a table is handed out before they are read.  :class:`LaterLines` holds
the units left and the address ranges each is read within.  A lookup first
reads the units its own addresses lie in (:meth:`LaterLines.settle`: for
10,000 random kernel addresses, a handful); :meth:`LaterLines.complete`
reads the rest, a few at a time, before the table is kept
(:meth:`kreld.debuginfo.lines.LineTable.to_bytes`).  The answers are the
same in any order: the units' ranges are disjoint (each cut to its own
``.debug_aranges`` range), and a table only ever gains rows and file names
(an index a call has taken stays good while another call adds).

The debug file stays mapped (read-only) until the last unit is read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kreld.debuginfo.lines import NONE
from kreld.debuginfo.lines_dwarf import Dwarf, ProgramLines
from kreld.debuginfo.lines_program import UnitCuts, unit_lines
from kreld.debuginfo.lines_ranges import joined

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from kreld.debuginfo.lines import LineTable

__all__ = ["CHUNK_S", "LaterLines"]

# complete() holds the table's lock for about this long at a time, so that a
# call needing a unit waits at most this for its turn.
CHUNK_S = 0.02


class LaterLines:
    """The units of a table whose lines are still to be read (see the
    module's docstring); *close* releases the debug file once all are."""

    def __init__(self, d: Dwarf, cuts: UnitCuts, close: Callable[[], None] = lambda: None):
        self._d = d
        self._cuts = cuts
        self._close = close
        self._left = np.ones(len(cuts), dtype=bool)
        starts = [r[0] for _, r in cuts]
        ends = [r[1] for _, r in cuts]
        units = [np.full(len(r[0]), n, dtype=np.int64) for n, (_, r) in enumerate(cuts)]
        self._starts: NDArray[np.uint64] = np.concatenate(starts or [np.zeros(0, np.uint64)])
        order = np.argsort(self._starts, kind="stable")
        self._starts = self._starts[order]
        self._ends: NDArray[np.uint64] = np.concatenate(ends or [np.zeros(0, np.uint64)])[order]
        self._unit: NDArray[np.int64] = np.concatenate(units or [np.zeros(0, np.int64)])[order]
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._left.sum())

    def settle(self, table: LineTable, addresses: NDArray[np.uint64]) -> None:
        """Read the units left that any of *addresses* (the table's own
        addresses, as :meth:`~kreld.debuginfo.lines.LineTable.frame_columns`
        takes them) lies in."""
        idx = np.searchsorted(self._starts, addresses, side="right").astype(np.int64) - 1
        ok = idx >= 0
        idx = idx[ok]
        hit = idx[addresses[ok] < self._ends[idx]]
        if not len(hit):
            return
        with self._lock:
            units = np.unique(self._unit[hit])
            units = units[self._left[units]]
            if len(units):
                self._read(table, units.tolist())

    def complete(self, table: LineTable, pause: Callable[[], None] | None = None) -> None:
        """Read every unit left, a few at a time (each turn about
        :data:`CHUNK_S`, then the lock is let go and *pause* called), then let
        the debug file go and detach from *table*."""
        while True:
            if pause is not None:
                pause()
            with self._lock:
                left = np.flatnonzero(self._left).tolist()
                if not left:
                    if table.later is self:
                        table.later = None
                    self._close()
                    return
                deadline = time.monotonic() + CHUNK_S
                read = []
                for n in left:
                    read.append(self._unit_lines([n]))
                    if time.monotonic() >= deadline:
                        break
                _add(table, read)

    def _read(self, table: LineTable, units: list[int]) -> None:
        _add(table, [self._unit_lines(units)])

    def _unit_lines(self, units: list[int]) -> ProgramLines:
        """The lines of *units*, marked read."""
        self._left[units] = False
        return unit_lines(self._d, [self._cuts[n] for n in units])


def _add(table: LineTable, programs: list[ProgramLines]) -> None:
    """Add the ranges of *programs* (absolute addresses, units apart) to
    *table*'s line-program rows, their file names after the table's: the
    names first, then the rows, each swapped in whole, so that a reader
    taking either sees a consistent table."""
    files, file_offs = table.file_blob()
    paths: list[str] = []
    starts, file0, line0 = table.program_rows()
    parts = [(starts.astype(np.uint64), file0, line0)]
    for p in programs:
        with np.errstate(over="ignore"):
            rel = p.starts - np.uint64(table.base)  # below base: wraps past 4 GiB
        keep = rel < np.uint64(1 << 32)
        first = len(file_offs) - 1 + len(paths)
        file = p.file[keep]
        file = np.where(file == NONE, NONE, file.astype(np.int64) + first).astype(np.uint32)
        parts.append((rel[keep], file, p.line[keep]))
        paths += p.paths
    if len(parts) == 1:
        return
    encoded = [p.encode() for p in paths]
    ends = np.cumsum([len(e) for e in encoded], dtype=np.int64) + int(file_offs[-1])
    if len(ends) and int(ends[-1]) >= NONE:
        return  # past the table's 4 GiB of names: not added, never a wrong line
    rows = joined(parts, [])
    table.extend(
        (files + b"".join(encoded), np.concatenate([file_offs, ends.astype(np.uint32)])),
        (rows.starts.astype(np.uint32), rows.file, rows.line),
    )
