"""Hostile perf.data given to ``kreldctl export kallsyms --for`` / ``symbolize --for``
each is refused with its named error and exit code, or read within its
bounds, and never costs unbounded memory, a hang or a traceback.

Every run is kreldctl as a child of the test, under RLIMIT_AS of 512 MiB and a
timeout; its peak resident memory and CPU come from ``wait4`` (the kernel's account
of the child), not from the child itself, through tests/support/peak.py so that the
figures are kreldctl's alone and not the high-water mark of this pytest process.
The files are built here (tests/support/perffile.py); the pipe and FIFO cases use real
pipes, FIFOs and, where it records here, the machine's own ``perf record -o -``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from kreld.core.errors import ExitCode
from kreld.core.model import Anchors, BootSnapshot, Timestamp
from kreld.perf import formats as perfrecords
from kreld.perf import input as perfinput
from kreld.perf import reader as perfdata
from kreld.store import Store

from support.faultlib import run_measured
from support.perffile import ROUND, PerfFile, compressed, module_maps, record, zstd_bomb
from support.run import bin_path

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]

AS_LIMIT = 512 << 20  # the child's address space
RSS_BOUND_KIB = 160 << 10  # what a refused or bounded read may take, resident
TIMEOUT = 60.0
# The biggest COMPRESSED record there is (its size is 16 bits): 2 GiB from 64 KiB.
BOMB_BYTES = 16370 << 17


class Run:
    """One kreldctl child: its exit code, output and the kernel's figures for it."""

    def __init__(self, rc: int, out: str, err: str, maxrss_kib: int, cpu_s: float, wall_s: float):
        self.rc, self.out, self.err = rc, out, err
        self.maxrss_kib, self.cpu_s, self.wall_s = maxrss_kib, cpu_s, wall_s

    def __repr__(self) -> str:
        return (
            f"rc={self.rc} maxrss={self.maxrss_kib} KiB cpu={self.cpu_s:.2f}s "
            f"wall={self.wall_s:.2f}s\nstderr: {self.err[-2000:]}"
        )


