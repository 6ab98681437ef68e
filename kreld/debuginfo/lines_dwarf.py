"""Reading DWARF's bytes and decoding line programs into ranges.

The readers every line-program user shares (bounded reads of a section, LEB128,
attribute forms, the string sections) and the decoder of a unit's line
program (``.debug_line``, DWARF 2 to 5): :func:`decode_rows` gives its rows,
:func:`ranges` makes them ranges, each row's address up to the next row's, the
last of a sequence ending it; among rows at one address, the last, as
llvm-symbolizer takes it.  Anything this reader does not follow raises
:class:`Bad`: its callers then give no lines from that unit, never a wrong one.
Which units are decoded is :mod:`kreld.debuginfo.lines_program`'s.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kreld.debuginfo.lines import normalize_path
from kreld.debuginfo.lines_ranges import (
    Cols,
    ProgramLines,
    Rows,
    Within,
    cut,
    joined,
    ranges,
)
from kreld.debuginfo.lines_reloc import read_sections, section_contents

if TYPE_CHECKING:
    from numpy.typing import NDArray

__all__ = ["Bad", "Buffer", "Dwarf", "ProgramLines", "Reader", "Span", "Strings", "Within",
           "dwarf_sections", "form_value", "uleb_at", "unit_programs"]  # fmt: skip

# Forms whose size does not depend on the unit (None: read specially).
_FIXED = {0x0B: 1, 0x05: 2, 0x06: 4, 0x07: 8, 0x1E: 16, 0x0C: 1, 0x11: 1, 0x12: 2, 0x13: 4,
          0x14: 8, 0x20: 8, 0x19: 0, 0x21: 0, 0x25: 1, 0x26: 2, 0x27: 3, 0x28: 4, 0x29: 1,
          0x2A: 2, 0x2B: 3, 0x2C: 4, 0x1C: 4, 0x24: 8}  # fmt: skip
_FORM_ADDR, _FORM_STRING, _FORM_STRP, _FORM_LINE_STRP = 0x01, 0x08, 0x0E, 0x1F
_FORM_SEC_OFFSET, _FORM_REF_ADDR, _FORM_STRP_SUP = 0x17, 0x10, 0x1D
_FORM_UDATA_LIKE = {0x0D, 0x0F, 0x15, 0x1A, 0x1B, 0x22, 0x23}  # LEB128 values
_FORM_BLOCKS = {0x0A: 1, 0x03: 2, 0x04: 4}  # block1/2/4: a length of that size
_FORM_BLOCK_LEB = {0x09, 0x18}  # block, exprloc: a ULEB128 length
_LNCT_PATH, _LNCT_DIRECTORY_INDEX = 1, 2
_SHT_NOBITS, _SHF_COMPRESSED = 8, 0x800
# Line program bytes decoded at most per unit, so rows at most (a unit of
# assembly has thousands of rows, a C unit tens of thousands).
_MAX_PROGRAM = 1 << 22


class Bad(Exception):
    """This reader does not follow the unit: it gives no lines."""


Buffer = bytes | mmap.mmap
# (compilation directory, directory, name) -> the name's one spelling
_Spelled = dict[tuple[str, bytes, bytes], str]


@dataclass(frozen=True)
class Span:
    """A section's bytes: *data*[*start*:*end*] (no copy of a file's map)."""

    data: Buffer
    start: int
    end: int

    def reader(self, offset: int, end: int | None = None) -> Reader:
        if not 0 <= offset < self.end - self.start:
            raise Bad("an offset past its section")
        stop = self.end if end is None else min(self.end, self.start + end)
        return Reader(self.data, self.start + offset, stop)


class Reader:
    """Reads *data* (bytes, or the file's map) from *pos*, never at or past *end*."""

    def __init__(self, data: Buffer, pos: int, end: int) -> None:
        self.data, self.pos, self.end = data, pos, min(end, len(data))

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.end:
            raise Bad("past the end")
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
        data, pos, end = self.data, self.pos, self.end
        while True:
            if pos >= end:
                raise Bad("past the end")
            b = data[pos]
            pos += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                self.pos = pos
                return value - (1 << shift) if signed and b & 0x40 else value
            if shift > 70:
                raise Bad("LEB128 too long")

    def cstr(self) -> bytes:
        end = self.data.find(b"\0", self.pos, self.end)
        if end < 0:
            raise Bad("unterminated string")
        out = self.data[self.pos : end]
        self.pos = end + 1
        return out


@dataclass
class Strings:
    """``.debug_str`` and ``.debug_line_str``; each string read once (the
    units' line program headers name the same few thousand files)."""

    str: Span
    line_str: Span
    read: dict[tuple[int, int], bytes] = field(default_factory=dict, repr=False, compare=False)

    def at(self, form: int, offset: int) -> bytes:
        out = self.read.get((form, offset))
        if out is None:
            span = self.line_str if form == _FORM_LINE_STRP else self.str
            out = self.read[(form, offset)] = span.reader(offset).cstr()
        return out

    def of(self, value: int | bytes, form: int) -> bytes:
        """A string attribute's value: inline, or by offset into a string section."""
        if isinstance(value, bytes):
            return value
        if form in (_FORM_STRP, _FORM_LINE_STRP):
            return self.at(form, value)
        raise Bad(f"a string of form {form:#x}")


def form_value(r: Reader, form: int, addr_size: int, off_size: int, version: int) -> int | bytes:
    """An attribute's value: an int, or bytes for an inline string (block
    forms and unknown ones: :class:`Bad`, except those only skipped)."""
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
    raise Bad(f"form {form:#x}")


def _entry_formats(r: Reader) -> list[tuple[int, int]]:
    return [(r.uleb(), r.uleb()) for _ in range(r.u(1))]


def _entries(
    r: Reader, formats: list[tuple[int, int]], strings: Strings, off_size: int
) -> list[tuple[bytes, int]]:
    """DWARF 5 directory or file entries: (path, directory index)."""
    out = []
    for _ in range(r.uleb()):
        path, directory = b"", 0
        for kind, form in formats:
            value = form_value(r, form, 8, off_size, 5)
            if kind == _LNCT_PATH:
                path = strings.of(value, form)
            elif kind == _LNCT_DIRECTORY_INDEX and isinstance(value, int):
                directory = value
        out.append((path, directory))
    return out


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


def _read_header(
    lines: Span, offset: int, comp_dir: str, strings: Strings, spelled: _Spelled | None = None
) -> _Header:
    """The header of the line program at *offset*; its file names spelled
    once (:func:`normalize_path`) through *spelled*, which units share (their
    headers repeat the same headers' names)."""
    if spelled is None:
        spelled = {}
    r = lines.reader(offset)
    length, off_size = r.u(4), 4
    if length == 0xFFFFFFFF:
        length, off_size = r.u(8), 8
    end = r.pos + length
    version = r.u(2)
    if end > lines.end or not 2 <= version <= 5:
        raise Bad("a line program header this reader does not follow")
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
    if line_range == 0 or opcode_base < 10:  # all of DWARF 2's standard opcodes at least
        raise Bad("a line program header this reader does not follow")
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
    paths: list[str | None] = []
    for name, at in files:
        if at >= len(dirs):
            paths.append(None)
            continue
        key = (comp_dir, dirs[at], name)
        path = spelled.get(key)
        if path is None:
            path = spelled[key] = normalize_path(
                comp_dir, dirs[at].decode("utf-8", "replace"), name.decode("utf-8", "replace")
            )
        paths.append(path)
    return _Header(min_inst, line_base, line_range, opcode_base, std_lengths, paths, first_file,
                   program, end)  # fmt: skip


def uleb_at(prog: Buffer, pos: int) -> tuple[int, int]:
    """The ULEB128 number at *pos* of *prog*, and where it ends."""
    value = shift = 0
    while True:
        b = prog[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, pos
        if shift > 70:
            raise Bad("LEB128 too long")


def _sleb(prog: bytes, pos: int) -> tuple[int, int]:
    if prog[pos] < 0x80:  # one byte, as most are
        value = prog[pos]
        return (value - 0x80 if value & 0x40 else value), pos + 1
    value, end = uleb_at(prog, pos)
    bits = 7 * (end - pos)
    return (value - (1 << bits) if prog[end - 1] & 0x40 else value), end


def _extended(prog: bytes, pos: int) -> tuple[int, int, int]:
    """An extended opcode at *pos* (after its 0): its sub-opcode, the
    address it sets (``set_address``; else 0) and where the next starts."""
    size, pos = uleb_at(prog, pos)
    after = pos + size
    if after > len(prog):
        raise Bad("past the end")
    sub = prog[pos] if size else 0
    if sub == 3:  # define_file (DWARF 2 to 4)
        raise Bad("define_file")
    return sub, int.from_bytes(prog[pos + 1 : after], "little") if sub == 2 else 0, after


def _opcode_tables(h: _Header) -> tuple[list[int], list[int], list[int], dict[int, int]]:
    """Each special opcode's address and line advances, how many operands
    each standard opcode from 5 (set_column) on has, and the file
    register's values that name a path (to the path's index)."""
    base = h.opcode_base
    step = [((op - base) // h.line_range) * h.min_inst for op in range(256)]
    rise = [h.line_base + (op - base) % h.line_range for op in range(256)]
    skip = [0, 0, 0, 0, 0, *h.std_lengths[4:]]
    return step, rise, skip, {i + h.first_file: i for i, p in enumerate(h.paths) if p}


def _decode_rows(data: Buffer, h: _Header) -> tuple[list[int], NDArray[np.int64], list[int]]:
    """The rows of a line program: address, file (an index of the header's
    paths, -1 where none, -2 a sequence's end) and line.  The file register,
    which changes seldom, comes from :func:`_rows` as the rows where it
    changes, and is spread over the rows here."""
    if h.end - h.program > _MAX_PROGRAM:  # a row takes a byte at least
        raise Bad("too many rows")
    addrs, lines, file_from = _rows(bytes(data[h.program : h.end]), h)
    at = np.fromiter(file_from, np.int64, len(file_from))
    value_of = np.fromiter(file_from.values(), np.int64, len(file_from))
    return addrs, np.repeat(value_of, np.diff(at, append=len(addrs))), lines


def _rows(prog: bytes, h: _Header) -> tuple[list[int], list[int], dict[int, int]]:
    """The rows' addresses and lines, and the file register's value from each row it changes
    at: one loop over the program's bytes, each opcode doing only what it needs."""
    base = h.opcode_base
    step, rise, skip, ok_file = _opcode_tables(h)
    addrs: list[int] = []
    lines: list[int] = []
    row_at, line_is = addrs.append, lines.append
    file_from = {0: (first := ok_file.get(1, -1))}
    column_1 = skip[5] == 1  # set_column's one operand, as DWARF has it
    address, line = 0, 1
    pos, n = 0, len(prog)
    while pos < n:
        op = prog[pos]
        pos += 1
        if op >= base:  # a special opcode
            address += step[op]
            line += rise[op]
            row_at(address)
            line_is(line)
        elif op == 5 and column_1:  # set_column: its operand only passed
            while prog[pos] & 0x80:
                pos += 1
            pos += 1
        elif op == 1:  # copy
            row_at(address)
            line_is(line)
        elif op == 3:  # advance_line, mostly one byte
            v = prog[pos]
            value, pos = (v - ((v & 0x40) << 1), pos + 1) if v < 0x80 else _sleb(prog, pos)
            line += value
        elif op == 2:  # advance_pc, mostly one byte
            value, pos = (prog[pos], pos + 1) if prog[pos] < 0x80 else uleb_at(prog, pos)
            address += value * h.min_inst
        elif op == 4:  # set_file
            value, pos = uleb_at(prog, pos)
            file_from[len(addrs)] = ok_file.get(value, -1)
        elif op == 8:  # const_add_pc
            address += step[255]
        elif op == 9:  # fixed_advance_pc
            address += int.from_bytes(prog[pos : pos + 2], "little")
            pos += 2
        elif op >= 5:  # other standard opcodes: their operands (ULEB128) passed
            for _ in range(skip[op]):
                while prog[pos] & 0x80:
                    pos += 1
                pos += 1
        else:  # 0: an extended opcode
            sub, value, pos = _extended(prog, pos)
            if sub == 1:  # end_sequence: a row of file -2, and the registers anew
                file_from[len(addrs)] = -2
                row_at(address)
                line_is(line)
                file_from[len(addrs)] = first
                address, line = 0, 1
            elif sub == 2:  # set_address
                address = value
    if pos > n:
        raise Bad("past the end")
    return addrs, lines, file_from


@dataclass(frozen=True)
class Dwarf:
    """The sections a line program is read from (empty where absent)."""

    info: Span
    abbrevs: Span
    lines: Span
    strings: Strings
    aranges: Span
    rnglists: Span = field(default_factory=lambda: Span(b"", 0, 0))
    ranges: Span = field(default_factory=lambda: Span(b"", 0, 0))


def dwarf_sections(buf: Buffer, path: str) -> Dwarf:
    """The DWARF sections of *buf* (an ELF file, its DWARF linked or
    relocated in place): where they lie in it, a compressed one inflated."""
    _, secs, names = read_sections(buf, path)
    by_name = dict(zip(names, secs, strict=True))

    def span(name: str) -> Span:
        s = by_name.get(name)
        if s is None or s.type == _SHT_NOBITS:
            return Span(b"", 0, 0)
        if s.flags & _SHF_COMPRESSED:
            data = section_contents(buf, s, name, path)
            return Span(data, 0, len(data))
        return Span(buf, s.offset, s.offset + s.size)

    strings = Strings(span(".debug_str"), span(".debug_line_str"))
    return Dwarf(span(".debug_info"), span(".debug_abbrev"), span(".debug_line"), strings,
                 span(".debug_aranges"), span(".debug_rnglists"),
                 span(".debug_ranges"))  # fmt: skip


def each_program(d: Dwarf, programs: list[tuple[int, bytes]]) -> Iterator[ProgramLines | None]:
    """The ranges of each of the line programs at these (``.debug_line``
    offset, compilation directory) pairs, one by one (None for one this
    reader does not follow), their file names spelt once for all."""
    spelled: _Spelled = {}
    for offset, comp_dir in programs:
        try:
            h = _read_header(
                d.lines, offset, comp_dir.decode("utf-8", "replace"), d.strings, spelled
            )
            addrs, files, lines = _decode_rows(d.lines.data, h)
        except (Bad, IndexError, struct.error, UnicodeError, OverflowError):
            yield None
            continue
        col = (np.array(addrs, np.uint64), files, np.array(lines, np.int64), 0)
        yield ranges([col], [p or "" for p in h.paths])


def unit_programs(
    d: Dwarf, programs: list[tuple[int, bytes]], within: list[Within] | None = None
) -> ProgramLines:
    """The ranges of the line programs at these (``.debug_line`` offset,
    compilation directory) pairs; one this reader does not follow gives none.
    With *within* (for each program, sorted disjoint address ranges: their
    starts and ends), each program's ranges cut to those."""
    paths: list[str] = []
    cols: Cols = []
    parts: list[Rows] = []
    spelled: _Spelled = {}
    for n, (offset, comp_dir) in enumerate(programs):
        try:
            h = _read_header(
                d.lines, offset, comp_dir.decode("utf-8", "replace"), d.strings, spelled
            )
            addrs, files, lines = _decode_rows(d.lines.data, h)
            col = (np.array(addrs, np.uint64), files,
                   np.array(lines, np.int64), len(paths))  # fmt: skip
        except (Bad, IndexError, struct.error, UnicodeError, OverflowError):
            continue  # no lines from this unit, never a wrong one
        if within is None:
            cols.append(col)
        else:
            parts.append(cut(ranges([col], []), *within[n]))
        paths += [p or "" for p in h.paths]
    return ranges(cols, paths) if within is None else joined(parts, paths)
