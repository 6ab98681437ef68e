"""The perf.data reader, on files the real ``perf record`` of this machine wrote
(a normal recording, ``-k monotonic``, ``-z`` and pipe mode), on files written
byte by byte (tests/support/perffile.py: module maps, MMAP2 build-ids, both compressed
record types), and on damaged files, which give :class:`PerfDataError`.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest

from kreld.core.errors import ExitCode, PerfDataError
from kreld.kernel.info import Root, read_kernel_build_id
from kreld.perf import reader as perfdata
from kreld.perf.reader import read_perf_header

from support.perffile import FINISHED_INIT, PerfFile, record, sample
from support.perftool import live_text
from support.run import kreldctl

# -- real recordings ---------------------------------------------------------------------


class Recordings:
    """perf record runs on this machine, made once for the module."""

    def __init__(self, perf: str, d: Path) -> None:
        self.perf = perf
        self.d = d
        self.env = {**os.environ, "HOME": str(d / "home")}
        (d / "home").mkdir(exist_ok=True)

    def record(self, name: str, *opts: str, pipe: bool = False) -> subprocess.CompletedProcess[str]:
        out = self.d / name
        argv = [self.perf, "record", "-N", "-q", "-e", "cpu-clock", "-a", *opts]
        argv += ["-o", "-" if pipe else str(out), "--", "sleep", "0.2"]
        if not pipe:
            return subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=120)
        with open(out, "wb") as f:
            cp = subprocess.run(argv, stdout=f, stderr=subprocess.PIPE, env=self.env, timeout=120)
        return subprocess.CompletedProcess(argv, cp.returncode, "", cp.stderr.decode())


@pytest.fixture(scope="module")
def rec(tmp_path_factory: pytest.TempPathFactory) -> Recordings:
    """The machine's perf, if it records system-wide here; else skip saying why."""
    perf = shutil.which("perf")
    if perf is None:
        pytest.skip("perf is not installed (Debian package linux-perf)")
    if os.geteuid() != 0:
        pytest.skip("not root: perf record -a needs privilege, kallsyms shows zeros")
    r = Recordings(perf, tmp_path_factory.mktemp("perf"))
    cp = r.record("probe.data")
    if cp.returncode != 0:
        pytest.skip(f"perf record -e cpu-clock -a fails here: {cp.stderr.strip()[-300:]}")
    return r


def live_modules() -> dict[str, int]:
    try:
        text = Path("/proc/modules").read_text()
    except OSError:
        return {}  # a kernel without loadable modules
    return {f[0]: int(f[5], 16) for line in text.splitlines() if len(f := line.split()) >= 6}


def assert_this_machine(h: object, path: Path) -> None:
    from kreld.perf.reader import PerfHeader

    assert isinstance(h, PerfHeader)
    assert h.text == live_text()
    assert h.hostname == socket.gethostname()
    assert h.osrelease == os.uname().release
    assert {m.name: m.start for m in h.modules} == live_modules()
    assert h.bytes_read <= path.stat().st_size


def test_a_normal_recording_names_this_kernel_its_text_and_its_samples(rec: Recordings) -> None:
    """perf record -a: the build-id of [kernel.kallsyms] is /sys/kernel/notes',
    the kernel map's pgoff is /proc/kallsyms' _text, the modules are
    /proc/modules', the sample times lie in the recording's CLOCK_MONOTONIC
    window loosely (no -k: local_clock()), and no clock is claimed."""
    cp = rec.record("normal.data")
    assert cp.returncode == 0, cp.stderr
    h = read_perf_header(rec.d / "normal.data")
    assert_this_machine(h, rec.d / "normal.data")
    assert h.kernel_build_id == read_kernel_build_id(Root(Path("/")))
    assert not h.pipe and not h.compressed
    assert h.clockid is None and h.clock_data is None
    assert h.sample_time is not None and 0 < h.sample_time[0] <= h.sample_time[1]


