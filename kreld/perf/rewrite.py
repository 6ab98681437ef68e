"""A perf.data copied whole with records added: each at its place in time among
the recording's own, the file's header and build-id table adjusted.

perf delivers records in time order (tools/perf/util/ordered-events.c): it
queues each timed record and, at each ``PERF_RECORD_FINISHED_ROUND``, hands on
those no later than the newest time of the round before.  A record of time T
placed just before the first record (in file order) whose time is T or later
is therefore delivered in order, and makes no record "out of order" that was
not already: everything before it is older, and the first record after it is
not.  A compressed record (``perf record -z``) is passed through as it is; its
time is the newest of the records it holds (inflated to read them, each bounded
by :data:`~kreld.perf.reader.DECOMPRESSED_LIMIT`), so an added record goes
before it rather than inside it.

File mode (``PERFILE2``, header of 104 bytes): everything before the data
section is copied as it is, the data section grows by what is added, and the
feature sections follow it again, each copied, the build-id table
(``HEADER_BUILD_ID``) extended.  Pipe mode (``perf record -o -``): the stream is
copied with the build-id entries added as ``PERF_RECORD_HEADER_BUILD_ID``
records.  Only regular files are read, little- or big-endian, and never whole:
one pass in chunks finds the times' span, where perf's synthesized records end
and each chunk's newest time; a second finds the place of each added record;
the output is then copied range by range.  Memory does not grow with the file.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from array import array
from collections.abc import Iterator, Sequence
from typing import cast

import numpy as np

from kreld.core.errors import PerfDataError, PerfDataTooLarge
from kreld.core.record import record
from kreld.core.safeout import Sink
from kreld.perf.formats import USER_TYPES
from kreld.perf.inner import InnerTimes, chunk_times
from kreld.perf.reader import ATTR_SIZES, ATTRS_LIMIT, COMPRESSED_TYPES, Feature, RecordType
from kreld.perf.synth import AttrLayout

__all__ = ["Added", "Recording", "write_with"]

_MAGIC = b"PERFILE2"
_FILE_HEADER = 104
_PIPE_HEADER = 16
_AUXTRACE = int(RecordType.AUXTRACE)
_TRACING_DATA = int(RecordType.HEADER_TRACING_DATA)
_KERNEL_MAP = b"[kernel.kallsyms]"
_FINISHED_INIT = int(RecordType.FINISHED_INIT)
_INIT_SCAN = 100_000  # records looked at for FINISHED_INIT, as for the kernel map
_CHUNK = 1 << 20  # the data section is read this much at a time (a record is < 64 KiB)


@record
class Added:
    """A record to add: at *time* on the sample clock, or (``time`` None) among
    perf's synthesized records, right after the kernel map."""

    data: bytes
    time: int | None


class _Chunk:
    """Whole records of one read of the data section: their offsets in *buf* and
    their times (-1: untimed).  Trailing data (AUXTRACE's) is stepped over unread."""

    def __init__(self, base: int, buf: bytes, offs: np.ndarray, times: np.ndarray) -> None:
        self.base = base
        self.buf = buf
        self.offs = offs
        self.times = times


