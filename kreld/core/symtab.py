"""Symbol tables: packed, sorted, bisected straight from LMDB's memory map.

One table per kernel build (values relative to ``_text``, so every boot of
the build shares it whatever its KASLR slide) and one per module build
(values relative to the base of the section each symbol lies in, so every
load of the module shares it).  Entries keep the order the kernel printed
them in, so an exported kallsyms is line for line what the kernel showed.

Layout (little-endian; every array starts 8-byte aligned)::

    header   magic "KRSYMTB1", count, nsorted, nsections, names_len,
             sections_len (u32 each), source (u32: FROM_KALLSYMS, FROM_ELF)
    sections section names joined by NUL (module tables)
    values   i64[count]   value relative to its section (kernel: to _text)
    keys     i64[nsorted] sort keys: section << 40 | (value + 2**39), ascending,
             unique: the symbols perf would name (see :func:`searchable`)
    sorted   u32[nsorted] entry index of each key
    name_end u32[count]   end of each name in the names blob
    secs     u16[count]   section index (kernel: 0 relocated, 1 absolute)
    types    u8[count]    the kallsyms type letter
    names    bytes        the names, concatenated
"""

from __future__ import annotations

import bisect
import struct
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Literal, Protocol

from kreld.core.record import record

__all__ = [
    "ABSOLUTE",
    "FROM_ELF",
    "FROM_KALLSYMS",
    "KEY_SPAN",
    "MAGIC",
    "MODULE_ABSOLUTE",
    "PERF_TYPES",
    "Columns",
    "Entry",
    "SymbolTable",
    "SymbolTables",
    "kernel_symbol_key",
    "kernel_table",
    "module_symbol_key",
    "module_table",
    "pack",
    "pack_columns",
    "searchable",
]

MAGIC = b"KRSYMTB1"
_HEADER = struct.Struct("<8s6I")
KEY_SPAN = 1 << 39
# Where a table's symbols came from (its header says): the kernel's own
# kallsyms lines, or an ELF file's symtab (a vmlinux or .ko), which lacks the
# symbols the kernel adds and is replaced once kallsyms shows the module.
FROM_KALLSYMS = 0
FROM_ELF = 1
ABSOLUTE = 1  # kernel table: section index of symbols that do not move with KASLR
# Module tables: the pseudo-section of symbols printed at absolute values.
MODULE_ABSOLUTE = "*absolute*"
# A kernel symbol more than this far from _text was not relocated (per-cpu
# symbols of x86-64 print as small absolute values).
_RELOCATED_RANGE = 1 << 31
# What an absolute entry holds (a signed 64-bit column).
_ABSOLUTE_RANGE = (-(1 << 63), 1 << 63)


def _pad8(n: int) -> int:
    return -n % 8


@record
class Entry:
    section: int
    value: int
    type: str
    name: str


# The kallsyms types perf keeps (symbol_type__filter() in tools/perf/util/symbol.c:
# T, W, D, B in either case, and u, l).
PERF_TYPES = frozenset(b"TtWwDdBbul")


class Columns:
    """A table being built column by column: what :func:`pack_columns` packs.

    Columns are compact arrays, so a kernel's 120,000 symbols never become
    as many Python tuples (the first capture's memory peak)."""

    __slots__ = ("name_end", "names", "secs", "types", "values")

    def __init__(self) -> None:
        self.values = array("q")
        self.secs = array("H")
        self.types = bytearray()
        self.names = bytearray()
        self.name_end = array("I")

    def add(self, section: int, value: int, typ: int, name: bytes) -> None:
        self.values.append(value)
        self.secs.append(section)
        self.types.append(typ)
        self.names += name
        self.name_end.append(len(self.names))


def _le(a: array[int]) -> array[int] | bytes:
    """*a* as little-endian bytes (a copy only on a big-endian host)."""
    if sys.byteorder == "little":
        return a
    b = array(a.typecode, a)
    b.byteswap()
    return b.tobytes()


