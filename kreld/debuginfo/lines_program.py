"""Lines of code no DWARF function covers, from the units' line programs.

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
(:mod:`kreld.debuginfo.lines_dwarf`).  A unit is examined only where its
first DIE uses the first abbreviation of its table (as both assemblers write
it: a few dozen units of a kernel's two thousand are decoded, in
milliseconds, reading the file where it lies).

C has such code too: a function gcc wrote a subprogram for without an
address (identical functions merged, ``-fipa-icf`` at ``-O2``, where each
must keep an address of its own: ``noop_send_IPI_all``, ``iommu_shutdown_noop``,
``__bpf_trace_*`` of a kernel).  The SymCache names it after its symbol, with
no line; llvm-symbolizer gives the unit's line program's row there.  Which
units hold such code is known only once the SymCache is: :func:`unit_cuts`
finds the units ``.debug_aranges`` places those addresses in, and
:func:`unit_lines` decodes their programs (most of a second for a kernel's 150
such units of its 2,800; :mod:`kreld.debuginfo.lines_later` reads each when
first asked).

The table gives these lines only where it has no DWARF line
(:meth:`kreld.debuginfo.lines.LineTable.frame_columns`).  A unit whose
header or program this reader does not follow (a form it does not know, a
string kept by index, a run past its end) gives no lines: never a wrong one.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import numpy as np

from kreld.debuginfo.lines import NONE
from kreld.debuginfo.lines_dwarf import (
    Bad,
    Buffer,
    Dwarf,
    ProgramLines,
    Reader,
    Span,
    Within,
    dwarf_sections,
    each_program,
    form_value,
    uleb_at,
    unit_programs,
)

if TYPE_CHECKING:
    from numpy.typing import NDArray

__all__ = [
    "UnitCuts",
    "Window",
    "assembly_lines",
    "cold_windows",
    "unit_cuts",
    "unit_lines",
]

_AT_STMT_LIST, _AT_LANGUAGE, _AT_COMP_DIR = 0x10, 0x13, 0x1B
_TAG_COMPILE_UNIT = 0x11
_LANG_ASSEMBLER = 0x8001  # DW_LANG_Mips_Assembler
_DW_UT_COMPILE = 1
_FORM_IMPLICIT_CONST = 0x21
# .debug_aranges entries read at most (a kernel's: about 6,000).
_MAX_ARANGES = 1 << 22


def _abbrev(abbrevs: Span, offset: int, code: int, first: bool) -> list[tuple[int, int]] | None:
    """The (attribute, form) pairs of abbreviation *code* of the table at
    *offset*, if a compilation unit's; with *first*, only if it is the
    table's first (else None: the unit is not examined).  A C unit's table
    has hundreds: walked over its bytes, the others' pairs not kept."""
    data, pos, end = abbrevs.data, abbrevs.start + offset, abbrevs.end
    if not abbrevs.start <= pos < end:
        raise Bad("an offset past its section")
    while pos < end:
        at_code, pos = uleb_at(data, pos)
        if at_code == 0:
            return None
        tag, pos = uleb_at(data, pos)
        pos += 1  # children
        mine = at_code == code
        specs: list[tuple[int, int]] = []
        while True:
            at, form = data[pos], data[pos + 1]
            if at < 0x80 and form < 0x80:  # most pairs: a byte each
                pos += 2
            else:
                at, pos = uleb_at(data, pos)
                form, pos = uleb_at(data, pos)
            if at == 0 and form == 0:
                break
            if form == _FORM_IMPLICIT_CONST:  # its value is here, not in the DIE
                _, pos = uleb_at(data, pos)
            if mine:
                specs.append((at, form))
        if mine:
            return specs if tag == _TAG_COMPILE_UNIT and pos <= end else None
        if first:
            return None
    raise Bad("an abbreviation table past its section")


_Unit = tuple[int, int, int, int, int, int]


