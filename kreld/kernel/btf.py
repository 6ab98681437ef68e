"""A small reader of BTF, the kernel's own description of its types.

``/sys/kernel/btf/vmlinux`` (CONFIG_DEBUG_INFO_BTF, on in Debian's kernels,
world-readable) is raw BTF: a header, a type section and a string section
(include/uapi/linux/btf.h).  kreld needs the layout of a few structures
(``struct module``, its section attributes) on the running kernel, whose
layout changes between releases, so it reads them from here rather than
hard-coding offsets.  A parser of its own, of the part of the format it needs:
libbpf is C, and the Python BTF readers there are (drgn's among them) come with
a whole debugger.

Reading is in two steps.  :meth:`Btf.parse` checks the header and walks the
type section once, keeping only where each type starts, its kind and its name
(a vmlinux has some 130,000 types); a type is decoded when it is asked for.
Every count is bounded before it is used: the file by ``consts.MAX_BTF``, the
sections by :data:`MAX_SECTION`, the types by :data:`MAX_TYPES`, each record by
the bytes that remain, a chain of typedefs and qualifiers by :data:`MAX_DEPTH`,
a search for a member by :data:`MAX_VISITS`; a member that lies past the end of
its struct is refused.
"""

from __future__ import annotations

import struct
from array import array
from enum import IntEnum
from pathlib import Path

from kreld.core import consts
from kreld.core.errors import BtfError, KernelReadError
from kreld.core.record import record
from kreld.kernel.files import read_bounded

__all__ = [
    "BTF_MAGIC",
    "MAX_DEPTH",
    "MAX_SECTION",
    "MAX_TYPES",
    "MAX_VISITS",
    "Btf",
    "Field",
    "Kind",
    "Member",
]

BTF_MAGIC = 0xEB9F
MAX_SECTION = 64 << 20  # bytes of types, or of strings (vmlinux: ~4 MB and ~2 MB)
MAX_TYPES = 1 << 20  # vmlinux has ~130,000
MAX_DEPTH = 32  # typedefs, qualifiers and nested members followed in a row
# Members looked at in one search for a member by name (struct module has ~100,
# its anonymous unions a few each).
MAX_VISITS = 1 << 16
_HDR = struct.Struct("<HBBIIIII")
_TYPE = struct.Struct("<III")
_U32 = struct.Struct("<I")
_ARRAY = struct.Struct("<III")
_MEMBER = struct.Struct("<III")
_ENUM = struct.Struct("<Ii")
_ENUM64 = struct.Struct("<III")


class Kind(IntEnum):
    """``BTF_KIND_*`` (include/uapi/linux/btf.h)."""

    UNKN = 0
    INT = 1
    PTR = 2
    ARRAY = 3
    STRUCT = 4
    UNION = 5
    ENUM = 6
    FWD = 7
    TYPEDEF = 8
    VOLATILE = 9
    CONST = 10
    RESTRICT = 11
    FUNC = 12
    FUNC_PROTO = 13
    VAR = 14
    DATASEC = 15
    FLOAT = 16
    DECL_TAG = 17
    TYPE_TAG = 18
    ENUM64 = 19


# Bytes that follow the 12-byte common part: fixed, and per vlen item.
_EXTRA: dict[int, tuple[int, int]] = {
    Kind.INT: (4, 0),
    Kind.ARRAY: (12, 0),
    Kind.STRUCT: (0, 12),
    Kind.UNION: (0, 12),
    Kind.ENUM: (0, 8),
    Kind.FUNC_PROTO: (0, 8),
    Kind.VAR: (4, 0),
    Kind.DATASEC: (0, 12),
    Kind.DECL_TAG: (4, 0),
    Kind.ENUM64: (0, 12),
}
_QUALIFIERS = frozenset({Kind.TYPEDEF, Kind.VOLATILE, Kind.CONST, Kind.RESTRICT, Kind.TYPE_TAG})


@record
class Member:
    """One member of a struct or union: its bit offset and, for a bitfield, its width."""

    name: str
    type_id: int
    bit_offset: int
    bitfield_size: int


@record
class Field:
    """Where a (possibly nested) member lies: bytes from the start of the outer type."""

    offset: int
    type_id: int
    size: int


