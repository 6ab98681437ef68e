"""perf side-band records about kernel code: parsed from a ring's bytes, and
the rings of every CPU merged by time.  Pure: no I/O.

The kernel writes ``PERF_RECORD_KSYMBOL`` (17) when a BPF program, trampoline,
dispatcher or out-of-line page (ftrace trampoline, kprobe instruction page)
is registered or unregistered, and ``PERF_RECORD_BPF_EVENT`` (18) when a BPF
program is loaded or unloaded (kernel/events/core.c, ``perf_event_ksymbol()``
and ``perf_event_bpf_event()``, since Linux 5.1, commits 76193a94522f and
6ee52e2a3fe4), each into the ring of the CPU it happens on only: a load and
its unload may sit in two rings, so the rings are merged by time.

Every record is read from its front and bounded by its own size: the kernel
adds each listener's ``id_header_size`` to the size in a header shared by all
listeners and never restores it (``perf_event_ksymbol_output()`` does
``header.size += id_header_size``), so a record may carry trailing bytes
(24 and 32 were seen) after its ``sample_id`` trailer.  The trailer sits
right after the fields, where the kernel wrote it, not at the record's end.
"""

from __future__ import annotations

import heapq
import struct
from collections.abc import Iterable, Iterator
from enum import IntEnum

from kreld.core.record import record

__all__ = [
    "HEADER",
    "KSYM_NAME_MAX",
    "KSYM_UNREGISTER",
    "BpfEvent",
    "BpfEventType",
    "IdLayout",
    "KsymType",
    "Ksymbol",
    "Lost",
    "Parsed",
    "RawSample",
    "RecordType",
    "SideRecord",
    "merge_by_time",
    "parse_records",
]

HEADER = struct.Struct("<IHH")  # struct perf_event_header: type, misc, size
_KSYM = struct.Struct("<QIHH")  # addr, len, ksym_type, flags
_BPF = struct.Struct("<HHI8s")  # type, flags, id, tag
_LOST = struct.Struct("<QQ")  # id, lost
_U64 = struct.Struct("<Q")
# KSYM_NAME_LEN (include/linux/kallsyms.h: 512 since 6.1, 128 before): a
# name longer than this, or without its NUL inside the record, is malformed.
KSYM_NAME_MAX = 512
KSYM_UNREGISTER = 1  # PERF_RECORD_KSYMBOL_FLAGS_UNREGISTER


class RecordType(IntEnum):
    """The ``perf_event_header.type`` values kreld reads (include/uapi/linux/perf_event.h)."""

    LOST = 2
    SAMPLE = 9
    KSYMBOL = 17
    BPF_EVENT = 18


class KsymType(IntEnum):
    UNKNOWN = 0
    BPF = 1
    OOL = 2  # out of line: kprobe instruction pages, ftrace trampolines


class BpfEventType(IntEnum):
    UNKNOWN = 0
    PROG_LOAD = 1
    PROG_UNLOAD = 2


@record
class IdLayout:
    """Where the ``sample_id`` trailer keeps the time, as the event's
    ``sample_type`` lays it out: its size in bytes and the time's offset in it
    (``PERF_SAMPLE_TIME`` alone: 8 and 0; with ``PERF_SAMPLE_TID`` before it, 16 and 8)."""

    size: int = 8
    time_at: int = 0


@record
class Ksymbol:
    time: int  # on the event's clock (CLOCK_MONOTONIC as kreld opens it)
    cpu: int
    addr: int
    length: int
    ksym_type: int  # KsymType, or a value a newer kernel added
    unregister: bool
    name: str


@record
class BpfEvent:
    time: int
    cpu: int
    type: int  # BpfEventType
    prog_id: int
    tag: str  # 16 hex digits


@record
class Lost:
    time: int
    cpu: int
    lost: int


@record
class RawSample:
    """A tracepoint's sample as ``PERF_SAMPLE_TIME|PERF_SAMPLE_RAW`` lays it
    out: its time and the tracepoint's own record (read with its ``format``)."""

    time: int
    cpu: int
    raw: bytes


SideRecord = Ksymbol | BpfEvent | Lost | RawSample


