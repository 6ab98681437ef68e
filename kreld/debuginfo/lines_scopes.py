"""The innermost inlined function at an address, from its unit's DIEs.

The table's chains come from symbolic's SymCache, which reads every function
of the DWARF (:mod:`kreld.debuginfo.lines_build`).  In one place it has less
than the DWARF says: where a function's range begins without a line-program
row of its own (the start of a ``.cold`` part, whose first row began in the
code before it, same file and line), symbolic drops that row as another
function's.  Where an inlined call begins there too, the SymCache keeps the
call sites of every inlined function there but not the innermost function
itself, up to the next row.  Its name is read here: the unit's DIEs are
walked down the scopes (``DW_TAG_subprogram``, ``DW_TAG_inlined_subroutine``,
``DW_TAG_lexical_block``) whose addresses hold the address, each other
subtree passed over by its ``DW_AT_sibling`` where it has one; the deepest
inlined call there is named after its ``DW_AT_abstract_origin`` (followed
through ``DW_AT_abstract_origin`` and ``DW_AT_specification`` to a
``DW_AT_name``), as llvm-symbolizer names it.

What this reader does not follow (a form it does not know, an address or a
string kept by index in another section, a walk past its bounds) gives no
name: the chain stays as the SymCache has it, never a wrong one.
"""

from __future__ import annotations

import struct

from kreld.debuginfo.lines_dwarf import Bad, Dwarf, Reader, Span, form_value, uleb_at

__all__ = ["innermost_inlined"]

_TAG_LEXICAL_BLOCK, _TAG_INLINED, _TAG_SUBPROGRAM = 0x0B, 0x1D, 0x2E
_SCOPES = (_TAG_LEXICAL_BLOCK, _TAG_INLINED, _TAG_SUBPROGRAM)
_AT_SIBLING, _AT_NAME, _AT_LOW_PC, _AT_HIGH_PC = 0x01, 0x03, 0x11, 0x12
_AT_ABSTRACT_ORIGIN, _AT_SPECIFICATION, _AT_RANGES = 0x31, 0x47, 0x55
_WANTED = {_AT_SIBLING, _AT_NAME, _AT_LOW_PC, _AT_HIGH_PC, _AT_ABSTRACT_ORIGIN,
           _AT_SPECIFICATION, _AT_RANGES}  # fmt: skip
_FORM_ADDR, _FORM_STRING, _FORM_STRP, _FORM_REF_ADDR = 0x01, 0x08, 0x0E, 0x10
_FORM_SEC_OFFSET, _FORM_LINE_STRP, _FORM_IMPLICIT_CONST = 0x17, 0x1F, 0x21
# References within the unit (ref1, ref2, ref4, ref8, ref_udata).
_FORM_REF_UNIT = {0x11, 0x12, 0x13, 0x14, 0x15}
# DIEs read at most in one walk, range list entries at most, names followed.
_MAX_DIES = 1 << 22
_MAX_RANGES = 1 << 16
_MAX_ORIGINS = 8

_Abbrev = tuple[int, bool, list[tuple[int, int]]]


def _abbrevs(abbrevs: Span, offset: int) -> dict[int, _Abbrev]:
    """The abbreviation table at *offset*: code -> (tag, has children,
    (attribute, form) pairs; an implicit constant's form kept, its value
    not: none of the attributes read here has one)."""
    data, pos, end = abbrevs.data, abbrevs.start + offset, abbrevs.end
    if not abbrevs.start <= pos < end:
        raise Bad("an offset past its section")
    out: dict[int, _Abbrev] = {}
    while pos < end:
        code, pos = uleb_at(data, pos)
        if code == 0:
            return out
        tag, pos = uleb_at(data, pos)
        children = data[pos] == 1
        pos += 1
        specs: list[tuple[int, int]] = []
        while True:
            at, pos = uleb_at(data, pos)
            form, pos = uleb_at(data, pos)
            if at == 0 and form == 0:
                break
            if form == _FORM_IMPLICIT_CONST:
                _, pos = uleb_at(data, pos)
            specs.append((at, form))
        out[code] = (tag, children, specs)
    raise Bad("an abbreviation table past its section")


