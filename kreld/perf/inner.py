"""The times of a perf.data's records, a chunk at a time: each record's from its
sample_id (vectorized over the chunk), a compressed record's the newest of the
records it holds, read through one zstd stream whose inflation is bounded."""

from __future__ import annotations

import struct
from typing import IO, cast

import numpy as np

from kreld.core.errors import PerfDataError, PerfDataTooLarge
from kreld.perf.formats import USER_TYPES
from kreld.perf.reader import DECOMPRESSED_LIMIT, InflateBudget, RecordType
from kreld.perf.synth import AttrLayout

__all__ = ["InnerTimes", "chunk_times"]

_SAMPLE = int(RecordType.SAMPLE)


def chunk_times(buf: bytes, offs: np.ndarray, lay: AttrLayout, e: str) -> np.ndarray:
    """The time of each record at *offs* in *buf* (-1: untimed; compressed ones are
    :class:`InnerTimes` finds)."""
    times = np.full(len(offs), -1, dtype=np.int64)
    raw = np.frombuffer(buf, dtype=np.uint8)
    big = e == ">"
    lo, hi = raw[offs + 6].astype(np.int64), raw[offs + 7].astype(np.int64)
    sizes = (lo << 8 | hi) if big else (hi << 8 | lo)
    types = raw[offs + (3 if big else 0)]
    dt = np.dtype(e + "i8")
    spots: list[tuple[np.ndarray, np.ndarray]] = []
    if lay.sample_time_offset is not None:
        sel = np.nonzero((types == _SAMPLE) & (sizes >= lay.sample_time_offset + 8))[0]
        spots.append((sel, offs[sel] + lay.sample_time_offset))
    back = lay.time_from_end
    if back is not None:
        kernel = (types < USER_TYPES) & (types != _SAMPLE) & (sizes >= 8 + back)
        sel = np.nonzero(kernel)[0]
        spots.append((sel, offs[sel] + sizes[sel] - back))
    for sel, at in spots:
        if len(sel):
            gathered = raw[at[:, None] + np.arange(8)]
            times[sel] = gathered.view(dt).reshape(-1)
    return times


class InnerTimes:
    """The records inside compressed records, read through one zstd stream (as
    perf keeps one per session: a record may span two compressed ones), every
    byte inflated counted against :class:`~kreld.perf.reader.InflateBudget`."""

    def __init__(self, path: str, e: str) -> None:
        self.path, self.e = path, e
        self.pending = b""
        self.out: list[bytes] = []
        self.total = 0
        self.budget = InflateBudget(path)
        self.at = 0
        self.stream: object | None = None

    def write(self, data: bytes) -> int:
        self.total += len(data)
        if self.total > DECOMPRESSED_LIMIT:
            raise PerfDataTooLarge(
                self.path,
                "bytes inflated from one compressed record",
                DECOMPRESSED_LIMIT,
                self.at,
            )
        self.budget.inflated(len(data), self.at)
        self.out.append(data)
        return len(data)

    def newest(
        self, rtype: int, buf: bytes, at: int, size: int, offset: int, lay: AttrLayout
    ) -> int:
        import zstandard

        e = self.e
        if self.stream is None:
            self.stream = zstandard.ZstdDecompressor().stream_writer(cast("IO[bytes]", self))
        stream = cast("zstandard.ZstdDecompressionWriter", self.stream)
        payload = buf[at + 8 : at + size]
        if rtype == RecordType.COMPRESSED2:
            (n,) = struct.unpack_from(e + "Q", buf, at + 8)
            payload = buf[at + 16 : at + 16 + min(n, size - 16)]
        self.out, self.total, self.at = [], 0, offset
        self.budget.compressed(len(payload))
        try:
            stream.write(payload)
            stream.flush()  # type: ignore[no-untyped-call]
        except zstandard.ZstdError as err:
            raise PerfDataError(self.path, f"compressed record: {err}", offset) from err
        data = self.pending + b"".join(self.out)
        self.out = []
        newest, pos = -1, 0
        while pos + 8 <= len(data):
            t, _misc, n = struct.unpack_from(e + "IHH", data, pos)
            if n < 8:
                raise PerfDataError(self.path, f"record of size {n} in a compressed record", offset)
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
    elif rtype < USER_TYPES and lay.time_from_end is not None and size >= 8 + lay.time_from_end:
        return int(struct.unpack_from(e + "q", data, pos + size - lay.time_from_end)[0])
    return -1
