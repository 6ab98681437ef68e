"""Lines of assembly no DWARF function covers, from the units' line programs.

Assembly built with ``-g`` (``entry_64.S``, ``irq_entries_start``, the retpoline
thunks of a kernel) gets a compilation unit in the language
``DW_LANG_Mips_Assembler`` (GNU as and LLVM's assembler both say so) with a
*line program*, and a subprogram for each symbol typed ``@function`` at most:
the labels between them (``entry_SYSCALL_64_after_hwframe``,
``irq_entries_start``) are covered by no function.  The SymCache is made of
functions, so it has no line there; both references give one, the function
named after the ELF symbol and the file:line of the line program's row
(llvm-symbolizer for an executable, eu-addr2line for a module).

:func:`assembly_lines` finds those units and decodes their line programs
(``.debug_line``, DWARF 2 to 5) into ranges: each row's address up to the
next row's, the last of a sequence ending it; among rows at one address, the
last, as llvm-symbolizer takes it.  The table gives them only where it has no
DWARF function (:meth:`kreld.debuginfo.lines.LineTable.frame_columns`).  A
unit is examined only where its first DIE uses the first abbreviation of its
table (as both assemblers write it: a few dozen units of a kernel's two
thousand are decoded, in milliseconds, reading the file where it lies); a
unit whose header or program this reader does not follow (a form it does
not know, a string kept by index, a run past its end) gives no lines: never
a wrong one.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kreld.debuginfo.lines import NONE, normalize_path
from kreld.debuginfo.lines_reloc import read_sections, section_contents

if TYPE_CHECKING:
    from numpy.typing import NDArray

__all__ = ["ProgramLines", "assembly_lines"]

# Forms whose size does not depend on the unit (None: read specially).
_FIXED = {0x0B: 1, 0x05: 2, 0x06: 4, 0x07: 8, 0x1E: 16, 0x0C: 1, 0x11: 1, 0x12: 2, 0x13: 4,
          0x14: 8, 0x20: 8, 0x19: 0, 0x21: 0, 0x25: 1, 0x26: 2, 0x27: 3, 0x28: 4, 0x29: 1,
          0x2A: 2, 0x2B: 3, 0x2C: 4, 0x1C: 4, 0x24: 8}  # fmt: skip
_FORM_ADDR, _FORM_STRING, _FORM_STRP, _FORM_LINE_STRP = 0x01, 0x08, 0x0E, 0x1F
_FORM_SEC_OFFSET, _FORM_REF_ADDR, _FORM_STRP_SUP = 0x17, 0x10, 0x1D
_FORM_UDATA_LIKE = {0x0D, 0x0F, 0x15, 0x1A, 0x1B, 0x22, 0x23}  # LEB128 values
_FORM_BLOCKS = {0x0A: 1, 0x03: 2, 0x04: 4}  # block1/2/4: a length of that size
_FORM_BLOCK_LEB = {0x09, 0x18}  # block, exprloc: a ULEB128 length
_AT_STMT_LIST, _AT_LANGUAGE, _AT_COMP_DIR = 0x10, 0x13, 0x1B
_TAG_COMPILE_UNIT = 0x11
_LANG_ASSEMBLER = 0x8001  # DW_LANG_Mips_Assembler
_LNCT_PATH, _LNCT_DIRECTORY_INDEX = 1, 2
_DW_UT_COMPILE = 1
_SHT_NOBITS, _SHF_COMPRESSED = 8, 0x800
# Line program rows decoded at most per unit (a unit of assembly has thousands).
_MAX_ROWS = 1 << 22


class _Bad(Exception):
    """This reader does not follow the unit: it gives no lines."""


@dataclass(frozen=True)
class ProgramLines:
    """Ranges of the line programs read: ``starts`` (absolute addresses,
    sorted, one per start), each range's ``file`` (an index of ``paths``,
    ``NONE`` past a sequence's end) and ``line``."""

    starts: NDArray[np.uint64]
    file: NDArray[np.uint32]
    line: NDArray[np.uint32]
    paths: list[str]


Buffer = bytes | mmap.mmap


@dataclass(frozen=True)
class _Span:
    """A section's bytes: *data*[*start*:*end*] (no copy of a file's map)."""

    data: Buffer
    start: int
    end: int

    def reader(self, offset: int, end: int | None = None) -> _Reader:
        if not 0 <= offset < self.end - self.start:
            raise _Bad("an offset past its section")
        stop = self.end if end is None else min(self.end, self.start + end)
        return _Reader(self.data, self.start + offset, stop)