def run_bounded(*args: str, stdin: int | IO[bytes] | None = None, timeout: float = TIMEOUT) -> Run:
    """kreldctl *args* under RLIMIT_AS, killed at *timeout* (a failure: it hung)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        m = run_measured(
            [bin_path("kreldctl"), *args],
            stdin=subprocess.DEVNULL if stdin is None else stdin,
            stdout=out,
            stderr=err,
            timeout=timeout,
            as_limit=AS_LIMIT,
        )
        if m.timed_out:
            pytest.fail(f"kreldctl {' '.join(args)} still running after {timeout} s")
        out.seek(0)
        err.seek(0)
        return Run(
            m.rc,
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
            m.maxrss_kib,
            m.cpu_s,
            m.wall_s,
        )


def assert_refused(r: Run, code: ExitCode, *words: str) -> None:
    assert r.rc == code, r
    assert "Traceback" not in r.err and "MemoryError" not in r.err, r
    for w in words:
        assert w in r.err, (w, r)
    assert r.maxrss_kib < RSS_BOUND_KIB, r


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """A real, empty kreld store: a recording read whole reaches the boot match."""
    d = tmp_path / "state"
    with Store(d):
        pass
    return d


def export(state: Path, target: str, **kw: object) -> Run:
    return run_bounded("--state-dir", str(state), "export", "kallsyms", "--for", target, **kw)  # type: ignore[arg-type]


F = PerfFile()


# -- compressed records that inflate without end --------------------------------------------


@pytest.mark.parametrize("kind", [81, 83], ids=["COMPRESSED", "COMPRESSED2"])
@pytest.mark.parametrize("pipe", [False, True], ids=["file", "pipe-mode"])
def test_a_66_kb_compressed_record_inflating_to_2_gib_is_too_large_in_bounded_memory(
    tmp_path: Path, state: Path, kind: int, pipe: bool
) -> None:
    """The record inflates to records kreld steps over (2,056 bytes of 0x08 each), so
    only the inflate cap stops it: PerfDataTooLarge, exit 1, checked while inflating."""
    data = F.kernel_map() + compressed(zstd_bomb(BOMB_BYTES), kind)
    path = (F.write_pipe if pipe else F.write)(tmp_path / "bomb.data", data=data)
    assert path.stat().st_size < 70_000
    r = export(state, str(path))
    limit = f"{perfdata.DECOMPRESSED_LIMIT:,}"
    assert_refused(r, ExitCode.ERROR, str(path), f"more than {limit} bytes inflated")


def test_a_bomb_of_zeros_is_refused_at_its_first_inner_record(tmp_path: Path, state: Path) -> None:
    path = F.write(tmp_path / "z.data", data=F.kernel_map() + compressed(zstd_bomb(BOMB_BYTES, 0)))
    assert_refused(export(state, str(path)), ExitCode.ERROR, "record of size 0")


def test_a_bomb_of_tiny_records_ends_at_the_record_limit(tmp_path: Path, state: Path) -> None:
    """32 MiB of 8-byte records from one compressed record: the scan stops at RECORD_LIMIT
    (no error: the recording is then matched, and no boot of an empty store matches)."""
    import zstandard

    z = zstandard.ZstdCompressor(level=1).compressobj()
    body = b"".join(z.compress(ROUND * (1 << 16)) for _ in range(64)) + z.flush()
    path = F.write(tmp_path / "t.data", data=F.kernel_map() + compressed(body))
    r = export(state, str(path))
    assert_refused(r, ExitCode.NO_SUCH_BOOT, "no recorded boot matches", "records limit")


# -- many records, many module maps ---------------------------------------------------------


def test_millions_of_tiny_records_stop_at_the_record_limit(tmp_path: Path, state: Path) -> None:
    """4 million FINISHED_ROUND records after the kernel map (the issue's 13-21 s of
    CPU): the scan ends at RECORD_LIMIT, says so, and the boot match goes on."""
    n = 4 * perfdata.RECORD_LIMIT
    path = F.write(tmp_path / "tiny.data", data=F.kernel_map() + ROUND * n)
    r = export(state, str(path))
    assert_refused(r, ExitCode.NO_SUCH_BOOT, "no recorded boot matches", "records limit")
    assert f"_text at {F.text:#x}" in r.err, r  # what came before the flood was read
    print(f"4M tiny records: {r}")


def test_module_maps_past_the_cap_are_too_large(tmp_path: Path, state: Path) -> None:
    """1.4 million module maps in the issue (17 s, 411 MB): refused at the cap."""
    n = perfrecords.MAX_MODULE_MAPS + 1
    path = F.write(tmp_path / "mods.data", data=F.kernel_map() + module_maps(n))
    r = export(state, str(path))
    assert_refused(r, ExitCode.ERROR, f"more than {perfrecords.MAX_MODULE_MAPS:,} module maps")


def test_module_maps_under_the_cap_warn_in_one_summary_line(tmp_path: Path) -> None:
    """16,000 module maps no recorded load matches: ten named, the rest counted in one
    line, not 16,000 warnings."""
    state = tmp_path / "state"
    text = F.text or 0
    b = BootSnapshot(
        boot_id=str(uuid.uuid4()), release=F.osrelease, version="#1",
        build_id=F.kernel_build_id, anchors=Anchors(text, text, text + 0x1000000), kaslr=None,
        restricted=False, restricted_reason=None, kptr_restrict=0, first_seen=Timestamp.now(),
    )  # fmt: skip
    with Store(state) as store:
        store.boots.record_boot(b)
    n = 16_000
    path = F.write(tmp_path / "mods.data", data=F.kernel_map() + module_maps(n) + ROUND)
    r = export(state, str(path))
    assert r.rc == ExitCode.ERROR, r  # the boot matched; it has no kallsyms recorded
    assert "no kernel symbols recorded" in r.err, r
    lines = [x for x in r.err.splitlines() if "warning" in x]
    assert len(lines) == 11, lines[:20]
    assert f"and {n - 10:,} more module maps with no recorded load" in lines[-1]
    assert len(r.err) < 4096 and "Traceback" not in r.err


# -- pipes, FIFOs, devices, read errors -----------------------------------------------------


def feed(w: int, data: bytes, hold: float = 0.0) -> threading.Thread:
    """Write *data* to fd *w* from a thread, keep it open *hold* s, then close it."""

    def run() -> None:
        with contextlib.suppress(BrokenPipeError), os.fdopen(w, "wb") as f:
            f.write(data)
            f.flush()
            time.sleep(hold)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_pipe_mode_recording_on_a_pipe_is_read_through_dash(tmp_path: Path, state: Path) -> None:
    r_fd, w_fd = os.pipe()
    t = feed(w_fd, F.pipe_bytes())
    with os.fdopen(r_fd, "rb") as rf:
        r = export(state, "-", stdin=rf)
    t.join(5)
    assert_refused(r, ExitCode.NO_SUCH_BOOT, f"_text at {F.text:#x}", "no recorded boot matches -")


def test_a_pipe_mode_recording_through_dev_stdin_is_read(state: Path) -> None:
    r_fd, w_fd = os.pipe()
    t = feed(w_fd, F.pipe_bytes())
    with os.fdopen(r_fd, "rb") as rf:
        r = export(state, "/dev/stdin", stdin=rf)
    t.join(5)
    assert_refused(r, ExitCode.NO_SUCH_BOOT, f"_text at {F.text:#x}")


def test_a_file_mode_recording_on_a_pipe_is_refused_by_name(tmp_path: Path, state: Path) -> None:
    data = F.write(tmp_path / "f.data").read_bytes()
    r_fd, w_fd = os.pipe()
    t = feed(w_fd, data)
    with os.fdopen(r_fd, "rb") as rf:
        r = export(state, "-", stdin=rf)
    t.join(5)
    assert_refused(r, ExitCode.ERROR, "cannot be read from a pipe", "perf record -o -")


def test_a_fifo_nobody_writes_to_is_refused_after_the_idle_timeout(
    tmp_path: Path, state: Path
) -> None:
    """The issue's hang: the open does not wait for a writer, the read waits
    PIPE_IDLE_TIMEOUT (10 s) and is refused."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = export(state, str(fifo), timeout=perfinput.PIPE_IDLE_TIMEOUT + 20)
    assert_refused(r, ExitCode.ERROR, str(fifo), "nothing written to it for 10 s")
    assert r.wall_s >= perfinput.PIPE_IDLE_TIMEOUT - 0.5, r


