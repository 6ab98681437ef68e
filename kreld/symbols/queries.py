"""Questions asked of recorded data: which modules were loaded at a time, and
which image and section held an address.  Pure functions over the model."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kreld.core.consts import FEW_ADDRESSES as FEW
from kreld.core.model import BootSnapshot, Clock, Incarnation, hexaddr
from kreld.core.record import record
from kreld.core.symtab import SymbolTables, module_symbol_key
from kreld.symbols.batch import name_batch
from kreld.symbols.kernel_code import CodeHistory, code_spans
from kreld.symbols.late_loads import possible_regions
from kreld.symbols.quoting import join_quoted, json_array

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray


__all__ = [
    "AddressMap",
    "Region",
    "Resolved",
    "code_regions",
    "init_live_at",
    "is_init_section",
    "loaded_at",
    "module_regions",
]

# A section's extent is not in sysfs; bound it by its module's size, or this.
_UNKNOWN_SIZE_BOUND = 1 << 24


def loaded_at(incs: Iterable[Incarnation], clock: Clock, t: int | None) -> list[Incarnation]:
    """Incarnations loaded at *t* on *clock*; with ``t=None``, those never seen unloaded."""
    if t is None:
        return [i for i in incs if i.unloaded is None]
    return [i for i in incs if i.loaded_at(clock, t)]


# Sections the kernel lays out in a module's init allocation, freed once its
# init has run: the .init.* code and data, and the full symbol table that
# kallsyms uses while the module is coming (layout_symtab(); the core keeps
# only the core symbols).
_INIT_LAYOUT_NAMES = (".symtab", ".strtab")


def is_init_section(name: str) -> bool:
    return name.startswith(".init") or name in _INIT_LAYOUT_NAMES


def module_regions(inc: Incarnation, live_init: bool) -> list[Region]:
    """Where each section of a loaded module lies, as far as can be known.

    sysfs gives section bases, not sizes.  A section ends where the next one
    of the same module begins, and never past the allocation it lies in: the
    core ``[core_base, core_base + coresize)`` from /proc/modules (one
    allocation before Linux 6.4; since 6.4, commit ac3b43283923, text, data
    and rodata are allocated apart and sections outside the text allocation
    are bounded by the module's size instead), or the init allocation of
    ``initsize`` bytes, whose sections exist only while init is live.
    """
    s = inc.state
    key = module_symbol_key(s.build_id, s.name, s.srcversion)
    core_lo = s.core_base
    core_hi = core_lo + s.coresize if core_lo is not None and s.coresize else None
    ordered = sorted(s.sections.items(), key=lambda kv: (kv[1], kv[0]))
    starts = [b for _, b in ordered]
    out = []
    for name, base in ordered:
        in_core = core_lo is not None and core_hi is not None and core_lo <= base < core_hi
        if not in_core and is_init_section(name):
            if not live_init:
                continue
            bound = base + (s.initsize or _UNKNOWN_SIZE_BOUND)
        elif in_core and core_hi is not None:
            bound = core_hi
        else:
            bound = base + (s.coresize or _UNKNOWN_SIZE_BOUND)
        k = bisect.bisect_right(starts, base)  # the next section that starts higher
        limit = min(bound, starts[k]) if k < len(starts) else bound
        out.append(Region(base, limit, s.name, name, inc, key, base))
    return out


def init_live_at(inc: Incarnation, clock: Clock, t: int | None) -> bool:
    """Whether the module's ``.init.*`` sections held its init code at *t*."""
    if not inc.init_live:
        return False
    if t is None:
        return inc.init_done is None and inc.unloaded is None
    return inc.loaded.on(clock) <= t and (inc.init_done is None or t < inc.init_done.on(clock))


@record
class Region:
    base: int
    limit: int  # exclusive upper bound
    image: str
    section: str
    inc: Incarnation | None
    table: str | None = None  # key of the symbol table that covers it
    rel_base: int = 0  # what the table's values are relative to (kernel: _text)
    name: str | None = None  # kernel code: its one symbol, its own name
    code_seq: int | None = None  # kernel code: its record's seq
    uncertain: bool = False  # what was there then cannot be known: nothing named
    possible: bool = False  # a module possibly loaded then (its load seen late): named


class AddressMap:
    """Sorted regions of one boot at one time, for bisecting addresses.

    Several sections may share a base (empty ones sit where the next
    begins); the last of them in sort order stands for that base.
    """

    def __init__(
        self,
        boot: BootSnapshot,
        incs: Sequence[Incarnation],
        clock: Clock,
        t: int | None,
        kernel_table: str | None = None,
        code: CodeHistory | None = None,
    ) -> None:
        regions: list[Region] = []
        a = boot.anchors
        text = a.text or 0
        if a.text is not None and a.etext is not None:
            regions.append(Region(a.text, a.etext, "kernel", ".text", None, kernel_table, text))
        if a.sinittext is not None and a.einittext is not None:
            regions.append(
                Region(a.sinittext, a.einittext, "kernel", ".init.text", None, kernel_table, text)
            )
        for inc in loaded_at(incs, clock, t):
            regions.extend(module_regions(inc, init_live_at(inc, clock, t)))
        regions += possible_regions(incs, clock, t, regions)
        if code is not None:
            regions += code_regions(code, clock, t, regions)
        regions.sort(key=lambda r: (r.base, r.limit, r.section))
        by_base: dict[int, Region] = {r.base: r for r in regions}
        self.regions = list(by_base.values())
        self._bases = [r.base for r in self.regions]
        self._limits = [r.limit for r in self.regions]
        self._members: list[dict[str, object] | None] = [None] * len(self.regions)
        self._arrays: tuple[NDArray[np.uint64], NDArray[np.uint64]] | None = None
        self.kernel_table = kernel_table
        self.kernel_build_id = boot.build_id

    def table_keys(self) -> set[str]:
        return {r.table for r in self.regions if r.table is not None}

    def members(self, i: int) -> dict[str, object]:
        """What Resolve says of region *i* once per reply (no null members)."""
        m = self._members[i]
        if m is None:
            r = self.regions[i]
            m = {"image": r.image, "section": r.section, "base": hexaddr(r.base)}
            build_id = self.kernel_build_id if r.inc is None else r.inc.state.build_id
            if r.inc is not None:
                m["seq"] = r.inc.seq
            if build_id and not r.image.startswith("["):  # not kernel code's "[bpf]"
                m["build_id"] = build_id
            if r.code_seq is not None:
                m["code_seq"] = r.code_seq
            if r.uncertain:
                m["uncertain"] = True
            if r.possible:
                m["possible"] = True
            self._members[i] = m
        return m

    def resolve(self, addresses: Sequence[int], tables: SymbolTables | None = None) -> Resolved:
        """Place every address in its region and name its symbol.

        A few addresses are bisected one by one (a batch's sort and runs cost
        more than theirs); a batch goes to :meth:`resolve_bulk`.  Both name
        what :meth:`~kreld.core.symtab.SymbolTable.lookup` names.
        """
        if len(addresses) <= FEW:
            return self.resolve_few(addresses, tables)
        return self.resolve_bulk(addresses, tables)

    def resolve_few(self, addresses: Sequence[int], tables: SymbolTables | None = None) -> Resolved:
        """:meth:`resolve`, one address at a time in plain Python."""
        where = [self._region_index(a) for a in addresses]
        used = sorted({i for i in where if i >= 0})
        renumber = {i: k for k, i in enumerate(used)}
        hits = [
            None if i < 0 else self._lookup(i, a, tables)
            for a, i in zip(addresses, where, strict=True)
        ]
        names: dict[int, dict[str, int]] = {i: {} for i in used}  # region's names, in order
        for i, hit in zip(where, hits, strict=True):
            if hit is not None:
                names[i].setdefault(hit[0], len(names[i]))
        first: dict[int, int] = {}
        ordered: list[str] = []
        for i in used:
            first[i] = len(ordered)
            ordered += names[i]
        symbol = [
            (-1 if i < 0 else -2 - renumber[i]) if hit is None else first[i] + names[i][hit[0]]
            for i, hit in zip(where, hits, strict=True)
        ]
        return Resolved(
            [{**self.members(i), "names": len(names[i])} for i in used],
            json_array(ordered),
            symbol,
            [0 if hit is None else hit[1] for hit in hits],
        )

    def region_at(self, address: int) -> Region | None:
        """The region holding *address*, or None."""
        i = self._region_index(address)
        return None if i < 0 else self.regions[i]

    def _region_index(self, address: int) -> int:
        i = bisect.bisect_right(self._bases, address) - 1
        return i if i >= 0 and address < self._limits[i] else -1

    def _lookup(self, i: int, address: int, tables: SymbolTables | None) -> tuple[str, int] | None:
        r = self.regions[i]
        if r.name is not None:
            return r.name, address - r.base
        table = tables.get(r.table) if tables is not None and r.table is not None else None
        if table is None:
            return None
        sec = 0 if r.inc is None else table.section_index(r.section)
        return None if sec is None else table.lookup(sec, address - r.rel_base)

    def region_indices(self, addrs: NDArray[np.uint64]) -> tuple[NDArray[np.int64], Any]:
        """Per address, its region's index (0 for none) and whether it has one."""
        import numpy as np

        if self._arrays is None:
            self._arrays = (np.array(self._bases, np.uint64), np.array(self._limits, np.uint64))
        bases, limits = self._arrays
        ri = np.searchsorted(bases, addrs, side="right").astype(np.int64) - 1
        inside = ri >= 0
        ric = np.where(inside, ri, 0)
        if len(bases):
            inside &= addrs < limits[ric]
        else:
            inside[:] = False
        return ric, inside

    def resolve_bulk(
        self, addresses: Sequence[int], tables: SymbolTables | None = None
    ) -> Resolved:
        """:meth:`resolve` of a batch: the addresses sorted once and named
        region by region with the standard library (kreld.symbols.batch), from
        the store's map (the views must not outlive *tables*; what is
        returned copies what it keeps)."""
        named, symbol, offset = name_batch(
            self.regions, self._bases, self._limits, addresses, tables
        )
        regions = [{**self.members(i), "names": count} for i, count in named.used]
        return Resolved(regions, join_quoted(named.names), symbol, offset)


def code_regions(
    code: CodeHistory, clock: Clock, t: int | None, taken: Sequence[Region]
) -> list[Region]:
    """Kernel code at *t* as regions (kreld/symbols/kernel_code.py)."""
    held = sorted((r.base, r.limit) for r in taken)
    return [
        Region(
            s.base,
            s.limit,
            "[kernel code]" if s.code is None else f"[{s.code.owner}]",
            "uncertain" if s.code is None else s.code.kind.value,
            None,
            name=None if s.uncertain or s.code is None else s.code.name,
            code_seq=None if s.uncertain or s.code is None else s.code.seq,
            uncertain=s.uncertain,
        )
        for s in code_spans(code, clock, t, held)
    ]


@record
class Resolved:
    """Resolve's answer, as it travels (see ``Resolve`` in io.kreld.varlink):
    what is true of many addresses once (a region: image, section, base,
    build-id, incarnation; a symbol's name and the region it lies in), and
    per address two small integers referring to it."""

    # Each region that held an address, with the count of its names.
    regions: list[dict[str, object]]
    symbols_json: bytes  # the distinct symbol names, region by region, a JSON array
    # Per address: the index of its symbol's name; without a symbol, -2 - the
    # index of its region, or -1 for none.
    symbol: Sequence[int]
    symbol_offset: Sequence[int]  # bytes past the symbol's start

    def to_json(self) -> bytes:
        """The reply's parameters as compact JSON."""
        import orjson

        return b"".join(
            (
                b'{"regions":',
                orjson.dumps(self.regions),
                b',"symbols":',
                self.symbols_json,
                b',"symbol":',
                orjson.dumps(self.symbol),
                b',"symbol_offset":',
                orjson.dumps(self.symbol_offset),
                b"}",
            )
        )
