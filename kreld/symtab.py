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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

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


def _pad8(n: int) -> int:
    return -n % 8


@dataclass(frozen=True, slots=True)
class Entry:
    section: int
    value: int
    type: str
    name: str


# The kallsyms types perf keeps (symbol_type__filter() in tools/perf/util/symbol.c:
# T, W, D, B in either case, and u, l).
PERF_TYPES = frozenset(b"TtWwDdBbul")


def searchable(entries: Sequence[tuple[int, int, int, bytes]]) -> list[tuple[int, int]]:
    """(sort key, entry index) of each symbol a lookup may name, by key.

    Of several symbols at one address, the one perf names reading a kallsyms
    file: of the types perf keeps, the last in file order.  perf sorts by
    address keeping file order on ties, gives every symbol but the last at an
    address zero length (symbols__fixup_end()), then symbols__fixup_duplicate()
    keeps the one of non-zero length (choose_best_symbol()); checked against
    ``perf script`` in tests/test_perf.py.  A symbol of a type perf drops (r,
    a: read-only data, never where a sample lands) is still named where no
    other starts at its address, so data addresses keep their names.
    """
    keyed = sorted(
        (e[0] * (1 << 40) + e[1] + KEY_SPAN, e[2] in PERF_TYPES, i)
        for i, e in enumerate(entries)
        if -KEY_SPAN <= e[1] < KEY_SPAN
    )  # at one key: the dropped types first, then file order
    last = len(keyed) - 1
    return [(k, i) for j, (k, _, i) in enumerate(keyed) if j == last or k != keyed[j + 1][0]]


def pack(
    entries: Sequence[tuple[int, int, int, bytes]],
    sections: Sequence[str],
    source: int = FROM_KALLSYMS,
) -> bytes:
    """Pack ``(section, value, type byte, name)`` entries, in their given order."""
    n = len(entries)
    names = b"".join(e[3] for e in entries)
    secblob = b"\0".join(s.encode() for s in sections)
    index = searchable(entries)
    out = bytearray(
        _HEADER.pack(MAGIC, n, len(index), len(sections), len(names), len(secblob), source)
    )
    out += secblob + b"\0" * _pad8(len(secblob))
    out += struct.pack(f"<{n}q", *(e[1] for e in entries))
    out += struct.pack(f"<{len(index)}q", *(k for k, _ in index))
    out += struct.pack(f"<{len(index)}I", *(i for _, i in index))
    ends, pos = [], 0
    for e in entries:
        pos += len(e[3])
        ends.append(pos)
    out += struct.pack(f"<{n}I", *ends)
    out += b"\0" * _pad8(len(out))
    out += struct.pack(f"<{n}H", *(e[0] for e in entries))
    out += bytes(e[2] for e in entries)
    out += names
    return bytes(out)


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
        self.name_end = take("I", n, 4)
        off += _pad8(off)
        self.secs = take("H", n, 2)
        self.types = mv[off : off + n]
        off += n
        self.names = mv[off : off + names_len]
        if off + names_len > len(mv):
            raise ValueError("symbol table truncated")

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


@dataclass
class Kallsyms:
    """One read of ``/proc/kallsyms``, split as the kernel prints it."""

    core: list[tuple[int, bytes, bytes]]  # (address, type, name)
    modules: dict[str, list[tuple[int, bytes, bytes]]]  # module -> its lines, in order
    order: list[str]  # modules (and other bracketed owners) in file order


def parse_kallsyms(data: bytes) -> Kallsyms:
    core: list[tuple[int, bytes, bytes]] = []
    modules: dict[str, list[tuple[int, bytes, bytes]]] = {}
    order: list[str] = []
    for line in data.split(b"\n"):
        if not line:
            continue
        addr, sp, rest = line.partition(b" ")
        typ, sp2, name = rest.partition(b" ")
        if not sp or not sp2 or len(typ) != 1:
            continue
        try:
            value = int(addr, 16)
        except ValueError:
            continue
        sym, tab, owner = name.partition(b"\t")
        if tab:
            mod = owner.strip(b"[]").decode("ascii", "replace")
            if mod not in modules:
                modules[mod] = []
                order.append(mod)
            modules[mod].append((value, typ, sym))
        else:
            core.append((value, typ, sym))
    return Kallsyms(core, modules, order)


def kernel_table(
    core: Sequence[tuple[int, bytes, bytes]], text: int, source: int = FROM_KALLSYMS
) -> bytes:
    entries = []
    for value, typ, name in core:
        rel = value - text
        if -_RELOCATED_RANGE <= rel < _RELOCATED_RANGE and typ not in (b"a", b"A"):
            entries.append((0, rel, typ[0], name))
        else:
            entries.append((ABSOLUTE, value, typ[0], name))
    return pack(entries, [], source)


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