class Btf:
    """Parsed BTF: the types' index, decoded on demand."""

    __slots__ = (
        "_data",
        "_info",
        "_name_off",
        "_offsets",
        "_strings",
        "_types",
        "path",
    )

    def __init__(self, path: str, data: bytes, types: memoryview, strings: bytes) -> None:
        self.path = path
        self._data = data
        self._strings = strings
        self._offsets = array("I", [0])  # type id -> offset in the type section (id 0: void)
        self._info = array("I", [0])
        self._name_off = array("I", [0])
        self._index(types)

    # -- loading --------------------------------------------------------------

    @classmethod
    def load(cls, path: Path) -> Btf:
        """Read and parse a BTF file (refused past :data:`MAX_SECTION` twice over)."""
        try:
            data = read_bounded(path, consts.MAX_BTF)
        except KernelReadError as e:
            raise BtfError(str(path), e.reason) from e
        return cls.parse(data, str(path))

    @classmethod
    def parse(cls, data: bytes, path: str = "<btf>") -> Btf:
        if len(data) < _HDR.size:
            raise BtfError(path, f"{len(data)} bytes: too short for a BTF header", 0)
        magic, version, _flags, hdr_len, type_off, type_len, str_off, str_len = _HDR.unpack_from(
            data
        )
        if magic != BTF_MAGIC:
            raise BtfError(path, f"magic {magic:#x} is not BTF's (little-endian {BTF_MAGIC:#x})", 0)
        if version != 1:
            raise BtfError(path, f"BTF version {version}, only version 1 is known", 2)
        if hdr_len < _HDR.size or hdr_len > len(data):
            raise BtfError(path, f"header length {hdr_len} out of range", 4)
        for what, off, size in (("type", type_off, type_len), ("string", str_off, str_len)):
            if size > MAX_SECTION:
                raise BtfError(path, f"{what} section of {size} bytes (limit {MAX_SECTION})")
            if hdr_len + off + size > len(data):
                raise BtfError(path, f"{what} section runs past the end of the data")
        view = memoryview(data)
        types = view[hdr_len + type_off : hdr_len + type_off + type_len]
        strings = bytes(view[hdr_len + str_off : hdr_len + str_off + str_len])
        if strings and strings[-1] != 0:
            raise BtfError(path, "string section does not end in a NUL")
        return cls(path, data, types, strings)

    def _index(self, types: memoryview) -> None:
        """One pass over the type section: where each type starts (linear)."""
        off, end = 0, len(types)
        offsets, info, names = self._offsets, self._info, self._name_off
        unpack = _TYPE.unpack_from
        while off < end:
            if len(offsets) > MAX_TYPES:
                raise BtfError(self.path, f"more than {MAX_TYPES:,} types")
            if end - off < _TYPE.size:
                raise BtfError(self.path, "type section ends inside a type", off)
            name_off, inf, _ = unpack(types, off)
            kind = (inf >> 24) & 0x1F
            if kind > Kind.ENUM64 or kind == Kind.UNKN:
                raise BtfError(self.path, f"unknown type kind {kind}", off)
            fixed, per = _EXTRA.get(kind, (0, 0))
            size = _TYPE.size + fixed + per * (inf & 0xFFFF)
            if off + size > end:
                raise BtfError(self.path, f"type {len(offsets)} runs past its section", off)
            offsets.append(off)
            info.append(inf)
            names.append(name_off)
            off += size
        self._types = types

    # -- one type -------------------------------------------------------------

    def __len__(self) -> int:
        """Type ids run from 1 to ``len(btf) - 1`` (0 is void)."""
        return len(self._offsets)

    def _check(self, type_id: int) -> None:
        if not 0 < type_id < len(self._offsets):
            raise BtfError(self.path, f"type id {type_id} out of range (1..{len(self) - 1})")

    def string(self, off: int) -> str:
        if not 0 <= off < len(self._strings):
            raise BtfError(self.path, f"string offset {off} out of range")
        end = self._strings.index(b"\0", off)
        return self._strings[off:end].decode("utf-8", "replace")

    def kind(self, type_id: int) -> Kind:
        if type_id == 0:
            return Kind.UNKN
        self._check(type_id)
        return Kind((self._info[type_id] >> 24) & 0x1F)

    def name(self, type_id: int) -> str:
        self._check(type_id)
        return self.string(self._name_off[type_id])

    def _vlen(self, type_id: int) -> int:
        return self._info[type_id] & 0xFFFF

    def _size_or_type(self, type_id: int) -> int:
        value: int = _U32.unpack_from(self._types, self._offsets[type_id] + 8)[0]
        return value

    def _items(self, type_id: int, fmt: struct.Struct) -> list[tuple[int, ...]]:
        base = self._offsets[type_id] + _TYPE.size + _EXTRA[self.kind(type_id)][0]
        return [
            fmt.unpack_from(self._types, base + i * fmt.size) for i in range(self._vlen(type_id))
        ]

    def resolve(self, type_id: int) -> int:
        """Through typedefs and const/volatile/restrict/type-tag qualifiers."""
        for _ in range(MAX_DEPTH):
            if self.kind(type_id) not in _QUALIFIERS:
                return type_id
            type_id = self._size_or_type(type_id)
        raise BtfError(self.path, f"more than {MAX_DEPTH} typedefs or qualifiers in a row")

    def size_of(self, type_id: int) -> int:
        """Bytes a value of the type takes (arrays: element size times count)."""
        elems = 1
        for _ in range(MAX_DEPTH):
            type_id = self.resolve(type_id)
            kind = self.kind(type_id)
            if kind == Kind.ARRAY:
                elem, count = self.array(type_id)
                elems *= count
                type_id = elem
                continue
            if kind == Kind.PTR:
                return 8 * elems
            if kind in (Kind.INT, Kind.STRUCT, Kind.UNION, Kind.ENUM, Kind.ENUM64, Kind.FLOAT):
                return self._size_or_type(type_id) * elems
            raise BtfError(self.path, f"type {type_id} ({kind.name}) has no size")
        raise BtfError(self.path, f"arrays nested more than {MAX_DEPTH} deep")

    def members(self, type_id: int) -> list[Member]:
        type_id = self.resolve(type_id)
        kind = self.kind(type_id)
        if kind not in (Kind.STRUCT, Kind.UNION):
            raise BtfError(self.path, f"type {type_id} is a {kind.name}, not a struct or union")
        bitfields = bool(self._info[type_id] >> 31)
        out = []
        for name_off, tid, off in self._items(type_id, _MEMBER):
            bits, width = (off & 0xFFFFFF, off >> 24) if bitfields else (off, 0)
            out.append(Member(self.string(name_off), tid, bits, width))
        return out

    def array(self, type_id: int) -> tuple[int, int]:
        """(element type, element count) of an array type."""
        type_id = self.resolve(type_id)
        if self.kind(type_id) != Kind.ARRAY:
            raise BtfError(self.path, f"type {type_id} is not an array")
        elem, _index, count = _ARRAY.unpack_from(self._types, self._offsets[type_id] + _TYPE.size)
        return int(elem), int(count)

    def pointee(self, type_id: int) -> int:
        """The type a pointer type points to (0: void)."""
        type_id = self.resolve(type_id)
        if self.kind(type_id) != Kind.PTR:
            raise BtfError(self.path, f"type {type_id} is not a pointer")
        return self._size_or_type(type_id)

    def enumerators(self, type_id: int) -> dict[str, int]:
        type_id = self.resolve(type_id)
        kind = self.kind(type_id)
        if kind == Kind.ENUM:
            return {self.string(n): v for n, v in self._items(type_id, _ENUM)}
        if kind == Kind.ENUM64:
            return {self.string(n): lo | hi << 32 for n, lo, hi in self._items(type_id, _ENUM64)}
        raise BtfError(self.path, f"type {type_id} is not an enum")

    # -- by name ----------------------------------------------------------------

    def find(self, name: str, *kinds: Kind) -> int:
        """The id of the first type called *name* of one of *kinds* (a full
        definition: a forward declaration is never what is asked for).

        The name is looked up in the string section first, then the types
        naming that string are found by a search of the names' index: no
        string is decoded but the one asked for.
        """
        for off in self._string_offsets(name):
            tid = 0
            while True:
                try:
                    tid = self._name_off.index(off, tid + 1)
                except ValueError:
                    break
                if self.kind(tid) in kinds:
                    return tid
        wanted = "/".join(k.name for k in kinds)
        raise BtfError(self.path, f"no {wanted} named {name!r}")

    def _string_offsets(self, name: str) -> list[int]:
        """Where *name* lies as a whole string in the string section (pahole
        writes each string once; a hand-made section may repeat one)."""
        needle = name.encode() + b"\0"
        out: list[int] = []
        pos = self._strings.find(needle, 1)
        while pos >= 0 and len(out) < MAX_DEPTH:
            if self._strings[pos - 1] == 0:
                out.append(pos)
            pos = self._strings.find(needle, pos + 1)
        return out

    def member(self, type_id: int, path: str) -> Field:
        """Where member *path* (``"a.b.c"``) lies in *type_id*, looking into
        anonymous structs and unions as C does; a member that does not lie
        inside the type is refused (what is read there would be another's)."""
        offset, outer = 0, type_id
        for part in path.split("."):
            found = self._find_member(type_id, part, 0, [MAX_VISITS])
            if found is None:
                raise BtfError(self.path, f"{self.name(self.resolve(type_id))!r} has no {part!r}")
            bits, type_id = found
            if bits % 8:
                raise BtfError(self.path, f"member {part!r} is a bitfield")
            offset += bits // 8
        field = Field(offset, type_id, self.size_of(type_id))
        if field.offset + field.size > self.size_of(outer):
            raise BtfError(
                self.path,
                f"member {path!r} ({field.size} bytes at {field.offset}) lies past the end "
                f"of {self.name(self.resolve(outer))!r} ({self.size_of(outer)} bytes)",
            )
        return field

    def _find_member(
        self, type_id: int, name: str, depth: int, budget: list[int]
    ) -> tuple[int, int] | None:
        """*name* among *type_id*'s members, or inside its anonymous ones; at most
        :data:`MAX_VISITS` members looked at in all (*budget*: what is left), for
        anonymous members may repeat the same struct without end."""
        if depth > MAX_DEPTH:
            raise BtfError(self.path, f"anonymous members nested more than {MAX_DEPTH} deep")
        members = self.members(type_id)
        budget[0] -= len(members)
        if budget[0] < 0:
            raise BtfError(
                self.path, f"more than {MAX_VISITS:,} members looked at in search of {name!r}"
            )
        for m in members:
            if m.name == name:
                return m.bit_offset, m.type_id
            if not m.name and self.kind(self.resolve(m.type_id)) in (Kind.STRUCT, Kind.UNION):
                inner = self._find_member(m.type_id, name, depth + 1, budget)
                if inner is not None:
                    return m.bit_offset + inner[0], inner[1]
        return None