def test_a_k_monotonic_recording_carries_its_clock_and_the_reference_pair(
    rec: Recordings,
) -> None:
    """perf record -k monotonic: the attrs and CLOCK_DATA say CLOCK_MONOTONIC (1),
    and the reference pair was read while perf ran, on both clocks."""
    mono0, real0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC), time.time_ns()
    cp = rec.record("mono.data", "-k", "monotonic")
    mono1, real1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC), time.time_ns()
    assert cp.returncode == 0, cp.stderr
    h = read_perf_header(rec.d / "mono.data")
    assert_this_machine(h, rec.d / "mono.data")
    assert h.clockid == 1
    assert h.clock_data is not None and h.clock_data.clockid == 1
    assert mono0 <= h.clock_data.clock_ns <= mono1
    assert real0 <= h.clock_data.realtime_ns <= real1
    assert h.sample_time is not None and mono0 <= h.sample_time[0] <= h.sample_time[1] <= mono1


def test_a_compressed_recording_is_read_through_its_zstd_records(rec: Recordings) -> None:
    """perf record -z: the same kernel facts, and the file says it is compressed.
    (perf 6.1 writes its synthesized records plain and compresses the samples,
    which the reader never inflates; compressed records in the synthesized
    prefix are covered by the written files below.)"""
    cp = rec.record("z.data", "-z")
    if cp.returncode != 0 and "zstd" in cp.stderr.lower():
        pytest.skip(f"this perf was built without zstd: {cp.stderr.strip()[-200:]}")
    assert cp.returncode == 0, cp.stderr
    h = read_perf_header(rec.d / "z.data")
    assert_this_machine(h, rec.d / "z.data")
    assert h.compressed


def test_a_threads_recording_directory_is_read_from_its_data_file(rec: Recordings) -> None:
    """perf record --threads writes a directory; its "data" file holds the header."""
    cp = rec.record("threads.data", "--threads")
    if cp.returncode != 0 and "threads" in cp.stderr:
        pytest.skip(f"this perf has no --threads: {cp.stderr.strip()[-200:]}")
    assert cp.returncode == 0, cp.stderr
    assert (rec.d / "threads.data").is_dir()
    h = read_perf_header(rec.d / "threads.data")
    assert_this_machine(h, rec.d / "threads.data" / "data")


def test_a_pipe_mode_recording_is_read_from_its_feature_records(rec: Recordings) -> None:
    """perf record -o - > file: no file header sections; hostname and release
    come from HEADER_FEATURE records, _text from the kernel map."""
    cp = rec.record("pipe.data", pipe=True)
    assert cp.returncode == 0, cp.stderr
    h = read_perf_header(rec.d / "pipe.data")
    assert_this_machine(h, rec.d / "pipe.data")
    assert h.pipe


def test_export_for_a_real_recording_finds_this_boot_with_no_boot_option(
    rec: Recordings, tmp_path: Path
) -> None:
    """kreldctl snapshot, then export kallsyms --for the recording: its boot is
    this one, and the kernel lines equal /proc/kallsyms'."""
    cp = rec.record("export.data")
    assert cp.returncode == 0, cp.stderr
    state = str(tmp_path / "state")
    kreldctl("--state-dir", state, "snapshot")
    out = kreldctl("--state-dir", state, "export", "kallsyms", "--for", str(rec.d / "export.data"))
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert f"boot {boot}" in out.stderr
    live = [ln for ln in Path("/proc/kallsyms").read_text().splitlines() if "\t" not in ln]
    assert [ln for ln in out.stdout.splitlines() if "\t" not in ln] == live


# -- files written here ------------------------------------------------------------------

MODS = [("brd", 0xFFFFFFFFC0400000, 0x5000), ("nf_tables", 0xFFFFFFFFC0600000, 0x9000)]


def test_module_maps_are_named_as_the_kernel_names_modules(tmp_path: Path) -> None:
    """A map of /lib/.../nf-tables.ko.xz is module nf_tables, at its start and size;
    the trampoline map of x86 and the user-space maps are no modules."""
    h = read_perf_header(PerfFile(modules=MODS).write(tmp_path / "p.data"))
    assert [(m.name, m.start, m.length) for m in h.modules] == MODS


def test_mmap2_records_with_build_ids_give_kernel_and_module_build_ids(tmp_path: Path) -> None:
    """perf >= 6.17 writes MMAP2 with PERF_RECORD_MISC_MMAP_BUILD_ID: the kernel's
    build-id comes from its map even without a build-id table."""
    f = PerfFile(modules=MODS, module_build_ids={"brd": "12" * 20}, mmap2=True)
    f.kernel_build_id = "34" * 20
    path = f.write(tmp_path / "p.data")
    h = read_perf_header(path)
    assert h.kernel_build_id == "34" * 20 and h.text == f.text
    assert h.modules[0].build_id == "12" * 20 and h.modules[1].build_id is None
    assert h.module_build_id("brd") == "12" * 20


