"""The lines of gcc's merged functions and the frames symbolic drops at the
start of ``.cold`` parts, read when first asked.

Where the SymCache names a symbol without a line (a function gcc merged with
``-fipa-icf``: :mod:`kreld.debuginfo.lines_program`), the table takes the
line from the unit's line program.  Which units those are is known only
once the reader's SymCache is, and decoding their programs all takes most
of a second for a kernel (150 of its 2,800 units, on one core, after the
reader): the longest part of a first use after the reader's.

The same holds for the units of ``.cold`` parts, where symbolic may have
dropped an innermost inlined frame (:mod:`kreld.debuginfo.lines_scopes`):
their line programs say where (45 of a 6.1 kernel's 2,413 parts; 800 of its
units), and their DIEs name the frame.

So a table is handed out before they are read.  :class:`LaterLines` holds
the units left and the address ranges each is read within.  A lookup first
reads the units its own addresses lie in (:meth:`LaterLines.settle`: for
10,000 random kernel addresses, a handful); :meth:`LaterLines.complete`
reads the rest, a few at a time, before the table is kept
(:meth:`kreld.debuginfo.lines.LineTable.to_bytes`).  The answers are the
same in any order: the units' ranges are disjoint (each cut to its own
``.debug_aranges`` range), and a table only ever gains rows and file names
(an index a call has taken stays good while another call adds), and
the frames put back before a chain lie in windows apart.

The debug file stays mapped (read-only) until the last unit is read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kreld.debuginfo.lines import NONE
from kreld.debuginfo.lines_dwarf import Dwarf, ProgramLines, Within
from kreld.debuginfo.lines_program import UnitCuts, cold_windows, unit_lines
from kreld.debuginfo.lines_ranges import joined
from kreld.debuginfo.lines_scopes import innermost_inlined

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from kreld.debuginfo.lines import LineTable

__all__ = ["CHUNK_S", "LaterLines"]


def _nothing() -> None:
    pass


# complete() holds the table's lock for about this long at a time, so that a
# call needing a unit waits at most this for its turn.
CHUNK_S = 0.02


# What is read of one unit: its offset in .debug_info, the ranges its line
# program's lines are cut to, and the first bytes of its .cold parts, where
# the SymCache may lack an innermost frame (either None).
_Job = tuple[int, "Within | None", "Within | None"]


class LaterLines:
    """The units of a table whose lines are still to be read (see the
    module's docstring): *cuts*, the units of gcc's merged functions with the
    ranges read; *colds*, the units of ``.cold`` parts with their first
    bytes, where symbolic may have dropped an innermost inlined frame
    (:func:`~kreld.debuginfo.lines_program.cold_windows`,
    :mod:`kreld.debuginfo.lines_scopes`).  *close* releases the debug file
    once all are read."""

    def __init__(
        self,
        d: Dwarf,
        cuts: UnitCuts,
        colds: UnitCuts | None = None,
        close: Callable[[], None] = _nothing,
    ):
        self._d = d
        self._close = close
        lines_of, colds_of = dict(cuts), dict(colds or [])
        self._jobs: list[_Job] = [(o, lines_of.get(o), colds_of.get(o))
                                  for o in sorted(set(lines_of) | set(colds_of))]  # fmt: skip
        self._left = np.ones(len(self._jobs), dtype=bool)
        spans = [(r, n) for n, (_, *kinds) in enumerate(self._jobs) for r in kinds if r is not None]
        none = [np.zeros(0, np.uint64)]
        starts = np.concatenate([r[0] for r, _ in spans] or none)
        order = np.argsort(starts, kind="stable")
        self._starts: NDArray[np.uint64] = starts[order]
        self._ends: NDArray[np.uint64] = np.concatenate([r[1] for r, _ in spans] or none)[order]
        self._unit: NDArray[np.int64] = np.concatenate(
            [np.full(len(r[0]), n, dtype=np.int64) for r, n in spans] or [np.zeros(0, np.int64)]
        )[order]
        # The windows of units read whose frames are not named yet (each
        # named when a lookup meets it, or by complete): (start, end, unit
        # offset, the covering row's file and line).
        self._windows: list[tuple[int, int, int, str, int]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._left.sum()) + len(self._windows)

    def settle(self, table: LineTable, addresses: NDArray[np.uint64]) -> None:
        """Read the units left that any of *addresses* (the table's own
        addresses, as :meth:`~kreld.debuginfo.lines.LineTable.frame_columns`
        takes them) lies in."""
        idx = np.searchsorted(self._starts, addresses, side="right").astype(np.int64) - 1
        ok = idx >= 0
        idx = idx[ok]
        hit = idx[addresses[ok] < self._ends[idx]]
        if not len(hit) and not self._windows:
            return
        with self._lock:
            units = np.unique(self._unit[hit])
            units = units[self._left[units]]
            read = [self._read(n) for n in units.tolist()]
            frames = self._frames(table, addresses)
            if read or frames:
                _add(table, read, frames)

    def complete(self, table: LineTable, pause: Callable[[], None] | None = None) -> None:
        """Read every unit left, a few at a time (each turn about
        :data:`CHUNK_S`, then the lock is let go and *pause* called), then let
        the debug file go and detach from *table*."""
        while True:
            if pause is not None:
                pause()
            with self._lock:
                left = np.flatnonzero(self._left).tolist()
                if not left and not self._windows:
                    if table.later is self:
                        table.later = None
                    self._close()
                    return
                deadline = time.monotonic() + CHUNK_S
                read = []
                for n in left:
                    read.append(self._read(n))
                    if time.monotonic() >= deadline:
                        break
                frames = [] if left else self._frames(table, None, deadline)
                _add(table, read, frames)

    def _read(self, n: int) -> ProgramLines:
        """Unit *n*'s lines, marked read; its windows kept to be named."""
        self._left[n] = False
        offset, lines, cold = self._jobs[n]
        if cold is not None:
            self._windows += [(s, e, offset, p, n) for s, e, p, n in
                              cold_windows(self._d, offset, cold[0])]  # fmt: skip
        return unit_lines(self._d, [] if lines is None else [(offset, lines)])

    def _frames(
        self, table: LineTable, addresses: NDArray[np.uint64] | None, deadline: float = 0.0
    ) -> list[tuple[int, int, str, str, int]]:
        """The frames of the windows left that hold one of *addresses* (all:
        None, until *deadline*), those windows then taken out: in each range
        of *table* there with a call site (an inlined call begins there), the
        innermost inlined function (:mod:`kreld.debuginfo.lines_scopes`)."""
        frames = []
        kept = []
        for w in self._windows:
            start, end, offset, path, line = w
            met = addresses is None and time.monotonic() < deadline
            if addresses is not None:
                met = bool(((addresses >= start) & (addresses < end)).any())
            if not met:
                kept.append(w)
                continue
            for lo, hi in _call_sites(table, start, end):
                name = innermost_inlined(self._d, offset, lo)
                if name is not None:
                    frames.append((lo, hi, name, path, line))
        self._windows = kept
        return frames


def _call_sites(table: LineTable, start: int, end: int) -> list[tuple[int, int]]:
    """The parts of [*start*, *end*) (absolute) of *table*'s ranges whose
    innermost location has a file: in a window no line-program row is in
    (:func:`~kreld.debuginfo.lines_program.cold_windows`), each an inlined
    call's call site."""
    lo, hi = start - table.base, end - table.base
    if not 0 <= lo < hi <= 1 << 32:
        return []
    starts = table.starts
    i = max(int(np.searchsorted(starts, np.uint32(lo), side="right")) - 1, 0)
    out = []
    while i < len(starts) and int(starts[i]) < hi:
        a = max(int(starts[i]), lo)
        b = min(int(starts[i + 1]) if i + 1 < len(starts) else hi, hi)
        if a < b and table.loc_file[table.loc_first + i] != NONE:
            out.append((a + table.base, b + table.base))
        i += 1
    return out


def _add(
    table: LineTable, programs: list[ProgramLines], added: list[tuple[int, int, str, str, int]]
) -> None:
    """Add to *table* the line-program ranges of *programs* (absolute
    addresses, units apart: :meth:`LaterLines._read`) to its rows, and the
    innermost frames *added* (:meth:`LaterLines._frames`); the names they
    use after the table's.  The names first, then the rows and frames, each
    swapped in whole, so that a reader taking any sees a consistent table."""
    files, file_offs = table.file_blob()
    names, func_offs = table.func_blob()
    base = np.uint64(table.base)
    paths: list[str] = []
    funcs: list[str] = []
    starts, file0, line0 = table.program_rows()
    parts = [(starts.astype(np.uint64), file0, line0)]
    frames: list[tuple[int, int, int, int, int]] = []
    for program in programs:
        with np.errstate(over="ignore"):
            rel = program.starts - base  # below base: wraps past 4 GiB
        keep = rel < np.uint64(1 << 32)
        first = len(file_offs) - 1 + len(paths)
        file = program.file[keep]
        file = np.where(file == NONE, NONE, file.astype(np.int64) + first).astype(np.uint32)
        parts.append((rel[keep], file, program.line[keep]))
        paths += program.paths
    for start, end, func, path, line in added:
        if table.base <= start < end <= table.base + (1 << 32):
            file_at = NONE if not path else len(file_offs) - 1 + len(paths)
            frames.append((start - table.base, end - table.base,
                           len(func_offs) - 1 + len(funcs), file_at, line))  # fmt: skip
            funcs.append(func)
            paths += [path] if path else []
    if len(parts) == 1 and not frames:
        return
    new_files, new_names = _blob(files, file_offs, paths), _blob(names, func_offs, funcs)
    if new_files is None or new_names is None:
        return  # past the table's 4 GiB of names: not added, never a wrong line
    rows = joined(parts, [])
    added_arrays = None
    if frames:
        old = table.frames_added()
        cols = [np.concatenate([o.astype(np.int64), np.array(c, dtype=np.int64)])
                for o, c in zip(old, zip(*frames, strict=True), strict=True)]  # fmt: skip
        order = np.argsort(cols[0], kind="stable")
        added_arrays = tuple(np.clip(c[order], 0, NONE).astype(np.uint32) for c in cols)
    table.extend(new_files, (rows.starts.astype(np.uint32), rows.file, rows.line), new_names,
                 added_arrays)  # fmt: skip


def _blob(
    blob: bytes, offs: NDArray[np.uint32], more: list[str]
) -> tuple[bytes, NDArray[np.uint32]] | None:
    """*blob* and its offsets with the strings *more* after them (None past
    4 GiB)."""
    if not more:
        return blob, offs
    encoded = [m.encode() for m in more]
    ends = np.cumsum([len(e) for e in encoded], dtype=np.int64) + int(offs[-1])
    if int(ends[-1]) >= NONE:
        return None
    return blob + b"".join(encoded), np.concatenate([offs, ends.astype(np.uint32)])