def _unit_at(info: Span, pos: int) -> tuple[_Unit | None, int]:
    """The compilation unit whose header is at *pos* (in the file's bytes):
    (version, offset size, address size, abbrev offset, its first DIE, its
    end), None for another kind of unit; and where the next one starts."""
    r = Reader(info.data, pos, info.end)
    length, off_size = r.u(4), 4
    if length == 0xFFFFFFFF:
        length, off_size = r.u(8), 8
    end = r.pos + length
    if length < 7 or end > info.end:
        raise Bad("a unit past its section")
    version = r.u(2)
    if version >= 5:
        unit_type, addr_size, abbrev = r.u(1), r.u(1), r.u(off_size)
        if unit_type == _DW_UT_COMPILE:
            return (version, off_size, addr_size, abbrev, r.pos, end), end
    elif 2 <= version <= 4:
        abbrev, addr_size = r.u(off_size), r.u(1)
        return (version, off_size, addr_size, abbrev, r.pos, end), end
    return None, end


def _units(info: Span) -> list[_Unit]:
    """Each compilation unit of ``.debug_info``, up to one it cannot read."""
    out = []
    pos = info.start
    while pos + 11 <= info.end:
        try:
            unit, pos = _unit_at(info, pos)
        except (Bad, IndexError):
            break
        if unit is not None:
            out.append(unit)
    return out


def _program(d: Dwarf, unit: _Unit, assembly: bool) -> tuple[int, bytes] | None:
    """A unit's line program offset and compilation directory (None: no
    program, a unit not examined, or of assembly unless *assembly*, of
    another language if it is)."""
    version, off_size, addr_size, abbrev, die, end = unit
    r = Reader(d.info.data, die, end)
    specs = _abbrev(d.abbrevs, abbrev, r.uleb(), first=assembly)
    if specs is None:
        return None
    stmt, comp_dir, language = None, b"", None
    for at, form in specs:
        value = form_value(r, form, addr_size, off_size, version)
        if at == _AT_STMT_LIST and isinstance(value, int):
            stmt = value
        elif at == _AT_COMP_DIR:
            comp_dir = d.strings.of(value, form)
        elif at == _AT_LANGUAGE:
            language = value
    if stmt is None or (language == _LANG_ASSEMBLER) != assembly:
        return None
    return stmt, comp_dir


def _programs(d: Dwarf, units: list[_Unit], assembly: bool) -> list[tuple[int, bytes]]:
    out = []
    for unit in units:
        try:
            found = _program(d, unit, assembly)
        except (Bad, IndexError, struct.error, UnicodeError):
            continue  # no lines from this unit, never a wrong one
        if found is not None:
            out.append(found)
    return out


def assembly_lines(buf: Buffer, path: str) -> ProgramLines:
    """The line-program ranges of the assembly units of *buf* (an ELF file,
    its DWARF linked or relocated in place)."""
    d = dwarf_sections(buf, path)
    return unit_programs(d, _programs(d, _units(d.info), assembly=True))


def _aranges(d: Dwarf) -> tuple[NDArray[np.uint64], NDArray[np.uint64], list[int]]:
    """``.debug_aranges``: each range's start and end, and its unit's offset
    in ``.debug_info`` (64-bit addresses; a set otherwise is passed over)."""
    table = d.aranges
    starts: list[int] = []
    ends: list[int] = []
    units: list[int] = []
    pos = table.start
    while pos + 16 <= table.end and len(starts) < _MAX_ARANGES:
        r = Reader(table.data, pos, table.end)
        length, off_size = r.u(4), 4
        if length == 0xFFFFFFFF:
            length, off_size = r.u(8), 8
        end = r.pos + length
        if end > table.end:
            break
        r.u(2)  # version
        unit, addr_size, seg_size = r.u(off_size), r.u(1), r.u(1)
        r.pos += -(r.pos - pos) % (2 * addr_size) if addr_size else 0
        while addr_size == 8 and seg_size == 0 and r.pos + 16 <= end:
            start, size = r.u(8), r.u(8)
            if start == 0 and size == 0:
                break
            starts.append(start)
            ends.append(start + size)
            units.append(unit)
        pos = end
    return np.array(starts, np.uint64), np.array(ends, np.uint64), units


