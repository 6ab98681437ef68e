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
records.  Only regular files are read (the records are indexed before anything
is written), little- or big-endian.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from array import array
from collections.abc import Sequence
from typing import IO, cast

import numpy as np

from kreld.core.errors import PerfDataError, PerfDataTooLarge
from kreld.core.record import record
from kreld.core.safeout import Sink
from kreld.perf.reader import ATTR_SIZES, DECOMPRESSED_LIMIT, Feature, RecordType
from kreld.perf.synth import AttrLayout

__all__ = ["Added", "Recording", "write_with"]

_MAGIC = b"PERFILE2"
_FILE_HEADER = 104
_PIPE_HEADER = 16
_SAMPLE = int(RecordType.SAMPLE)
_AUXTRACE = int(RecordType.AUXTRACE)
_TRACING_DATA = int(RecordType.HEADER_TRACING_DATA)
_COMPRESSED = (int(RecordType.COMPRESSED), int(RecordType.COMPRESSED2))
_USER_TYPES = 64  # types from here on are perf's own, untimed
_KERNEL_MAP = b"[kernel.kallsyms]"
_FINISHED_INIT = int(RecordType.FINISHED_INIT)
_INIT_SCAN = 100_000  # records looked at for FINISHED_INIT, as for the kernel map


@record
class Added:
    """A record to add: at *time* on the sample clock, or (``time`` None) among
    perf's synthesized records, right after the kernel map."""

    data: bytes
    time: int | None


