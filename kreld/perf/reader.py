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
from pathlib import Path
from typing import BinaryIO

from kreld.core.errors import PerfDataError
from kreld.perf.records import _FEATURES as _FEATURES
from kreld.perf.records import _FILE_HEADER_SIZE, _HOST_PID, _MAGIC, _PIPE_HEADER_SIZE, _Collector
from kreld.perf.records import KERNEL_MAP_PREFIX as KERNEL_MAP_PREFIX
from kreld.perf.records import BuildIdEntry as BuildIdEntry
from kreld.perf.records import ClockData as ClockData
from kreld.perf.records import ClockId as ClockId
from kreld.perf.records import Feature as Feature
from kreld.perf.records import ModuleMap as ModuleMap
from kreld.perf.records import PerfHeader as PerfHeader
from kreld.perf.records import RecordType as RecordType
from kreld.perf.records import module_name as module_name

__all__ = ["DECOMPRESSED_LIMIT", "FEATURE_LIMIT", "PREFIX_LIMIT", "read_perf_header"]

# How far into the data section the synthesized records are looked for.
PREFIX_LIMIT = 64 << 20
# A feature section larger than this is not one of the few read here.
FEATURE_LIMIT = 64 << 20
# One compressed record never inflates past this (perf's own bound is its
# mmap size, a few MiB).
DECOMPRESSED_LIMIT = 64 << 20
_READ_CHUNK = 1 << 16


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