def test_a_fifo_whose_writer_stalls_after_the_magic_is_refused(tmp_path: Path, state: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    holder = threading.Event()

    def writer() -> None:
        with open(fifo, "wb", buffering=0) as f:  # waits for kreldctl's open
            f.write(F.pipe_bytes()[:40])
            holder.wait(60)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        r = export(state, str(fifo), timeout=perfinput.PIPE_IDLE_TIMEOUT + 20)
    finally:
        holder.set()
    assert_refused(r, ExitCode.ERROR, "nothing written to it for 10 s")


def test_a_fifo_with_a_whole_pipe_mode_recording_is_read(tmp_path: Path, state: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def writer() -> None:
        with contextlib.suppress(BrokenPipeError), open(fifo, "wb") as f:
            f.write(F.pipe_bytes())

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    r = export(state, str(fifo))
    t.join(5)
    assert_refused(r, ExitCode.NO_SUCH_BOOT, f"_text at {F.text:#x}")


def test_real_perf_record_to_a_pipe_is_read_from_dash(tmp_path: Path, state: Path) -> None:
    """``perf record -o - | kreldctl export kallsyms --for -``: this kernel's _text
    read from the pipe; kreldctl stops reading after the synthesized records."""
    perf = shutil.which("perf")
    if perf is None or os.geteuid() != 0:
        pytest.skip("needs perf and root to record system-wide")
    argv = [perf, "record", "-N", "-q", "-e", "cpu-clock", "-a", "-o", "-", "--", "sleep", "1"]
    env = {**os.environ, "HOME": str(tmp_path)}
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert p.stdout is not None
    try:
        r = export(state, "-", stdin=p.stdout)
    finally:
        p.stdout.close()
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGINT)
        p.wait(30)
    if r.rc == ExitCode.ERROR and "truncated (0 of 16" in r.err:
        pytest.skip(f"perf record -o - wrote nothing here: {p.stderr.read()[-300:]!r}")  # type: ignore[union-attr]
    from support.perftool import live_text

    assert_refused(r, ExitCode.NO_SUCH_BOOT, f"_text at {live_text():#x}")


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ("/dev/zero", ("not a regular file or a pipe", "a character device")),
        ("/dev/null", ("not a regular file or a pipe",)),
        ("/proc/self/mem", ("read error: Input/output error",)),  # a read that fails after open
    ],
)
def test_devices_and_read_errors_are_named(
    state: Path, target: str, words: tuple[str, ...]
) -> None:
    assert_refused(export(state, target), ExitCode.ERROR, target, *words)


