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

Every read is bounded before anything is expanded (docs/RELIABILITY.md lists
the bounds): ``--for`` takes a regular file, or for a pipe-mode recording a
pipe, a FIFO or ``-`` (read once, in order, each wait for data bounded, so a
FIFO nobody writes to is refused rather than waited on); a compressed record
inflates in chunks and is refused once it passes :data:`DECOMPRESSED_LIMIT`;
the scan ends after :data:`RECORD_LIMIT` records or :data:`PREFIX_LIMIT`
bytes; module maps and build-ids are capped (:mod:`kreld.perf.formats`).
Whatever the bytes, the result is a :class:`PerfHeader` or a
:class:`~kreld.core.errors.PerfDataError` (:class:`~kreld.core.errors.PerfDataTooLarge`
for a bound).
"""

from __future__ import annotations

import os
import struct
from typing import IO, TYPE_CHECKING, cast

from kreld.core.errors import InvalidArgument, PerfDataError, PerfDataTooLarge
from kreld.perf.formats import _FEATURES as _FEATURES
from kreld.perf.formats import _FILE_HEADER_SIZE, _HOST_PID, _MAGIC, _PIPE_HEADER_SIZE, _Collector
from kreld.perf.formats import KERNEL_MAP_PREFIX as KERNEL_MAP_PREFIX
from kreld.perf.formats import MAX_BUILD_IDS as MAX_BUILD_IDS
from kreld.perf.formats import MAX_MODULE_MAPS as MAX_MODULE_MAPS
from kreld.perf.formats import BuildIdEntry as BuildIdEntry
from kreld.perf.formats import ClockData as ClockData
from kreld.perf.formats import ClockId as ClockId
from kreld.perf.formats import Feature as Feature
from kreld.perf.formats import ModuleMap as ModuleMap
from kreld.perf.formats import PerfHeader as PerfHeader
from kreld.perf.formats import RecordType as RecordType
from kreld.perf.formats import module_name as module_name
from kreld.perf.input import Input, is_stdin, open_input

if TYPE_CHECKING:
    import zstandard

__all__ = [
    "ATTRS_LIMIT",
    "ATTR_SIZES",
    "COMPRESSED_TYPES",
    "DECOMPRESSED_LIMIT",
    "DECOMPRESSED_RATIO",
    "DECOMPRESSED_SLACK",
    "FEATURE_LIMIT",
    "PREFIX_LIMIT",
    "RECORD_LIMIT",
    "SMALL_FEATURE_LIMIT",
    "InflateBudget",
    "read_perf_header",
]

# How far into the data section the synthesized records are looked for: the
# scan ends (without an error) after this many bytes or this many records.  A
# real ``perf record -a`` on this machine has some 330 records before
# FINISHED_INIT; a host with 10,000 threads and their maps some 500,000, of 100
# bytes or more (the byte limit comes first for them).
PREFIX_LIMIT = 64 << 20
RECORD_LIMIT = 1_000_000
# The largest build-id feature read (65,536 entries of a path each), and the
# largest of the other features read (a host name, a release, a few numbers).
FEATURE_LIMIT = 16 << 20
SMALL_FEATURE_LIMIT = 64 << 10
# The attrs section: per event a perf_event_attr (64 to 4,096 bytes:
# PERF_ATTR_SIZE_VER0 is 64, perf 6.1 writes 128) and a 16-byte ids section.
ATTRS_LIMIT = 1 << 20
ATTR_SIZES = range(64 + 16, 4096 + 16 + 1)
# One compressed record never inflates past this (perf's own bound is its
# mmap size, HEADER_COMPRESSED's mmap_len: 516 KiB by default).
DECOMPRESSED_LIMIT = 16 << 20
# All of a recording's compressed records together inflate to at most
# DECOMPRESSED_RATIO times their compressed bytes, plus DECOMPRESSED_SLACK: the
# work of reading what they hold then grows with the file, not with what an
# attacker packs into it.  ``perf record -z`` (zstd level 1 by default) packs
# perf's records some 3 to 10 times; a frame of repeated bytes packs thousands.
DECOMPRESSED_RATIO = 32
DECOMPRESSED_SLACK = DECOMPRESSED_LIMIT
_READ_CHUNK = 1 << 16
# The records the scan looks at; any other is only counted and stepped over.
_WANTED = frozenset(
    int(t)
    for t in (
        *(RecordType.MMAP, RecordType.COMM, RecordType.SAMPLE, RecordType.MMAP2),
        *(RecordType.HEADER_ATTR, RecordType.HEADER_TRACING_DATA, RecordType.HEADER_BUILD_ID),
        *(RecordType.AUXTRACE, RecordType.HEADER_FEATURE, RecordType.FINISHED_INIT),
        *(RecordType.COMPRESSED, RecordType.COMPRESSED2),
    )
)
COMPRESSED_TYPES = frozenset((int(RecordType.COMPRESSED), int(RecordType.COMPRESSED2)))


class InflateBudget:
    """What a recording's compressed records have inflated to, against their
    compressed bytes: :class:`PerfDataTooLarge` as soon as the inflation passes
    :data:`DECOMPRESSED_RATIO` times the input plus :data:`DECOMPRESSED_SLACK`
    (checked with each chunk zstd hands on, not after a record)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.packed = 0
        self.out = 0

    def compressed(self, n: int) -> None:
        """*n* more compressed bytes are about to be inflated."""
        self.packed += n

    def inflated(self, n: int, offset: int) -> None:
        self.out += n
        limit = DECOMPRESSED_SLACK + DECOMPRESSED_RATIO * self.packed
        if self.out > limit:
            raise PerfDataTooLarge(
                self.path,
                f"bytes inflated from {self.packed:,} compressed bytes "
                f"({DECOMPRESSED_RATIO} times theirs and {DECOMPRESSED_SLACK >> 20} MiB)",
                limit,
                offset,
            )