class _Reader:
    """Reads *data* (bytes, or the file's map) from *pos*, never at or past *end*."""

    def __init__(self, data: Buffer, pos: int, end: int) -> None:
        self.data, self.pos, self.end = data, pos, min(end, len(data))

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.end:
            raise _Bad("past the end")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u(self, n: int) -> int:
        return int.from_bytes(self.take(n), "little")

    def uleb(self) -> int:
        return self._leb(signed=False)

    def sleb(self) -> int:
        return self._leb(signed=True)

    def _leb(self, signed: bool) -> int:
        value = shift = 0
        while True:
            b = self.u(1)
            value |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return value - (1 << shift) if signed and b & 0x40 else value
            if shift > 70:
                raise _Bad("LEB128 too long")

    def cstr(self) -> bytes:
        end = self.data.find(b"\0", self.pos, self.end)
        if end < 0:
            raise _Bad("unterminated string")
        out = self.data[self.pos : end]
        self.pos = end + 1
        return out


@dataclass
class _Strings:
    """``.debug_str`` and ``.debug_line_str``."""

    str: _Span
    line_str: _Span

    def at(self, form: int, offset: int) -> bytes:
        return (self.line_str if form == _FORM_LINE_STRP else self.str).reader(offset).cstr()

    def of(self, value: int | bytes, form: int) -> bytes:
        """A string attribute's value: inline, or by offset into a string section."""
        if isinstance(value, bytes):
            return value
        if form in (_FORM_STRP, _FORM_LINE_STRP):
            return self.at(form, value)
        raise _Bad(f"a string of form {form:#x}")


def _form_value(r: _Reader, form: int, addr_size: int, off_size: int, version: int) -> int | bytes:
    """An attribute's value: an int, or bytes for an inline string (block
    forms and unknown ones: :class:`_Bad`, except those only skipped)."""
    if form == _FORM_STRING:
        return r.cstr()
    if form == _FORM_ADDR:
        return r.u(addr_size)
    if form in (_FORM_STRP, _FORM_LINE_STRP, _FORM_SEC_OFFSET, _FORM_STRP_SUP):
        return r.u(off_size)
    if form == _FORM_REF_ADDR:
        return r.u(addr_size if version == 2 else off_size)
    if form in _FIXED:
        return r.u(_FIXED[form]) if _FIXED[form] else 0
    if form in _FORM_UDATA_LIKE:
        return r.uleb()
    if form in _FORM_BLOCKS:
        r.take(r.u(_FORM_BLOCKS[form]))
        return 0
    if form in _FORM_BLOCK_LEB:
        r.take(r.uleb())
        return 0
    raise _Bad(f"form {form:#x}")


def _first_abbrev(abbrevs: _Span, offset: int, code: int) -> list[tuple[int, int]] | None:
    """The (attribute, form) pairs of the first abbreviation of the table at
    *offset*, if it is *code* and a compilation unit's (else None: the unit
    is not examined)."""
    r = abbrevs.reader(offset)
    if r.uleb() != code or r.uleb() != _TAG_COMPILE_UNIT:
        return None
    r.u(1)  # children
    specs: list[tuple[int, int]] = []
    while True:
        at, form = r.uleb(), r.uleb()
        if at == 0 and form == 0:
            return specs
        if form == 0x21:  # implicit_const: its value is here, not in the DIE
            r.sleb()
        specs.append((at, form))


_Unit = tuple[int, int, int, int, int, int]


def _units(info: _Span) -> list[_Unit]:
    """Each compilation unit: (version, offset size, address size, abbrev
    offset, its first DIE, its end), positions in the file's bytes."""
    out = []
    pos = info.start
    while pos + 11 <= info.end:
        r = _Reader(info.data, pos, info.end)
        length, off_size = r.u(4), 4
        if length == 0xFFFFFFFF:
            length, off_size = r.u(8), 8
        end = r.pos + length
        if length < 7 or end > info.end:
            break
        version = r.u(2)
        if version >= 5:
            unit_type, addr_size, abbrev = r.u(1), r.u(1), r.u(off_size)
            if unit_type == _DW_UT_COMPILE:
                out.append((version, off_size, addr_size, abbrev, r.pos, end))
        elif 2 <= version <= 4:
            abbrev, addr_size = r.u(off_size), r.u(1)
            out.append((version, off_size, addr_size, abbrev, r.pos, end))
        pos = end
    return out


