"""Resolve's ``lines``: every address's frames as columns, in bulk.

The same answers as :func:`kreld.symbols.linequery.lines_at` (the address
placed in its region, the kernel's KASLR offset taken off, a module's section
offset found in its build's table; where not, the reason), but without a
Python object per frame: the addresses of one build are looked up together
(one ``searchsorted`` and a gather per inline depth) and the frames are
written straight into the reply's columns with numpy, so a reply of 100,000
addresses costs milliseconds past the table look-up (see ``ResolveLines`` in
io.kreld.varlink for the shape).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kreld.debuginfo.lines import NONE, FrameColumns
from kreld.symbols.quoting import join_quoted, quote_names

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from kreld.debuginfo.lines import LineTable
    from kreld.symbols.linequery import TableSource
    from kreld.symbols.queries import AddressMap, Region

__all__ = ["LineColumns", "line_columns"]


class _Reasons:
    """Distinct reasons, numbered in order of first use."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def code(self, why: str) -> int:
        """The ``frames`` entry saying *why*: -1 minus its index."""
        return -1 - self.index.setdefault(why, len(self.index))


class LineColumns:
    """The columns of ``ResolveLines`` being filled."""

    def __init__(self, n: int) -> None:
        self.reasons = _Reasons()
        self.frames = np.zeros(n, dtype=np.int64)  # every address is set once
        # Per table looked up: the indices of its addresses and their frames
        # (one entry per region of the table's build).
        self._found: dict[int, tuple[LineTable, list[tuple[NDArray[np.int64], FrameColumns]]]] = {}

    def why(self, at: NDArray[np.int64], reason: str) -> None:
        self.frames[at] = self.reasons.code(reason)

    def found(self, at: NDArray[np.int64], cols: FrameColumns, table: LineTable) -> None:
        """The frames of the addresses *at* (*cols* has some for each)."""
        self.frames[at] = cols.counts
        self._found.setdefault(id(table), (table, []))[1].append((at, cols))

    def to_json(self) -> bytes:
        """The ``ResolveLines`` object as JSON.  Each table's functions and
        files that are used are numbered by marking them in an array as long
        as the table's names (no sort), and quoted in bulk from its blobs, as
        Resolve's symbol names are (some 40,000 distinct functions for 100,000
        kernel addresses); each address's frames are copied to their place
        in the columns at once."""
        import orjson

        counts = np.maximum(self.frames, 0)
        start = np.cumsum(counts) - counts
        total = int(counts.sum())
        function = np.empty(total, dtype=np.int32)
        file = np.empty(total, dtype=np.int32)
        line = np.empty(total, dtype=np.int32)
        functions: list[bytes] = []
        files: list[bytes] = []
        nfunc = nfile = 0
        for table, chunks in self._found.values():
            names, func_offs, paths, file_offs = table.name_blobs()
            func_ids, func_of = _numbered([c.function for _, c in chunks], len(func_offs) - 1)
            file_ids, file_of = _numbered([c.file for _, c in chunks], len(file_offs) - 1)
            for at, cols in chunks:
                where = _places(start[at], cols.counts)
                function[where] = func_of[cols.function] + nfunc
                fl = cols.file.astype(np.int64)
                has = fl != NONE
                file[where] = np.where(has, file_of[np.where(has, fl, 0)] + nfile, -1)
                line[where] = cols.line
            if len(func_ids):
                functions += quote_names(names, func_offs[1:], func_ids)
            if len(file_ids):
                files += quote_names(paths, file_offs[1:], file_ids)
            nfunc += len(func_ids)
            nfile += len(file_ids)
        opt = orjson.OPT_SERIALIZE_NUMPY
        return b"".join(
            (
                b'{"functions":', join_quoted(functions),
                b',"files":', join_quoted(files),
                b',"reasons":', orjson.dumps(list(self.reasons.index)),
                b',"frames":', orjson.dumps(self.frames, option=opt),
                b',"function":', orjson.dumps(function, option=opt),
                b',"file":', orjson.dumps(file, option=opt),
                b',"line":', orjson.dumps(line, option=opt),
                b"}",
            )
        )  # fmt: skip