class _Stop(Exception):
    """Ends an inflation early: the scan has what it wanted."""


class _Records:
    """Splits a byte stream into records, fed in chunks: the kinds the scan
    reads go to it, any other is only counted and stepped over (no copy)."""

    def __init__(self, scan: _Scan, offset: int, inner: bool) -> None:
        self.scan = scan
        self.head = struct.Struct(scan.c.e + "IHH")
        self.pending = b""  # a record not yet whole
        self.offset = offset  # the stream offset of pending[0]
        self.skip = 0  # bytes still to step over (data that follows a record)
        self.inner = inner  # inside compressed records: offsets are the record's
        self.fixed = offset

    def where(self, at: int) -> int:
        return self.fixed if self.inner else self.offset + at

    def feed(self, data: bytes) -> None:
        """The records of *data*, after what earlier feeds left, until the scan is done."""
        scan = self.scan
        buf = self.pending + data if self.pending else data
        n, at = len(buf), min(self.skip, len(buf))
        self.skip -= at
        scan.scanned += at
        if self.skip and scan.scanned >= PREFIX_LIMIT:  # data said to follow, without end
            scan.done, scan.limit = True, "bytes"
            return
        count, scanned = scan.count, scan.scanned
        n_limit, b_limit = RECORD_LIMIT, PREFIX_LIMIT
        unpack, wanted = self.head.unpack_from, _WANTED
        while n - at >= 8:
            rtype, misc, size = unpack(buf, at)
            if size < 8:
                raise scan.c.error(f"record of size {size}", self.where(at))
            if n - at < size:
                break
            count += 1
            scanned += size
            if rtype in wanted:
                scan.count, scan.scanned = count, scanned
                skip = self.dispatch(rtype, misc, buf[at : at + size], at)
                count, scanned = scan.count, scan.scanned
                if skip:  # data that follows the record, outside any record
                    step = min(skip, n - at - size)
                    at += step
                    scanned += step
                    self.skip = skip - step
                if scan.done:
                    break
            at += size
            if count >= n_limit or scanned >= b_limit:
                scan.done = True
                scan.limit = "records" if count >= n_limit else "bytes"
                break
        scan.count, scan.scanned = count, scanned
        self.pending = b"" if scan.done else buf[at:]
        self.offset += at

    def dispatch(self, rtype: int, misc: int, rec: bytes, at: int) -> int:
        if self.inner and rtype in COMPRESSED_TYPES:
            raise self.scan.c.error("a compressed record inside a compressed record", self.fixed)
        return self.scan.record(rtype, misc, rec, self.where(at))

    def end(self) -> None:
        """At the end of the stream: a record cut short is an error."""
        if self.pending or self.skip:
            raise self.scan.c.error("last record truncated", self.offset)