@record
class Parsed:
    """The records of one ring's bytes, in its order; ``skipped`` counts
    records of other types and malformed ones (each stepped over by its size);
    ``rest`` is the offset where a record cut short starts (len(data) if none)."""

    records: list[SideRecord]
    skipped: int
    rest: int


def _time(data: bytes, at: int, end: int, layout: IdLayout) -> int | None:
    """The trailer's time when the trailer starts at *at* and fits before *end*."""
    if at + layout.size > end:
        return None
    return int(_U64.unpack_from(data, at + layout.time_at)[0])


def _ksymbol(data: bytes, off: int, end: int, cpu: int, layout: IdLayout) -> Ksymbol | None:
    body = off + HEADER.size
    if body + _KSYM.size > end:
        return None
    addr, length, ksym_type, flags = _KSYM.unpack_from(data, body)
    start = body + _KSYM.size
    nul = data.find(b"\0", start, min(end, start + KSYM_NAME_MAX))
    if nul < 0:
        return None
    # The name is NUL-padded to 8 bytes (perf_event_ksymbol(): ALIGN(len + 1, 8)).
    padded = (nul - start + 1 + 7) & ~7
    t = _time(data, start + padded, end, layout)
    if t is None:
        return None
    name = data[start:nul].decode("utf-8", "replace")
    return Ksymbol(t, cpu, addr, length, ksym_type, bool(flags & KSYM_UNREGISTER), name)


def _bpf_event(data: bytes, off: int, end: int, cpu: int, layout: IdLayout) -> BpfEvent | None:
    body = off + HEADER.size
    if body + _BPF.size > end:
        return None
    typ, _flags, prog_id, tag = _BPF.unpack_from(data, body)
    t = _time(data, body + _BPF.size, end, layout)
    return None if t is None else BpfEvent(t, cpu, typ, prog_id, tag.hex())


def _lost(data: bytes, off: int, end: int, cpu: int, layout: IdLayout) -> Lost | None:
    body = off + HEADER.size
    if body + _LOST.size > end:
        return None
    _id, lost = _LOST.unpack_from(data, body)
    t = _time(data, body + _LOST.size, end, layout)
    return None if t is None else Lost(t, cpu, lost)


def _raw_sample(data: bytes, off: int, end: int, cpu: int, layout: IdLayout) -> RawSample | None:
    """``u64 time; u32 size; char raw[size]`` (the fields of PERF_SAMPLE_TIME and
    PERF_SAMPLE_RAW, in perf_output_sample()'s order): no trailer in a sample."""
    body = off + HEADER.size
    if body + _U64.size + 4 > end:
        return None
    t = int(_U64.unpack_from(data, body)[0])
    (size,) = struct.unpack_from("<I", data, body + _U64.size)
    start = body + _U64.size + 4
    if start + size > end:
        return None
    return RawSample(t, cpu, bytes(data[start : start + size]))


_READERS = {
    RecordType.SAMPLE: _raw_sample,
    RecordType.KSYMBOL: _ksymbol,
    RecordType.BPF_EVENT: _bpf_event,
    RecordType.LOST: _lost,
}


def parse_records(data: bytes, cpu: int, layout: IdLayout | None = None) -> Parsed:
    """The side-band records in *data*, the bytes read from CPU *cpu*'s ring.

    Linear in ``len(data)``: each step advances by a record's size, at least
    a header.  A size under a header's ends the parse there (nothing after it
    can be framed); so does a record running past the end (``rest``).
    """
    lay = layout or IdLayout()
    out: list[SideRecord] = []
    skipped = off = 0
    n = len(data)
    while off + HEADER.size <= n:
        typ, _misc, size = HEADER.unpack_from(data, off)
        if size < HEADER.size or off + size > n:
            break
        reader = _READERS.get(typ)
        rec = None if reader is None else reader(data, off, off + size, cpu, lay)
        if rec is None:
            skipped += 1
        else:
            out.append(rec)
        off += size
    return Parsed(out, skipped, off)


def merge_by_time(streams: Iterable[Iterable[SideRecord]]) -> Iterator[SideRecord]:
    """The records of every CPU's ring as one stream in time order (each ring
    is already in time order; of equal times, the earlier stream's first)."""
    return heapq.merge(*streams, key=lambda r: r.time)