def test_a_directory_without_a_data_file_is_refused(tmp_path: Path, state: Path) -> None:
    (tmp_path / "dir").mkdir()
    assert_refused(export(state, str(tmp_path / "dir")), ExitCode.ERROR, "perf record --threads")


def test_symbolize_refuses_a_perf_data_on_its_own_stdin(state: Path, tmp_path: Path) -> None:
    """symbolize reads perf script output on stdin: --for - (or /dev/stdin) is a usage error."""
    for target in ("-", "/dev/stdin"):
        r_fd, w_fd = os.pipe()
        t = feed(w_fd, F.pipe_bytes())
        with os.fdopen(r_fd, "rb") as rf:
            r = run_bounded("--state-dir", str(state), "symbolize", "--for", target, stdin=rf)
        t.join(5)
        assert_refused(r, ExitCode.USAGE, "symbolize reads perf script output on stdin")


# -- every other field range-checked --------------------------------------------------------


def _mutations() -> Iterator[tuple[str, int, int, bytes | None]]:
    """(what, offset, 8-byte value, words) of file-mode header fields set absurd."""
    yield "attr size", 16, 1 << 40, b"attr size"
    yield "attrs section size", 32, 1 << 62, b"past the end"
    yield "attrs offset", 24, 1 << 62, b"past the end"
    yield "data offset", 40, 1 << 62, b"past the end"
    yield "data size", 48, 1 << 62, b"past the end"
    yield "header size", 8, 1 << 40, b"header size"


@pytest.mark.parametrize(("what", "at", "value", "words"), list(_mutations()), ids=lambda x: str(x))
def test_absurd_header_fields_are_named_errors(
    tmp_path: Path, state: Path, what: str, at: int, value: int, words: bytes
) -> None:
    raw = bytearray(F.write(tmp_path / "good.data").read_bytes())
    raw[at : at + 8] = value.to_bytes(8, "little")
    (tmp_path / "bad.data").write_bytes(bytes(raw))
    assert_refused(export(state, str(tmp_path / "bad.data")), ExitCode.ERROR, words.decode())