class _Inflater:
    """perf's compressed records, inflated in chunks of _READ_CHUNK bytes through
    one zstd stream (perf keeps one ZSTD_DStream a session, tools/perf/util/zstd.c:
    a frame may span records), each record refused once its output passes
    DECOMPRESSED_LIMIT, and stopped as soon as the scan is done."""

    def __init__(self, scan: _Scan, offset: int) -> None:
        import zstandard  # only recordings made with -z need it

        self.zstd = zstandard
        self.scan = scan
        self.records = _Records(scan, offset, inner=True)
        self.stream: zstandard.ZstdDecompressionWriter = zstandard.ZstdDecompressor().stream_writer(
            cast("IO[bytes]", self), write_size=_READ_CHUNK
        )
        self.out = 0
        self.budget = InflateBudget(scan.path)

    def write(self, data: bytes) -> int:
        """Called by zstandard with each inflated chunk."""
        self.out += len(data)
        self.budget.inflated(len(data), self.records.fixed)
        if self.out > DECOMPRESSED_LIMIT:
            raise PerfDataTooLarge(
                self.scan.path,
                "bytes inflated from one compressed record",
                DECOMPRESSED_LIMIT,
                self.records.fixed,
            )
        self.records.feed(data)
        if self.scan.done:
            raise _Stop
        return len(data)

    def inflate(self, payload: bytes, offset: int) -> None:
        self.out = 0
        self.records.fixed = offset
        self.budget.compressed(len(payload))
        try:
            self.stream.write(payload)
        except _Stop:
            pass
        except self.zstd.ZstdError as e:
            raise self.scan.c.error(f"compressed record: {e}", offset) from e


class _Scan:
    """The walk over the data section's synthesized prefix."""

    def __init__(self, c: _Collector, path: str) -> None:
        self.c = c
        self.path = path
        self.done = False
        self.limit: str | None = None  # the bound that ended the scan, if one did
        self.scanned = 0
        self.count = 0
        self.inflater: _Inflater | None = None

    def record(self, rtype: int, misc: int, rec: bytes, offset: int) -> int:
        """Take one record; returns how many bytes of data follow it outside any record."""
        c = self.c
        if rtype in (RecordType.FINISHED_INIT, RecordType.SAMPLE, RecordType.AUXTRACE):
            self.done = True  # AUXTRACE: trace data from the mmaps, after synthesis
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
        elif rtype == RecordType.HEADER_TRACING_DATA:
            # pipe mode: the tracing data follows the record (its size, 8-aligned:
            # perf_event__synthesize_tracing_data in tools/perf/util/synthetic-events.c)
            if len(rec) < 16:
                raise c.error("HEADER_TRACING_DATA record truncated", offset)
            return int(struct.unpack_from(c.e + "I", rec, 8)[0])
        elif rtype in (RecordType.COMPRESSED, RecordType.COMPRESSED2):
            self.compressed(rtype, rec, offset)
        return 0

    def compressed(self, rtype: int, rec: bytes, offset: int) -> None:
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
        if self.inflater is None:
            self.inflater = _Inflater(self, offset)
        self.inflater.inflate(payload, offset)


def read_perf_header(path: str | os.PathLike[str], *, stdin_taken: bool = False) -> PerfHeader:
    """Read what *path* says about its kernel; :class:`PerfDataError` if it is
    not a perf.data file or is damaged.  ``-`` reads standard input, which
    *stdin_taken* (symbolize reads perf script output there) refuses."""
    inp = open_input(os.fspath(path))
    try:
        if stdin_taken and is_stdin(inp):
            raise InvalidArgument(
                "--for", "symbolize reads perf script output on stdin: give the perf.data as a file"
            )
        return _read(inp)
    finally:
        inp.close()


