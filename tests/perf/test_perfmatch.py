"""A perf.data finds its own boot in a real store, and ``perf script`` output is
symbolized at each sample's time.

kreld runs as a real subprocess on a fake machine (test_symbols.Machine) for
three boots of one kernel build; perf.data files say what ``perf record``
would have written on each (tests/support/perffile.py).  ``kreldctl`` runs as a
subprocess on the store.

    A: slide 0, brd at BASE_A
    B: slide 1, mx at BASE_A and brd at BASE_B; while kreld runs, "late" is
       loaded at BASE_C, unloaded, and "late2" loaded at the same base
    C: slide 0 again (a KASLR tie with A), brd at BASE_C
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kreld.core.errors import NoBootForRecording
from kreld.core.model import (
    Anchors,
    BootSnapshot,
    Clock,
    Incarnation,
    ModuleState,
    SeenBy,
    Timestamp,
)
from kreld.perf.match import SampleClock, match_boot
from kreld.perf.reader import ClockData, ModuleMap, PerfHeader

from support.perffile import PerfFile
from support.run import Daemon, bin_path, kreldctl
from support.symbols import BASE_A, BASE_B, BASE_C, BUILD_ID, LINK, RELEASE, SLIDES, Machine
from support.symbols import daemons as daemons
from support.symbols import sock_dir as sock_dir

SIZE = 0x4000  # FakeTree's coresize
OTHER_SLIDE = 0x1E000000


def mono() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


@dataclass
class World:
    m: Machine
    ids: dict[str, str]
    times: dict[str, int]  # CLOCK_MONOTONIC ns of boot B's moments
    d: Path

    def perf(self, name: str, slide: int, mods: list[tuple[str, int]], **kw: object) -> Path:
        f = PerfFile(
            text=LINK + slide,
            kernel_build_id=BUILD_ID,
            osrelease=RELEASE,
            modules=[(n, base, SIZE) for n, base in mods],
            **kw,  # type: ignore[arg-type]
        )
        return f.write(self.d / name)

    def ctl(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        opts = ["--state-dir", str(self.m.state), "--config", str(self.m.config)]
        if stdin is None:
            return kreldctl(*args, *opts, check=check)
        return subprocess.run(
            [bin_path("kreldctl"), *args, *opts], input=stdin, capture_output=True, text=True
        )


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory,
    sock_dir: Path,
    daemons: list[Daemon],
) -> Iterator[World]:
    d = tmp_path_factory.mktemp("perfmatch")
    m = Machine(d / "machine", sock_dir / "perf.sock", daemons)
    ids: dict[str, str] = {}
    times: dict[str, int] = {}

    def run(label: str, during: Callable[[Daemon], None] | None = None) -> None:
        ids[label] = m.tree.boot_id
        k = m.start()
        k.wait_for("kernel_symbols")
        k.wait_for("modules_startup")
        if during is not None:
            during(k)
        assert k.stop() == 0

    m.load("brd", BASE_A)
    run("A")
    m.unload("brd")
    m.new_boot(SLIDES[1])
    m.load("mx", BASE_A)
    m.load("brd", BASE_B)

    def late(k: Daemon) -> None:
        times["start"] = mono()  # perf record starts: brd and mx are loaded
        time.sleep(0.05)
        m.load("late", BASE_C)
        k.wait_for("module_loaded", module="late")
        times["late"] = mono()
        k.wait_for("module_symbols", module="late")
        m.unload("late")
        k.wait_for("module_unloaded", module="late")
        m.load("late2", BASE_C)
        k.wait_for("module_loaded", module="late2")
        times["late2"] = mono()
        k.wait_for("module_symbols", module="late2")

    run("B", late)
    m.unload("late2")
    m.unload("mx")
    m.unload("brd")
    m.new_boot(SLIDES[0])
    m.load("brd", BASE_C)
    run("C")
    yield World(m, ids, times, d)


def module_lines(kallsyms: str, name: str) -> list[str]:
    return [ln for ln in kallsyms.splitlines() if ln.endswith(f"\t[{name}]")]


def test_export_for_picks_the_boot_by_text_and_the_loads_by_base(world: World) -> None:
    """Recorded on boot B: B's kernel, and mx and brd at the bases the recording
    shows; late and late2, which it never mapped, are left out."""
    data = world.perf("b.data", SLIDES[1], [("brd", BASE_B), ("mx", BASE_A)])
    cp = world.ctl("export", "kallsyms", "--for", str(data))
    assert f"boot {world.ids['B']}" in cp.stderr and "2 of 2 module maps" in cp.stderr
    out = cp.stdout
    assert f"{LINK + SLIDES[1]:016x} T _text" in out.splitlines()
    assert f"{BASE_B:016x} t brd_open\t[brd]" in module_lines(out, "brd")
    assert f"{BASE_A:016x} t mx_open\t[mx]" in module_lines(out, "mx")
    assert not module_lines(out, "late") and not module_lines(out, "late2")


def test_a_kaslr_tie_is_broken_by_the_module_bases(world: World) -> None:
    """A and C share _text; brd's base in the recording tells them apart."""
    for label, base in (("A", BASE_A), ("C", BASE_C)):
        data = world.perf(f"tie-{label}.data", SLIDES[0], [("brd", base)])
        cp = world.ctl("export", "kallsyms", "--for", str(data))
        assert f"boot {world.ids[label]}" in cp.stderr
        assert module_lines(cp.stdout, "brd")[0].startswith(f"{base:016x} ")