def test_feature_sections_past_their_caps_are_too_large(tmp_path: Path, state: Path) -> None:
    """A HOSTNAME feature of 1 MiB (a real one is under 100 bytes): refused at 64 KiB,
    without reading it; a feature section past the file's end is a PerfDataError."""
    path = F.write(tmp_path / "f.data")
    raw = bytearray(path.read_bytes())
    d_off, d_size = (int.from_bytes(raw[o : o + 8], "little") for o in (40, 48))
    table = d_off + d_size  # bits 2, 3, 4, 21 set: HOSTNAME's entry is the second
    big = bytearray(raw) + bytes(1 << 20)
    big[table + 16 : table + 32] = len(raw).to_bytes(8, "little") + (1 << 20).to_bytes(8, "little")
    path.write_bytes(bytes(big))
    cap = f"{perfdata.SMALL_FEATURE_LIMIT:,}"
    assert_refused(
        export(state, str(path)), ExitCode.ERROR, f"more than {cap} bytes in feature HOSTNAME"
    )
    raw[table + 24 : table + 32] = (1 << 60).to_bytes(8, "little")
    path.write_bytes(bytes(raw))
    assert_refused(export(state, str(path)), ExitCode.ERROR, "feature HOSTNAME", "past the end")


def test_an_attrs_section_over_its_cap_is_too_large(tmp_path: Path, state: Path) -> None:
    n = perfdata.ATTRS_LIMIT // 144 + 1
    attrs = bytes(144) * n
    raw = bytearray(F.write(tmp_path / "a.data").read_bytes())
    raw += attrs
    raw[24:40] = (len(raw) - len(attrs)).to_bytes(8, "little") + len(attrs).to_bytes(8, "little")
    (tmp_path / "a.data").write_bytes(bytes(raw))
    r = export(state, str(tmp_path / "a.data"))
    assert_refused(r, ExitCode.ERROR, "bytes in the attrs section")


def test_pipe_mode_tracing_data_is_stepped_over_and_a_lie_about_its_size_is_bounded(
    tmp_path: Path, state: Path
) -> None:
    """HEADER_TRACING_DATA says how much raw data follows it: stepped over when true;
    a size of 4 GiB on a short file is a truncated file, not a 4 GiB read."""
    tracing = bytes(range(256)) * 64
    ok = record(66, 0, len(tracing).to_bytes(4, "little") + bytes(4)) + tracing
    path = F.write_pipe(tmp_path / "tp.data", data=ok + F.data())
    assert_refused(export(state, str(path)), ExitCode.NO_SUCH_BOOT, f"_text at {F.text:#x}")
    lie = record(66, 0, (0xFFFFFFF8).to_bytes(4, "little") + bytes(4)) + tracing
    path = F.write_pipe(tmp_path / "lie.data", data=lie + F.data())
    assert_refused(export(state, str(path)), ExitCode.ERROR, "last record truncated")


@pytest.mark.parametrize("pipe", [False, True], ids=["feature", "pipe-mode-records"])
def test_build_ids_past_the_cap_are_too_large(tmp_path: Path, state: Path, pipe: bool) -> None:
    """65,537 build-id entries (the feature of a file, or pipe mode's HEADER_BUILD_ID
    records): refused at MAX_BUILD_IDS, not kept."""
    from support.perffile import build_id_event

    n = perfrecords.MAX_BUILD_IDS + 1
    ids = b"".join(build_id_event(f"/x/{i}", f"{i:040x}", kernel=False) for i in range(n))
    if pipe:
        path = F.write_pipe(tmp_path / "b.data", data=ids + F.data())
    else:
        path = F.write(tmp_path / "b.data")
        raw = path.read_bytes()
        d_off, d_size = (int.from_bytes(raw[o : o + 8], "little") for o in (40, 48))
        table = d_off + d_size  # BUILD_ID (bit 2) is the first entry
        entry = len(raw).to_bytes(8, "little") + len(ids).to_bytes(8, "little")
        path.write_bytes(raw[:table] + entry + raw[table + 16 :] + ids)
    r = export(state, str(path))
    assert_refused(r, ExitCode.ERROR, f"more than {perfrecords.MAX_BUILD_IDS:,} build-id entries")
