"""``kreldctl inject`` reads its input in chunks: what it writes does not depend
on where the chunks fall, nor on whether records are compressed, and an added
record lands before the first record (in file order) as new as it or newer."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import zstandard

from kreld.core.safeout import safe_output
from kreld.perf import rewrite
from kreld.perf.rewrite import Added, Recording, write_with

from support.perffile import FINISHED_INIT, PerfFile, mmap, record, sample

T0 = 5_000_000_000
N = 60_000  # samples: 2.4 MB of records, dozens of 64 KiB chunks


def samples(n: int) -> bytes:
    # Times rise by 10 ns, except that every 1,000th sample is 5 us late (out of order).
    return b"".join(
        sample(0xFFFFFFFF81001000, T0 + 10 * i - (5000 if i % 1000 == 999 else 0)) for i in range(n)
    )


def packed(recs: bytes, pieces: int) -> bytes:
    """*recs* as COMPRESSED2 records through one zstd stream, cut mid-record."""
    z = zstandard.ZstdCompressor(level=1).compressobj()
    step = len(recs) // pieces + 5
    out = b""
    for i in range(0, len(recs), step):
        frame = z.compress(recs[i : i + step]) + z.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
        body = struct.pack("<Q", len(frame)) + frame + b"\0" * (-len(frame) % 8)
        out += record(83, 0, body)
    return out


def added() -> list[Added]:
    early = Added(mmap("[early]", 0xFFFFFFFFC0000000, 0, 0), None)
    times = [T0 - 1, T0 + 10 * 12_345 + 3, T0 + 10 * 41_000, T0 + 10 * N + 99]
    return [early] + [
        Added(mmap(f"[late{i}]", 0xFFFFFFFFC0100000, 0x1000, 0), t) for i, t in enumerate(times)
    ]


def inject_with_chunk(monkeypatch: pytest.MonkeyPatch, src: Path, out: Path, chunk: int) -> bytes:
    monkeypatch.setattr(rewrite, "_CHUNK", chunk)
    rec = Recording(str(src))
    try:
        with safe_output(str(out), 0o600) as sink:
            write_with(rec, sink, added(), [b"\x01" * 8])
    finally:
        rec.close()
    return out.read_bytes()


def where_added(out: bytes) -> list[int]:
    """Offsets of the added records in *out*, relative to the first sample."""
    first = out.index(sample(0xFFFFFFFF81001000, T0))
    return [out.index(a.data) - first for a in added()]


@pytest.mark.parametrize("mode", ["file", "pipe"])
@pytest.mark.parametrize("compress", [False, True], ids=["plain", "compressed2"])
def test_output_is_the_same_whatever_the_chunk_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, compress: bool
) -> None:
    f = PerfFile()
    body = samples(N)
    # No kernel map (its made-up trailer reads as a late time): the added records of
    # no time go before FINISHED_INIT, the others among the samples.
    data = FINISHED_INIT + (packed(body, 300) if compress else body)
    src = (f.write if mode == "file" else f.write_pipe)(tmp_path / "in.data", data=data)
    whole = inject_with_chunk(monkeypatch, src, tmp_path / "whole.data", 1 << 30)
    for chunk in (1 << 16, (1 << 16) + 24, 1 << 20):
        got = inject_with_chunk(monkeypatch, src, tmp_path / f"c{chunk}.data", chunk)
        assert got == whole, chunk
    grown = sum(len(a.data) for a in added())
    assert len(whole) == src.stat().st_size + grown + 8  # the build-id entry
    if not compress:
        at = where_added(whole)
        size = len(sample(0, 0))
        assert at[0] < at[1] < 0
        assert at[2] == size * 12_346  # 12,345's successor is the first newer
        assert at[3] == len(added()[2].data) + size * 41_000
        assert at[4] > size * N  # newer than every sample: at the end
