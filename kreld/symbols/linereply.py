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

from kreld.debuginfo.lines import NONE
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
        # Per build looked up: its addresses' indices, their location chains
        # (depth x addresses, NONE past the outermost) and the table.
        self._found: list[tuple[NDArray[np.int64], NDArray[np.uint32], LineTable]] = []

    def why(self, at: NDArray[np.int64], reason: str) -> None:
        self.frames[at] = self.reasons.code(reason)

    def found(self, at: NDArray[np.int64], chains: NDArray[np.uint32], table: LineTable) -> None:
        depth = (chains != NONE).sum(axis=0)
        self.frames[at] = depth
        self._found.append((at, chains, table))

    def to_json(self) -> bytes:
        """The ``ResolveLines`` object as JSON.  Names are quoted in bulk from
        the tables' blobs, as Resolve's symbol names are (some 40,000
        distinct functions for 100,000 kernel addresses)."""
        import orjson

        counts = np.maximum(self.frames, 0)
        start = np.cumsum(counts) - counts
        total = int(counts.sum())
        function = np.zeros(total, dtype=np.int64)
        file = np.full(total, -1, dtype=np.int64)
        line = np.zeros(total, dtype=np.int64)
        functions: list[bytes] = []
        files: list[bytes] = []
        nfunc = nfile = 0
        for at, chains, table in self._found:
            names, func_offs, paths, file_offs = table.name_blobs()
            live = chains != NONE
            d_idx, a_idx = np.nonzero(live)  # row-major: as chains[live] lists them
            locs = chains[d_idx, a_idx]
            where = start[at[a_idx]] + d_idx
            # Each build's functions and files that are used, once.
            funcs, func_of = np.unique(table.loc_func[locs], return_inverse=True)
            function[where] = nfunc + func_of.reshape(-1)
            functions += quote_names(names, func_offs[1:], funcs)
            nfunc += len(funcs)
            fl = table.loc_file[locs]
            has = fl != NONE
            fids = np.unique(fl[has])
            file[where[has]] = nfile + np.searchsorted(fids, fl[has])
            files += quote_names(paths, file_offs[1:], fids) if len(fids) else []
            nfile += len(fids)
            line[where] = table.loc_line[locs]
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


def line_columns(amap: AddressMap, addresses: Any, tables: TableSource) -> LineColumns:
    """The frames of every address of *addresses* (a list or a u64 array)."""
    addrs = np.asarray(addresses, dtype=np.uint64)
    out = LineColumns(len(addrs))
    ric, inside = amap.region_indices(addrs)
    out.why(np.flatnonzero(~inside), "not in the kernel image nor in a module loaded then")
    by_build: dict[str, list[int]] = {}
    for i in np.unique(ric[inside]).tolist():
        r = amap.regions[i]
        build = amap.kernel_build_id if r.inc is None else r.inc.state.build_id
        at = np.flatnonzero(inside & (ric == i))
        if r.name is not None or r.image.startswith("["):
            out.why(at, f"{r.image} code has no debuginfo")
        elif build is None:
            out.why(at, f"no build-id recorded for {r.image}")
        else:
            by_build.setdefault(build, []).append(i)
    for build, regions in by_build.items():
        table = tables(build)
        for i in regions:
            at = np.flatnonzero(inside & (ric == i))
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
    offsets = addrs - np.uint64(region.base)
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
        past = offsets >= np.uint64(max(section.size, 1))
        out.why(at[past], f"past the end of section {region.section} in the debug file")
        at, offsets = at[~past], offsets[~past]
        where = offsets + np.uint64(section.base)
    if not len(at):
        return
    chains = np.stack(table.chains(where))
    none = chains[0] == NONE
    out.why(at[none], f"no function at this address in build {build}'s DWARF")
    out.found(at[~none], chains[:, ~none], table)