class Recording:
    """One perf.data, read in chunks and never whole: where its sections are, the
    first event's layout, and what a pass over its records found (the span of its
    times, where perf's synthesized records end, each chunk's newest time).

    Its records are walked twice at most (:meth:`placement`), each walk holding one
    chunk of :data:`_CHUNK` bytes and the compressed records' inflation (bounded by
    :class:`~kreld.perf.reader.InflateBudget`), so memory does not grow with the file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise PerfDataError(path, e.strerror or str(e)) from e
        self.fd = fd
        try:
            self._open()
        except BaseException:
            os.close(fd)
            raise

    def _open(self) -> None:
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode):
            raise PerfDataError(
                self.path, "inject reads a regular file (not a pipe or a directory)"
            )
        self.size = st.st_size
        if self.size < _PIPE_HEADER:
            raise PerfDataError(self.path, "not a perf.data file (too short)")
        head = self._pread(0, min(self.size, _FILE_HEADER))
        if head[:8] not in (_MAGIC, _MAGIC[::-1]):
            raise PerfDataError(self.path, "not a perf.data file (no PERFILE2 magic)")
        self.head = head
        self.e = "<" if head[:8] == _MAGIC else ">"
        (hsize,) = struct.unpack_from(self.e + "Q", head, 8)
        self.pipe = hsize == _PIPE_HEADER
        self.layouts: list[AttrLayout] = []
        self.features: dict[int, tuple[int, int]] = {}
        if self.pipe:
            self.start, self.end = _PIPE_HEADER, self.size
        elif hsize == _FILE_HEADER and len(head) == _FILE_HEADER:
            self._file_header()
        else:
            raise PerfDataError(self.path, f"header size {hsize}, not {_FILE_HEADER}")
        self._first_pass()

    def close(self) -> None:
        os.close(self.fd)

    def _pread(self, off: int, n: int) -> bytes:
        """*n* bytes at *off*, read rather than mapped: a file cut short while it is
        mapped kills its reader with SIGBUS, one cut short while read is refused."""
        parts: list[bytes] = []
        got = 0
        while got < n:
            try:
                part = os.pread(self.fd, n - got, off + got)
            except OSError as e:
                raise PerfDataError(self.path, f"cannot be read: {e.strerror or e}", off) from e
            if not part:
                raise PerfDataError(self.path, f"changed while read: it ends at byte {off + got}")
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _file_header(self) -> None:
        e, head = self.e, self.head
        attr_size, a_off, a_size, d_off, d_size, t_off, t_size = struct.unpack_from(
            e + "7Q", head, 16
        )
        self.flags = list(struct.unpack_from(e + "4Q", head, 72))
        for what, off, n in (("attrs", a_off, a_size), ("data", d_off, d_size)):
            if off > self.size or n > self.size - off:
                raise PerfDataError(self.path, f"{what} section [{off}, +{n}) lies past the end")
        if t_size and t_off >= d_off:
            raise PerfDataError(self.path, "an event-types section after the data: unsupported")
        if a_size and (attr_size not in ATTR_SIZES or a_size % attr_size):
            raise PerfDataError(
                self.path, f"attrs section of {a_size} bytes, attr size {attr_size}"
            )
        if a_size > ATTRS_LIMIT:
            raise PerfDataTooLarge(self.path, "bytes in the attrs section", ATTRS_LIMIT, a_off)
        attrs = self._pread(a_off, a_size) if a_size else b""
        for at in range(0, a_size, attr_size):
            attr = attrs[at : at + attr_size - 16]
            ids_off, ids_size = struct.unpack_from(e + "QQ", attrs, at + attr_size - 16)
            n = min(ids_size // 8, 1) if ids_off + ids_size <= self.size else 0
            ids = struct.unpack_from(f"{e}{n}Q", self._pread(ids_off, 8 * n)) if n else ()
            self.layouts.append(AttrLayout.from_attr(attr, ids, e))
        self.start, self.end = d_off, d_off + d_size
        bits = [b for b in range(256) if self.flags[b // 64] >> (b % 64) & 1]
        table = self.end
        if table + 16 * len(bits) > self.size:
            raise PerfDataError(self.path, "feature table lies past the end", table)
        raw = self._pread(table, 16 * len(bits))
        for i, bit in enumerate(bits):
            off, n = struct.unpack_from(e + "QQ", raw, 16 * i)
            if off > self.size or n > self.size - off:
                raise PerfDataError(self.path, f"feature {bit} section lies past the end", off)
            self.features[bit] = (off, n)

    @property
    def layout(self) -> AttrLayout:
        """The first event's: added records carry its sample_id and id."""
        return self.layouts[0] if self.layouts else AttrLayout(0, False)

    # -- walking the records ---------------------------------------------------------------

    def _chunks(self, inner: InnerTimes) -> Iterator[_Chunk]:
        """Every chunk of records in file order; *inner* inflates compressed records."""
        pos = self.start
        while pos < self.end:
            chunk, pos = self._chunk_at(pos, inner)
            yield chunk
        if pos != self.end:
            raise PerfDataError(self.path, "last record truncated", self.end)

    def _chunk_at(self, pos: int, inner: InnerTimes) -> tuple[_Chunk, int]:
        """The records that lie whole in the chunk read at *pos*, and where the next
        chunk begins (a record is at most 64 KiB: every chunk holds one)."""
        n = min(_CHUNK, self.end - pos)
        buf = self._pread(pos, n)
        offs = array("q")  # 8 bytes a record (a list would take some 40)
        specials: list[int] = []
        big = self.e == ">"
        at = 0
        while at + 8 <= n:
            size = (buf[at + 6] << 8 | buf[at + 7]) if big else (buf[at + 6] | buf[at + 7] << 8)
            if size < 8:
                raise PerfDataError(self.path, f"record of size {size}", pos + at)
            if at + size > n:
                break
            offs.append(at)
            rtype = buf[at + 3] if big else buf[at]
            if rtype >= USER_TYPES:
                specials.append(len(offs) - 1)
                at += self._trailing(rtype, buf, at, size)
            at += size
        if not offs:
            raise PerfDataError(self.path, "last record truncated", pos)
        local = np.frombuffer(offs, dtype=np.int64)
        if self.pipe:
            self._pipe_attrs(buf, local, specials)
        times = chunk_times(buf, local, self.layout, self.e)
        for i in specials:
            o = int(local[i])
            rtype, _misc, size = struct.unpack_from(self.e + "IHH", buf, o)
            if rtype in COMPRESSED_TYPES:
                times[i] = inner.newest(rtype, buf, o, size, pos + o, self.layout)
        return _Chunk(pos, buf, local, times), pos + at

    def _pipe_attrs(self, buf: bytes, offs: np.ndarray, specials: Sequence[int]) -> None:
        """Pipe mode's attributes: each a HEADER_ATTR record (the attr, then its ids)."""
        if self.layouts:
            return  # the first event's is the one used, and the first pass found it
        for i in specials:
            at = int(offs[i])
            rtype, _misc, size = struct.unpack_from(self.e + "IHH", buf, at)
            if rtype != RecordType.HEADER_ATTR or size < 8 + 64:
                continue
            (asize,) = struct.unpack_from(self.e + "I", buf, at + 12)
            if asize < 64 or 8 + asize > size:
                raise PerfDataError(self.path, f"HEADER_ATTR of attr size {asize}", at)
            nids = (size - 8 - asize) // 8
            ids = (
                struct.unpack_from(f"{self.e}{min(nids, 1)}Q", buf, at + 8 + asize) if nids else ()
            )
            self.layouts.append(AttrLayout.from_attr(buf[at + 8 : at + 8 + asize], ids, self.e))

    def _trailing(self, rtype: int, buf: bytes, at: int, size: int) -> int:
        """Bytes of data that follow a record outside any record."""
        if rtype == _AUXTRACE and size >= 16:
            return int(struct.unpack_from(self.e + "Q", buf, at + 8)[0])
        if rtype == _TRACING_DATA and self.pipe and size >= 12:
            n = int(struct.unpack_from(self.e + "I", buf, at + 8)[0])
            return n + (-n % 8)
        return 0

    # -- what the first pass finds ---------------------------------------------------------

    def _first_pass(self) -> None:
        """The span of the times, each chunk's start and newest time, and where
        perf's synthesized records end (:meth:`_prefix`)."""
        inner = InnerTimes(self.path, self.e)
        self.first = self.last = -1
        self.kmap_end: int | None = None
        self.init_at: int | None = None
        self.timed_at: int | None = None
        self._kmap_done = False
        self.seen = 0
        starts, newest = array("q"), array("q")
        for c in self._chunks(inner):
            starts.append(c.base)
            newest.append(int(c.times.max()))
            positive = c.times[c.times > 0]
            if len(positive):
                lo, hi = int(positive.min()), int(positive.max())
                self.first = lo if self.first < 0 else min(self.first, lo)
                self.last = max(self.last, hi)
            if self.timed_at is None:
                self._prefix(c)
            self.seen += len(c.offs)
        self.compressed = inner.stream is not None
        self.chunk_starts = (
            np.frombuffer(starts, dtype=np.int64) if starts else np.zeros(0, np.int64)
        )
        newest_np = np.frombuffer(newest, dtype=np.int64) if newest else np.zeros(0, np.int64)
        self.chunk_newest = np.maximum.accumulate(newest_np) if len(newest_np) else newest_np

    def _prefix(self, c: _Chunk) -> None:
        """perf's kernel map and FINISHED_INIT among the first :data:`_INIT_SCAN`
        records before the first timed one, and that record's offset."""
        timed = np.flatnonzero(c.times > 0)
        first = int(timed[0]) if len(timed) else None
        # Only the first _INIT_SCAN records are looked at one by one.
        look = min(len(c.offs) if first is None else first + 1, max(0, _INIT_SCAN - self.seen))
        for j in range(look):
            at = int(c.offs[j])
            rtype, misc, size = struct.unpack_from(self.e + "IHH", c.buf, at)
            if not self._kmap_done and rtype in (1, 10) and misc & 7 == 1:
                name = 40 if rtype == 1 else 72
                if c.buf[at + name : at + name + len(_KERNEL_MAP)] == _KERNEL_MAP:
                    self.kmap_end, self._kmap_done = c.base + at + size, True
            if rtype == _FINISHED_INIT and self.init_at is None:
                self.init_at = c.base + at
        if self.seen + len(c.offs) >= _INIT_SCAN:
            self._kmap_done = True
        if first is not None:
            self._kmap_done = True
            self.timed_at = c.base + int(c.offs[first])

    def early_at(self) -> int:
        """Where records of no time go: after perf's kernel map; in a recording with
        none, before perf's FINISHED_INIT (the end of its synthesis, which readers
        of the synthesized prefix stop at) or else before the first timed record."""
        if self.kmap_end is not None:
            return self.kmap_end
        if self.init_at is not None:
            return self.init_at
        return self.timed_at if self.timed_at is not None else self.end

    def span(self) -> tuple[int, int] | None:
        """The first and last time of the recording's timed records."""
        return None if self.last <= 0 else (self.first, self.last)

    def placement(self, times: Sequence[int]) -> list[int]:
        """For each of the sorted *times*, the offset of the first record as new or
        newer than it or every record before it (end: none).  A second walk, over
        only the chunks that hold a place when no record is compressed (else over
        all, replaying the one zstd stream)."""
        out = [self.end] * len(times)
        if not len(times) or not len(self.chunk_starts):
            return out
        want = np.array(times, dtype=np.int64)
        where = np.searchsorted(self.chunk_newest, want, side="left")
        needed = {int(k) for k in where if k < len(self.chunk_starts)}
        if self.compressed:
            chunks: Iterator[tuple[int, _Chunk]] = enumerate(
                self._chunks(InnerTimes(self.path, self.e))
            )
        else:
            chunks = (
                (k, self._chunk_at(int(self.chunk_starts[k]), InnerTimes(self.path, self.e))[0])
                for k in sorted(needed)
            )
        for k, c in chunks:
            if k not in needed:
                continue
            before = int(self.chunk_newest[k - 1]) if k else -(1 << 63)
            newest = np.maximum(np.maximum.accumulate(c.times), before)
            for i in np.nonzero(where == k)[0]:
                j = int(np.searchsorted(newest, want[i], side="left"))
                out[int(i)] = c.base + int(c.offs[j]) if j < len(c.offs) else self.end
            if self.compressed and k >= max(needed):
                break
        return out


