"""A relocatable object's DWARF made readable as if it were linked.

A kernel module's debug file (``.ko``) is relocatable: its DWARF refers to code
through ``.rela.debug_*`` entries, each "symbol + addend", and every allocated
section starts at 0.  DWARF readers built for executables (``symbolic`` here)
do not apply those entries, so a module's ranges come out empty or garbled,
and a reader that does apply them while placing every section at 0 mixes
``.text`` with ``.init.text`` (the llvm-symbolizer failure on modules).

:func:`place_sections` writes a private copy in which each allocated section
(``SHF_ALLOC``) has its own base, far from every other, the debug sections are
decompressed (``SHF_COMPRESSED``, zlib) and relocated against those bases, and
the symbol table's values are made absolute.  An address in that copy is
``base[section] + offset``, so a table built from it answers by (section,
offset), the one thing every incarnation of a module build shares.

The copy leaves out the symbol table (``SHT_NULL``): given one, the reader
names an out-of-line function after its ELF symbol (``brd_alloc.isra.0``, or
another alias at the same address), which eu-addr2line does not; the table
takes symbol names itself (:func:`read_symbols`), where and as
kreld.debuginfo.lines_build says.

Only what kernel modules on x86-64 carry is handled: ELF64 little-endian,
``SHT_RELA``, and the absolute relocation types DWARF uses; anything else is a
:class:`~kreld.core.errors.LineTableError` naming what it met.
"""

from __future__ import annotations

import mmap
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from kreld.core.errors import LineTableError
from kreld.kernel.elf import ElfFileError, ElfHeader, ElfSource, SectionHeader, elf_header
from kreld.kernel.elf import section_headers as elf_section_headers

__all__ = [
    "PlacedObject",
    "SectionBase",
    "SymbolRows",
    "place_sections",
    "read_sections",
    "read_symbols",
    "section_contents",
    "symbol_value",
]

# An ELF64 little-endian section header, as written back (kreld.kernel.elf
# reads them), the ELF header's size and where it holds e_shoff.
_SHDR = struct.Struct("<IIQQQQIIQQ")
_EHDR_SIZE, _E_SHOFF = 64, 0x28
_CHDR = struct.Struct("<IIQQ")
_ET_REL = 1
_EM_X86_64 = 62
_SHT_NULL = 0
_SHT_SYMTAB = 2
_SHT_RELA = 4
_SHT_NOBITS = 8
_SHF_ALLOC = 0x2
_SHF_COMPRESSED = 0x800
_ELFCOMPRESS_ZLIB = 1
_SHN_LORESERVE = 0xFF00
_SHN_ABS = 0xFFF1
# Relocation types (x86-64 psABI) that DWARF in a relocatable object uses:
# the value is symbol + addend, written in 8 or 4 bytes.
_R_NONE, _R_64, _R_32, _R_32S = 0, 1, 10, 11
# Sections start at this base, each on its own page with a gap after it, so
# that no two sections' addresses meet and 0 stays unused.
_FIRST_BASE = 0x10000
_GAP = 0x10000
# A debug section decompressed beyond this is refused (a zlib bomb).
MAX_SECTION_BYTES = 1 << 30
_SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                 ("value", "<u8"), ("size", "<u8")])  # fmt: skip
_RELA = np.dtype([("offset", "<u8"), ("info", "<u8"), ("addend", "<i8")])


@dataclass(frozen=True)
class SectionBase:
    """Where :func:`place_sections` put one allocated section."""

    name: str
    base: int
    size: int


@dataclass(frozen=True)
class PlacedObject:
    """The relocated copy (bytes of an ELF file) and where each section went."""

    image: bytes
    sections: tuple[SectionBase, ...]
    #: section index -> base, for placing the symbols of each section
    bases: dict[int, int]


def _bad(path: str, why: str) -> LineTableError:
    return LineTableError(path, why)