def test_a_kernel_map_relative_to_stext_says_so(tmp_path: Path) -> None:
    """Where the kernel has no _text perf names its map [kernel.kallsyms]_stext."""
    from support.perffile import mmap

    f = PerfFile()
    raw = f.write(tmp_path / "p.data").read_bytes()
    text = mmap("[kernel.kallsyms]_text", f.text or 0, 0x1269A88, f.text or 0)
    stext = mmap("[kernel.kallsyms]_stext", f.text or 0, 0x1269A88, f.text or 0)
    assert len(text) == len(stext)
    (tmp_path / "s.data").write_bytes(raw.replace(text, stext))
    h = read_perf_header(tmp_path / "s.data")
    assert (h.ref_symbol, h.text) == ("_stext", f.text)
    assert read_perf_header(tmp_path / "p.data").ref_symbol == "_text"


def test_features_are_found_by_the_table_whatever_order_their_sections_lie_in(
    tmp_path: Path,
) -> None:
    """perffile writes feature sections in reverse bit order."""
    f = PerfFile(hostname="h1", osrelease="6.9.9-x", clock=(7, 10**18, 42), sample_time=(3, 9))
    h = read_perf_header(f.write(tmp_path / "p.data"))
    assert (h.hostname, h.osrelease, h.sample_time) == ("h1", "6.9.9-x", (3, 9))
    assert h.clockid == 7 and h.clock_data is not None
    assert (h.clock_data.realtime_ns, h.clock_data.clock_ns) == (10**18, 42)


def test_compressed_records_of_both_kinds_are_read_across_a_split_record(tmp_path: Path) -> None:
    """PERF_RECORD_COMPRESSED then COMPRESSED2, a record split between them."""
    f = PerfFile(modules=MODS, compress=True)
    h = read_perf_header(f.write(tmp_path / "p.data"))
    assert h.compressed and h.text == f.text
    assert [(m.name, m.start, m.length) for m in h.modules] == MODS


def test_pipe_mode_written_here_is_read(tmp_path: Path) -> None:
    f = PerfFile(modules=MODS, clock=(1, 10**18, 5))
    h = read_perf_header(f.write_pipe(tmp_path / "p.data"))
    assert h.pipe and h.text == f.text and h.clockid == 1 and h.hostname == "testhost"
    assert [m.name for m in h.modules] == ["brd", "nf_tables"]


def test_the_scan_stops_at_finished_init_however_large_the_file(tmp_path: Path) -> None:
    """50 MB of samples after FINISHED_INIT, then garbage: a few KiB are read."""
    samples = b"".join(sample(0xFFFFFFFF81000000 + i, i) for i in range(1000))
    path = PerfFile(modules=MODS).write(tmp_path / "big.data", tail=samples * 1400 + b"\0" * 64)
    size = path.stat().st_size
    assert size > 50 << 20
    h = read_perf_header(path)
    assert h.text is not None and len(h.modules) == 2
    assert h.bytes_read < 256 << 10, f"read {h.bytes_read} of {size} bytes"


def test_without_finished_init_the_scan_stops_after_the_kernel_maps(tmp_path: Path) -> None:
    """perf < 5.19 wrote no FINISHED_INIT: the first user-space record after the
    kernel's maps ends the scan (what follows is not read: here, garbage)."""
    f = PerfFile(modules=MODS)
    data = f.data()
    cut = data.index(FINISHED_INIT)
    path = f.write(tmp_path / "old.data")
    raw = path.read_bytes().replace(data[cut:], b"\xff" * len(data[cut:]), 1)
    path.write_bytes(raw)
    h = read_perf_header(path)
    assert [m.name for m in h.modules] == ["brd", "nf_tables"]


# -- damaged files -------------------------------------------------------------------------


def damaged(tmp_path: Path, raw: bytes) -> PerfDataError:
    path = tmp_path / "bad.data"
    path.write_bytes(raw)
    with pytest.raises(PerfDataError) as e:
        read_perf_header(path)
    assert str(path) in str(e.value)
    return e.value


def good(tmp_path: Path, **kw: object) -> bytes:
    return PerfFile(modules=MODS, **kw).write(tmp_path / "good.data").read_bytes()  # type: ignore[arg-type]