def _numbered(
    columns: list[NDArray[np.uint32]], size: int
) -> tuple[NDArray[np.int64], NDArray[np.int32]]:
    """The distinct entries of *columns* (indices below *size*, or ``NONE``),
    in order, and each index's number among them."""
    used = np.zeros(size + 1, dtype=bool)  # the last stands for NONE
    for col in columns:
        used[np.minimum(col, size)] = True
    used[size] = False
    ids = np.flatnonzero(used)
    number = (np.cumsum(used, dtype=np.int32) - 1).astype(np.int32)
    return ids, number


def _places(starts: NDArray[np.int64], counts: NDArray[np.int64]) -> NDArray[np.int64]:
    """Where in the columns the frames of addresses starting at *starts*
    (*counts* of each, one after the other in their own columns) go."""
    total = int(counts.sum())
    shift = starts - (np.cumsum(counts) - counts)
    return np.repeat(shift, counts) + np.arange(total, dtype=np.int64)


def line_columns(amap: AddressMap, addresses: Any, tables: TableSource) -> LineColumns:
    """The frames of every address of *addresses* (a list or a u64 array)."""
    addrs = np.asarray(addresses, dtype=np.uint64)
    out = LineColumns(len(addrs))
    ric, inside = amap.region_indices(addrs)
    out.why(np.flatnonzero(~inside), "not in the kernel image nor in a module loaded then")
    # The addresses of each region, grouped by one stable sort (regions are
    # few, addresses many: a pass over all of them per region costs more).
    key = np.where(inside, ric, -1)
    order = np.argsort(key, kind="stable")
    bounds = np.searchsorted(key[order], np.arange(len(amap.regions) + 2) - 1)
    by_build: dict[str, list[tuple[int, NDArray[np.int64]]]] = {}
    for i in np.flatnonzero(np.diff(bounds[1:])).tolist():
        r = amap.regions[i]
        at = order[bounds[i + 1] : bounds[i + 2]]
        build = amap.kernel_build_id if r.inc is None else r.inc.state.build_id
        if r.name is not None or r.image.startswith("["):
            out.why(at, f"{r.image} code has no debuginfo")
        elif build is None:
            out.why(at, f"no build-id recorded for {r.image}")
        else:
            by_build.setdefault(build, []).append((i, at))
    for build, regions in by_build.items():
        table = tables(build)
        for i, at in regions:
            if isinstance(table, str):
                out.why(at, table)
            else:
                _look_up(out, amap.regions[i], at, addrs[at], table, build)
    return out


def _look_up(
    out: LineColumns,
    region: Region,
    at: NDArray[np.int64],
    addrs: NDArray[np.uint64],
    table: LineTable,
    build: str,
) -> None:
    """The frames of the addresses *at* of one region, from its build's table."""
    if region.inc is None:
        text = table.meta.get("text")
        if not isinstance(text, int):
            out.why(at, "the kernel's debug file has no _text symbol")
            return
        # Link-time address: the runtime one minus the KASLR offset (mod 2**64).
        shift = np.uint64((text - region.rel_base) % (1 << 64))
        where = addrs + shift
    else:
        section = table.sections.get(region.section)
        if section is None:
            out.why(at, f"section {region.section} is not in the debug file")
            return
        offsets = addrs - np.uint64(region.base)
        past = offsets >= np.uint64(max(section.size, 1))
        if past.any():
            out.why(at[past], f"past the end of section {region.section} in the debug file")
            at, offsets = at[~past], offsets[~past]
        where = offsets + np.uint64(section.base)
    if not len(at):
        return
    cols = table.frame_columns(where)
    none = cols.counts == 0
    if none.any():
        out.why(at[none], f"no function at this address in build {build}'s DWARF")
        cols = _only(cols, ~none)
        at = at[~none]
    out.found(at, cols, table)


def _only(cols: FrameColumns, keep: NDArray[np.bool_]) -> FrameColumns:
    """*cols* of the addresses *keep* says (the others have no frames)."""
    return FrameColumns(cols.counts[keep], cols.function, cols.file, cols.line)