Sections = tuple[ElfHeader, list[SectionHeader], list[str]]


def _headers(buf: bytes, path: str) -> Sections:
    eh, secs, names = read_sections(buf, path)
    if eh.type != _ET_REL:
        raise _bad(path, "not a relocatable object")
    if eh.machine != _EM_X86_64:
        raise _bad(path, f"relocations of ELF machine {eh.machine} are not handled")
    return eh, secs, names


def read_sections(buf: bytes | mmap.mmap, path: str) -> Sections:
    """The ELF header, the section headers (:mod:`kreld.kernel.elf` reads both)
    and the section names of *buf*, each section checked to lie inside it."""
    try:
        src = ElfSource(path, len(buf), data=buf)  # type: ignore[arg-type]
        eh = elf_header(src)
        if not eh.wide or eh.endian != "<":
            raise _bad(path, "not a 64-bit little-endian ELF file")
        secs = elf_section_headers(src, eh)
    except ElfFileError as e:
        raise _bad(path, e.reason) from None
    if eh.shentsize != _SHDR.size or not secs or eh.shstrndx >= len(secs):
        raise _bad(path, "section headers malformed or extended (more than 65279 sections)")
    strtab = secs[eh.shstrndx]
    table = buf[strtab.offset : strtab.offset + strtab.size]
    names = []
    for s in secs:
        if s.type != _SHT_NOBITS and s.offset + s.size > len(buf):
            raise _bad(path, "a section runs past the end of the file")
        end = table.find(b"\0", s.name)
        names.append(table[s.name : end if end >= 0 else len(table)].decode("utf-8", "replace"))
    return eh, secs, names