# For each unit (its offset in ``.debug_info``), the address ranges its line
# program is read within.
UnitCuts = list[tuple[int, Within]]


def unit_cuts(d: Dwarf, within: Within) -> UnitCuts:
    """The units ``.debug_aranges`` places the address ranges *within*
    (sorted, disjoint) in, each with those ranges cut to its own aranges
    range of their start (as llvm-symbolizer finds a unit for an address);
    in the order of the units' offsets."""
    starts, ends, owners = _aranges(d)
    if not len(within[0]) or not len(starts):
        return []
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    idx = np.searchsorted(starts, within[0], side="right").astype(np.int64) - 1
    hit = np.flatnonzero((idx >= 0) & (within[0] < ends[np.maximum(idx, 0)]))
    cut_end = np.minimum(within[1][hit], ends[idx[hit]])
    by_unit: dict[int, list[int]] = {}
    for n, i in enumerate(idx[hit].tolist()):
        by_unit.setdefault(owners[int(order[i])], []).append(n)
    return [(offset, (within[0][hit][ns], cut_end[ns])) for offset, ns in sorted(by_unit.items())]


def unit_lines(d: Dwarf, cuts: UnitCuts) -> ProgramLines:
    """The line-program ranges of the units *cuts* names, each within its
    ranges; not assembly's (:func:`assembly_lines` has them all)."""
    programs, within = [], []
    for offset, ranges in cuts:
        try:
            unit, _ = _unit_at(d.info, d.info.start + offset)
            found = None if unit is None else _program(d, unit, assembly=False)
        except (Bad, IndexError, struct.error, UnicodeError):
            continue  # no lines from this unit, never a wrong one
        if found is not None:
            programs.append(found)
            within.append(ranges)
    return unit_programs(d, programs, within)


# Where symbolic's SymCache may lack an innermost frame: the start of a
# ``.cold`` part no line-program row begins at, where the first row after it
# begins, and the file ("" for none) and line of the row covering it (line 0
# where none does).
Window = tuple[int, int, str, int]


def cold_windows(d: Dwarf, offset: int, starts: NDArray[np.uint64]) -> list[Window]:
    """The windows (:data:`Window`) at the starts of ``.cold`` parts *starts*
    (sorted) in the unit at *offset*, from its line program.  There the row
    covering the start began in the code before it (the same file and line
    going on, gcc wrote none), and symbolic drops it as another function's:
    the SymCache keeps the call sites of the inlined calls that begin in
    the window, but not the innermost function itself
    (:mod:`kreld.debuginfo.lines_scopes` names it).  A 6.1 kernel has 45
    such windows at its 2,413 starts, none over 26 bytes."""
    try:
        unit, _ = _unit_at(d.info, d.info.start + offset)
        program = None if unit is None else _program(d, unit, assembly=False)
    except (Bad, IndexError, struct.error, UnicodeError):
        return []  # nothing from this unit, never a wrong frame
    rows = None if program is None else next(each_program(d, [program]))
    if rows is None or not len(rows.starts):
        return []
    out: list[Window] = []
    idx = np.searchsorted(rows.starts, starts, side="right").astype(np.int64) - 1
    for start, i in zip(starts.tolist(), idx.tolist(), strict=True):
        if i >= 0 and int(rows.starts[i]) == start:
            continue  # a row of its own: symbolic has it
        end = int(rows.starts[i + 1]) if i + 1 < len(rows.starts) else start + 1
        if i < 0 or rows.file[i] == NONE:  # no row covers it: line 0, as llvm says
            out.append((start, end, "", 0))
        else:
            out.append((start, end, rows.paths[int(rows.file[i])], int(rows.line[i])))
    return out
