"""The SymCache, symbolic's line table (raw format version 9), as numpy
arrays: read from the bytes the DWARF reader writes, and two merged into one.

The layout (symbolic-symcache's ``raw::v9``): a preamble (magic ``SYMC``,
version), a 72-byte header whose six u32 counts start at byte 44 (files,
functions, source locations, ranges, string bytes, then a reserved word),
then files (6 u32: string offsets), functions (4 u32: name, compilation
directory, entry pc, language), source locations (4 u32: file, line,
function, the call location it was inlined into), range starts (u32) and
the string table, each section aligned to 8 bytes.  The last source
locations, one per range, are the ranges' innermost; the ones before are
call locations, which the others' ``inlined_into`` point at.  ``0xffffffff``
is "none" in every field; a range whose location has no function is a gap
(symbolic ends every function with one).

:func:`merge` puts together the SymCaches of two readers that each read
part of one file's units (:mod:`kreld.debuginfo.lines_spawn`), both with the
file's symbol table: as symbolic's one pass puts a function's ranges over
the symbols' and the gaps, a range from a function of the DWARF (a language
known) wins over one from a symbol or a gap, whichever cache it is in.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kreld.core.errors import LineTableError

if TYPE_CHECKING:
    from numpy.typing import NDArray

__all__ = ["SymCache", "merge"]

MAGIC = b"SYMC"
VERSION = 9
NONE = 0xFFFFFFFF
_COUNTS = struct.Struct("<6I")
_COUNTS_AT = 44
HEADER_END = 8 + 72
_WIDTHS = (6, 4, 4, 1)  # files, functions, source locations, ranges: u32 each
_FILE_STRINGS = 6  # every field of a file is a string offset
_FUNC_STRINGS = (0, 1)  # a function's name and compilation directory


def _align8(n: int) -> int:
    return (n + 7) & ~7


@dataclass
class SymCache:
    """One SymCache's sections (see the module's docstring)."""

    head: bytes  # the preamble and header, counts and all (debug id, arch kept)
    files: NDArray[np.uint32]  # (n, 6)
    funcs: NDArray[np.uint32]  # (n, 4)
    locs: NDArray[np.uint32]  # (n, 4): the call locations, then one per range
    starts: NDArray[np.uint32]  # (ranges,)
    strings: bytes

    @classmethod
    def parse(cls, raw: bytes, path: str) -> SymCache:
        """*raw*'s sections, each within *raw* (else a named error)."""
        if len(raw) < HEADER_END or raw[:4] != MAGIC:
            raise LineTableError(path, "the reader produced no SymCache")
        version = struct.unpack_from("<I", raw, 4)[0]
        if version != VERSION:
            raise LineTableError(path, f"SymCache version {version}, this kreld reads {VERSION}")
        counts = _COUNTS.unpack_from(raw, _COUNTS_AT)
        pos = _align8(HEADER_END)
        arrays = []
        for count, width in zip(counts[:4], _WIDTHS, strict=True):
            if pos + 4 * count * width > len(raw):
                raise LineTableError(path, "a SymCache shorter than its header says")
            a = np.frombuffer(raw, dtype="<u4", count=count * width, offset=pos)
            arrays.append(a.reshape(count, width))
            pos = _align8(pos + 4 * count * width)
        files, funcs, locs, starts = arrays
        if len(starts) > len(locs) or pos + counts[4] > len(raw):
            raise LineTableError(path, "a SymCache shorter than its header says")
        return cls(raw[:HEADER_END], files, funcs, locs, starts[:, 0], raw[pos : pos + counts[4]])

    @property
    def calls(self) -> NDArray[np.uint32]:
        """The call locations (the source locations before the ranges')."""
        return self.locs[: len(self.locs) - len(self.starts)]

    @property
    def ranged(self) -> NDArray[np.uint32]:
        """Each range's innermost source location."""
        return self.locs[len(self.locs) - len(self.starts) :]

    def to_bytes(self) -> bytes:
        counts = (len(self.files), len(self.funcs), len(self.locs), len(self.starts),
                  len(self.strings))  # fmt: skip
        head = bytearray(self.head)
        reserved = _COUNTS.unpack_from(head, _COUNTS_AT)[5]
        _COUNTS.pack_into(head, _COUNTS_AT, *counts, reserved)
        parts = [bytes(head)]
        for a in (self.files, self.funcs, self.locs, self.starts):
            parts.append(b"\0" * (_align8(sum(map(len, parts))) - sum(map(len, parts))))
            parts.append(np.ascontiguousarray(a, dtype="<u4").tobytes())
        parts.append(b"\0" * (_align8(sum(map(len, parts))) - sum(map(len, parts))))
        parts.append(self.strings)
        return b"".join(parts)