def symbol_value(buf: bytes | mmap.mmap, path: str, name: str) -> int | None:
    """The value of the first ``.symtab`` symbol called *name* (None if none)."""
    _, secs, _ = read_sections(buf, path)
    st = next((s for s in secs if s.type == _SHT_SYMTAB), None)
    if st is None or not 0 < st.link < len(secs) or st.entsize != _SYM.itemsize:
        return None
    strs = secs[st.link]
    table = bytes(buf[strs.offset : strs.offset + strs.size])
    # A linker shares string tails ("_text" may be the end of "xyz_text"), so
    # every place the name ends a string is a candidate.
    want = name.encode() + b"\0"
    starts, at = [], table.find(want)
    while at >= 0:
        starts.append(at)
        at = table.find(want, at + 1)
    if not starts:
        return None
    syms = np.frombuffer(buf, dtype=_SYM, count=st.size // _SYM.itemsize, offset=st.offset)
    hit = np.flatnonzero(np.isin(syms["name"], np.array(starts, dtype=np.uint32)))
    value = int(syms["value"][hit[0]]) if len(hit) else None
    del syms
    return value


_STT_NOTYPE, _STT_OBJECT, _STT_FUNC, _STT_GNU_IFUNC = 0, 1, 2, 10


@dataclass(frozen=True)
class SymbolRows:
    """The symbols of a file that can name code, in symbol-table order:
    ``value`` as the file has it (section-relative in a relocatable object),
    ``size``, ``shndx`` (the section index) and ``name``."""

    value: np.ndarray
    size: np.ndarray
    shndx: np.ndarray
    names: list[str]


def read_symbols(buf: bytes | mmap.mmap, path: str) -> SymbolRows:
    """The ``.symtab`` symbols that llvm-symbolizer and elfutils name code
    with: functions, objects, indirect functions and untyped symbols (what
    assembly defines), each in a section of the file (not undefined,
    absolute or common), with a name.  None where the file has no table."""
    _, secs, _ = read_sections(buf, path)
    st = next((s for s in secs if s.type == _SHT_SYMTAB), None)
    empty = np.zeros(0, dtype=np.uint64)
    if st is None or not 0 < st.link < len(secs) or st.entsize != _SYM.itemsize:
        return SymbolRows(empty, empty, empty, [])
    strs = secs[st.link]
    table = bytes(buf[strs.offset : strs.offset + strs.size])
    syms = np.frombuffer(buf, dtype=_SYM, count=st.size // _SYM.itemsize, offset=st.offset).copy()
    stype = syms["info"] & 0xF
    shndx = syms["shndx"].astype(np.int64)
    keep = (
        np.isin(stype, [_STT_NOTYPE, _STT_OBJECT, _STT_FUNC, _STT_GNU_IFUNC])
        & (shndx != 0)
        & (shndx < _SHN_LORESERVE)
        & (syms["name"] != 0)
        & (syms["name"] < len(table))
    )
    syms = syms[keep]
    names = []
    for off in syms["name"].tolist():
        end = table.find(b"\0", off)
        names.append(table[off : end if end >= 0 else len(table)].decode("utf-8", "replace"))
    return SymbolRows(
        syms["value"].astype(np.uint64), syms["size"].astype(np.uint64),
        syms["shndx"].astype(np.uint64), names,
    )  # fmt: skip


def section_contents(buf: bytes | mmap.mmap, s: SectionHeader, name: str, path: str) -> bytes:
    """The bytes of section *s* (named *name*) of *buf*, decompressed if it is
    (zlib, bounded)."""
    data = buf[s.offset : s.offset + s.size]
    if not s.flags & _SHF_COMPRESSED:
        return data
    if len(data) < _CHDR.size:
        raise _bad(path, f"{name}: compressed section shorter than its header")
    ctype, _, size, _ = _CHDR.unpack_from(data)
    if ctype != _ELFCOMPRESS_ZLIB:
        raise _bad(path, f"{name}: compression type {ctype} is not handled (zlib only)")
    if size > MAX_SECTION_BYTES:
        raise _bad(path, f"{name}: decompresses to {size} bytes, over the bound")
    d = zlib.decompressobj()
    try:
        out = d.decompress(data[_CHDR.size :], size)
    except zlib.error as e:
        raise _bad(path, f"{name}: {e}") from None
    if len(out) != size:
        raise _bad(path, f"{name}: decompressed to {len(out)} bytes, header says {size}")
    return out


def _place(secs: list[SectionHeader], path: str) -> dict[int, int]:
    bases: dict[int, int] = {}
    cursor = _FIRST_BASE
    for i, s in enumerate(secs):
        if not s.flags & _SHF_ALLOC:
            continue
        align = max(s.align, 16)
        base = (cursor + align - 1) // align * align
        bases[i] = base
        cursor = (base + s.size + _GAP + 0xFFF) & ~0xFFF
    if cursor >= 1 << 32:
        raise _bad(path, "allocated sections too large to place in 4 GiB")
    return bases


def _symbol_values(
    buf: bytes, secs: list[SectionHeader], bases: dict[int, int], path: str
) -> tuple[int, np.ndarray]:
    idx = next((i for i, s in enumerate(secs) if s.type == _SHT_SYMTAB), -1)
    if idx < 0:
        raise _bad(path, "no symbol table")
    st = secs[idx]
    if st.entsize != _SYM.itemsize or st.size % _SYM.itemsize:
        raise _bad(path, "symbol table entries malformed")
    syms = np.frombuffer(buf, dtype=_SYM, count=st.size // _SYM.itemsize, offset=st.offset).copy()
    shndx = syms["shndx"].astype(np.int64)
    add = np.zeros(len(syms), dtype=np.uint64)
    for i, base in bases.items():
        add[shndx == i] = base
    # Undefined and common symbols have no place in this file: 0, as a linker
    # leaves an unresolved weak reference; absolute ones keep their value.
    ok = (shndx != 0) & ((shndx < _SHN_LORESERVE) | (shndx == _SHN_ABS))
    syms["value"] = np.where(ok, syms["value"] + add, 0)
    return idx, syms


def _relocate(data: bytearray, rela: np.ndarray, values: np.ndarray, name: str, path: str) -> None:
    sym = (rela["info"] >> np.uint64(32)).astype(np.int64)
    rtype = (rela["info"] & np.uint64(0xFFFFFFFF)).astype(np.int64)
    if len(sym) and int(sym.max()) >= len(values):
        raise _bad(path, f"{name}: a relocation names a symbol past the table")
    unknown = set(np.unique(rtype).tolist()) - {_R_NONE, _R_64, _R_32, _R_32S}
    if unknown:
        raise _bad(path, f"{name}: relocation types {sorted(unknown)} are not handled")
    val = values[sym].astype(np.int64) + rela["addend"]
    offs = rela["offset"].astype(np.int64)
    view = np.frombuffer(data, dtype=np.uint8)
    for rt, width in ((_R_64, 8), (_R_32, 4), (_R_32S, 4)):
        sel = rtype == rt
        if not sel.any():
            continue
        o, v = offs[sel], val[sel]
        if int(o.max()) + width > len(data) or int(o.min()) < 0:
            raise _bad(path, f"{name}: a relocation writes past its section")
        if width == 4:
            lo, hi = (-(1 << 31), 1 << 31) if rt == _R_32S else (0, 1 << 32)
            if int(v.min()) < lo or int(v.max()) >= hi:
                raise _bad(path, f"{name}: a 32-bit relocation overflows")
        raw = v.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :width]
        view[o[:, None] + np.arange(width)] = raw


def place_sections(buf: bytes, path: str) -> PlacedObject:
    """The relocatable object *buf* (read from *path*, named in errors) linked
    in place: see the module's docstring."""
    _, secs, names = _headers(buf, path)
    bases = _place(secs, path)
    sym_idx, syms = _symbol_values(buf, secs, bases, path)
    values = syms["value"]
    new: dict[int, bytes] = {sym_idx: syms.tobytes()}
    for s, name in zip(secs, names, strict=True):
        if s.type != _SHT_RELA or not 0 < s.info < len(secs) or s.link != sym_idx:
            continue
        target = secs[s.info]
        if target.flags & _SHF_ALLOC or target.type == _SHT_NOBITS:
            continue  # code relocations: what a loader does, not what lines need
        if s.entsize != _RELA.itemsize or s.size % _RELA.itemsize:
            raise _bad(path, f"{name}: entries malformed")
        data = bytearray(new.get(s.info) or section_contents(buf, target, names[s.info], path))
        rela = np.frombuffer(buf, dtype=_RELA, count=s.size // _RELA.itemsize, offset=s.offset)
        _relocate(data, rela, values, name, path)
        new[s.info] = bytes(data)
    for i, s in enumerate(secs):
        if s.flags & _SHF_COMPRESSED and i not in new and not s.flags & _SHF_ALLOC:
            new[i] = section_contents(buf, s, names[i], path)
    placed = tuple(SectionBase(names[i], b, secs[i].size) for i, b in sorted(bases.items()))
    return PlacedObject(_rewrite(buf, secs, bases, new), placed, dict(bases))


def _rewrite(
    buf: bytes, secs: list[SectionHeader], bases: dict[int, int], new: dict[int, bytes]
) -> bytes:
    out = bytearray(buf)
    secs = list(secs)
    for i, data in new.items():
        out += b"\0" * (-len(out) % 8)
        s = secs[i]
        secs[i] = s._replace(offset=len(out), size=len(data), flags=s.flags & ~_SHF_COMPRESSED)
        out += data
    for i, base in bases.items():
        secs[i] = secs[i]._replace(addr=base)
    out += b"\0" * (-len(out) % 8)
    shoff = len(out)
    for s in secs:
        out += _SHDR.pack(*s._replace(type=_SHT_NULL) if s.type == _SHT_SYMTAB else s)
    struct.pack_into("<Q", out, _E_SHOFF, shoff)
    return bytes(out)
