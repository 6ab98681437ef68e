"""Line tables: address ranges to source lines with their inline chains.

A :class:`LineTable` is one build's table, in kreld's own layout: sorted
range starts, each with the innermost of a chain of deduplicated (function,
file, line, caller) locations, and the ELF symbols that name code the DWARF
does not.  A lookup is one ``searchsorted`` and a gather per inline depth.
It is kept in the symbol cache as the bytes :meth:`LineTable.to_bytes` writes
and read back as views of them.  :mod:`kreld.debuginfo.lines_build` builds
one from a debug file, and says why that way and which names it keeps.

File names are normalized one way: the compilation directory, the line
table's directory and the file name joined, then ``posixpath.normpath`` (``./``
and ``a/../`` removed lexically, duplicate slashes folded); a relative build
prefix such as ``debian/build/build_amd64_none_cloud-amd64/`` is kept.
"""

from __future__ import annotations

import io
import json
import posixpath
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kreld.core.errors import LineTableError
from kreld.debuginfo.lines_reloc import SectionBase

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from kreld.debuginfo.lines_later import LaterLines

__all__ = ["BUILDER", "NONE", "Frame", "FrameColumns", "LineTable", "normalize_path"]

NONE = 0xFFFFFFFF  # "no such index" in every u32 array of a table
# What the builder puts in a table, numbered (its header's "builder"); one
# up whenever a build gives other answers.  A table an older builder made
# (without the lines of assembly units and of the functions gcc merged, or the
# inlined frames symbolic drops at the start of .cold parts) reads back, but is
# built again where its debug file can be had.
BUILDER = 4
_MAGIC = b"KRLNTAB2"
_PRELUDE = struct.Struct("<8sI")  # magic, length of the JSON header after it
# Deeper inline chains than this are taken for a loop in a damaged table.
_MAX_DEPTH = 256


@dataclass(frozen=True)
class Frame:
    """One frame of an address's chain, innermost first.  ``line`` 0 and
    ``file`` None where the DWARF has none; ``inlined`` says the frame's code
    was inlined into the next one."""

    function: str
    file: str | None
    line: int
    column: int | None
    inlined: bool

    def to_json(self) -> dict[str, Any]:
        return {"function": self.function, "file": self.file, "line": self.line,
                "column": self.column, "inlined": self.inlined}  # fmt: skip


@dataclass(frozen=True)
class FrameColumns:
    """The frames of many addresses in columns: ``counts[i]`` frames for
    address *i*, following those of the addresses before it, innermost
    first, in ``function`` (an index of :meth:`LineTable.function_name`),
    ``file`` (of :meth:`LineTable.file_name`, ``NONE`` where the DWARF has
    none) and ``line`` (0 where it has none).  Every frame of an address but
    its outermost was inlined into the next."""

    counts: NDArray[np.int64]
    function: NDArray[np.uint32]
    file: NDArray[np.uint32]
    line: NDArray[np.uint32]


def normalize_path(comp_dir: str, directory: str, name: str) -> str:
    """The one spelling of a source file name: see the module's docstring."""
    joined = posixpath.join(comp_dir, directory, name)
    return posixpath.normpath(joined) if joined else ""