def test_a_module_kreld_never_saw_at_that_base_is_left_out_with_a_warning(world: World) -> None:
    data = world.perf("odd.data", SLIDES[1], [("brd", BASE_B), ("mx", BASE_C)])
    cp = world.ctl("export", "kallsyms", "--for", str(data))
    assert f"no recorded load of mx at {BASE_C:#x}" in cp.stderr
    assert not module_lines(cp.stdout, "mx") and module_lines(cp.stdout, "brd")


def test_no_matching_text_exits_3_listing_the_boots_of_the_build(world: World) -> None:
    data = world.perf("none.data", OTHER_SLIDE, [])
    cp = world.ctl("export", "kallsyms", "--for", str(data), check=False)
    assert cp.returncode == 3, cp.stderr
    assert f"_text at {LINK + OTHER_SLIDE:#x}" in cp.stderr
    for label in "ABC":
        assert world.ids[label] in cp.stderr
    assert f"_text {LINK + SLIDES[1]:#x}" in cp.stderr


def test_for_with_boot_or_at_is_a_usage_error(world: World) -> None:
    data = world.perf("b.data", SLIDES[1], [])
    for extra in (["--boot", world.ids["A"]], ["--at", "5s"]):
        cp = world.ctl("export", "kallsyms", "--for", str(data), *extra, check=False)
        assert cp.returncode == 2 and "--for" in cp.stderr, cp.stderr


def test_another_kernel_build_exits_3(world: World, tmp_path: Path) -> None:
    f = PerfFile(text=LINK + SLIDES[0], kernel_build_id="77" * 20, osrelease=RELEASE)
    cp = world.ctl("export", "kallsyms", "--for", str(f.write(tmp_path / "x.data")), check=False)
    assert cp.returncode == 3, cp.stderr
    assert "77" * 20 in cp.stderr and world.ids["A"] not in cp.stderr


def script(*samples: tuple[int, int]) -> str:
    """perf script output: each sample a line with its ip, then a call chain."""
    out = []
    for t, ip in samples:
        sec, ns = divmod(t, 1_000_000_000)
        out.append(
            f"              dd   322 [000] {sec:>6}.{ns // 1000:06d}:    1003009 cpu-clock:  "
            f"{ip:x} [unknown] ([unknown])\n"
        )
        out.append(f"\t{ip:16x} [unknown] ([unknown])\n")
        out.append(f"\t{LINK + SLIDES[1] + 0x10480:16x} __schedule+0x0 ([kernel.kallsyms])\n")
        out.append("\t    7f0011223344 [unknown] (/usr/lib/libc.so.6)\n\n")
    return "".join(out)