class _Unit:
    """One compilation unit's DIEs, read from *start* (its first DIE) to *end*."""

    def __init__(self, d: Dwarf, offset: int) -> None:
        r = Reader(d.info.data, d.info.start + offset, d.info.end)
        length, self.off_size = r.u(4), 4
        if length == 0xFFFFFFFF:
            length, self.off_size = r.u(8), 8
        self.end = r.pos + length
        if self.end > d.info.end:
            raise Bad("a unit past its section")
        self.version = r.u(2)
        if self.version >= 5:
            if r.u(1) != 1:  # DW_UT_compile
                raise Bad("not a compilation unit")
            self.addr_size, abbrev = r.u(1), r.u(self.off_size)
        else:
            abbrev, self.addr_size = r.u(self.off_size), r.u(1)
        self.d, self.offset, self.first = d, offset, r.pos
        self.table = _abbrevs(d.abbrevs, abbrev)
        self.base = 0

    def die(self, pos: int) -> tuple[int, bool, dict[int, tuple[int, int | bytes]], int]:
        """The DIE at *pos*: its tag, whether it has children, the attributes
        read here (attribute -> (form, value)) and where the next DIE starts
        (tag 0 for a null entry)."""
        r = Reader(self.d.info.data, pos, self.end)
        code = r.uleb()
        if code == 0:
            return 0, False, {}, r.pos
        tag, children, specs = self.table.get(code) or (None, False, [])
        if tag is None:
            raise Bad(f"abbreviation {code} not in its table")
        attrs = {}
        for at, form in specs:
            value = form_value(r, form, self.addr_size, self.off_size, self.version)
            if at in _WANTED:
                attrs[at] = (form, value)
        return tag, children, attrs, r.pos

    def ref(self, form: int, value: int | bytes) -> int:
        """Where a reference attribute's DIE is, in the file's bytes."""
        if not isinstance(value, int):
            raise Bad("a reference that is not a number")
        if form in _FORM_REF_UNIT:
            return self.d.info.start + self.offset + value
        if form == _FORM_REF_ADDR:
            return self.d.info.start + value
        raise Bad(f"a reference of form {form:#x}")

    def holds(self, attrs: dict[int, tuple[int, int | bytes]], address: int) -> bool | None:
        """Whether a scope's addresses hold *address* (None: it has none)."""
        if _AT_RANGES in attrs:
            form, value = attrs[_AT_RANGES]
            if form != _FORM_SEC_OFFSET or not isinstance(value, int):
                raise Bad("ranges kept by index")
            return any(lo <= address < hi for lo, hi in self._ranges(value))
        if _AT_LOW_PC not in attrs:
            return None
        (lo_form, low), (hi_form, high) = attrs[_AT_LOW_PC], attrs.get(_AT_HIGH_PC, (0, 0))
        if lo_form != _FORM_ADDR or not isinstance(low, int) or not isinstance(high, int):
            raise Bad("an address kept by index")
        return low <= address < (high if hi_form == _FORM_ADDR else low + high)

    def _ranges(self, offset: int) -> list[tuple[int, int]]:
        if self.version >= 5:
            return _rnglist(self.d.rnglists, offset, self.base, self.addr_size)
        return _ranges4(self.d.ranges, offset, self.base, self.addr_size)

    def name(self, pos: int) -> bytes | None:
        """The name of the function the DIE at *pos* stands for."""
        for _ in range(_MAX_ORIGINS):
            _, _, attrs, _ = self.die(pos)
            if _AT_NAME in attrs:
                form, value = attrs[_AT_NAME]
                if form == _FORM_STRING and isinstance(value, bytes):
                    return value
                if form in (_FORM_STRP, _FORM_LINE_STRP) and isinstance(value, int):
                    return self.d.strings.at(form, value)
                return None
            origin = attrs.get(_AT_ABSTRACT_ORIGIN) or attrs.get(_AT_SPECIFICATION)
            if origin is None:
                return None
            pos = self.ref(*origin)
            if not self.d.info.start + self.offset <= pos < self.end:
                return None  # in another unit: not followed
        return None