def write_with(
    rec: Recording, out: Sink, added: Sequence[Added], build_ids: Sequence[bytes]
) -> int:
    """*rec* to *out* with *added* records and *build_ids* entries; returns the
    bytes written."""
    early = b"".join(a.data for a in added if a.time is None)
    timed = sorted((a for a in added if a.time is not None), key=lambda a: cast("int", a.time))
    where = rec.placement([cast("int", a.time) for a in timed])
    if rec.pipe:
        early = b"".join(build_ids) + early
    pieces: list[tuple[int, bytes]] = [(rec.early_at(), early)] if early else []
    pieces += [(w, a.data) for w, a in zip(where, timed, strict=True)]
    pieces.sort(key=lambda p: p[0])  # stable: early records before timed ones at one place
    grown = sum(len(b) for _, b in pieces)
    w = _Writer(rec.fd, out, rec.path)
    if rec.pipe:
        w.copy(0, rec.start)
    else:
        w.data(_file_head(rec, grown, build_ids))
        w.copy(_FILE_HEADER, rec.start - _FILE_HEADER)
    pos = rec.start
    for at, blob in pieces:
        w.copy(pos, at - pos)
        w.data(blob)
        pos = at
    w.copy(pos, rec.end - pos)
    if not rec.pipe:
        _features(rec, w, rec.end + grown, build_ids)
    return w.written