class LineTable:
    """Ranges of one build's addresses, each with its chain of source locations.

    ``starts`` (sorted u32, address minus ``base``) begin the ranges; range
    *i*'s innermost location is ``loc_first + i``.  Each location has a
    function, a file, a line and the location it was inlined into (``NONE``
    at the outermost).  For a relocatable object ``sections`` says where each
    allocated section was placed, so that (section, offset) finds an address.
    """

    def __init__(
        self,
        meta: dict[str, Any],
        arrays: dict[str, NDArray[np.uint32]],
        names: bytes,
        files: bytes,
    ):
        self.meta = meta
        self.base: int = meta["base"]
        self.sections: dict[str, SectionBase] = {
            s[0]: SectionBase(s[0], s[1], s[2]) for s in meta.get("sections") or []
        }
        self.starts = arrays["starts"]
        self.loc_file, self.loc_line = arrays["loc_file"], arrays["loc_line"]
        self.loc_func, self.loc_parent = arrays["loc_func"], arrays["loc_parent"]
        self.loc_first = len(self.loc_func) - len(self.starts)
        self.sym_starts, self.sym_sizes = arrays["sym_starts"], arrays["sym_sizes"]
        self.sym_func = arrays["sym_func"]
        # Lines of code no DWARF function gives one (kreld.debuginfo.lines_program):
        # range starts, each's file (NONE past a sequence's end) and line.
        # Each swapped in whole (see extend).
        none = np.zeros(0, dtype=np.uint32)
        self._lp = (arrays.get("lp_starts", none), arrays.get("lp_file", none),
                    arrays.get("lp_line", none))  # fmt: skip
        self._func_names = (names, arrays["func_offs"])
        self._file_names = (files, arrays["file_offs"])
        # Innermost frames the SymCache lacks (lines_scopes): ranges, each's
        # function, file and line, put before the chain there.
        self._ex = tuple(arrays.get(k, none) for k in _EX)
        #: The lines still to be read of a table just built (see lines_later).
        self.later: LaterLines | None = None
        # How the ELF symbol table names frames: "outer" (an executable, as
        # llvm-symbolizer does) or "fill" (a relocatable object, as elfutils).
        self.symbol_names: str = meta.get("symbol_names", "fill")
        #: For a table just built, the peak RSS in bytes of the process that
        #: read its DWARF (not kept with the table).
        self.reader_peak_rss: int | None = None

    @property
    def lp_starts(self) -> NDArray[np.uint32]:
        return self._lp[0]

    @property
    def lp_file(self) -> NDArray[np.uint32]:
        return self._lp[1]

    @property
    def lp_line(self) -> NDArray[np.uint32]:
        return self._lp[2]

    def program_rows(self) -> tuple[NDArray[np.uint32], NDArray[np.uint32], NDArray[np.uint32]]:
        """The line-program rows: their starts, files and lines, as one."""
        return self._lp

    def file_blob(self) -> tuple[bytes, NDArray[np.uint32]]:
        """The file names' blob and the offsets into it, as one."""
        return self._file_names

    def func_blob(self) -> tuple[bytes, NDArray[np.uint32]]:
        """The function names' blob and the offsets into it, as one."""
        return self._func_names

    def frames_added(self) -> tuple[NDArray[np.uint32], ...]:
        """The innermost frames put before the SymCache's chain: starts, ends,
        functions, files and lines, as one."""
        return self._ex

    def extend(
        self,
        file_names: tuple[bytes, NDArray[np.uint32]],
        rows: tuple[NDArray[np.uint32], NDArray[np.uint32], NDArray[np.uint32]],
        func_names: tuple[bytes, NDArray[np.uint32]] | None = None,
        added: tuple[NDArray[np.uint32], ...] | None = None,
    ) -> None:
        """Take more line-program rows, innermost frames, and the names they
        use (the old names kept as they were, new ones after them): the names
        first, so that an index any reader holds is always in range."""
        if func_names is not None:
            self._func_names = func_names
        self._file_names = file_names
        self._lp = rows
        if added is not None:
            self._ex = added

    def complete(self, pause: Callable[[], None] | None = None) -> None:
        """Read the lines still to be read (:mod:`kreld.debuginfo.lines_later`),
        calling *pause* between turns."""
        later = self.later
        if later is not None:
            later.complete(self, pause)

    # -- lookups ----------------------------------------------------------
    def locations(self, addresses: NDArray[np.uint64]) -> NDArray[np.uint32]:
        """The innermost location of each address (``NONE`` where none)."""
        rel = addresses.astype(np.uint64) - np.uint64(self.base)
        inside = (addresses >= np.uint64(self.base)) & (rel < np.uint64(1 << 32))
        idx = np.searchsorted(self.starts, rel.astype(np.uint32), side="right").astype(np.int64) - 1
        ok = inside & (idx >= 0)
        loc = np.where(ok, idx + self.loc_first, 0).astype(np.int64)
        found = ok & (self.loc_func[loc] != NONE)
        return np.where(found, loc, NONE).astype(np.uint32)

    def symbols(self, addresses: NDArray[np.uint64]) -> NDArray[np.uint32]:
        """The function-name index of the ELF symbol each address lies in
        (``NONE`` where none): the last symbol starting at or before it,
        unless that one has a size and ends before it."""
        out = np.full(len(addresses), NONE, dtype=np.uint32)
        if not len(self.sym_starts):
            return out
        rel = addresses.astype(np.uint64) - np.uint64(self.base)
        inside = (addresses >= np.uint64(self.base)) & (rel < np.uint64(1 << 32))
        rel32 = np.where(inside, rel, 0).astype(np.uint32)
        idx = np.searchsorted(self.sym_starts, rel32, side="right").astype(np.int64) - 1
        i = np.where(idx >= 0, idx, 0)
        size = self.sym_sizes[i]
        within = (size == 0) | ((rel32 - self.sym_starts[i]) < size)
        ok = inside & (idx >= 0) & within
        out[ok] = self.sym_func[i[ok]]
        return out

    def frame_columns(self, addresses: NDArray[np.uint64]) -> FrameColumns:
        """Every address's frames, innermost first, named as the reference of
        the file's kind names them (see the module's docstring): the DWARF's
        chain, its outermost frame renamed after its ELF symbol in an
        executable; the symbol alone, without a file or line, where no DWARF
        function covers the address.  In columns, without a Python object
        per address: the chains are walked one inline depth at a time over
        the addresses still that deep, each depth's frames written straight
        to their places."""
        later = self.later
        if later is not None:
            later.settle(self, addresses)
        loc = self.locations(addresses)
        syms = self.symbols(addresses)
        counts = np.zeros(len(loc), dtype=np.int64)
        at = np.flatnonzero(loc != NONE)
        level = loc[at]
        levels: list[tuple[NDArray[np.int64], NDArray[np.uint32]]] = []
        while len(at):
            if len(levels) == _MAX_DEPTH:
                raise LineTableError(
                    "<line table>", f"an inline chain deeper than {_MAX_DEPTH}: a loop"
                )
            levels.append((at, level))
            counts[at] += 1
            up = self.loc_parent[level]
            live = up != NONE
            at, level = at[live], up[live]
        named = syms != NONE
        alone = np.flatnonzero(named & (counts == 0))
        counts[alone] = 1
        extra, shift, added = _added(self, addresses, counts)
        first = np.cumsum(counts) - counts
        total = int(first[-1] + counts[-1]) if len(counts) else 0
        function = np.empty(total, dtype=np.uint32)
        file = np.full(total, NONE, dtype=np.uint32)
        line = np.zeros(total, dtype=np.uint32)
        for depth, (at, level) in enumerate(levels):
            where = first[at] + depth + shift[at]
            function[where] = self.loc_func[level]
            file[where] = self.loc_file[level]
            line[where] = self.loc_line[level]
        function[first[alone]] = syms[alone]
        if len(extra):
            at, (_, _, ex_func, ex_file, ex_line) = np.flatnonzero(shift), added
            function[first[at]], file[first[at]], line[first[at]] = (
                ex_func[extra], ex_file[extra], ex_line[extra])  # fmt: skip
        if self.symbol_names == "outer":
            outer = np.flatnonzero(named & (counts > 0))
            function[first[outer] + counts[outer] - 1] = syms[outer]
        if len(self._lp[0]):
            self._program_lines(addresses, counts, first, file, line)
        return FrameColumns(counts, function, file, line)

    def _program_lines(
        self,
        addresses: NDArray[np.uint64],
        counts: NDArray[np.int64],
        first: NDArray[np.int64],
        file: NDArray[np.uint32],
        line: NDArray[np.uint32],
    ) -> None:
        """File and line from a unit's line program, for each
        address named by one frame without a file (no DWARF function)."""
        one = np.flatnonzero(counts == 1)
        one = one[file[first[one]] == NONE]
        rel = addresses[one].astype(np.uint64) - np.uint64(self.base)
        inside = (addresses[one] >= np.uint64(self.base)) & (rel < np.uint64(1 << 32))
        one, rel = one[inside], rel[inside]
        lp_starts, lp_file, lp_line = self._lp
        idx = np.searchsorted(lp_starts, rel.astype(np.uint32), side="right").astype(np.int64)
        ok = idx > 0
        one, idx = one[ok], idx[ok] - 1
        ok = lp_file[idx] != NONE
        one, idx = one[ok], idx[ok]
        file[first[one]] = lp_file[idx]
        line[first[one]] = lp_line[idx]

    def frames_at(self, addresses: NDArray[np.uint64]) -> list[list[Frame]]:
        """Each address's frames, innermost first (:meth:`frame_columns`), as
        :class:`Frame` objects."""
        cols = self.frame_columns(addresses)
        funcs = cols.function.tolist()
        files, lines = cols.file.tolist(), cols.line.tolist()
        out: list[list[Frame]] = []
        k = 0
        for n in cols.counts.tolist():
            out.append([Frame(self.function_name(funcs[j]), self.file_name(files[j]), lines[j],
                              None, j + 1 < k + n) for j in range(k, k + n)])  # fmt: skip
            k += n
        return out

    def name_blobs(self) -> tuple[bytes, NDArray[np.uint32], bytes, NDArray[np.uint32]]:
        """The function names and file names as kept: each blob and the
        offsets into it (name *i* is ``blob[offs[i]:offs[i + 1]]``), for
        readers that take many names at once."""
        (names, func_offs), (files, file_offs) = self._func_names, self._file_names
        return names, func_offs, files, file_offs

    def function_name(self, i: int) -> str:
        names, offs = self._func_names
        return names[int(offs[i]) : int(offs[i + 1])].decode("utf-8", "replace")

    def file_name(self, i: int) -> str | None:
        if i == NONE:
            return None
        files, offs = self._file_names
        return files[int(offs[i]) : int(offs[i + 1])].decode("utf-8", "replace")

    def frames(self, address: int) -> list[Frame]:
        """The chain at one address, innermost first; empty where no function."""
        return self.frames_at(np.array([address], dtype=np.uint64))[0]

    def section_address(self, section: str, offset: int) -> int | None:
        """The address standing for *offset* in a relocatable object's *section*."""
        s = self.sections.get(section)
        if s is None or not 0 <= offset < max(s.size, 1):
            return None
        return s.base + offset

    # -- bytes ------------------------------------------------------------
    def arrays(self) -> dict[str, NDArray[np.uint32]]:
        """Every array, by its name as kept (:data:`_ARRAYS`)."""
        lp_starts, lp_file, lp_line = self._lp
        return {
            "starts": self.starts, "loc_file": self.loc_file, "loc_line": self.loc_line,
            "loc_func": self.loc_func, "loc_parent": self.loc_parent,
            "func_offs": self._func_names[1], "file_offs": self._file_names[1],
            "sym_starts": self.sym_starts, "sym_sizes": self.sym_sizes, "sym_func": self.sym_func,
            "lp_starts": lp_starts, "lp_file": lp_file, "lp_line": lp_line,
            **dict(zip(_EX, self._ex, strict=True)),
        }  # fmt: skip

    def nbytes(self) -> int:
        """The bytes the table holds in memory (its arrays and names)."""
        names, files = self._func_names[0], self._file_names[0]
        return sum(int(a.nbytes) for a in self.arrays().values()) + len(names) + len(files)

    def to_bytes(self) -> bytes:
        """The table as kept (its lines still to be read read first)."""
        self.complete()
        return _to_bytes(self)

    @classmethod
    def from_bytes(cls, buf: bytes | memoryview, what: str = "<line table>") -> LineTable:
        """A table :meth:`to_bytes` wrote; the arrays are views of *buf*."""
        try:
            meta, arrays, names, files = _from_bytes(buf)
            table = cls(meta, arrays, names, files)
            _check(table)
        except (ValueError, KeyError, TypeError, struct.error) as e:
            raise LineTableError(what, f"malformed line table: {e}") from None
        return table


