"""``kreldctl inject`` on perf.data files written here (tests/support/perffile.py), for
what needs no perf: damaged input refused by name with nothing written, the
output's rules, and the layouts of what inject writes (sample_id order, the
module's text range)."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

from kreld.core.model import Clock, Incarnation, ModuleState, SeenBy, Timestamp
from kreld.perf.inject import Unloads, text_range
from kreld.perf.match import SampleClock
from kreld.perf.synth import AttrLayout, SampleType, kernel_mmap, ksymbol

from support.faketree import FakeTree
from support.inject import TEXT
from support.inject import store as store
from support.perffile import PerfFile
from support.run import bin_path, kreldctl


def recording(tree: FakeTree) -> PerfFile:
    return PerfFile(text=TEXT, kernel_build_id=tree.build_id, osrelease=tree.release)


def test_a_recording_with_nothing_to_add_keeps_its_data_section_byte_for_byte(
    store: tuple[list[str], FakeTree], tmp_path: Path
) -> None:
    opts, tree = store
    src = recording(tree).write(tmp_path / "in.data")
    out = tmp_path / "out.data"
    cp = kreldctl("inject", "-i", str(src), "-o", str(out), *opts)
    assert "0 module loads mapped" in cp.stderr
    a, b = src.read_bytes(), out.read_bytes()
    d_off, d_size = struct.unpack_from("<QQ", a, 40)
    assert b[:104] == a[:104] and b[d_off : d_off + d_size] == a[d_off : d_off + d_size]


def test_a_truncated_record_is_refused_by_name_and_nothing_is_written(
    store: tuple[list[str], FakeTree], tmp_path: Path
) -> None:
    opts, tree = store
    f = recording(tree)
    src = f.write(tmp_path / "in.data", data=f.data() + struct.pack("<IHH", 9, 1, 64))
    out = tmp_path / "out.data"
    cp = kreldctl("inject", "-i", str(src), "-o", str(out), *opts, check=False)
    assert cp.returncode == 1, cp.stderr
    assert "last record truncated" in cp.stderr and "Traceback" not in cp.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.data", "root", "state"]


def test_a_record_of_size_zero_is_refused_not_looped_on(
    store: tuple[list[str], FakeTree], tmp_path: Path
) -> None:
    opts, tree = store
    f = recording(tree)
    src = f.write(tmp_path / "in.data", data=f.data() + struct.pack("<IHH", 9, 1, 0) + bytes(8))
    cp = kreldctl("inject", "-i", str(src), "-o", str(tmp_path / "o"), *opts, check=False)
    assert cp.returncode == 1 and "record of size 0" in cp.stderr, cp.stderr


def test_stdin_input_and_a_file_mode_recording_to_stdout_are_usage_errors(
    store: tuple[list[str], FakeTree], tmp_path: Path
) -> None:
    opts, tree = store
    src = recording(tree).write(tmp_path / "in.data")
    cp = kreldctl("inject", "-i", "-", "-o", str(tmp_path / "o"), *opts, check=False)
    assert cp.returncode == 2 and "regular file" in cp.stderr
    cp = kreldctl("inject", "-i", str(src), *opts, check=False)
    assert cp.returncode == 2 and "pipe mode" in cp.stderr
    cp = kreldctl("inject", "-i", str(src), "-o", str(src), *opts, check=False)
    assert cp.returncode == 2 and "never modified" in cp.stderr


def test_a_pipe_mode_recording_streams_to_stdout(
    store: tuple[list[str], FakeTree], tmp_path: Path
) -> None:
    opts, tree = store
    src = recording(tree).write_pipe(tmp_path / "in.data")
    cp = subprocess.run(
        [bin_path("kreldctl"), "inject", "-i", str(src), *opts], capture_output=True
    )
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == src.read_bytes()


def test_sample_id_fields_come_in_perfs_order_each_only_when_asked_for() -> None:
    every = (
        SampleType.TID | SampleType.TIME | SampleType.ID | SampleType.STREAM_ID
        | SampleType.CPU | SampleType.IDENTIFIER | SampleType.IP
    )  # fmt: skip
    lay = AttrLayout(int(every), True, 77)
    assert lay.sample_id(1234, pid=5, tid=6) == struct.pack(
        "<iIQQQIIQ", 5, 6, 1234, 77, 77, 0, 0, 77
    )
    assert lay.id_size == 48 and lay.time_from_end == 8 + 32
    assert lay.sample_time_offset == 8 + 8 + 8 + 8  # after IDENTIFIER, IP, TID
    only_time = AttrLayout(int(SampleType.TIME), True)
    assert only_time.sample_id(9) == struct.pack("<Q", 9)
    assert AttrLayout(int(every), False).sample_id(9) == b""


def test_records_are_8_byte_aligned_and_say_their_size() -> None:
    trailer = struct.pack("<Q", 5)
    for rec in (
        kernel_mmap("[brd]", 0xFFFFFFFFC0000000, 0x2000, trailer),
        ksymbol(0xFFFFFFFFA0000000, 0x100, 1, "bpf_prog_x", trailer, unregister=True),
    ):
        assert len(rec) % 8 == 0 and struct.unpack_from("<H", rec, 6)[0] == len(rec)
        assert rec.endswith(trailer)
    k = ksymbol(0xFFFFFFFFA0000000, 0x100, 1, "bpf_prog_x", b"", unregister=True)
    assert struct.unpack_from("<IHHQIHH", k) == (17, 1, 40, 0xFFFFFFFFA0000000, 0x100, 1, 1)


def test_the_text_range_runs_over_the_code_sections_after_text_and_stops_at_data() -> None:
    base = 0xFFFFFFFFC0400000
    sections = {
        ".text": base,
        ".text.unlikely": base + 0x1000,
        ".exit.text": base + 0x1800,
        ".rodata": base + 0x2000,
        ".data": base + 0x3000,
        ".init.text": base + 0x100000,
    }
    state = ModuleState("brd", None, sections, 0x4000, 0x1000, "live", None, None, base, False, 1)
    ts = Timestamp(1, 1, 1)
    inc = Incarnation("b", 1, state, ts, SeenBy.UEVENT, False)
    assert text_range(inc) == (base, base + 0x2000)


def _load(seq: int, name: str, base: int, loaded: int, **kw: int) -> Incarnation:
    state = ModuleState(name, None, {".text": base, ".data": base + 0x1000}, 0x2000, 0,
                        "live", None, None, base, False, seq)  # fmt: skip
    times = {k: Timestamp(v, v, v) for k, v in kw.items()}
    return Incarnation("b", seq, state, Timestamp(loaded, loaded, loaded), SeenBy.UEVENT, False,
                       **times)  # type: ignore[arg-type]  # fmt: skip


def test_a_load_is_mapped_from_the_look_before_unless_an_earlier_occupant_was_seen_later() -> None:
    """A load's map begins when the module was last seen absent (its code ran no
    earlier), moved later to when an earlier occupant of the same range was seen
    gone if that was later (a sample there may be the old module's), never after
    the load itself; an occupant elsewhere, or seen gone before, changes nothing."""
    clock = SampleClock(Clock.MONOTONIC, True, 0)
    A, B = 0xFFFFFFFFC0100000, 0xFFFFFFFFC0200000
    old = _load(1, "old", A, 100, unloaded_after=400, unloaded=700)
    far = _load(2, "far", B, 100, unloaded_after=500, unloaded=800)
    early = _load(3, "early", A + 0x1800, 100, unloaded_after=150, unloaded=200)
    new = _load(4, "new", A, 1000, loaded_after=600)
    blind = _load(5, "blind", B, 2000)  # found by the start-up scan: no look before
    u = Unloads([old, far, early, new, blind], clock)
    assert u.map_time(new, text_range(new)) == 700  # type: ignore[arg-type]
    assert u.map_time(blind, text_range(blind)) == 2000  # type: ignore[arg-type]
    moved = _load(6, "new", A, 1000, loaded_after=750)
    assert Unloads([old, far, moved], clock).map_time(moved, (A, A + 0x1000)) == 750