def _read_whole(fd: int, size: int, path: str) -> bytearray:
    """The file's *size* bytes, read rather than mapped: a file cut short while it
    is mapped kills its reader with SIGBUS, one cut short while it is read ends in
    :class:`PerfDataError`."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    try:
        while got < size:
            try:
                n = os.preadv(fd, [view[got:]], got)
            except OSError as e:
                raise PerfDataError(path, f"cannot be read: {e.strerror or e}", got) from e
            if n == 0:
                raise PerfDataError(path, f"changed while read: it ends at byte {got} of {size}")
            got += n
    finally:
        view.release()
    return buf


class Recording:
    """One perf.data, indexed: where each record starts and when it happened."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise PerfDataError(path, e.strerror or str(e)) from e
        self.fd = fd
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise PerfDataError(path, "inject reads a regular file (not a pipe or a directory)")
        self.size = st.st_size
        if self.size < _PIPE_HEADER:
            os.close(fd)
            raise PerfDataError(path, "not a perf.data file (too short)")
        self.buf = _read_whole(fd, self.size, path)
        head = self.buf[:8]
        if head not in (_MAGIC, _MAGIC[::-1]):
            self.close()
            raise PerfDataError(path, "not a perf.data file (no PERFILE2 magic)")
        self.e = "<" if head == _MAGIC else ">"
        (hsize,) = struct.unpack_from(self.e + "Q", self.buf, 8)
        self.pipe = hsize == _PIPE_HEADER
        self.layouts: list[AttrLayout] = []
        if self.pipe:
            self.start, self.end = _PIPE_HEADER, self.size
        elif hsize == _FILE_HEADER:
            self._file_header()
        else:
            self.close()
            raise PerfDataError(path, f"header size {hsize}, not {_FILE_HEADER}")
        self._index()

    def close(self) -> None:
        os.close(self.fd)

    def _u(self, fmt: str, off: int) -> tuple[int, ...]:
        return struct.unpack_from(self.e + fmt, self.buf, off)

    def _file_header(self) -> None:
        attr_size, a_off, a_size, d_off, d_size, t_off, t_size = self._u("7Q", 16)
        self.flags = list(self._u("4Q", 72))
        for what, off, n in (("attrs", a_off, a_size), ("data", d_off, d_size)):
            if off > self.size or n > self.size - off:
                raise PerfDataError(self.path, f"{what} section [{off}, +{n}) lies past the end")
        if t_size and t_off >= d_off:
            raise PerfDataError(self.path, "an event-types section after the data: unsupported")
        if a_size and (attr_size not in ATTR_SIZES or a_size % attr_size):
            raise PerfDataError(
                self.path, f"attrs section of {a_size} bytes, attr size {attr_size}"
            )
        for at in range(a_off, a_off + a_size, attr_size):
            attr = bytes(self.buf[at : at + attr_size - 16])
            ids_off, ids_size = self._u("QQ", at + attr_size - 16)
            n = min(ids_size // 8, 1) if ids_off + ids_size <= self.size else 0
            ids = self._u(f"{n}Q", ids_off) if n else ()
            self.layouts.append(AttrLayout.from_attr(attr, ids, self.e))
        self.start, self.end = d_off, d_off + d_size
        bits = [b for b in range(256) if self.flags[b // 64] >> (b % 64) & 1]
        table = self.end
        if table + 16 * len(bits) > self.size:
            raise PerfDataError(self.path, "feature table lies past the end", table)
        self.features: dict[int, tuple[int, int]] = {}
        for i, bit in enumerate(bits):
            off, n = self._u("QQ", table + 16 * i)
            if off > self.size or n > self.size - off:
                raise PerfDataError(self.path, f"feature {bit} section lies past the end", off)
            self.features[bit] = (off, n)

    @property
    def layout(self) -> AttrLayout:
        """The first event's: added records carry its sample_id and id."""
        return self.layouts[0] if self.layouts else AttrLayout(0, False)

    def _index(self) -> None:
        """Record offsets, then each record's time (-1: untimed)."""
        buf, pos, end = self.buf, self.start, self.end
        offs = array("q")  # 8 bytes a record (a list would take some 40)
        append = offs.append
        specials: list[int] = []
        big = self.e == ">"
        while pos + 8 <= end:
            size = (buf[pos + 6] << 8 | buf[pos + 7]) if big else (buf[pos + 6] | buf[pos + 7] << 8)
            if size < 8:
                raise PerfDataError(self.path, f"record of size {size}", pos)
            append(pos)
            rtype = buf[pos + 3] if big else buf[pos]
            pos += size
            if rtype >= _USER_TYPES:
                specials.append(len(offs) - 1)
                pos += self._trailing(rtype, pos - size, size)
        if pos != end:
            raise PerfDataError(self.path, "last record truncated", offs[-1] if offs else pos)
        self.offs = np.frombuffer(offs, dtype=np.int64) if offs else np.zeros(0, np.int64)
        self.ends = np.append(self.offs[1:], end) if offs else self.offs
        if self.pipe:
            self._pipe_attrs(specials)
        self.times = self._times()
        self._specials(specials)

    def _pipe_attrs(self, specials: Sequence[int]) -> None:
        """Pipe mode's attributes: each a HEADER_ATTR record (the attr, then its ids)."""
        for i in specials:
            at = int(self.offs[i])
            rtype, _misc, size = self._u("IHH", at)
            if rtype != RecordType.HEADER_ATTR or size < 8 + 64:
                continue
            (asize,) = self._u("I", at + 12)
            if asize < 64 or 8 + asize > size:
                raise PerfDataError(self.path, f"HEADER_ATTR of attr size {asize}", at)
            nids = (size - 8 - asize) // 8
            ids = self._u(f"{min(nids, 1)}Q", at + 8 + asize) if nids else ()
            self.layouts.append(
                AttrLayout.from_attr(bytes(self.buf[at + 8 : at + 8 + asize]), ids, self.e)
            )

    def _trailing(self, rtype: int, at: int, size: int) -> int:
        """Bytes of data that follow a record outside any record."""
        if rtype == _AUXTRACE and size >= 16:
            return int(self._u("Q", at + 8)[0])
        if rtype == _TRACING_DATA and self.pipe and size >= 12:
            n = int(self._u("I", at + 8)[0])
            return n + (-n % 8)
        return 0

    def _times(self) -> np.ndarray:
        n = len(self.offs)
        times = np.full(n, -1, dtype=np.int64)
        if not n:
            return times
        raw = np.frombuffer(cast("bytes", self.buf), dtype=np.uint8)
        sizes = self.ends - self.offs
        types = raw[self.offs + (3 if self.e == ">" else 0)]
        lay = self.layout
        dt = np.dtype(self.e + "i8")
        spots: list[tuple[np.ndarray, np.ndarray]] = []
        if lay.sample_time_offset is not None:
            sel = np.nonzero((types == _SAMPLE) & (sizes >= lay.sample_time_offset + 8))[0]
            spots.append((sel, self.offs[sel] + lay.sample_time_offset))
        back = lay.time_from_end
        if back is not None:
            kernel = (types < _USER_TYPES) & (types != _SAMPLE) & (sizes >= 8 + back)
            sel = np.nonzero(kernel)[0]
            spots.append((sel, self.offs[sel] + sizes[sel] - back))
        for sel, at in spots:
            if len(sel):
                gathered = raw[at[:, None] + np.arange(8)]
                times[sel] = gathered.view(dt).reshape(-1)
        return times

    def _specials(self, specials: Sequence[int]) -> None:
        """Compressed records take the newest time they hold."""
        inner = _InnerTimes(self)
        for i in specials:
            at, size = int(self.offs[i]), int(self.ends[i] - self.offs[i])
            rtype = self._u("I", at)[0]
            if rtype in _COMPRESSED:
                self.times[i] = inner.newest(rtype, at, size)

    def record_type(self, i: int) -> int:
        return int(self._u("I", int(self.offs[i]))[0])

    def kernel_map_index(self) -> int | None:
        """The index of perf's ``[kernel.kallsyms]`` map, among the first records."""
        for i in range(min(len(self.offs), 100_000)):
            at = int(self.offs[i])
            rtype, misc = self._u("IH", at)
            if rtype in (1, 10) and misc & 7 == 1:
                name = 40 if rtype == 1 else 72
                if self.buf[at + name : at + name + len(_KERNEL_MAP)] == _KERNEL_MAP:
                    return i
            if self.times[i] > 0:
                return None
        return None

    def span(self) -> tuple[int, int] | None:
        """The first and last time of the recording's timed records."""
        timed = self.times[self.times > 0]
        if not len(timed):
            return None
        return int(timed.min()), int(timed.max())


class _InnerTimes:
    """The records inside compressed records, read through one zstd stream (as
    perf keeps one per session: a record may span two compressed ones)."""

    def __init__(self, rec: Recording) -> None:
        self.rec = rec
        self.pending = b""
        self.out: list[bytes] = []
        self.total = 0
        self.stream: object | None = None

    def write(self, data: bytes) -> int:
        self.total += len(data)
        if self.total > DECOMPRESSED_LIMIT:
            raise PerfDataTooLarge(
                self.rec.path, "bytes inflated from one compressed record", DECOMPRESSED_LIMIT
            )
        self.out.append(data)
        return len(data)

    def newest(self, rtype: int, at: int, size: int) -> int:
        import zstandard

        rec, e = self.rec, self.rec.e
        if self.stream is None:
            self.stream = zstandard.ZstdDecompressor().stream_writer(cast("IO[bytes]", self))
        stream = cast("zstandard.ZstdDecompressionWriter", self.stream)
        payload = rec.buf[at + 8 : at + size]
        if rtype == RecordType.COMPRESSED2:
            (n,) = rec._u("Q", at + 8)
            payload = rec.buf[at + 16 : at + 16 + min(n, size - 16)]
        self.out, self.total = [], 0
        try:
            stream.write(payload)
            stream.flush()  # type: ignore[no-untyped-call]
        except zstandard.ZstdError as err:
            raise PerfDataError(rec.path, f"compressed record: {err}", at) from err
        data = self.pending + b"".join(self.out)
        newest, pos = -1, 0
        lay = rec.layout
        while pos + 8 <= len(data):
            t, _misc, n = struct.unpack_from(e + "IHH", data, pos)
            if n < 8:
                raise PerfDataError(rec.path, f"record of size {n} in a compressed record", at)
            if pos + n > len(data):
                break
            newest = max(newest, _time_of(data, pos, t, n, lay, e))
            pos += n
        self.pending = data[pos:]
        return newest


def _time_of(data: bytes, pos: int, rtype: int, size: int, lay: AttrLayout, e: str) -> int:
    if rtype == _SAMPLE:
        off = lay.sample_time_offset
        if off is not None and size >= off + 8:
            return int(struct.unpack_from(e + "q", data, pos + off)[0])
    elif rtype < _USER_TYPES and lay.time_from_end is not None and size >= 8 + lay.time_from_end:
        return int(struct.unpack_from(e + "q", data, pos + size - lay.time_from_end)[0])
    return -1


def write_with(
    rec: Recording, out: Sink, added: Sequence[Added], build_ids: Sequence[bytes]
) -> int:
    """*rec* to *out* with *added* records and *build_ids* entries; returns the
    bytes written."""
    early = b"".join(a.data for a in added if a.time is None)
    timed = sorted((a for a in added if a.time is not None), key=lambda a: cast("int", a.time))
    where = _placement(rec, [cast("int", a.time) for a in timed])
    k = rec.kernel_map_index()
    if rec.pipe:
        early = b"".join(build_ids) + early
    at_early = int(rec.ends[k]) if k is not None else _first_timed(rec)
    pieces: list[tuple[int, bytes]] = [(at_early, early)] if early else []
    pieces += [(w, a.data) for w, a in zip(where, timed, strict=True)]
    pieces.sort(key=lambda p: p[0])  # stable: early records before timed ones at one place
    grown = sum(len(b) for _, b in pieces)
    w = _Writer(rec.fd, out)
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
        w.data(_features(rec, rec.end + grown, build_ids))
    return w.written


def _first_timed(rec: Recording) -> int:
    """Where synthesized records go in a recording with no kernel map: before
    perf's FINISHED_INIT (the end of its synthesis, which readers of the
    synthesized prefix stop at) or else before the first timed record."""
    timed = np.nonzero(rec.times > 0)[0]
    first = int(timed[0]) if len(timed) else len(rec.offs)
    for i in range(min(first, _INIT_SCAN)):
        if rec.record_type(i) == _FINISHED_INIT:
            return int(rec.offs[i])
    return int(rec.offs[first]) if first < len(rec.offs) else rec.end


def _placement(rec: Recording, times: Sequence[int]) -> list[int]:
    """For each time, the offset of the first record as new or newer (end: none)."""
    if not len(rec.offs):
        return [rec.end] * len(times)
    newest = np.maximum.accumulate(rec.times)
    idx = np.searchsorted(newest, np.array(times, dtype=np.int64), side="left")
    starts = np.append(rec.offs, rec.end)
    return [int(starts[i]) for i in idx]


def _file_head(rec: Recording, grown: int, build_ids: Sequence[bytes]) -> bytes:
    head = bytearray(rec.buf[:_FILE_HEADER])
    struct.pack_into(rec.e + "Q", head, 16 + 8 * 4, rec.end - rec.start + grown)
    if build_ids:
        flags = list(rec.flags)
        flags[Feature.BUILD_ID // 64] |= 1 << (Feature.BUILD_ID % 64)
        struct.pack_into(rec.e + "4Q", head, 72, *flags)
    return bytes(head)


def _features(rec: Recording, table_at: int, build_ids: Sequence[bytes]) -> bytes:
    """The feature table and sections, after the data section ending at *table_at*."""
    sections = {bit: bytes(rec.buf[off : off + n]) for bit, (off, n) in rec.features.items()}
    if build_ids:
        sections[Feature.BUILD_ID] = sections.get(Feature.BUILD_ID, b"") + b"".join(build_ids)
    bits = sorted(sections)
    pos = table_at + 16 * len(bits)
    table, body = b"", b""
    for bit in bits:
        table += struct.pack(rec.e + "QQ", pos + len(body), len(sections[bit]))
        body += sections[bit]
    return table + body


class _Writer:
    """Copies ranges of the input (in the kernel where it can) and writes bytes."""

    def __init__(self, src: int, dst: Sink) -> None:
        self.src, self.dst = src, dst
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
                raise PerfDataError("input", f"cannot be read: {e.strerror or e}", off) from e
            if not chunk:
                raise PerfDataError("input", "ended while being copied", off)
            self.data(chunk)
            off, n = off + len(chunk), n - len(chunk)