def _assembly_unit(
    info: _Span, abbrevs: _Span, strings: _Strings, unit: _Unit
) -> tuple[int, bytes] | None:
    """An assembly unit's line program offset and directory (None: another
    language, or a unit not examined)."""
    version, off_size, addr_size, abbrev, die, end = unit
    r = _Reader(info.data, die, end)
    specs = _first_abbrev(abbrevs, abbrev, r.uleb())
    if specs is None:
        return None
    stmt, comp_dir, language = None, b"", None
    for at, form in specs:
        value = _form_value(r, form, addr_size, off_size, version)
        if at == _AT_STMT_LIST and isinstance(value, int):
            stmt = value
        elif at == _AT_COMP_DIR:
            comp_dir = strings.of(value, form)
        elif at == _AT_LANGUAGE:
            language = value
    if language != _LANG_ASSEMBLER or stmt is None:
        return None
    return stmt, comp_dir


def _entry_formats(r: _Reader) -> list[tuple[int, int]]:
    return [(r.uleb(), r.uleb()) for _ in range(r.u(1))]


def _entries(
    r: _Reader, formats: list[tuple[int, int]], strings: _Strings, off_size: int
) -> list[tuple[bytes, int]]:
    """DWARF 5 directory or file entries: (path, directory index)."""
    out = []
    for _ in range(r.uleb()):
        path, directory = b"", 0
        for kind, form in formats:
            value = _form_value(r, form, 8, off_size, 5)
            if kind == _LNCT_PATH:
                path = strings.of(value, form)
            elif kind == _LNCT_DIRECTORY_INDEX and isinstance(value, int):
                directory = value
        out.append((path, directory))
    return out


_Cols = list[tuple[list[int], list[int], list[int], int]]


@dataclass
class _Header:
    min_inst: int
    line_base: int
    line_range: int
    opcode_base: int
    std_lengths: bytes
    paths: list[str | None]
    first_file: int  # the file register's value naming paths[0]
    program: int
    end: int


def _header(lines: _Span, offset: int, comp_dir: str, strings: _Strings) -> _Header:
    r = lines.reader(offset)
    length, off_size = r.u(4), 4
    if length == 0xFFFFFFFF:
        length, off_size = r.u(8), 8
    end = r.pos + length
    version = r.u(2)
    if end > lines.end or not 2 <= version <= 5:
        raise _Bad("a line program header this reader does not follow")
    if version >= 5:
        r.take(2)  # address size, segment selector size
    program = r.pos + off_size
    program += r.u(off_size)
    min_inst = r.u(1)
    if version >= 4:
        r.u(1)  # maximum operations per instruction (1 on x86)
    r.u(1)  # default_is_stmt: every row counts alike here
    line_base = struct.unpack("b", r.take(1))[0]
    line_range, opcode_base = r.u(1), r.u(1)
    if line_range == 0 or opcode_base == 0:
        raise _Bad("a line program header this reader does not follow")
    std_lengths = r.take(opcode_base - 1)
    if version >= 5:
        dirs = [p for p, _ in _entries(r, _entry_formats(r), strings, off_size)]
        files = _entries(r, _entry_formats(r), strings, off_size)
        first_file = 0
    else:
        dirs = [b""]
        while d := r.cstr():
            dirs.append(d)
        files = []
        while name := r.cstr():
            files.append((name, r.uleb()))
            r.uleb(), r.uleb()  # modification time, length
        first_file = 1
    text = [d.decode("utf-8", "replace") for d in dirs]
    paths: list[str | None] = [
        normalize_path(comp_dir, text[d], name.decode("utf-8", "replace"))
        if d < len(text)
        else None
        for name, d in files
    ]
    return _Header(min_inst, line_base, line_range, opcode_base, std_lengths, paths, first_file,
                   program, end)  # fmt: skip