def _shifted(a: NDArray[np.uint32], by: int) -> NDArray[np.uint32]:
    """*a* + *by*, "none" kept."""
    return np.where(a == NONE, NONE, a + np.uint32(by)).astype(np.uint32)


def _renumbered(b: SymCache, a: SymCache) -> SymCache:
    """*b* with its strings, files, functions and call locations numbered
    after *a*'s (the merged cache holds *a*'s first)."""
    files = _shifted(b.files, len(a.strings))
    funcs = b.funcs.copy()
    for k in _FUNC_STRINGS:
        funcs[:, k] = _shifted(b.funcs[:, k], len(a.strings))
    locs = np.column_stack([
        _shifted(b.locs[:, 0], len(a.files)), b.locs[:, 1],
        _shifted(b.locs[:, 2], len(a.funcs)), _shifted(b.locs[:, 3], len(a.calls)),
    ]).astype(np.uint32)  # fmt: skip
    return SymCache(b.head, files, funcs, locs, b.starts, b.strings)


def _at(
    c: SymCache, keys: NDArray[np.uint32]
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.bool_]]:
    """For each of *keys*: the range of *c* it lies in (-1: before any), that
    range's start (-1: none), and whether it is a function of the DWARF's."""
    i = np.searchsorted(c.starts, keys, side="right").astype(np.int64) - 1
    if not len(c.starts):
        return i, np.full(len(keys), -1, dtype=np.int64), np.zeros(len(keys), dtype=bool)
    at = np.maximum(i, 0)
    start = np.where(i >= 0, c.starts[at].astype(np.int64), -1)
    func = np.where(i >= 0, c.ranged[at, 2], NONE)
    dwarf = func != NONE
    dwarf[dwarf] = c.funcs[func[dwarf], 3] != NONE  # a symbol's function has no language
    return i, start, dwarf


def merge(a: SymCache, b: SymCache) -> SymCache:
    """One SymCache of two readers' (see the module's docstring): *a*'s
    sections, then *b*'s renumbered; at each range start of either, the
    range a function of the DWARF has there (of the two, the one that began
    later, *b*'s where both began at once), else the later of the two."""
    keys = np.concatenate([a.starts, b.starts]).astype(np.uint32)
    keys.sort(kind="stable")  # two sorted runs (np.union1d hashes: ten times slower here)
    keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])]
    ia, key_a, dwarf_a = _at(a, keys)
    ib, key_b, dwarf_b = _at(b, keys)
    b = _renumbered(b, a)
    take_b = np.where(dwarf_a == dwarf_b, key_b >= np.where(dwarf_a, key_a, key_a + 1), dwarf_b)
    # Where a start of one changes nothing the other said, it goes.
    which = np.where(take_b, ib + (1 << 40), ia)
    keep = np.ones(len(keys), dtype=bool)
    keep[1:] = which[1:] != which[:-1]
    keys, take_b, ia, ib = keys[keep], take_b[keep], ia[keep], ib[keep]
    # The ranges' locations of both, a gap last: each key's, by index.
    ranged = np.concatenate([a.ranged, b.ranged, np.full((1, 4), NONE, dtype=np.uint32)])
    pick = np.where(take_b, ib + len(a.starts), ia)
    pick[np.where(take_b, ib, ia) < 0] = len(ranged) - 1
    locs = np.concatenate([a.calls, b.calls, ranged[pick]])
    return SymCache(a.head, np.concatenate([a.files, b.files]), np.concatenate([a.funcs, b.funcs]),
                    locs, keys, a.strings + b.strings)  # fmt: skip
