"""What a ``perf.data`` file says about the kernel it was recorded on.

perf.data carries no boot-id.  What ties a recording to a boot is in its
header and in the first records of its data section, which ``perf record``
synthesizes before any sample (``record__synthesize()`` in
tools/perf/builtin-record.c):

* the build-id table (feature ``HEADER_BUILD_ID``): ``[kernel.kallsyms]`` and
  the modules that had samples (all of them with ``--buildid-all``);
* the kernel map ``[kernel.kallsyms]_text`` (an MMAP, or since perf 6.17 an
  MMAP2 carrying the build-id, ``PERF_RECORD_MISC_MMAP_BUILD_ID``) whose
  pgoff is the runtime ``_text`` when recording started;
* one map per module of ``/proc/modules`` at record start: its core base and
  size;
* the features ``HOSTNAME``, ``OSRELEASE``, ``SAMPLE_TIME`` and, with
  ``perf record -k CLOCK`` (perf >= 5.9), ``CLOCK_DATA``.

The layout follows tools/perf/Documentation/perf.data-file-format.txt and
tools/perf/util/header.c.  Only the header, the feature sections and the
synthesized prefix of the data section are read: the scan stops at
``PERF_RECORD_FINISHED_INIT`` (written once synthesis is done, perf >= 5.19),
at the first sample, at the first user-space record after the kernel maps, or
after :data:`PREFIX_LIMIT` bytes, whichever comes first; a file of gigabytes
costs what its first kilobytes cost.  Records compressed with ``perf record
-z`` (``PERF_RECORD_COMPRESSED``, and ``COMPRESSED2`` of perf 6.16) are
decompressed as they come; pipe-mode files (``perf record -o -``), whose
features travel as ``PERF_RECORD_HEADER_FEATURE`` records, are read too, and
so are the directories ``perf record --threads`` writes (their ``data`` file
holds the header and the synthesized records).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import BinaryIO

from kreld.errors import PerfDataError

# How far into the data section the synthesized records are looked for.
PREFIX_LIMIT = 64 << 20
# A feature section larger than this is not one of the few read here.
FEATURE_LIMIT = 64 << 20
# One compressed record never inflates past this (perf's own bound is its
# mmap size, a few MiB).
DECOMPRESSED_LIMIT = 64 << 20
_READ_CHUNK = 1 << 16

_MAGIC = b"PERFILE2"
_FILE_HEADER_SIZE = 104  # magic, size, attr_size, 3 sections, 256 feature bits
_PIPE_HEADER_SIZE = 16  # magic, size
_ATTR_CLOCKID_OFFSET = 92  # perf_event_attr.clockid (s32)
_ATTR_FLAGS_OFFSET = 40
_ATTR_USE_CLOCKID = 1 << 25
_ATTR_MIN_SIZE = 96  # PERF_ATTR_SIZE_VER1 (clockid came with it)
_HOST_PID = 0xFFFFFFFF  # pid -1: the kernel's own maps (HOST_KERNEL_ID)
KERNEL_MAP_PREFIX = "[kernel.kallsyms]"


class Feature(IntEnum):
    """Feature bits of the header (``HEADER_*`` in tools/perf/util/header.h)."""

    BUILD_ID = 2
    HOSTNAME = 3
    OSRELEASE = 4
    SAMPLE_TIME = 21
    CLOCKID = 23
    COMPRESSED = 27
    CLOCK_DATA = 29


_FEATURES = frozenset(int(f) for f in Feature)


class RecordType(IntEnum):
    """``PERF_RECORD_*`` types read here (kernel ones, then perf's own from 64)."""

    MMAP = 1
    COMM = 3
    SAMPLE = 9
    MMAP2 = 10
    HEADER_ATTR = 64
    HEADER_BUILD_ID = 67
    HEADER_FEATURE = 80
    COMPRESSED = 81
    FINISHED_INIT = 82
    COMPRESSED2 = 83


class ClockId(IntEnum):
    """The clocks ``perf record -k`` takes (``clockid_t`` values)."""

    REALTIME = 0
    MONOTONIC = 1
    MONOTONIC_RAW = 4
    BOOTTIME = 7
    TAI = 11


_MISC_CPUMODE_MASK = 0x7
_MISC_KERNEL = 1
_MISC_MMAP_BUILD_ID = 1 << 14  # MMAP2 carries a build-id instead of a device
_MISC_BUILD_ID_SIZE = 1 << 15  # a build-id event says its build-id's size


@dataclass(frozen=True, slots=True)
class BuildIdEntry:
    """One entry of the build-id table."""

    name: str  # "[kernel.kallsyms]", a module as "[name]" or its .ko path, or a file
    build_id: str
    kernel: bool  # recorded in kernel mode (the kernel and its modules)

    @property
    def module(self) -> str | None:
        return None if not self.kernel or self.name == KERNEL_MAP_PREFIX else module_name(self.name)


@dataclass(frozen=True, slots=True)
class ModuleMap:
    """A module as ``/proc/modules`` showed it when recording started."""

    name: str  # as the kernel names it ("nf_tables", never "nf-tables")
    filename: str  # what perf wrote: "[name]" or the .ko path it found
    start: int
    length: int
    build_id: str | None = None  # MMAP2 with a build-id (perf >= 6.17)


@dataclass(frozen=True, slots=True)
class ClockData:
    """``HEADER_CLOCK_DATA``: the sample clock, and one instant read on it and on
    CLOCK_REALTIME when recording started."""

    clockid: int
    realtime_ns: int
    clock_ns: int


@dataclass(frozen=True, slots=True)
class PerfHeader:
    """What one recording says about its kernel."""

    path: str
    pipe: bool
    compressed: bool
    kernel_build_id: str | None
    text: int | None  # runtime _text at record start (pgoff of the kernel map)
    modules: tuple[ModuleMap, ...]
    build_ids: tuple[BuildIdEntry, ...]
    hostname: str | None
    osrelease: str | None
    sample_time: tuple[int, int] | None  # first and last sample, on the sample clock
    clockid: int | None  # set by perf record -k; None: perf_clock() (local_clock())
    clock_data: ClockData | None
    bytes_read: int  # of the file, to show the scan stayed in its prefix
    file_size: int | None = field(default=None)
    # The symbol the kernel map is relative to: "_text", or "_stext" where the
    # kernel has no _text (perf's ref_reloc_sym_names); ``text`` is its address.
    ref_symbol: str = "_text"

    def module_build_id(self, name: str) -> str | None:
        for m in self.modules:
            if m.name == name and m.build_id:
                return m.build_id
        for e in self.build_ids:
            if e.module == name:
                return e.build_id
        return None


def module_name(filename: str) -> str:
    """The kernel's name of a module from perf's map name: ``[nf_tables]`` or
    ``/lib/modules/R/kernel/net/netfilter/nf_tables.ko.xz``."""
    if filename.startswith("[") and filename.endswith("]"):
        return filename[1:-1]
    base = filename.rsplit("/", 1)[-1]
    base = base.split(".ko", 1)[0]
    return base.replace("-", "_")


def _is_module_map(filename: str) -> bool:
    """Module maps are ``[name]`` or a .ko path; other kernel maps perf makes
    (x86's entry trampolines, ``[kernel.kallsyms]`` itself) are neither."""
    if filename.startswith(KERNEL_MAP_PREFIX):
        return False
    if filename.startswith("[") and filename.endswith("]"):
        return True
    return ".ko" in filename.rsplit("/", 1)[-1]


def _cstr(data: bytes) -> str:
    return data.split(b"\0", 1)[0].decode("utf-8", "replace")


class _Collector:
    """Gathers the facts as records and features are met (one per file)."""

    def __init__(self, path: str, endian: str) -> None:
        self.path = path
        self.e = endian
        self.build_ids: list[BuildIdEntry] = []
        self.modules: list[ModuleMap] = []
        self.text: int | None = None
        self.kernel_build_id: str | None = None
        self.kernel_map_seen = False
        self.ref_symbol = "_text"
        self.hostname: str | None = None
        self.osrelease: str | None = None
        self.sample_time: tuple[int, int] | None = None
        self.clockid: int | None = None
        self.clock_data: ClockData | None = None
        self.compressed = False

    def error(self, reason: str, offset: int | None = None) -> PerfDataError:
        return PerfDataError(self.path, reason, offset)

    # -- features ----------------------------------------------------------------

    def feature(self, feat: int, data: bytes, offset: int) -> None:
        e = self.e
        if feat == Feature.BUILD_ID:
            self.build_id_events(data, offset)
        elif feat in (Feature.HOSTNAME, Feature.OSRELEASE):
            if len(data) < 4:
                raise self.error(f"feature {Feature(feat).name} truncated", offset)
            (n,) = struct.unpack_from(e + "I", data, 0)
            if n > len(data) - 4:
                raise self.error(f"feature {Feature(feat).name}: string overruns it", offset)
            text = _cstr(data[4 : 4 + n])
            if feat == Feature.HOSTNAME:
                self.hostname = text
            else:
                self.osrelease = text
        elif feat == Feature.SAMPLE_TIME:
            if len(data) < 16:
                raise self.error("feature SAMPLE_TIME truncated", offset)
            first, last = struct.unpack_from(e + "QQ", data, 0)
            # zeros: perf did not process the samples (pipe mode, perf record -z)
            self.sample_time = (first, last) if last else None
        elif feat == Feature.CLOCK_DATA:
            if len(data) < 24:
                raise self.error("feature CLOCK_DATA truncated", offset)
            _version, clockid, tod, ref = struct.unpack_from(e + "IIQQ", data, 0)
            self.clock_data = ClockData(clockid, tod, ref)
            self.clockid = clockid
        elif feat == Feature.COMPRESSED:
            self.compressed = True

    def build_id_events(self, data: bytes, offset: int) -> None:
        """A sequence of ``struct build_id_event`` (header, pid, 24 bytes, name)."""
        pos = 0
        while pos + 8 <= len(data):
            _type, misc, size = struct.unpack_from(self.e + "IHH", data, pos)
            if size < 36 or pos + size > len(data):
                raise self.error(f"build-id entry of size {size}", offset + pos)
            self.build_id_event(data[pos : pos + size], misc)
            pos += size

    def build_id_event(self, rec: bytes, misc: int) -> None:
        raw = rec[12:36]
        n = raw[20] if misc & _MISC_BUILD_ID_SIZE else 20
        if n > 20:
            raise self.error(f"build-id of {n} bytes")
        entry = BuildIdEntry(
            _cstr(rec[36:]), raw[:n].hex(), misc & _MISC_CPUMODE_MASK == _MISC_KERNEL
        )
        self.build_ids.append(entry)
        if entry.kernel and entry.name == KERNEL_MAP_PREFIX and self.kernel_build_id is None:
            self.kernel_build_id = entry.build_id

    def attr(self, data: bytes) -> None:
        """One ``perf_event_attr``: its clock, when ``use_clockid`` is set."""
        if len(data) < _ATTR_MIN_SIZE:
            return
        (flags,) = struct.unpack_from(self.e + "Q", data, _ATTR_FLAGS_OFFSET)
        if flags & _ATTR_USE_CLOCKID and self.clockid is None:
            (self.clockid,) = struct.unpack_from(self.e + "i", data, _ATTR_CLOCKID_OFFSET)

    # -- records -----------------------------------------------------------------

    def mmap(self, rtype: int, misc: int, rec: bytes, offset: int) -> None:
        fixed = 40 if rtype == RecordType.MMAP else 72
        if len(rec) < fixed:
            raise self.error(f"{RecordType(rtype).name} record of {len(rec)} bytes", offset)
        pid, _tid, start, length, pgoff = struct.unpack_from(self.e + "IIQQQ", rec, 8)
        if pid != _HOST_PID or misc & _MISC_CPUMODE_MASK != _MISC_KERNEL:
            return
        build_id = None
        if rtype == RecordType.MMAP2 and misc & _MISC_MMAP_BUILD_ID:
            n = rec[40]
            if n > 20:
                raise self.error(f"MMAP2 build-id of {n} bytes", offset)
            build_id = rec[44 : 44 + n].hex()
        name = _cstr(rec[fixed:])
        if name.startswith(KERNEL_MAP_PREFIX):
            if not self.kernel_map_seen:
                self.kernel_map_seen = True
                # pgoff 0: kallsyms was restricted when perf read it
                self.text = pgoff or None
                self.ref_symbol = name[len(KERNEL_MAP_PREFIX) :] or "_text"
                if build_id and self.kernel_build_id is None:
                    self.kernel_build_id = build_id
        elif _is_module_map(name):
            self.modules.append(ModuleMap(module_name(name), name, start, length, build_id))

    def header(self, path: str, pipe: bool, bytes_read: int, size: int | None) -> PerfHeader:
        return PerfHeader(
            path=path,
            pipe=pipe,
            compressed=self.compressed,
            kernel_build_id=self.kernel_build_id,
            text=self.text,
            modules=tuple(self.modules),
            build_ids=tuple(self.build_ids),
            hostname=self.hostname,
            osrelease=self.osrelease,
            sample_time=self.sample_time,
            clockid=self.clockid,
            clock_data=self.clock_data,
            bytes_read=bytes_read,
            file_size=size,
            ref_symbol=self.ref_symbol,
        )


class _Reader:
    """Reads of one open file, counted."""

    def __init__(self, f: BinaryIO, path: str) -> None:
        self.f = f
        self.path = path
        self.bytes_read = 0

    def at(self, offset: int, n: int, what: str) -> bytes:
        self.f.seek(offset)
        data = self.f.read(n)
        self.bytes_read += len(data)
        if len(data) != n:
            raise PerfDataError(self.path, f"{what} truncated ({len(data)} of {n} bytes)", offset)
        return data

    def records(
        self, start: int, end: int | None, endian: str
    ) -> Iterator[tuple[int, int, int, bytes]]:
        """``(offset, type, misc, record)`` from *start* to *end* (EOF: None),
        read in chunks so a stop early costs little."""
        self.f.seek(start)
        buf = b""
        at = 0  # the next record's index in buf
        pos = start  # its file offset
        while True:
            while len(buf) - at >= 8:
                rtype, misc, size = struct.unpack_from(endian + "IHH", buf, at)
                if size < 8:
                    raise PerfDataError(self.path, f"record of size {size}", pos)
                if len(buf) - at < size:
                    break
                yield pos, rtype, misc, buf[at : at + size]
                at += size
                pos += size
            buf = buf[at:]
            at = 0
            limit = _READ_CHUNK if end is None else min(_READ_CHUNK, end - pos - len(buf))
            chunk = self.f.read(limit) if limit > 0 else b""
            self.bytes_read += len(chunk)
            if not chunk:
                if buf:
                    raise PerfDataError(self.path, "last record truncated", pos)
                return
            buf += chunk


def _records(data: bytes, endian: str, path: str) -> Iterator[tuple[int, int, bytes]]:
    """The records in a decompressed buffer, and the bytes of a trailing part."""
    pos = 0
    while pos + 8 <= len(data):
        rtype, misc, size = struct.unpack_from(endian + "IHH", data, pos)
        if size < 8:
            raise PerfDataError(path, f"compressed record holds a record of size {size}")
        if pos + size > len(data):
            break
        yield rtype, misc, data[pos : pos + size]
        pos += size


class _Scan:
    """The walk over the data section's synthesized prefix."""

    def __init__(self, c: _Collector, path: str) -> None:
        self.c = c
        self.path = path
        self.pending = b""  # a record split between two compressed records
        self.done = False
        self.scanned = 0

    def record(self, rtype: int, misc: int, rec: bytes, offset: int) -> None:
        c = self.c
        self.scanned += len(rec)
        if rtype in (RecordType.FINISHED_INIT, RecordType.SAMPLE):
            self.done = True
        elif rtype in (RecordType.MMAP, RecordType.MMAP2):
            pid = struct.unpack_from(c.e + "I", rec, 8)[0] if len(rec) >= 12 else 0
            if pid != _HOST_PID and c.kernel_map_seen:
                self.done = True  # user-space maps come after the kernel's
            else:
                c.mmap(rtype, misc, rec, offset)
        elif rtype == RecordType.COMM and c.kernel_map_seen:
            self.done = True
        elif rtype == RecordType.HEADER_FEATURE:
            if len(rec) < 16:
                raise c.error("HEADER_FEATURE record truncated", offset)
            (feat,) = struct.unpack_from(c.e + "Q", rec, 8)
            c.feature(feat, rec[16:], offset)
        elif rtype == RecordType.HEADER_ATTR:
            c.attr(rec[8:])
        elif rtype == RecordType.HEADER_BUILD_ID:
            if len(rec) < 36:
                raise c.error("HEADER_BUILD_ID record truncated", offset)
            c.build_id_event(rec, misc)
        elif rtype in (RecordType.COMPRESSED, RecordType.COMPRESSED2):
            self.compressed(rtype, rec, offset)
        if self.scanned >= PREFIX_LIMIT:
            self.done = True

    def compressed(self, rtype: int, rec: bytes, offset: int) -> None:
        import zstandard  # only recordings made with -z need it

        c = self.c
        c.compressed = True
        if rtype == RecordType.COMPRESSED2:
            if len(rec) < 16:
                raise c.error("COMPRESSED2 record truncated", offset)
            (n,) = struct.unpack_from(c.e + "Q", rec, 8)
            if n > len(rec) - 16:
                raise c.error(f"COMPRESSED2 data size {n} overruns its record", offset)
            payload = rec[16 : 16 + n]
        else:
            payload = rec[8:]
        try:
            data = zstandard.ZstdDecompressor().decompressobj().decompress(payload)
        except zstandard.ZstdError as e:
            raise c.error(f"compressed record: {e}", offset) from e
        if len(data) > DECOMPRESSED_LIMIT:
            raise c.error("compressed record inflates past the limit", offset)
        data = self.pending + data
        used = 0
        for rtype2, misc2, inner in _records(data, c.e, self.path):
            used += len(inner)
            if rtype2 in (RecordType.COMPRESSED, RecordType.COMPRESSED2):
                raise c.error("a compressed record inside a compressed record", offset)
            self.record(rtype2, misc2, inner, offset)
            if self.done:
                return
        self.pending = data[used:]


def read_perf_header(path: str | os.PathLike[str]) -> PerfHeader:
    """Read what *path* says about its kernel; :class:`PerfDataError` if it is
    not a perf.data file or is damaged."""
    p = str(path)
    if Path(p, "data").is_file():  # perf record --threads: a directory, header in "data"
        p = str(Path(p, "data"))
    try:
        f = open(p, "rb")  # noqa: SIM115 - closed below; the reader keeps it
    except OSError as e:
        raise PerfDataError(p, e.strerror or str(e)) from e
    with f:
        size = os.fstat(f.fileno()).st_size if Path(p).is_file() else None
        r = _Reader(f, p)
        head = r.at(0, _PIPE_HEADER_SIZE, "file header")
        if head[:8] == _MAGIC:
            endian = "<"
        elif head[:8] == _MAGIC[::-1]:
            endian = ">"
        elif head[:8] == b"PERFFILE":
            raise PerfDataError(p, "a version 1 perf.data (PERFFILE): too old to read")
        else:
            raise PerfDataError(p, "not a perf.data file (no PERFILE2 magic)")
        c = _Collector(p, endian)
        (hsize,) = struct.unpack_from(endian + "Q", head, 8)
        if hsize == _PIPE_HEADER_SIZE:
            scan = _Scan(c, p)
            for off, rtype, misc, rec in r.records(_PIPE_HEADER_SIZE, None, endian):
                scan.record(rtype, misc, rec, off)
                if scan.done:
                    break
            return c.header(p, True, r.bytes_read, size)
        if hsize != _FILE_HEADER_SIZE:
            raise PerfDataError(p, f"header size {hsize}, not {_FILE_HEADER_SIZE}")
        rest = r.at(_PIPE_HEADER_SIZE, _FILE_HEADER_SIZE - _PIPE_HEADER_SIZE, "file header")
        (attr_size, a_off, a_size, d_off, d_size, _t_off, _t_size) = struct.unpack_from(
            endian + "7Q", rest, 0
        )
        flags = struct.unpack_from(endian + "4Q", rest, 56)
        limit = size if size is not None else 1 << 62
        for what, off, n in (("attrs", a_off, a_size), ("data", d_off, d_size)):
            if off > limit or n > limit - off:
                raise PerfDataError(p, f"{what} section [{off}, +{n}) lies past the end")
        if attr_size and a_size % (attr_size + 16) == 0 and a_size <= FEATURE_LIMIT:
            attrs = r.at(a_off, a_size, "attrs section")
            for i in range(0, a_size, attr_size + 16):
                c.attr(attrs[i : i + attr_size])
        _read_features(r, c, flags, d_off + d_size, limit)
        scan = _Scan(c, p)
        for off, rtype, misc, rec in r.records(d_off, d_off + d_size, endian):
            scan.record(rtype, misc, rec, off)
            if scan.done:
                break
        return c.header(p, False, r.bytes_read, size)


def _read_features(r: _Reader, c: _Collector, flags: tuple[int, ...], at: int, limit: int) -> None:
    """The feature sections: a table of (offset, size) after the data section,
    one per set bit in bit order; the sections themselves may lie in any order."""
    bits = [b for b in range(256) if flags[b // 64] >> (b % 64) & 1]
    if not bits:
        return
    table = r.at(at, 16 * len(bits), "feature table")
    for i, bit in enumerate(bits):
        off, n = struct.unpack_from(c.e + "QQ", table, 16 * i)
        if bit not in _FEATURES:
            continue
        if off > limit or n > limit - off or n > FEATURE_LIMIT:
            raise PerfDataError(c.path, f"feature {Feature(bit).name} section [{off}, +{n})", off)
        c.feature(bit, r.at(off, n, f"feature {Feature(bit).name}"), off)