# The arrays as kept, in order; a table written before the lines of assembly
# ("lp_") or the frames SymCache lacks ("ex_") has none of those.
_EX = ("ex_starts", "ex_ends", "ex_func", "ex_file", "ex_line")
_ARRAYS = ("starts", "loc_file", "loc_line", "loc_func", "loc_parent", "func_offs", "file_offs",
           "sym_starts", "sym_sizes", "sym_func",
           "lp_starts", "lp_file", "lp_line", *_EX)  # fmt: skip
_LATER = ("lp_", "ex_")


def _added(
    table: LineTable, addresses: NDArray[np.uint64], counts: NDArray[np.int64]
) -> tuple[NDArray[np.int64], NDArray[np.int64], tuple[NDArray[np.uint32], ...]]:
    """The innermost frames put before a chain (:mod:`kreld.debuginfo.lines_scopes`)
    at *addresses* that have one: which (in the addresses' order), where
    (1 at each such address, 0 elsewhere), and the frames they index (one
    reading: another call may add more meanwhile); *counts* counts them."""
    added = table.frames_added()
    ex_starts, ex_ends = added[0], added[1]
    shift = np.zeros(len(addresses), dtype=np.int64)
    if not len(ex_starts):
        return np.zeros(0, dtype=np.int64), shift, added
    rel = addresses.astype(np.uint64) - np.uint64(table.base)
    inside = (addresses >= np.uint64(table.base)) & (rel < np.uint64(1 << 32))
    rel32 = np.where(inside, rel, 0).astype(np.uint32)
    idx = np.searchsorted(ex_starts, rel32, side="right").astype(np.int64) - 1
    i = np.maximum(idx, 0)
    hit = inside & (idx >= 0) & (rel32 < ex_ends[i]) & (counts > 0)
    shift[hit] = 1
    counts += shift
    return i[hit], shift, added