def searchable(cols: Columns) -> tuple[array[int], array[int]]:
    """The sort keys, ascending, and the entry each names: of the symbols at
    one address, the one a lookup there names.

    That is the one perf names reading a kallsyms file: of the types perf
    keeps, the last in file order.  perf sorts by address keeping file order
    on ties, gives every symbol but the last at an address zero length
    (symbols__fixup_end()), then symbols__fixup_duplicate() keeps the one of
    non-zero length (choose_best_symbol()); checked against ``perf script`` in
    tests/perf/test_perf.py.  A symbol of a type perf drops (r, a: read-only data,
    never where a sample lands) is still named where no other starts at its
    address, so data addresses keep their names.
    """
    # (key << 33 | kept by perf << 32 | entry): one int per entry, so that at
    # one key the dropped types sort first, then file order; the last wins.
    keyed = [
        ((sec << 40) + value + KEY_SPAN) << 33 | (typ in PERF_TYPES) << 32 | i
        for i, (sec, value, typ) in enumerate(zip(cols.secs, cols.values, cols.types, strict=True))
        if -KEY_SPAN <= value < KEY_SPAN
    ]
    keyed.sort()
    keys, order = array("q"), array("I")
    for j, k in enumerate(keyed):
        key = k >> 33
        if j + 1 == len(keyed) or keyed[j + 1] >> 33 != key:
            keys.append(key)
            order.append(k & 0xFFFFFFFF)
    return keys, order


def pack_columns(cols: Columns, sections: Sequence[str], source: int = FROM_KALLSYMS) -> bytes:
    """Pack a table's columns (entries in their given order)."""
    n = len(cols.values)
    keys, order = searchable(cols)
    secblob = b"\0".join(s.encode() for s in sections)
    head = _HEADER.pack(MAGIC, n, len(keys), len(sections), len(cols.names), len(secblob), source)
    parts: list[bytes | bytearray | array[int]] = [head, secblob, b"\0" * _pad8(len(secblob))]
    parts += [_le(cols.values), _le(keys), _le(order), _le(cols.name_end)]
    size = sum(len(p) * (p.itemsize if isinstance(p, array) else 1) for p in parts)
    parts += [b"\0" * _pad8(size), _le(cols.secs), cols.types, cols.names]
    return b"".join(parts)


def pack(
    entries: Iterable[tuple[int, int, int, bytes]],
    sections: Sequence[str],
    source: int = FROM_KALLSYMS,
) -> bytes:
    """Pack ``(section, value, type byte, name)`` entries, in their given order."""
    cols = Columns()
    for sec, value, typ, name in entries:
        cols.add(sec, value, typ, name)
    return pack_columns(cols, sections, source)


class SymbolTables(Protocol):
    """Tables by key, as a read of the store gives them (absent: None)."""

    def get(self, key: str) -> SymbolTable | None: ...


class SymbolTable:
    """A view of a packed table; valid as long as its buffer (an LMDB read txn)."""

    def __init__(self, buf: bytes | memoryview) -> None:
        mv = memoryview(buf)
        if len(mv) < _HEADER.size:
            raise ValueError("symbol table too short")
        magic, n, ns, nsec, names_len, sec_len, source = _HEADER.unpack_from(mv, 0)
        if magic != MAGIC:
            raise ValueError("not a kreld symbol table")
        off = _HEADER.size
        need = off + sec_len + _pad8(sec_len) + 12 * n + 12 * ns
        need += _pad8(need) + 3 * n + names_len
        if need > len(mv):
            raise ValueError(
                f"symbol table truncated: its counts need {need:,} bytes, not {len(mv):,}"
            )
        self.sections = (
            [s.decode() for s in bytes(mv[off : off + sec_len]).split(b"\0")] if nsec else []
        )
        off += sec_len + _pad8(sec_len)

        def take(fmt: Literal["q", "I", "H"], count: int, size: int) -> memoryview:
            nonlocal off
            view: memoryview = mv[off : off + count * size].cast(fmt)
            off += count * size
            return view

        self.count = n
        self.source = source
        self.values = take("q", n, 8)
        self.keys = take("q", ns, 8)
        self.sorted = take("I", ns, 4)
        # Where each name starts: the u32 before each end (entry 0's is not a
        # name's end but the last of ``sorted``, or of ``keys``: read it as 0).
        self.name_start = mv[off - 4 : off - 4 + 4 * n].cast("I")
        self.name_end = take("I", n, 4)
        off += _pad8(off)
        self.secs = take("H", n, 2)
        self.types = mv[off : off + n]
        off += n
        self.names = mv[off : off + names_len]
        if off + names_len > len(mv):
            raise ValueError("symbol table truncated")

    def check(self) -> None:
        """Every index inside the table (a table from someone else: the fleet
        bucket); ValueError naming the first that is not.  Linear, in numpy."""
        import numpy as np

        if self.sorted and int(np.frombuffer(self.sorted, dtype=np.uint32).max()) >= self.count:
            raise ValueError("a sorted entry past the table's count")
        ends = np.frombuffer(self.name_end, dtype=np.uint32)
        if len(ends) and (int(ends[-1]) > len(self.names) or bool((np.diff(ends) < 0).any())):
            raise ValueError("name ends out of order or past the names")
        keys = np.frombuffer(self.keys, dtype=np.int64)
        if len(keys) > 1 and bool((np.diff(keys) <= 0).any()):
            raise ValueError("sort keys not ascending")

    def section_index(self, name: str) -> int | None:
        try:
            return self.sections.index(name)
        except ValueError:
            return None

    def name(self, i: int) -> str:
        start = self.name_end[i - 1] if i else 0
        return bytes(self.names[start : self.name_end[i]]).decode("utf-8", "replace")

    def lookup(self, section: int, value: int) -> tuple[str, int] | None:
        """The symbol at or before *value* in *section*: (name, offset into it)."""
        key = section * (1 << 40) + value + KEY_SPAN
        keys = self.keys
        i = bisect.bisect_right(keys, key) - 1
        if i < 0:
            return None
        if keys[i] >> 40 != section:
            return None
        entry = self.sorted[i]
        return self.name(entry), value - self.values[entry]

    def __iter__(self) -> Iterator[Entry]:
        for i in range(self.count):
            yield Entry(self.secs[i], self.values[i], chr(self.types[i]), self.name(i))


