"""Builders of kernel-memory-shaped files for tests: raw BTF, and an ELF64
core like ``/proc/kcore`` (PT_NOTE with VMCOREINFO, PT_LOADs of memory).

Written from the formats' definitions (include/uapi/linux/btf.h, elf(5),
fs/proc/kcore.c), independently of the readers under test.
"""

from __future__ import annotations

import struct
from pathlib import Path

KIND = {
    "int": 1,
    "ptr": 2,
    "array": 3,
    "struct": 4,
    "union": 5,
    "enum": 6,
    "fwd": 7,
    "typedef": 8,
    "volatile": 9,
    "const": 10,
}


class BtfBuilder:
    """Types in id order (1, 2, ...); a struct may be declared first and
    defined later, for pointers to itself."""

    def __init__(self) -> None:
        self.strings = bytearray(b"\0")
        self._string_at: dict[str, int] = {"": 0}
        self.types: list[bytes | None] = []

    def s(self, name: str) -> int:
        if name not in self._string_at:
            self._string_at[name] = len(self.strings)
            self.strings += name.encode() + b"\0"
        return self._string_at[name]

    def _add(self, raw: bytes | None) -> int:
        self.types.append(raw)
        return len(self.types)

    @staticmethod
    def _head(name_off: int, kind: str, vlen: int, size_or_type: int, flag: bool = False) -> bytes:
        info = vlen | KIND[kind] << 24 | (1 << 31 if flag else 0)
        return struct.pack("<III", name_off, info, size_or_type)

    def int(self, name: str, size: int, signed: bool = False) -> int:
        enc = 1 if signed else 0
        return self._add(
            self._head(self.s(name), "int", 0, size) + struct.pack("<I", enc << 24 | size * 8)
        )

    def ptr(self, target: int) -> int:
        return self._add(self._head(0, "ptr", 0, target))

    def qual(self, kind: str, target: int, name: str = "") -> int:
        return self._add(self._head(self.s(name), kind, 0, target))

    def array(self, elem: int, count: int, index_type: int) -> int:
        return self._add(
            self._head(0, "array", 0, 0) + struct.pack("<III", elem, index_type, count)
        )

    def enum(self, name: str, values: dict[str, int]) -> int:
        body = b"".join(struct.pack("<Ii", self.s(k), v) for k, v in values.items())
        return self._add(self._head(self.s(name), "enum", len(values), 4) + body)

    def declare(self) -> int:
        return self._add(None)

    def struct(
        self,
        name: str,
        size: int,
        members: list[tuple[str, int, int]] | list[tuple[str, int, int, int]],
        *,
        union: bool = False,
        into: int | None = None,
    ) -> int:
        """Members as (name, type, byte offset) or (name, type, bit offset, bits)."""
        flag = any(len(m) == 4 for m in members)
        body = b""
        for m in members:
            off = m[2] | m[3] << 24 if len(m) == 4 else m[2] * 8  # type: ignore[misc]
            body += struct.pack("<III", self.s(m[0]), m[1], off)
        raw = self._head(self.s(name), "union" if union else "struct", len(members), size, flag)
        raw += body
        if into is not None:
            self.types[into - 1] = raw
            return into
        return self._add(raw)

    def raw_type(self, raw: bytes) -> int:
        return self._add(raw)

    def build(self) -> bytes:
        types = b"".join(t or b"" for t in self.types)
        if any(t is None for t in self.types):
            raise ValueError("a declared struct was never defined")
        hdr = struct.pack(
            "<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(self.strings)
        )
        return hdr + types + bytes(self.strings)


class KcoreImage:
    """Kernel memory in segments, saved as an ELF64 core file."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, bytearray]] = []

    def segment(self, vaddr: int, size: int) -> None:
        self.segments.append((vaddr, bytearray(size)))

    def _at(self, addr: int, n: int) -> tuple[bytearray, int]:
        for vaddr, mem in self.segments:
            if vaddr <= addr and addr + n <= vaddr + len(mem):
                return mem, addr - vaddr
        raise ValueError(f"{addr:#x} is in no segment of the image")

    def write(self, addr: int, data: bytes) -> None:
        mem, off = self._at(addr, len(data))
        mem[off : off + len(data)] = data

    def u64(self, addr: int, value: int) -> None:
        self.write(addr, struct.pack("<Q", value))

    def u32(self, addr: int, value: int) -> None:
        self.write(addr, struct.pack("<I", value))

    def offset_of(self, addr: int) -> int:
        """Where *addr* lies in the saved file (after :meth:`save`)."""
        base = 64 + 56 * (len(self.segments) + 1) + len(self._note)
        for vaddr, mem in self.segments:
            if vaddr <= addr < vaddr + len(mem):
                return base + addr - vaddr
            base += len(mem)
        raise ValueError(f"{addr:#x} is in no segment of the image")

    def save(self, path: Path, vmcoreinfo: dict[str, str] | None = None) -> Path:
        text = "".join(f"{k}={v}\n" for k, v in (vmcoreinfo or {}).items()).encode()
        name = b"VMCOREINFO\0"
        note = struct.pack("<III", len(name), len(text), 0) + name.ljust(12, b"\0")
        note += text.ljust((len(text) + 3) & ~3, b"\0")
        self._note = note
        phnum = len(self.segments) + 1
        offset = 64 + 56 * phnum
        ehdr = b"\x7fELF" + bytes([2, 1, 1, 0]) + b"\0" * 8
        ehdr += struct.pack("<HHIQQQIHHHHHH", 4, 62, 1, 0, 64, 0, 0, 64, 56, phnum, 0, 0, 0)
        phdrs = struct.pack("<IIQQQQQQ", 4, 0, offset, 0, 0, len(note), 0, 4)
        offset += len(note)
        for vaddr, mem in self.segments:
            phdrs += struct.pack("<IIQQQQQQ", 1, 7, offset, vaddr, 0, len(mem), len(mem), 4096)
            offset += len(mem)
        path.write_bytes(ehdr + phdrs + note + b"".join(bytes(m) for _, m in self.segments))
        return path