def _to_bytes(table: LineTable) -> bytes:
    names, _, files, _ = table.name_blobs()
    arrays = table.arrays()
    meta = dict(table.meta, counts={k: len(arrays[k]) for k in _ARRAYS},
                names=len(names), files=len(files))  # fmt: skip
    head = json.dumps(meta, separators=(",", ":")).encode()
    out = io.BytesIO()
    out.write(_PRELUDE.pack(_MAGIC, len(head)) + head)
    for k in _ARRAYS:
        out.write(b"\0" * (-out.tell() % 8))
        out.write(arrays[k].astype("<u4").tobytes())
    out.write(names)
    out.write(files)
    return out.getvalue()


def _from_bytes(
    buf: bytes | memoryview,
) -> tuple[dict[str, Any], dict[str, NDArray[np.uint32]], bytes, bytes]:
    magic, hlen = _PRELUDE.unpack_from(buf)
    if magic != _MAGIC:
        raise ValueError("not a line table")
    pos = _PRELUDE.size + hlen
    meta = json.loads(bytes(buf[_PRELUDE.size : pos]))
    arrays: dict[str, NDArray[np.uint32]] = {}
    for k in _ARRAYS:
        if k not in meta["counts"] and k.startswith(_LATER):
            continue  # a table written before those: none
        pos += -pos % 8
        n = int(meta["counts"][k])
        arrays[k] = np.frombuffer(buf, dtype="<u4", count=n, offset=pos)
        pos += 4 * n
    nn, nf = int(meta["names"]), int(meta["files"])
    names, files = bytes(buf[pos : pos + nn]), bytes(buf[pos + nn : pos + nn + nf])
    if len(files) != nf:
        raise ValueError("truncated")
    return meta, arrays, names, files