def test_not_a_perf_data_file_is_refused_by_its_magic(tmp_path: Path) -> None:
    assert "no PERFILE2 magic" in str(damaged(tmp_path, b"\x7fELF" + b"\0" * 200))
    assert "too old" in str(damaged(tmp_path, b"PERFFILE" + b"\0" * 200))
    assert "truncated" in str(damaged(tmp_path, b"PERFILE2"))


def test_a_truncated_file_is_refused_wherever_it_is_cut(tmp_path: Path) -> None:
    """Every cut inside the header, the data section or the feature table is
    refused with the named error (never a struct.error or an IndexError)."""
    raw = good(tmp_path)
    data_end = raw.index(FINISHED_INIT)
    for cut in [*range(0, 120, 7), *range(120, data_end, 13)]:
        damaged(tmp_path, raw[:cut])


def test_absurd_sizes_are_refused(tmp_path: Path) -> None:
    raw = bytearray(good(tmp_path))
    big = bytearray(raw)
    struct.pack_into("<Q", big, 8, 1 << 40)  # header size
    assert "header size" in str(damaged(tmp_path, bytes(big)))
    big = bytearray(raw)
    struct.pack_into("<Q", big, 48, 1 << 62)  # data section size
    assert "past the end" in str(damaged(tmp_path, bytes(big)))
    zero = bytearray(raw)
    first = struct.unpack_from("<Q", raw, 40)[0]  # data offset: the first record
    struct.pack_into("<H", zero, first + 6, 0)  # a record of size 0
    assert "size 0" in str(damaged(tmp_path, bytes(zero)))
    # a feature section past the end of the file
    table = struct.unpack_from("<QQ", raw, 40)  # data offset and size
    feat = bytearray(raw)
    struct.pack_into("<Q", feat, table[0] + table[1] + 8, 1 << 50)
    damaged(tmp_path, bytes(feat))


def test_a_short_mmap_and_bad_compressed_data_are_refused(tmp_path: Path) -> None:
    from support.perffile import mmap

    raw = PerfFile(text=None).write(tmp_path / "s.data").read_bytes()
    tramp = mmap("__entry_SYSCALL_64_trampoline", 0xFFFFFE0000000000, 0x1000, 0)
    # an MMAP record too short for its fields, padded to the same length
    short = record(1, 1, b"\xff" * 16) + record(68, 0, b"\0" * (len(tramp) - 32))
    assert len(short) == len(tramp) and raw.count(tramp) == 1
    assert "MMAP record of 24 bytes" in str(damaged(tmp_path, raw.replace(tramp, short)))
    z = bytearray(good(tmp_path, compress=True))
    d_off = struct.unpack_from("<Q", z, 40)[0]
    z[d_off + 8 : d_off + 16] = b"\x00" * 8  # break the first zstd frame
    assert "compressed" in str(damaged(tmp_path, bytes(z)))


def test_kreldctl_reports_a_bad_perf_data_with_the_file_and_exit_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.data"
    bad.write_bytes(b"not perf data at all")
    state = tmp_path / "state"
    cp = kreldctl("--state-dir", str(state), "export", "kallsyms", "--for", str(bad), check=False)
    assert cp.returncode == ExitCode.ERROR, cp.stderr
    assert str(bad) in cp.stderr and "PERFILE2" in cp.stderr
    assert "Traceback" not in cp.stderr


