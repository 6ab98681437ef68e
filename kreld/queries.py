"""Questions asked of recorded data: which modules were loaded at a time, and
which image and section held an address.  Pure functions over the model."""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kreld.model import BootSnapshot, Clock, Incarnation, hexaddr
from kreld.symtab import (
    PAGE_SHIFT,
    Accel,
    SymbolTable,
    SymbolTables,
    json_plain,
    module_symbol_key,
)

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


@dataclass(frozen=True, slots=True)
class Region:
    base: int
    limit: int  # exclusive upper bound
    image: str
    section: str
    inc: Incarnation | None
    table: str | None = None  # key of the symbol table that covers it
    rel_base: int = 0  # what the table's values are relative to (kernel: _text)


def _fragment(r: Region) -> str:
    """The constant part of a resolution in *r*, as JSON members."""
    members: dict[str, object] = {"image": r.image, "section": r.section, "base": hexaddr(r.base)}
    if r.inc is not None:
        members["seq"] = r.inc.seq
        members["build_id"] = r.inc.state.build_id
    return json.dumps(members, separators=(",", ":"))[1:-1]


_UNSET: Any = object()


def _symbols_of(
    r: Region,
    tables: SymbolTables | None,
    get_accel: Callable[[str, int, SymbolTable], Accel],
) -> tuple[Any, ...] | None:
    """What ``resolve_json`` needs to name symbols in *r*: its table's arrays,
    the key of value 0 in its section, and the table's page index."""
    table = tables.get(r.table) if tables is not None and r.table else None
    if table is None or r.table is None:
        return None
    sec = 0 if r.inc is None else table.section_index(r.section)
    if sec is None:
        return None
    acc = get_accel(r.table, sec, table)
    zero = sec * (1 << 40) + (1 << 39)
    return (
        table.keys,
        table.sorted,
        table.values,
        table.name_end,
        table.names,
        zero - r.rel_base,
        zero,
        sec << 40,
        acc.first,
        acc.key0,
        acc.npages,
        acc.plain,
    )


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
        regions.sort(key=lambda r: (r.base, r.limit, r.section))
        by_base: dict[int, Region] = {r.base: r for r in regions}
        self.regions = list(by_base.values())
        self._bases = [r.base for r in self.regions]
        self._limits = [r.limit for r in self.regions]
        self._fragments: list[str | None] = [None] * len(self.regions)
        self.kernel_table = kernel_table

    def region_of(self, address: int) -> Region | None:
        """The region holding *address* (``resolve_json`` inlines this)."""
        i = bisect.bisect_right(self._bases, address) - 1
        if i >= 0 and address < self._limits[i]:
            return self.regions[i]
        return None

    def table_keys(self) -> set[str]:
        return {r.table for r in self.regions if r.table is not None}

    def resolve_json(
        self,
        addresses: Iterable[int],
        tables: SymbolTables | None = None,
        accel: Callable[[str, int, SymbolTable], Accel] | None = None,
    ) -> str:
        """The resolutions of *addresses* as a JSON array, built as text.

        The hot path of ``Resolve`` (``hex()`` rather than a ``#x`` format:
        three times faster): one bisect for the region, one in its
        symbol table (straight from the store's map, within the address's
        page for the kernel's, see :class:`~kreld.symtab.Accel`), one format
        per address; the region's own members are rendered once, and an
        address asked twice in a batch (profiles repeat hot functions) is
        answered once.  *accel* gives the table's accelerator (a caller that
        keeps them across calls passes its cache; built here otherwise).
        """
        regions, bases, limits, frags = self.regions, self._bases, self._limits, self._fragments
        get_accel = accel or (lambda _key, sec, table: Accel(table, sec))
        # A region's members and symbol data are made when an address first
        # falls in it: a call about a few addresses costs little however many
        # modules the boot had.
        syms: list[Any] = [_UNSET] * len(regions)
        find = bisect.bisect_right
        done: dict[int, str] = {}
        out = []
        for a in addresses:
            hit = done.get(a)
            if hit is not None:
                out.append(hit)
                continue
            i = find(bases, a) - 1
            if i < 0 or a >= limits[i]:
                text = f'{{"address":"{hex(a)}","image":null}}'
            else:
                frag = frags[i]
                if frag is None:
                    frag = frags[i] = _fragment(regions[i])
                sym = syms[i]
                if sym is _UNSET:
                    sym = syms[i] = _symbols_of(regions[i], tables, get_accel)
                j = -1
                if sym is not None:
                    (keys, order, values, ends, names, bias, zero, lowest,
                     first, key0, npages, plain) = sym  # fmt: skip
                    key = a + bias
                    p = (key - key0) >> PAGE_SHIFT
                    if first is not None and 0 <= p < npages:
                        j = find(keys, key, first[p], first[p + 1]) - 1
                    else:
                        j = find(keys, key) - 1
                    if j >= 0 and keys[j] < lowest:  # a symbol of an earlier section
                        j = -1
                if j < 0:
                    text = f'{{"address":"{hex(a)}","offset":"{hex(a - bases[i])}",{frag}}}'
                else:
                    e = order[j]
                    name = str(names[ends[e - 1] if e else 0 : ends[e]], "utf-8", "replace")
                    if not plain and not json_plain(name):
                        name = json.dumps(name)[1:-1]
                    off = key - zero - values[e]
                    text = (
                        f'{{"address":"{hex(a)}","offset":"{hex(a - bases[i])}",{frag},'
                        f'"symbol":"{name}","symbol_offset":"{hex(off)}"}}'
                    )
            done[a] = text
            out.append(text)
        return "[" + ",".join(out) + "]"