def _check(table: LineTable) -> None:
    """Every index in range, so that a damaged table fails here, not in a lookup."""
    names, func_offs, files, file_offs = table.name_blobs()
    nl, nfn, nfi = len(table.loc_func), len(func_offs) - 1, len(file_offs) - 1
    if (
        len(table.loc_file) != nl
        or len(table.loc_line) != nl
        or len(table.loc_parent) != nl
        or table.loc_first < 0
    ):
        raise ValueError("location arrays differ in length")
    ns = len(table.sym_starts)
    if len(table.sym_sizes) != ns or len(table.sym_func) != ns:
        raise ValueError("symbol arrays differ in length")
    if len(table.sym_starts) > 1 and (np.diff(table.sym_starts.astype(np.int64)) <= 0).any():
        raise ValueError("symbol starts out of order")
    nlp = len(table.lp_starts)
    if len(table.lp_file) != nlp or len(table.lp_line) != nlp:
        raise ValueError("line program arrays differ in length")
    if nlp > 1 and (np.diff(table.lp_starts.astype(np.int64)) <= 0).any():
        raise ValueError("line program starts out of order")
    ex_starts, ex_ends, ex_func, ex_file, ex_line = table.frames_added()
    nex = len(ex_starts)
    if any(len(a) != nex for a in (ex_ends, ex_func, ex_file, ex_line)):
        raise ValueError("added frame arrays differ in length")
    if nex > 1 and (np.diff(ex_starts.astype(np.int64)) <= 0).any():
        raise ValueError("added frame starts out of order")
    for arr, bound in ((table.loc_func, nfn), (table.loc_file, nfi), (table.loc_parent, nl),
                       (table.sym_func, nfn), (table.lp_file, nfi), (ex_func, nfn),
                       (ex_file, nfi)):  # fmt: skip
        if len(arr) and int(np.where(arr == NONE, 0, arr).max()) >= bound:
            raise ValueError("an index points past its array")
    if nfn >= 0 and len(func_offs) and int(func_offs[-1]) > len(names):
        raise ValueError("function names past their data")
    if len(file_offs) and int(file_offs[-1]) > len(files):
        raise ValueError("file names past their data")