def _rows(data: Buffer, h: _Header) -> tuple[list[int], list[int], list[int]]:
    """The rows of a line program: address, file (an index of the header's
    paths, -1 where none, -2 a sequence's end) and line."""
    r = _Reader(data, h.program, h.end)
    addrs: list[int] = []
    files: list[int] = []
    lines: list[int] = []
    address, file, line = 0, 1, 1

    def emit(end: bool = False) -> None:
        if len(addrs) >= _MAX_ROWS:
            raise _Bad("too many rows")
        k = file - h.first_file
        addrs.append(address)
        files.append(-2 if end else k if 0 <= k < len(h.paths) and h.paths[k] else -1)
        lines.append(line)

    while r.pos < h.end:
        op = r.u(1)
        if op >= h.opcode_base:
            adj = op - h.opcode_base
            address += (adj // h.line_range) * h.min_inst
            line += h.line_base + adj % h.line_range
            emit()
        elif op == 0:
            size = r.uleb()
            after = r.pos + size
            sub = r.u(1) if size else 0
            if sub == 1:  # end_sequence
                emit(end=True)
                address, file, line = 0, 1, 1
            elif sub == 2:  # set_address
                address = r.u(size - 1)
            elif sub == 3:  # define_file (DWARF 2 to 4)
                raise _Bad("define_file")
            r.pos = after
        elif op == 1:  # copy
            emit()
        elif op == 2:  # advance_pc
            address += r.uleb() * h.min_inst
        elif op == 3:  # advance_line
            line += r.sleb()
        elif op == 4:  # set_file
            file = r.uleb()
        elif op == 8:  # const_add_pc
            address += ((255 - h.opcode_base) // h.line_range) * h.min_inst
        elif op == 9:  # fixed_advance_pc
            address += r.u(2)
        else:  # the others only move past their operands
            for _ in range(h.std_lengths[op - 1]):
                r.uleb()
    return addrs, files, lines


def assembly_lines(buf: Buffer, path: str) -> ProgramLines:
    """The line-program ranges of the assembly units of *buf* (an ELF file,
    its DWARF linked or relocated in place)."""
    _, secs, names = read_sections(buf, path)
    by_name = dict(zip(names, secs, strict=True))

    def span(name: str) -> _Span:
        s = by_name.get(name)
        if s is None or s.type == _SHT_NOBITS:
            return _Span(b"", 0, 0)
        if s.flags & _SHF_COMPRESSED:
            data = section_contents(buf, s, name, path)
            return _Span(data, 0, len(data))
        return _Span(buf, s.offset, s.offset + s.size)

    info, abbrevs, lines = span(".debug_info"), span(".debug_abbrev"), span(".debug_line")
    strings = _Strings(span(".debug_str"), span(".debug_line_str"))
    paths: list[str] = []
    cols: _Cols = []
    for unit in _units(info):
        try:
            found = _assembly_unit(info, abbrevs, strings, unit)
            if found is None:
                continue
            h = _header(lines, found[0], found[1].decode("utf-8", "replace"), strings)
            rows = _rows(lines.data, h)
        except (_Bad, IndexError, struct.error, UnicodeError):
            continue  # no lines from this unit, never a wrong one
        cols.append((*rows, len(paths)))
        paths += [p or "" for p in h.paths]
    return _ranges(cols, paths)


def _ranges(
    cols: list[tuple[list[int], list[int], list[int], int]], paths: list[str]
) -> ProgramLines:
    """One range per start address: at an address a sequence ends and
    another starts, the start; among rows at one address, the last."""
    if not cols:
        return ProgramLines(np.zeros(0, np.uint64), np.zeros(0, np.uint32),
                            np.zeros(0, np.uint32), paths)  # fmt: skip
    addr = np.concatenate([np.array(a, dtype=np.uint64) for a, _, _, _ in cols])
    raw = np.concatenate([np.array(f, dtype=np.int64) for _, f, _, _ in cols])
    shift = np.concatenate([np.full(len(f), s, dtype=np.int64) for _, f, _, s in cols])
    line = np.concatenate([np.array(n, dtype=np.int64) for _, _, n, _ in cols])
    kind = (raw != -2).astype(np.int64)  # a sequence's end sorts before a row at its address
    order = np.lexsort((np.arange(len(addr)), kind, addr))
    addr, raw, shift, line = addr[order], raw[order], shift[order], line[order]
    last = np.ones(len(addr), dtype=bool)
    last[:-1] = addr[1:] != addr[:-1]
    addr, raw, shift, line = addr[last], raw[last], shift[last], line[last]
    file = np.where(raw >= 0, raw + shift, NONE).astype(np.uint32)
    line = np.where(raw >= 0, np.clip(line, 0, NONE), 0).astype(np.uint32)
    return ProgramLines(addr, file, line, paths)