def test_prefix_limit_bounds_a_file_without_any_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kernel maps only, no samples, no FINISHED_INIT, no user-space records:
    the scan still ends after PREFIX_LIMIT bytes (lowered here to 1 MiB)."""
    limit = 1 << 20
    monkeypatch.setattr(perfdata, "PREFIX_LIMIT", limit)
    f = PerfFile(modules=MODS, samples=0, user_maps=0)
    round_ = record(68, 0, b"")  # FINISHED_ROUND
    path = f.write(tmp_path / "nostop.data", tail=round_ * (4 * limit // 8))
    data = path.read_bytes()
    fi = data.index(FINISHED_INIT, 104)
    path.write_bytes(data[:fi] + round_ + data[fi + 8 :])
    h = read_perf_header(path)
    assert len(h.modules) == 2
    assert h.bytes_read < limit + (1 << 17) < path.stat().st_size


# -- bounds (tests/faults/test_faults_perfdata.py runs each as kreldctl) -----------------


def test_a_compressed_record_is_refused_while_it_inflates_past_the_limit(tmp_path: Path) -> None:
    from kreld.core.errors import PerfDataTooLarge

    from support.perffile import compressed, zstd_bomb

    f = PerfFile()
    bomb = compressed(zstd_bomb(16370 << 17))  # 64 KiB that inflate to 2 GiB
    path = f.write(tmp_path / "bomb.data", data=f.kernel_map() + bomb)
    with pytest.raises(PerfDataTooLarge) as e:
        read_perf_header(path)
    assert e.value.limit == perfdata.DECOMPRESSED_LIMIT and e.value.exit_code == ExitCode.ERROR


def test_the_scan_ends_at_the_record_limit_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from support.perffile import ROUND, module_maps

    monkeypatch.setattr(perfdata, "RECORD_LIMIT", 1000)
    f = PerfFile(modules=MODS)
    path = f.write(tmp_path / "r.data", data=f.kernel_map() + module_maps(2) + ROUND * 5000)
    h = read_perf_header(path)
    assert h.scan_limit == "records" and h.text == f.text and len(h.modules) == 2
    assert read_perf_header(f.write(tmp_path / "ok.data")).scan_limit is None


def test_module_maps_past_the_cap_are_too_large(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kreld.core.errors import PerfDataTooLarge
    from kreld.perf import formats as perfrecords

    from support.perffile import module_maps

    monkeypatch.setattr(perfrecords, "MAX_MODULE_MAPS", 50)
    f = PerfFile()
    ok = f.write(tmp_path / "m.data", data=f.kernel_map() + module_maps(50) + FINISHED_INIT)
    assert len(read_perf_header(ok).modules) == 50
    bad = f.write(tmp_path / "m.data", data=f.kernel_map() + module_maps(51))
    with pytest.raises(PerfDataTooLarge, match="more than 50 module maps"):
        read_perf_header(bad)


def test_a_pipe_mode_recording_is_read_from_a_real_pipe(tmp_path: Path) -> None:
    f = PerfFile(modules=MODS)
    data = f.pipe_bytes()
    r, w = os.pipe()
    os.write(w, data)  # fits in the pipe's buffer
    os.close(w)
    try:
        h = read_perf_header(f"/dev/fd/{r}")
    finally:
        os.close(r)
    assert h.pipe and h.text == f.text and len(h.modules) == 2


def test_pipe_mode_tracing_data_after_its_record_is_stepped_over(tmp_path: Path) -> None:
    """``perf record -e sched:... -o -`` writes its tracing data after a
    HEADER_TRACING_DATA record, outside any record."""
    f = PerfFile(modules=MODS)
    tracing = b"\x00" * 4096  # zeros: read as records, they would be of size 0
    rec = record(66, 0, struct.pack("<II", len(tracing), 0)) + tracing
    h = read_perf_header(f.write_pipe(tmp_path / "tp.data", data=rec + f.data()))
    assert h.text == f.text and len(h.modules) == 2


def test_a_fifo_without_a_writer_and_a_trickling_writer_are_refused_in_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from kreld.perf import input as perfinput

    monkeypatch.setattr(perfinput, "PIPE_IDLE_TIMEOUT", 0.3)
    monkeypatch.setattr(perfinput, "PIPE_DEADLINE", 1.0)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # The message names the idle timeout that ended the wait (no timer of ours).
    with pytest.raises(PerfDataError, match=r"nothing written to it for 0\.3 s"):
        read_perf_header(fifo)
    stop = threading.Event()

    def trickle() -> None:
        with open(fifo, "wb", buffering=0) as w:
            for b in PerfFile().pipe_bytes():
                if stop.is_set():
                    return
                w.write(bytes([b]))
                time.sleep(0.05)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        with pytest.raises(PerfDataError, match="did not arrive within 1 s"):
            read_perf_header(fifo)
    finally:
        stop.set()
    t.join(5)


def test_devices_directories_and_read_errors_are_perf_data_errors(tmp_path: Path) -> None:
    for target, words in (
        ("/dev/zero", "a character device"),
        ("/proc/self/mem", "read error"),
        (str(tmp_path), "perf record --threads"),
    ):
        with pytest.raises(PerfDataError, match=words):
            read_perf_header(target)