def _read(inp: Input) -> PerfHeader:
    p = inp.path
    head = inp.exact(0, _PIPE_HEADER_SIZE, "file header")
    if head[:8] == _MAGIC:
        endian = "<"
    elif head[:8] == _MAGIC[::-1]:
        endian = ">"
    elif head[:8] == b"PERFFILE":
        raise PerfDataError(p, "a version 1 perf.data (PERFFILE): too old to read")
    else:
        raise PerfDataError(p, "not a perf.data file (no PERFILE2 magic)")
    c = _Collector(p, endian)
    scan = _Scan(c, p)
    (hsize,) = struct.unpack_from(endian + "Q", head, 8)
    if hsize == _PIPE_HEADER_SIZE:
        _scan_data(inp, scan, _PIPE_HEADER_SIZE, None)
        return c.header(p, True, inp.bytes_read, inp.size, scan.limit)
    if hsize != _FILE_HEADER_SIZE:
        raise PerfDataError(p, f"header size {hsize}, not {_FILE_HEADER_SIZE}")
    if inp.pipe:
        raise PerfDataError(
            p,
            "a perf.data written to a file cannot be read from a pipe (its sections are "
            "read at their offsets): give the file itself, or record with perf record -o -",
        )
    rest = inp.exact(_PIPE_HEADER_SIZE, _FILE_HEADER_SIZE - _PIPE_HEADER_SIZE, "file header")
    (attr_size, a_off, a_size, d_off, d_size, _t_off, _t_size) = struct.unpack_from(
        endian + "7Q", rest, 0
    )
    flags = struct.unpack_from(endian + "4Q", rest, 56)
    limit = inp.size or 0
    for what, off, n in (("attrs", a_off, a_size), ("data", d_off, d_size)):
        if off > limit or n > limit - off:
            raise PerfDataError(p, f"{what} section [{off}, +{n}) lies past the end")
    _read_attrs(inp, c, attr_size, a_off, a_size)
    _read_features(inp, c, flags, d_off + d_size, limit)
    _scan_data(inp, scan, d_off, d_off + d_size)
    return c.header(p, False, inp.bytes_read, inp.size, scan.limit)


def _scan_data(inp: Input, scan: _Scan, start: int, end: int | None) -> None:
    """The records from *start* to *end* (None: the end of the input), read in
    chunks so a stop early costs little."""
    records = _Records(scan, start, inner=False)
    pos = start
    while not scan.done:
        n = _READ_CHUNK if end is None else min(_READ_CHUNK, end - pos)
        chunk = inp.read(pos, n) if n > 0 else b""
        if not chunk:
            records.end()
            return
        pos += len(chunk)
        records.feed(chunk)


def _read_attrs(inp: Input, c: _Collector, attr_size: int, off: int, size: int) -> None:
    """The attrs section: a ``struct perf_file_attr`` per event, the header's
    attr_size bytes each (a perf_event_attr, then its ids section: 16 bytes;
    ``sizeof(f_attr)`` in perf_session__write_header, tools/perf/util/header.c)."""
    if not size:
        return
    if attr_size not in ATTR_SIZES:
        raise PerfDataError(
            c.path, f"attr size {attr_size}, not {ATTR_SIZES.start} to {ATTR_SIZES.stop - 1}"
        )
    if size > ATTRS_LIMIT:
        raise PerfDataTooLarge(c.path, "bytes in the attrs section", ATTRS_LIMIT, off)
    if size % attr_size:
        raise PerfDataError(
            c.path, f"attrs section of {size} bytes: not whole attrs of {attr_size}", off
        )
    attrs = inp.exact(off, size, "attrs section")
    for i in range(0, size, attr_size):
        c.attr(attrs[i : i + attr_size - 16])


def _read_features(inp: Input, c: _Collector, flags: tuple[int, ...], at: int, limit: int) -> None:
    """The feature sections: a table of (offset, size) after the data section,
    one per set bit in bit order; the sections themselves may lie in any order."""
    bits = [b for b in range(256) if flags[b // 64] >> (b % 64) & 1]
    if not bits:
        return
    table = inp.exact(at, 16 * len(bits), "feature table")
    for i, bit in enumerate(bits):
        off, n = struct.unpack_from(c.e + "QQ", table, 16 * i)
        if bit not in _FEATURES:
            continue
        name = Feature(bit).name
        if off > limit or n > limit - off:
            raise PerfDataError(
                c.path, f"feature {name} section [{off}, +{n}) lies past the end", off
            )
        cap = FEATURE_LIMIT if bit == Feature.BUILD_ID else SMALL_FEATURE_LIMIT
        if n > cap:
            raise PerfDataTooLarge(c.path, f"bytes in feature {name}", cap, off)
        c.feature(bit, inp.exact(off, n, f"feature {name}"), off)