def _rnglist(span: Span, offset: int, base: int, addr_size: int) -> list[tuple[int, int]]:
    """A DWARF 5 range list (``.debug_rnglists``) at *offset*."""
    r = span.reader(offset)
    out: list[tuple[int, int]] = []
    for _ in range(_MAX_RANGES):
        kind = r.u(1)
        if kind == 0:  # DW_RLE_end_of_list
            return out
        if kind == 4:  # DW_RLE_offset_pair
            lo, hi = r.uleb(), r.uleb()
            out.append((base + lo, base + hi))
        elif kind == 5:  # DW_RLE_base_address
            base = r.u(addr_size)
        elif kind == 6:  # DW_RLE_start_end
            lo, hi = r.u(addr_size), r.u(addr_size)
            out.append((lo, hi))
        elif kind == 7:  # DW_RLE_start_length
            lo = r.u(addr_size)
            out.append((lo, lo + r.uleb()))
        else:  # by index into .debug_addr
            raise Bad(f"range list entry {kind}")
    raise Bad("a range list past its bound")


def _ranges4(span: Span, offset: int, base: int, addr_size: int) -> list[tuple[int, int]]:
    """A DWARF 2-4 range list (``.debug_ranges``) at *offset*."""
    r = span.reader(offset)
    top = (1 << (8 * addr_size)) - 1
    out: list[tuple[int, int]] = []
    for _ in range(_MAX_RANGES):
        lo, hi = r.u(addr_size), r.u(addr_size)
        if lo == 0 and hi == 0:
            return out
        if lo == top:
            base = hi
        else:
            out.append((base + lo, base + hi))
    raise Bad("a range list past its bound")


def _skip_children(unit: _Unit, pos: int) -> int:
    """Past the children of a DIE whose children start at *pos*."""
    depth = 1
    for _ in range(_MAX_DIES):
        tag, children, attrs, nxt = unit.die(pos)
        if tag == 0:
            depth -= 1
            if depth == 0:
                return nxt
        elif children:
            sibling = attrs.get(_AT_SIBLING)
            if sibling is not None:
                nxt = unit.ref(*sibling)
            else:
                depth += 1
        pos = nxt
    raise Bad("a walk past its bound")


def innermost_inlined(d: Dwarf, unit_offset: int, address: int) -> str | None:
    """The name of the deepest inlined call whose addresses hold *address*,
    in the compilation unit at *unit_offset* of ``.debug_info``; None where
    there is none, or the unit cannot be followed (see the module's
    docstring)."""
    try:
        return _innermost(_Unit(d, unit_offset), address)
    except (Bad, IndexError, struct.error, UnicodeError, OverflowError):
        return None


def _innermost(unit: _Unit, address: int) -> str | None:
    tag, children, attrs, pos = unit.die(unit.first)
    if not children:
        return None
    low = attrs.get(_AT_LOW_PC)
    unit.base = low[1] if low is not None and isinstance(low[1], int) else 0
    found: int | None = None
    # The scopes walked down into: whether each holds the address (None: a
    # lexical block without addresses of its own, walked through).
    down: list[bool | None] = []
    for _ in range(_MAX_DIES):
        tag, children, attrs, nxt = unit.die(pos)
        if tag == 0:  # the end of a scope walked down into
            if not down or down.pop():
                break  # nothing deeper holds it
            pos = nxt
            continue
        holds = unit.holds(attrs, address) if tag in _SCOPES else False
        if holds and tag == _TAG_INLINED:
            found = pos
        if children and (holds or (holds is None and tag == _TAG_LEXICAL_BLOCK)):
            down.append(holds)
            pos = nxt
            continue
        if children:
            sibling = attrs.get(_AT_SIBLING)
            nxt = unit.ref(*sibling) if sibling is not None else _skip_children(unit, nxt)
        elif holds and tag == _TAG_SUBPROGRAM:
            break
        pos = nxt
    if found is None:
        return None
    name = unit.name(found)
    return None if name is None else name.decode("utf-8", "replace")