def test_symbolize_for_names_each_sample_by_the_load_live_at_its_time(world: World) -> None:
    """-k monotonic: BASE_C+0x1c4 is late_ioctl+0x4 while late was loaded and
    50 ms before kreld saw it load (its init runs before the uevent),
    late2_ioctl+0x4 once late2 took its place, and nothing a minute before
    either was loaded; every other line is unchanged."""
    t = world.times
    clock = (1, time.time_ns(), t["start"])
    data = world.perf("late.data", SLIDES[1], [("brd", BASE_B), ("mx", BASE_A)], clock=clock)
    ip = BASE_C + 0x1C4
    minute = 60 * 10**9
    text = script((t["late"], ip), (t["late2"], ip), (t["start"], ip), (t["start"] - minute, ip))
    cp = world.ctl("symbolize", "--for", str(data), stdin=text)
    assert cp.returncode == 0, cp.stderr
    assert "approximate" not in cp.stderr
    got, want = cp.stdout.splitlines(), text.splitlines()
    assert len(got) == len(want)
    named = {i: g for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w}
    assert sorted(named) == [0, 1, 5, 6, 10, 11]
    assert named[0].endswith(f"{ip:x} late_ioctl+0x4 ([late])")
    assert named[1] == f"\t{ip:16x} late_ioctl+0x4 ([late])"
    assert named[6] == f"\t{ip:16x} late2_ioctl+0x4 ([late2])"
    # In late's init: named, and marked possible when kreld's look before the one
    # that found late came before the sample (the load then known as an interval
    # holding it), as Resolve answers it.
    assert named[11] in (f"\t{ip:16x} late_ioctl+0x4 ([late])",
                         f"\t{ip:16x} late_ioctl+0x4 (possible) ([late])")  # fmt: skip
    assert "named 6 of 8 unknown kernel frames" in cp.stderr


def test_symbolize_for_without_a_kreld_clock_says_times_are_approximate(world: World) -> None:
    """No -k: sample times are local_clock(); kreld still names the later load
    nearest in time, and says the times are approximate."""
    t = world.times
    data = world.perf("noclock.data", SLIDES[1], [("brd", BASE_B), ("mx", BASE_A)])
    ip = BASE_C + 0x80
    cp = world.ctl("symbolize", "--for", str(data), stdin=script((t["late2"], ip)))
    assert cp.returncode == 0, cp.stderr
    assert "approximate" in cp.stderr
    assert f"\t{ip:16x} late2_read+0x0 ([late2])" in cp.stdout.splitlines()


# -- the pure matching, on model objects ---------------------------------------------------


def snap(boot_id: str, text: int, booted_at: int, seen_after: int = 60 * 10**9) -> BootSnapshot:
    """A boot that started at realtime *booted_at* and was first seen *seen_after* later."""
    return BootSnapshot(
        boot_id=boot_id,
        release=RELEASE,
        version="#1",
        build_id=BUILD_ID,
        anchors=Anchors(text=text, etext=text + 0x1000000),
        kaslr=None,
        restricted=False,
        restricted_reason=None,
        kptr_restrict=0,
        first_seen=Timestamp(seen_after, seen_after, booted_at + seen_after),
    )


def inc(
    boot_id: str, seq: int, name: str, base: int, loaded: int, unloaded: int | None
) -> Incarnation:
    state = ModuleState(name, None, {".text": base}, SIZE, 0, "live", None, None, base, False, None)
    return Incarnation(
        boot_id, seq, state, Timestamp(loaded, loaded, loaded), SeenBy.UEVENT, False,
        unloaded=None if unloaded is None else Timestamp(unloaded, unloaded, unloaded),
    )  # fmt: skip


def header(**kw: Any) -> PerfHeader:
    base: dict[str, Any] = dict(
        path="p.data", pipe=False, compressed=False, kernel_build_id=BUILD_ID, text=LINK,
        modules=(), build_ids=(), hostname=None, osrelease=RELEASE, sample_time=None,
        clockid=None, clock_data=None, bytes_read=0,
    )  # fmt: skip
    base.update(kw)
    return PerfHeader(**base)


def test_a_tie_without_module_maps_is_broken_by_the_clock_data() -> None:
    """Two boots at one _text, no module maps: CLOCK_DATA's (realtime, monotonic)
    pair puts the recording's boot instant at the second boot's; without clock
    data the newest boot wins."""
    day = 86_400 * 10**9
    older, newer = snap("old", LINK, 1000 * day), snap("new", LINK, 1001 * day)
    boots = [newer, older]
    cd = ClockData(1, 1000 * day + 500 * 10**9, 500 * 10**9)  # 500 s after the older boot
    m = match_boot(header(clockid=1, clock_data=cd), boots, lambda _b: [])
    assert m.boot.boot_id == "old" and m.clock == SampleClock(Clock.MONOTONIC, True, 500 * 10**9)
    assert match_boot(header(), boots, lambda _b: []).boot.boot_id == "new"


