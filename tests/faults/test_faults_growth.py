"""Work that grows with what an attacker writes, given to ``kreldctl inject``: a
large recording of small records, many COMPRESSED2 records, compressed records
that inflate far past what they weigh.  Each run is kreldctl as a child under
RLIMIT_AS of 1.5 GiB and 10 s (tests/support/peak.py), its peak resident memory
taken from ``wait4``: it ends in an output or a named error with its documented
exit status, never a traceback, within 500 MB whatever the input's size.

The recordings are built here (tests/support/perffile.py) against a fake tree
kreld took a snapshot of (tests/support/inject.py), so inject matches a boot and
writes its output; a refused one writes nothing.
"""

from __future__ import annotations

import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zstandard

from kreld.core.errors import ExitCode
from kreld.perf import reader as perfdata

from support.faketree import FakeTree
from support.faultlib import run_measured
from support.inject import TEXT
from support.perffile import FINISHED_INIT, PerfFile, record, sample, zstd_bomb
from support.run import bin_path, kreldctl

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

TIMEOUT = 10.0
AS_LIMIT = 1536 << 20
MEMORY_CEILING_KIB = 500 << 10
T0 = 5_000_000_000


class World:
    def __init__(self, at: Path) -> None:
        self.at = at
        tree = FakeTree(at / "root", text=TEXT)
        self.opts = ["--root", str(tree.root), "--state-dir", str(at / "state")]
        kreldctl(*self.opts, "snapshot")
        self.f = PerfFile(text=TEXT, kernel_build_id=tree.build_id, osrelease=tree.release)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    # Recordings of hundreds of MB go to pytest's directory on disk (not to a tmpfs,
    # which would hold them in memory), and are removed at once.
    w = World(tmp_path)
    yield w
    for p in tmp_path.glob("*.data"):
        p.unlink()


def inject(w: World, src: Path) -> tuple[int, str, Path]:
    """inject *src* under the fault limits: its exit status, its stderr and the output path."""
    out = w.at / "out.data"
    argv = [bin_path("kreldctl"), "inject", "-i", str(src), "-o", str(out), *w.opts]
    with tempfile.TemporaryFile(dir=w.at) as err:
        m = run_measured(argv, stdout=err, stderr=err, timeout=TIMEOUT, as_limit=AS_LIMIT)
        err.seek(0)
        text = err.read().decode(errors="replace")
    print(
        f"inject of {src.stat().st_size:,} bytes: rc {m.rc}, {m.maxrss_kib} KiB, {m.wall_s:.2f} s"
    )
    assert not m.timed_out, f"inject still running after {TIMEOUT} s"
    assert "Traceback" not in text and "MemoryError" not in text, text
    assert m.maxrss_kib < MEMORY_CEILING_KIB, (m.maxrss_kib, text)
    return m.rc, text, out


def samples(n: int) -> bytes:
    one = sample(0xFFFFFFFF81001000, T0 + 10)
    return one * n


def compressed2(frame: bytes) -> bytes:
    return record(83, 0, struct.pack("<Q", len(frame)) + frame + b"\0" * (-len(frame) % 8))


# -- a large recording of small records ------------------------------------------------------


@pytest.mark.parametrize("mode", ["file", "pipe"])
def test_a_recording_of_120_mb_of_small_records_is_injected_in_bounded_memory(
    world: World, mode: str
) -> None:
    """Three million 40-byte samples: the output is written whole, the input never
    held (inject once read it whole, with some 4.4 times its size in memory)."""
    f = world.f
    data = f.data() + samples((120 << 20) // 40)
    src = (f.write if mode == "file" else f.write_pipe)(world.at / "in.data", data=data)
    rc, err, out = inject(world, src)
    assert rc == 0, err
    assert out.stat().st_size >= src.stat().st_size


# -- compressed records ----------------------------------------------------------------------


def test_twenty_thousand_compressed2_records_are_injected(world: World) -> None:
    """Each COMPRESSED2 record holds a few samples, one zstd stream across them all."""
    f = world.f
    z = zstandard.ZstdCompressor(level=1).compressobj()
    body = b""
    for i in range(20_000):
        recs = b"".join(sample(0xFFFFFFFF81001000, T0 + 4 * i + k) for k in range(4))
        body += compressed2(z.compress(recs) + z.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    src = f.write(world.at / "in.data", data=f.synthesized() + FINISHED_INIT + body)
    rc, err, out = inject(world, src)
    assert rc == 0, err
    assert out.exists()


@pytest.mark.parametrize(
    "inner",
    ["2056-byte records of 0x08", "64-byte FINISHED_ROUND records"],
)
def test_a_thousand_compressed2_records_each_inflating_to_15_mib_are_too_large(
    world: World, inner: str
) -> None:
    """Each record stays under the one-record cap; together they would inflate to
    15 GiB from a file of a few hundred KiB: refused by the whole recording's
    budget (PerfDataTooLarge, exit 1) once the inflation passes it, nothing written."""
    if inner.startswith("2056"):
        frame = zstd_bomb(15 << 20)
    else:
        z = zstandard.ZstdCompressor(level=19)
        # (8-byte ones cost some 4 s of walking the first record's 2 million on an
        # idle machine, up to 9 s on a busy one: too near the limit to check it)
        frame = z.compress(record(68, 0, bytes(56)) * ((15 << 20) // 64))
    f = world.f
    body = compressed2(frame) * 1000
    src = f.write(world.at / "in.data", data=f.synthesized() + FINISHED_INIT + body)
    assert src.stat().st_size < 64 << 20
    rc, err, out = inject(world, src)
    assert rc == ExitCode.ERROR, err
    assert "bytes inflated from" in err and f"{perfdata.DECOMPRESSED_RATIO} times" in err, err
    assert not out.exists()


def test_one_compression_bomb_past_the_record_cap_is_refused(world: World) -> None:
    f = world.f
    body = compressed2(zstd_bomb(1 << 30))
    src = f.write(world.at / "in.data", data=f.synthesized() + FINISHED_INIT + body)
    rc, err, out = inject(world, src)
    assert rc == ExitCode.ERROR, err
    assert f"more than {perfdata.DECOMPRESSED_LIMIT:,} bytes inflated" in err, err
    assert not out.exists()