def _file_head(rec: Recording, grown: int, build_ids: Sequence[bytes]) -> bytes:
    head = bytearray(rec.head)
    struct.pack_into(rec.e + "Q", head, 16 + 8 * 4, rec.end - rec.start + grown)
    if build_ids:
        flags = list(rec.flags)
        flags[Feature.BUILD_ID // 64] |= 1 << (Feature.BUILD_ID % 64)
        struct.pack_into(rec.e + "4Q", head, 72, *flags)
    return bytes(head)


def _features(rec: Recording, w: _Writer, table_at: int, build_ids: Sequence[bytes]) -> None:
    """The feature table and sections after the data section ending at *table_at*,
    each section copied from the input (never held), the build-id table extended."""
    sections = dict(rec.features)
    extra = b"".join(build_ids)
    if build_ids:
        sections.setdefault(Feature.BUILD_ID, (0, 0))
    bits = sorted(sections)
    sizes = [sections[b][1] + (len(extra) if b == Feature.BUILD_ID else 0) for b in bits]
    pos = table_at + 16 * len(bits)
    table = b""
    for n in sizes:
        table += struct.pack(rec.e + "QQ", pos, n)
        pos += n
    w.data(table)
    for bit in bits:
        w.copy(*sections[bit])
        if bit == Feature.BUILD_ID:
            w.data(extra)


class _Writer:
    """Copies ranges of the input (in the kernel where it can) and writes bytes."""

    def __init__(self, src: int, dst: Sink, path: str) -> None:
        self.src, self.dst, self.path = src, dst, path
        self.fast = True

    @property
    def written(self) -> int:
        return self.dst.written

    def data(self, b: bytes) -> None:
        self.dst.write(b)

    def copy(self, off: int, n: int) -> None:
        while n > 0 and self.fast:
            try:
                done = os.copy_file_range(self.src, self.dst.fd, n, off)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG):
                    raise self.dst.failed(e) from e
                done = 0
            if done <= 0:
                self.fast = False
                break
            off, n = off + done, n - done
            self.dst.written += done
        while n > 0:
            try:
                chunk = os.pread(self.src, min(n, 1 << 20), off)
            except OSError as e:
                raise PerfDataError(self.path, f"cannot be read: {e.strerror or e}", off) from e
            if not chunk:
                raise PerfDataError(self.path, "ended while being copied", off)
            self.data(chunk)
            off, n = off + len(chunk), n - len(chunk)
