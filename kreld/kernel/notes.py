"""ELF note parsing (``Elf64_Nhdr`` and ``Elf32_Nhdr`` share one layout).

A note is ``namesz``, ``descsz`` and ``type`` (three native-endian 32-bit
words), then the name (``namesz`` bytes including its NUL) padded to 4 bytes,
then the descriptor padded to 4 bytes.  ``/sys/kernel/notes`` and a module's
``notes/.note.gnu.build-id`` are exactly such raw note streams.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterator
from enum import IntEnum

from kreld.core.errors import NoteError
from kreld.core.record import record

__all__ = ["Note", "NoteType", "find_build_id", "iter_notes", "parse_vmcoreinfo"]

_NHDR = struct.Struct("=III")


class NoteType(IntEnum):
    NT_GNU_BUILD_ID = 3  # with name "GNU"
    NT_VMCOREINFO = 0  # with name "VMCOREINFO"


@record
class Note:
    name: bytes
    type: int
    desc: bytes


def _align4(n: int) -> int:
    return (n + 3) & ~3


def iter_notes(data: bytes, byteorder: str = sys.byteorder) -> Iterator[Note]:
    """Yield each note in *data*; raise :class:`NoteError` on malformed input."""
    hdr = (
        _NHDR
        if byteorder == sys.byteorder
        else struct.Struct("<III" if byteorder == "little" else ">III")
    )
    off = 0
    end = len(data)
    while off < end:
        if end - off < hdr.size:
            # Trailing zero padding after the last note is legal (section alignment).
            if not any(data[off:]):
                return
            raise NoteError(f"{end - off} trailing bytes, too short for a note header", off)
        namesz, descsz, ntype = hdr.unpack_from(data, off)
        name_off = off + hdr.size
        desc_off = name_off + _align4(namesz)
        next_off = desc_off + _align4(descsz)
        if desc_off + descsz > end:
            raise NoteError(
                f"note claims name {namesz} and descriptor {descsz} bytes, "
                f"but only {end - name_off} remain",
                off,
            )
        name = data[name_off : name_off + namesz]
        if namesz and name[-1:] == b"\0":
            name = name[:-1]
        yield Note(name, ntype, data[desc_off : desc_off + descsz])
        off = min(next_off, end)


def find_build_id(data: bytes) -> str | None:
    """The GNU build-id (``NT_GNU_BUILD_ID`` with name ``GNU``) as lowercase hex."""
    for note in iter_notes(data):
        if note.name == b"GNU" and note.type == NoteType.NT_GNU_BUILD_ID:
            if not note.desc:
                raise NoteError("empty GNU build-id descriptor", 0)
            return note.desc.hex()
    return None


def parse_vmcoreinfo(desc: bytes) -> dict[str, str]:
    """``KEY=value`` lines of a VMCOREINFO note descriptor."""
    out: dict[str, str] = {}
    for line in desc.rstrip(b"\0").decode("ascii", "replace").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out