# -- building tables from kallsyms ---------------------------------------------


def kernel_table(
    core: Iterable[tuple[int, bytes, bytes]], text: int, source: int = FROM_KALLSYMS
) -> bytes:
    """The kernel's table; *core* is read once, in order (it may be a stream)."""
    cols = Columns()
    for value, typ, name in core:
        rel = value - text
        if -_RELOCATED_RANGE <= rel < _RELOCATED_RANGE and typ not in (b"a", b"A"):
            cols.add(0, rel, typ[0], name)
        elif _ABSOLUTE_RANGE[0] <= value < _ABSOLUTE_RANGE[1]:
            cols.add(ABSOLUTE, value, typ[0], name)
        # else: no symbol of the image lies 2 GiB from _text, nor is a per-cpu
        # offset that large: a line the table cannot hold is left out.
    return pack_columns(cols, [], source)


def module_table(
    lines: Sequence[tuple[int, bytes, bytes]],
    sections: Mapping[str, int],
    sizes: Mapping[str, int],
) -> bytes | None:
    """A module's kallsyms lines relative to its sections; ``None`` if a symbol
    lies in no section (the lines belong to another load of the module).

    Per-cpu variables print as type ``a`` at their offset in the per-cpu area
    (``elf_type()`` in kernel/module/kallsyms.c), and ``.data..percpu`` is not
    in sysfs (the kernel clears its alloc flag): those lines are kept as they
    are, in the pseudo-section :data:`MODULE_ABSOLUTE`.
    """
    if not sections:
        return None
    names = sorted(sections, key=lambda s: (sections[s], s))
    bases = [sections[s] for s in names]
    absolute = len(names)
    # Empty sections share their base with the next one: the last name stands.
    entries = []
    for value, typ, sym in lines:
        if typ in (b"a", b"A"):
            if _ABSOLUTE_RANGE[0] <= value < _ABSOLUTE_RANGE[1]:  # else left out
                entries.append((absolute, value, typ[0], sym))
            continue
        i = bisect.bisect_right(bases, value) - 1
        if i < 0:
            return None
        sec = names[i]
        bound = sizes.get(sec)
        if bound is not None and value - bases[i] >= bound:
            return None
        entries.append((i, value - bases[i], typ[0], sym))
    return pack(entries, [*names, MODULE_ABSOLUTE])


def module_symbol_key(build_id: str | None, name: str, srcversion: str | None) -> str | None:
    if build_id:
        return f"m:{build_id}"
    if srcversion:
        return f"m:{name}:{srcversion}"
    return None


def kernel_symbol_key(build_id: str | None, boot_id: str) -> str:
    return f"k:{build_id}" if build_id else f"b:{boot_id}"
