"""perf.data records kreld writes: kernel module maps, KSYMBOL records and
build-id entries, each with the ``sample_id`` fields its event's attribute asks
for.  Pure: bytes in, bytes out.

Layouts from tools/perf/util/synthetic-events.c and include/uapi/linux/perf_event.h:

* ``PERF_RECORD_MMAP`` (1): pid, tid, start, len, pgoff, filename (NUL-ended,
  padded to 8 bytes); a kernel map has pid -1 (``HOST_KERNEL_ID``) and misc
  ``PERF_RECORD_MISC_KERNEL``, as ``perf_event__synthesize_modules`` writes it.
* ``PERF_RECORD_KSYMBOL`` (17): addr (u64), len (u32), ksym_type (u16), flags
  (u16; 1 = unregister), name.
* ``sample_id`` (``attr.sample_id_all``), in this order, each field only when
  ``attr.sample_type`` has its bit: TID (pid, tid), TIME, ID, STREAM_ID, CPU
  (cpu, reserved), IDENTIFIER (``perf_event__synthesize_id_sample``).
* a build-id entry (``struct perf_record_header_build_id``): header, pid,
  build-id (20 bytes, its size, 3 reserved), the name padded to 64 bytes
  (``NAME_ALIGN`` in tools/perf/util/header.c).
"""

from __future__ import annotations

import struct
from enum import IntEnum, IntFlag

from kreld.core.record import record
from kreld.perf.formats import MISC_BUILD_ID_SIZE, MISC_KERNEL, RecordType

__all__ = [
    "KSYM_UNREGISTER",
    "AttrLayout",
    "KsymType",
    "SampleType",
    "build_id_entry",
    "kernel_mmap",
    "ksymbol",
]

KSYM_UNREGISTER = 1
_NAME_ALIGN = 64
_SAMPLE_ID_ALL = 1 << 18  # perf_event_attr's flags: bit 18


class SampleType(IntFlag):
    """The ``PERF_SAMPLE_*`` bits that place fields in a record."""

    IP = 1 << 0
    TID = 1 << 1
    TIME = 1 << 2
    ADDR = 1 << 3
    ID = 1 << 6
    CPU = 1 << 7
    STREAM_ID = 1 << 9
    IDENTIFIER = 1 << 16


class KsymType(IntEnum):
    """``PERF_RECORD_KSYMBOL_TYPE_*``."""

    UNKNOWN = 0
    BPF = 1
    OOL = 2  # out-of-line code: trampolines, kprobe instruction pages


_ID_FIELDS = (
    SampleType.TID,
    SampleType.TIME,
    SampleType.ID,
    SampleType.STREAM_ID,
    SampleType.CPU,
    SampleType.IDENTIFIER,
)


@record
class AttrLayout:
    """Where an event's records keep their time, and what sample_id they carry."""

    sample_type: int
    sample_id_all: bool
    id: int = 0  # the event's first id, written in ID and IDENTIFIER

    @classmethod
    def from_attr(cls, attr: bytes, ids: tuple[int, ...], endian: str) -> AttrLayout:
        sample_type, _rf, flags = struct.unpack_from(endian + "QQQ", attr, 24)
        return cls(sample_type, bool(flags & _SAMPLE_ID_ALL), ids[0] if ids else 0)

    def has(self, bit: SampleType) -> bool:
        return bool(self.sample_type & bit)

    @property
    def sample_time_offset(self) -> int | None:
        """Offset of a SAMPLE record's time from the record's start."""
        if not self.has(SampleType.TIME):
            return None
        off = 8
        for bit in (SampleType.IDENTIFIER, SampleType.IP, SampleType.TID):
            off += 8 if self.has(bit) else 0
        return off

    @property
    def id_size(self) -> int:
        """Bytes of sample_id at the end of every other kernel record."""
        if not self.sample_id_all:
            return 0
        return 8 * sum(1 for b in _ID_FIELDS if self.has(b))

    @property
    def time_from_end(self) -> int | None:
        """Offset of a non-sample record's time, counted back from its end."""
        if not self.sample_id_all or not self.has(SampleType.TIME):
            return None
        after = (SampleType.ID, SampleType.STREAM_ID, SampleType.CPU, SampleType.IDENTIFIER)
        return 8 + 8 * sum(1 for b in after if self.has(b))

    def sample_id(self, time: int, endian: str = "<", pid: int = 0, tid: int = 0) -> bytes:
        """The trailer of a record written at *time* (the idle task, cpu 0)."""
        if not self.sample_id_all:
            return b""
        out = b""
        if self.has(SampleType.TID):
            out += struct.pack(endian + "iI", pid, tid)
        if self.has(SampleType.TIME):
            out += struct.pack(endian + "Q", time)
        if self.has(SampleType.ID):
            out += struct.pack(endian + "Q", self.id)
        if self.has(SampleType.STREAM_ID):
            out += struct.pack(endian + "Q", self.id)
        if self.has(SampleType.CPU):
            out += struct.pack(endian + "II", 0, 0)
        if self.has(SampleType.IDENTIFIER):
            out += struct.pack(endian + "Q", self.id)
        return out


def _record(rtype: int, misc: int, body: bytes, endian: str) -> bytes:
    if 8 + len(body) > 0xFFFF:
        raise ValueError(f"a record of {8 + len(body)} bytes does not fit perf's u16 size")
    return struct.pack(endian + "IHH", rtype, misc, 8 + len(body)) + body


def _name(name: str, align: int = 8) -> bytes:
    b = name.encode("utf-8", "replace") + b"\0"
    return b + b"\0" * (-len(b) % align)


def kernel_mmap(
    name: str, start: int, length: int, trailer: bytes, endian: str = "<", pgoff: int = 0
) -> bytes:
    """A kernel MMAP of *name* (``[brd]``) over [start, start + length); perf's
    kernel map (``[kernel.kallsyms]_text``) gives its reference symbol's address as *pgoff*."""
    body = struct.pack(endian + "iIQQQ", -1, 0, start, length, pgoff) + _name(name)
    return _record(RecordType.MMAP, MISC_KERNEL, body + trailer, endian)


def ksymbol(
    addr: int,
    length: int,
    kind: KsymType,
    name: str,
    trailer: bytes,
    *,
    unregister: bool = False,
    endian: str = "<",
) -> bytes:
    """A ``PERF_RECORD_KSYMBOL``: *name* registered (or unregistered) at *addr*."""
    flags = KSYM_UNREGISTER if unregister else 0
    body = struct.pack(endian + "QIHH", addr, length, int(kind), flags) + _name(name)
    return _record(RecordType.KSYMBOL, MISC_KERNEL, body + trailer, endian)


def build_id_entry(name: str, build_id: str, endian: str = "<") -> bytes:
    """A kernel-mode build-id entry for the table (or a pipe's HEADER_BUILD_ID)."""
    raw = bytes.fromhex(build_id)[:20]
    bid = raw.ljust(20, b"\0") + bytes([len(raw)]) + b"\0\0\0"
    body = struct.pack(endian + "i", -1) + bid + _name(name, _NAME_ALIGN)
    return _record(RecordType.HEADER_BUILD_ID, MISC_KERNEL | MISC_BUILD_ID_SIZE, body, endian)