def test_a_tie_between_hosts_is_broken_by_the_hostname_before_the_clock_data() -> None:
    """Two boots at one _text on two hosts (a fleet bucket): the one whose host
    is the recording's HOSTNAME wins, even against closer clock data; a source
    that knows no hosts falls back to the clock data, and so does a recording
    without HOSTNAME."""
    day = 86_400 * 10**9
    a, b = snap("on-a", LINK, 1000 * day), snap("on-b", LINK, 1001 * day)
    hosts = {"on-a": "host-a", "on-b": "host-b"}
    cd = ClockData(1, 1000 * day + 500 * 10**9, 500 * 10**9)  # at on-a's boot instant
    h = header(hostname="host-b", clockid=1, clock_data=cd)
    assert match_boot(h, [a, b], lambda _b: [], hosts.get).boot.boot_id == "on-b"
    assert match_boot(h, [a, b], lambda _b: []).boot.boot_id == "on-a"
    plain = header(clockid=1, clock_data=cd)
    assert match_boot(plain, [a, b], lambda _b: [], hosts.get).boot.boot_id == "on-a"


def test_two_loads_at_one_base_are_told_apart_by_the_record_start() -> None:
    """brd loaded, unloaded and loaded again at the same base: the load live
    when recording started (its clock data) is chosen; with no clock, the newest."""
    b = snap("b", LINK, 0)
    loads = [inc("b", 1, "brd", BASE_A, 10, 20), inc("b", 2, "brd", BASE_A, 30, None)]
    brd = ModuleMap("brd", "[brd]", BASE_A, SIZE)
    for start, seq in ((15, 1), (35, 2)):
        h = header(modules=(brd,), clockid=1, clock_data=ClockData(1, 10**18, start))
        (choice,) = match_boot(h, [b], lambda _b: loads).modules
        assert choice.inc is not None and choice.inc.seq == seq
    (choice,) = match_boot(header(modules=(brd,)), [b], lambda _b: loads).modules
    assert choice.inc is not None and choice.inc.seq == 2


def test_a_recording_without_text_is_matched_by_its_boot_instant_alone() -> None:
    """perf at kptr_restrict=2 writes no _text map: the boot of the build whose
    instant the clock data gives (monotonic or boottime, within the slack and
    NTP's slew since) is the recording's; another host's is not; without clock
    data, or with a realtime clock, or nothing near, no boot is guessed."""
    day, s = 86_400 * 10**9, 10**9
    older, newer = snap("old", LINK, 1000 * day), snap("new", LINK + 0x200000, 1001 * day)
    boots = [newer, older]
    at = 3600 * s  # an hour after the older boot, its clock read 1.5 s off
    cd = ClockData(1, 1000 * day + at + 1_500_000_000, at)
    m = match_boot(header(text=None, clockid=1, clock_data=cd), boots, lambda _b: [])
    assert m.boot.boot_id == "old" and m.clock == SampleClock(Clock.MONOTONIC, True, at)
    boottime = ClockData(7, 1001 * day + at, at)
    m = match_boot(header(text=None, clockid=7, clock_data=boottime), boots, lambda _b: [])
    assert m.boot.boot_id == "new"
    hosts = {"old": "host-a", "new": "host-b"}
    h = header(text=None, hostname="host-b", clockid=1, clock_data=cd)
    with pytest.raises(NoBootForRecording, match="no boot of its kernel build began"):
        match_boot(h, boots, lambda _b: [], hosts.get)
    realtime = ClockData(0, 1000 * day, 1000 * day)
    off = ClockData(1, 1000 * day + at + 5 * s, at)  # 2 s + 1.8 s of slew allowed
    for bad, why in (
        (header(text=None), "no clock data"),
        (header(text=None, clockid=0, clock_data=realtime), "no clock data"),
        (header(text=None, clockid=1, clock_data=off), "began within"),
    ):
        with pytest.raises(NoBootForRecording, match=why):
            match_boot(bad, boots, lambda _b: [])
    # A day later, NTP may have slewed 43 s: 10 s off is still that boot.
    late = ClockData(1, 1000 * day + day + 10 * s, day)
    assert (
        match_boot(header(text=None, clockid=1, clock_data=late), boots, lambda _b: []).boot.boot_id
        == "old"
    )
