"""kreld on a real kernel: a Debian cloud kernel with KASLR and loadable
modules, booted under QEMU (software emulation) with virtme-ng.

Two boots share one state dir on a writable host directory:

* boot A (``guest.sh first``): kreld runs as the real daemon on the guest's
  ``/proc`` and ``/sys``, with a ``kreld.client`` subscriber (``Subscribe``,
  tests/vm/guest_subscribe.py) following it, while ``modprobe dummy``, ``modprobe veth``, ``rmmod
  dummy`` and ``modprobe dummy`` happen; once kreld has captured the symbol
  tables the guest copies its ``/proc/kallsyms`` at a moment T; then
  ``kreldctl snapshot`` runs with ``/proc/kcore`` hidden, once with Debian's
  stock ``/boot/System.map`` and once with the real one bind-mounted over it;
* boot B (``guest.sh second``): kreld again, on the same state dir, while
  ``dummy`` is loaded; ``/proc/kallsyms`` at T as in boot A.

The guest script reads the kernel's own answers with cat/grep/od/cp and
writes them as files; the host compares them with what kreld recorded, read
back with ``kreldctl`` on the host (the store is portable: that is its point).

Opt-in: these tests run only when selected with ``-m realkernel`` (each boot
takes 30-120 s of emulation), and skip with the reason where QEMU, vng or
the kernel are missing (``scripts/setup-vm`` installs them).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import lzma
import mmap
import os
import re
import shutil
import struct
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from support import harness
from support.linerefs import eu, instructions, llvm
from support.realkernel import CTL, addr, anchors_of, ctl, host_ctl


@pytest.fixture(scope="module")
def rw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The guest's writable host directory: facts, the state dir, logs.

    KRELD_VM_DIR=DIR keeps it in DIR (left in place for a look afterwards);
    with KRELD_VM_REUSE=1 as well, boots whose facts are complete there are
    not run again (to iterate on the host-side checks without booting).
    """
    keep = os.environ.get("KRELD_VM_DIR")
    if keep:
        d = Path(keep).resolve()
        if not os.environ.get("KRELD_VM_REUSE") and d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True, exist_ok=True)
        yield d
        return
    d = tmp_path_factory.mktemp("vm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def state(rw: Path) -> Path:
    return rw / "state"


pytestmark = [pytest.mark.realkernel, pytest.mark.timeout(900)]

GUEST_SCRIPT = Path(__file__).resolve().parent / "guest.sh"
ANCHORS = ("_text", "_stext", "_etext", "_sinittext", "_einittext")
BOOT_TIMEOUT = 420.0


# -- what the guest read itself -------------------------------------------------------


def gnu_build_id(notes: bytes) -> str | None:
    """The NT_GNU_BUILD_ID of a raw ELF note stream (our own parser, not kreld's)."""
    off = 0
    while off + 12 <= len(notes):
        namesz, descsz, ntype = struct.unpack_from("<III", notes, off)
        name_off = off + 12
        desc_off = name_off + ((namesz + 3) & ~3)
        name = notes[name_off : name_off + namesz].rstrip(b"\0")
        if name == b"GNU" and ntype == 3:
            return notes[desc_off : desc_off + descsz].hex()
        off = desc_off + ((descsz + 3) & ~3)
    return None


def from_od(text: str) -> bytes:
    return bytes(int(b, 16) for b in text.split())


def symbols(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) == 3:
            out.setdefault(f[2], int(f[0], 16))
    return out


def proc_modules(text: str) -> dict[str, tuple[int, int]]:
    """/proc/modules as name -> (base, size)."""
    out = {}
    for line in text.splitlines():
        f = line.split()
        out[f[0]] = (int(f[5], 16), int(f[1]))
    return out


@dataclass
class ModFacts:
    sections: dict[str, int]
    build_id: str | None
    core_base: int
    coresize: int
    initsize: int
    loaded: dict[str, tuple[int, int]]  # all of /proc/modules at that moment


@dataclass
class Facts:
    """One boot, as the guest's own /proc and /sys showed it."""

    dir: Path
    boot_id: str = ""
    release: str = ""
    build_id: str | None = None
    anchors: dict[str, int] = field(default_factory=dict)
    kptr_restrict: int = -1
    modules_at_start: dict[str, tuple[int, int]] = field(default_factory=dict)
    # /proc/modules once kreld said READY=1: its start-up scan lay in between.
    modules_at_ready: dict[str, tuple[int, int]] = field(default_factory=dict)
    times: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def read(cls, d: Path) -> Facts:
        f = cls(d)
        f.boot_id = (d / "boot_id").read_text().strip()
        f.release = (d / "release").read_text().strip()
        f.build_id = gnu_build_id(from_od((d / "kernel_notes.hex").read_text()))
        f.anchors = symbols((d / "anchors").read_text())
        f.kptr_restrict = int((d / "kptr_restrict").read_text())
        f.modules_at_start = proc_modules((d / "modules.start").read_text())
        f.modules_at_ready = proc_modules((d / "modules.ready").read_text())
        for line in (d / "times").read_text().splitlines():
            label, mono, real = line.split()
            f.times[label] = (int(mono), int(real))
        return f

    def mono(self, label: str) -> int:
        return self.times[label][0]

    def module(self, label: str) -> ModFacts:
        d = self.dir / "mod" / label
        sections = {p.name: int(p.read_text().strip(), 16) for p in (d / "sections").iterdir()}
        loaded = proc_modules((d / "proc_modules").read_text())
        return ModFacts(
            sections=sections,
            build_id=gnu_build_id((d / ".note.gnu.build-id").read_bytes()),
            core_base=loaded[label.rstrip("0123456789")][0],
            coresize=int((d / "coresize").read_text()),
            initsize=int((d / "initsize").read_text()),
            loaded=loaded,
        )


def host_module_build_id(release: str, name: str) -> str:
    """``readelf -n`` of the host's .ko (decompressed to a temp file first)."""
    found = sorted(Path(f"/lib/modules/{release}/kernel").rglob(f"{name}.ko*"))
    assert found, f"no {name}.ko* under /lib/modules/{release}/kernel"
    ko = found[0]
    with tempfile.TemporaryDirectory() as tmp:
        if ko.suffix in (".xz", ".zst", ".gz"):
            plain = Path(tmp) / f"{name}.ko"
            raw = ko.read_bytes()
            if ko.suffix == ".xz":
                plain.write_bytes(lzma.decompress(raw))
            elif ko.suffix == ".gz":
                plain.write_bytes(gzip.decompress(raw))
            else:
                plain.write_bytes(
                    subprocess.run(["zstd", "-dc", str(ko)], capture_output=True, check=True).stdout
                )
            ko = plain
        out = subprocess.run(
            ["readelf", "-n", str(ko)], capture_output=True, text=True, check=True
        ).stdout
    m = re.search(r"Build ID: ([0-9a-f]+)", out)
    assert m, f"readelf -n {ko} shows no build-id:\n{out}"
    return m.group(1)


# -- what kreld recorded, read on the host ---------------------------------------------------


@dataclass
class Boot:
    facts: Facts
    run: harness.GuestRun
    show: dict[str, Any]
    modules: list[dict[str, Any]]
    boots: list[dict[str, Any]]

    def incs(self, name: str) -> list[dict[str, Any]]:
        return sorted((i for i in self.modules if i["name"] == name), key=lambda i: i["seq"])


def say(request: pytest.FixtureRequest, line: str) -> None:
    """A line on the terminal now, past output capturing (boot times, figures)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capman is None:
        return
    with capman.global_and_fixture_disabled():
        reporter.ensure_newline()
        reporter.write_line(line)


def boot(
    rw: Path, mode: str, state: Path, request: pytest.FixtureRequest, env: dict[str, str]
) -> Boot:
    out = rw / f"facts-{mode}"
    if os.environ.get("KRELD_VM_REUSE") and (out / "done").exists():
        run = harness.GuestRun(0, "", "", 0.0)
    else:
        shutil.rmtree(out, ignore_errors=True)
        run = harness.run_in_guest(
            f"sh {GUEST_SCRIPT} {mode}",
            rw,
            timeout=BOOT_TIMEOUT,
            env={"OUT": str(out), "STATE": str(state), **env},
            name=mode,
        )
    log = out / "kreld.log"
    tail = log.read_text()[-4000:] if log.exists() else "(no kreld.core.log)"
    assert run.status == 0, (
        f"guest.sh {mode} exited {run.status} after {run.elapsed:.1f}s\n"
        f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}\nkreld.log tail:\n{tail}"
    )
    assert (out / "kreld.rc").read_text().strip() == "0", f"kreld did not exit 0:\n{tail}"
    facts = Facts.read(out)
    mods = ", ".join(
        f"{d.name} .text {m.sections['.text']:#x} ({len(m.sections)} sections)"
        for d in sorted((out / "mod").iterdir())
        for m in [facts.module(d.name)]
    )
    say(
        request,
        f"[realkernel] boot {mode}: {run.elapsed:.1f}s, boot-id {facts.boot_id}, "
        f"_text {facts.anchors['_text']:#x}; {mods}",
    )
    with open(rw / "timings.txt", "a") as f:
        f.write(f"{mode} {run.elapsed:.1f}\n")
    return Boot(
        facts=facts,
        run=run,
        show=ctl(state, "show", facts.boot_id, as_boot=facts.boot_id),
        modules=ctl(state, "modules", "--boot", facts.boot_id, "--all", as_boot=facts.boot_id),
        boots=ctl(state, "boots", as_boot=facts.boot_id),
    )


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _selected(request: pytest.FixtureRequest) -> None:
    harness.skip_unless_selected(request.config.getoption("markexpr"))


@pytest.fixture(scope="module")
def sysmap() -> Path | None:
    kernel = harness.find_kernel()
    assert kernel is not None
    return harness.real_system_map(harness.kernel_release(kernel))


@pytest.fixture(scope="module")
def first(rw: Path, state: Path, sysmap: Path | None, request: pytest.FixtureRequest) -> Boot:
    return boot(rw, "first", state, request, {"SYSMAP": str(sysmap or "")})


@pytest.fixture(scope="module")
def second(first: Boot, rw: Path, state: Path, request: pytest.FixtureRequest) -> Boot:
    return boot(rw, "second", state, request, {"PREV_LOG": str(first.facts.dir / "kreld.log")})


def snapshot(first: Boot, label: str) -> dict[str, Any]:
    d = first.facts.dir
    rc = (d / f"snapshot-{label}.rc").read_text().strip()
    assert rc == "0", (d / f"snapshot-{label}.err").read_text()
    return dict(json.loads((d / f"snapshot-{label}.json").read_text())["boot"])


# -- 1. boot snapshot --------------------------------------------------------------------


def test_boot_record_matches_the_kernel(first: Boot) -> None:
    f, rec = first.facts, first.show
    assert rec["boot_id"] == f.boot_id
    assert rec["release"] == f.release
    assert f.build_id and rec["build_id"] == f.build_id
    assert f.kptr_restrict == 0 and rec["kptr_restrict"] == 0
    assert rec["restricted"] is False
    assert rec["faults"] == []
    assert set(f.anchors) == set(ANCHORS)
    assert anchors_of(rec) == f.anchors
    assert f.boot_id in [b["boot_id"] for b in first.boots]


def test_kaslr_offset_from_vmcoreinfo(first: Boot) -> None:
    """Root in the guest can read /proc/kcore: its KERNELOFFSET wins (the design's order)."""
    rec, text = first.show, first.facts.anchors["_text"]
    assert rec["kaslr_source"] == "vmcoreinfo"
    assert rec["kaslr_path"] == "/proc/kcore"
    # x86-64 links _text at 0xffffffff81000000 and KASLR moves it in 2 MiB steps.
    assert addr(rec["kaslr_offset"]) == text - 0xFFFFFFFF81000000
    assert text % (2 << 20) == 0


def test_kaslr_offset_from_system_map(first: Boot, sysmap: Path | None) -> None:
    if sysmap is None:
        pytest.skip("no real System.map in /var/lib/kreld-vm: run scripts/setup-vm")
    f = first.facts
    link = symbols((f.dir / "system-map-anchors").read_text())
    assert set(link) == set(ANCHORS)
    expected = f.anchors["_text"] - link["_text"]
    # The whole image moves as one: every anchor by the same offset.
    assert {name: f.anchors[name] - link[name] for name in ANCHORS} == dict.fromkeys(
        ANCHORS, expected
    )
    snap = snapshot(first, "system-map")
    assert snap["boot_id"] == f.boot_id
    assert addr(snap["anchors"]["text"]) == f.anchors["_text"]
    assert snap["kaslr_source"] == "system.map"
    assert snap["kaslr_path"] == f"/boot/System.map-{f.release}"
    assert addr(snap["kaslr_offset"]) == expected
    assert addr(first.show["kaslr_offset"]) == expected


def test_stock_debian_system_map_gives_no_offset_but_keeps_text(first: Boot) -> None:
    """Debian ships a one-line placeholder as /boot/System.map-<release>: without
    /proc/kcore, kreld must record _text and no offset, never a wrong one."""
    f = first.facts
    stock = (f.dir / "stock-system-map").read_text()
    if " _text\n" in stock:
        pytest.skip("this /boot/System.map is a real one")
    snap = snapshot(first, "stock-map")
    assert snap["kaslr_offset"] is None and snap["kaslr_source"] is None
    assert anchors_of(snap) == f.anchors


# -- 2. modules ----------------------------------------------------------------------------


def test_modules_present_at_startup_are_recorded(first: Boot) -> None:
    """Every module loaded before kreld started, and none it did not see then (one
    the boot's udev still loaded while kreld started may be either side)."""
    f = first.facts
    startup = {i["name"]: i for i in first.modules if i["seen_by"] == "startup"}
    assert set(f.modules_at_start) <= set(startup) <= set(f.modules_at_ready), sorted(startup)
    for name, (base, size) in f.modules_at_ready.items():
        if name not in startup:
            continue
        assert addr(startup[name]["core_base"]) == base, name
        assert startup[name]["coresize"] == size, name
        assert startup[name]["sections"], name


def seen_first_by_an_event(facts: Facts, by: str | None, action: str, module: str) -> bool:
    """Whether a kernel event saw this load (*action* ``add``) or unload
    (``remove``) first: the module tracepoint (exact, a load's before its init),
    or where none could be opened the uevent; or the poll did, in the moment
    before the kernel sent the uevent (a load's, after the module's init), and
    the uevent came as well."""
    if by in ("tracepoint", "uevent"):
        return True
    return by == "poll" and any(
        r.get("event") == "uevent" and r.get("action") == action and r.get("module") == module
        for r in kreld_log(facts)
    )


def test_every_incarnation_recorded_with_the_kernels_sections(first: Boot) -> None:
    f = first.facts
    dummies, veths = first.incs("dummy"), first.incs("veth")
    assert len(dummies) == 2, dummies
    assert len(veths) == 1, veths
    order = [("dummy1", dummies[0]), ("veth", veths[0]), ("dummy2", dummies[1])]
    assert [i["seq"] for _, i in order] == sorted(i["seq"] for _, i in order)
    for label, inc in order:
        name = inc["name"]
        m = f.module(label)
        assert len(m.sections) >= 10, (label, sorted(m.sections))
        assert {".text", ".data", ".gnu.linkonce.this_module"} <= set(m.sections)
        assert {k: addr(v) for k, v in inc["sections"].items()} == m.sections, label
        assert seen_first_by_an_event(f, inc["seen_by"], "add", name), (label, inc["seen_by"])
        assert inc["boot_id"] == f.boot_id
        assert inc["restricted"] is False and inc["faults"] == [], label
        assert m.build_id and inc["build_id"] == m.build_id, label
        assert inc["build_id"] == host_module_build_id(f.release, name), label
        assert addr(inc["core_base"]) == m.core_base == m.sections[".text"], label
        assert inc["coresize"] == m.coresize and inc["initsize"] == m.initsize, label
        loaded = inc["loaded"]["monotonic"]
        assert f.mono(f"{label}.before") <= loaded <= f.mono(f"{label}.seen"), label
        assert abs(inc["loaded"]["boottime"] - loaded) < 10**9, label
        real_before, real_seen = f.times[f"{label}.before"][1], f.times[f"{label}.seen"][1]
        assert real_before - 10**8 <= inc["loaded"]["realtime"] <= real_seen + 10**8, label


def test_unload_times(first: Boot) -> None:
    f = first.facts
    dummy1, dummy2 = first.incs("dummy")
    (veth,) = first.incs("veth")
    assert dummy1["unloaded"] is not None
    assert seen_first_by_an_event(f, dummy1["unload_seen_by"], "remove", "dummy")
    gone = dummy1["unloaded"]["monotonic"]
    assert f.mono("dummy1.before_rmmod") <= gone <= f.mono("dummy1.unload_seen")
    after = dummy1["unloaded_after"]["monotonic"]
    assert dummy1["loaded"]["monotonic"] <= after <= gone
    # Still loaded when kreld stopped: left open for the next run to continue.
    assert veth["unloaded"] is None and dummy2["unloaded"] is None


def test_resolve_inside_each_incarnation_at_a_time_it_was_loaded(first: Boot, state: Path) -> None:
    f = first.facts
    dummy1, dummy2 = first.incs("dummy")
    (veth,) = first.incs("veth")
    for label, inc in (("dummy1", dummy1), ("veth", veth), ("dummy2", dummy2)):
        text = f.module(label).sections[".text"]
        kernel_addr = f.anchors["_text"] + 0x10
        for clock, t in (
            ("monotonic", f.times[f"{label}.copied"][0]),
            ("realtime", f.times[f"{label}.copied"][1]),
        ):
            got = ctl(
                state,
                "resolve",
                f"{text + 0x10:#x}",
                f"{kernel_addr:#x}",
                "--boot",
                f.boot_id,
                "--at",
                str(t),
                "--clock",
                clock,
                as_boot=f.boot_id,
            )
            assert got[0]["image"] == inc["name"], (label, clock, got)
            assert got[0]["section"] == ".text", (label, clock, got)
            assert got[0]["seq"] == inc["seq"], (label, clock, got)
            assert addr(got[0]["base"]) == text and addr(got[0]["offset"]) == 0x10
            assert (got[1]["image"], got[1]["section"]) == ("kernel", ".text"), got


def test_resolve_every_address_of_a_loaded_core_names_that_module(first: Boot, state: Path) -> None:
    """Every 256th byte of each incarnation's core ([base, base + size) in the
    guest's /proc/modules while it was loaded) resolves to that incarnation."""
    f = first.facts
    incs = {"dummy1": first.incs("dummy")[0], "veth": first.incs("veth")[0]}
    incs["dummy2"] = first.incs("dummy")[1]
    wrong = []
    for label, inc in incs.items():
        m = f.module(label)
        addresses = [f"{a:#x}" for a in range(m.core_base, m.core_base + m.coresize, 0x100)]
        t = str(f.mono(f"{label}.copied"))
        got = ctl(state, "resolve", *addresses, "--at", t, as_boot=f.boot_id, check=False)
        wrong += [
            f"{label} {g['address']}: kreld says {g.get('image')} (seq {g.get('seq')}) "
            f"{g.get('section')} +{g.get('offset')}"
            for g in got
            if (g.get("image"), g.get("seq")) != (inc["name"], inc["seq"])
        ]
    assert not wrong, f"{len(wrong)} addresses misattributed:\n" + "\n".join(wrong[:12])


def in_a_module(address: int, loaded: dict[str, tuple[int, int]]) -> str | None:
    return next((n for n, (b, size) in loaded.items() if b <= address < b + size), None)


def test_resolve_names_no_module_where_the_kernel_has_none(first: Boot, state: Path) -> None:
    """Addresses in no module's memory, by the kernel's own /proc/modules at that
    moment (base and size of each loaded module's core; init memory is freed by
    then), must not be attributed to a module:

    * just past the end of each incarnation's core, while it was loaded;
    * in dummy's init sections (.init.*, .symtab, .strtab: the kernel puts the
      full symbol table in the init allocation too) after its init had run;
    * dummy's old .text between ``rmmod dummy`` and the second ``modprobe dummy``.
    """
    f = first.facts
    cases: list[tuple[str, int, int, dict[str, tuple[int, int]]]] = []
    for label in ("dummy1", "veth", "dummy2"):
        m = f.module(label)
        t = f.mono(f"{label}.copied")
        cases.append(
            (f"{label}: its core end + 0x10", m.core_base + m.coresize + 0x10, t, m.loaded)
        )
        if label == "dummy1":
            for sec in (".init.text", ".symtab", ".strtab"):
                if sec in m.sections:
                    cases.append(
                        (f"{label}: freed {sec} + 0x10", m.sections[sec] + 0x10, t, m.loaded)
                    )
    after_rmmod = dict(f.module("veth").loaded)
    after_rmmod.pop("dummy")
    t = (f.mono("dummy1.unload_seen") + f.mono("dummy2.before")) // 2
    old = f.module("dummy1").sections[".text"] + 0x10
    cases.append(("dummy1: .text + 0x10 after rmmod", old, t, after_rmmod))
    wrong = []
    for what, address, t, loaded in cases:
        if in_a_module(address, loaded) or f.anchors["_text"] <= address < f.anchors["_etext"]:
            continue  # another module (or the kernel) does hold it: no case
        got = ctl(state, "resolve", f"{address:#x}", "--at", str(t), as_boot=f.boot_id, check=False)
        if "image" in got[0]:
            wrong.append(
                f"{what} ({address:#x}): kreld says {got[0]['image']} "
                f"{got[0]['section']} +{got[0]['offset']}"
            )
    assert not wrong, "addresses in no module resolved to one:\n" + "\n".join(wrong)


# -- 3. two boots, one state dir --------------------------------------------------------------


def test_second_boot_is_a_new_record_and_the_first_is_intact(
    first: Boot, second: Boot, state: Path
) -> None:
    a, b = first.facts, second.facts
    assert b.boot_id != a.boot_id
    assert {x["boot_id"] for x in second.boots} == {a.boot_id, b.boot_id}
    rec = second.show
    assert rec["boot_id"] == b.boot_id
    assert rec["build_id"] == b.build_id == a.build_id
    assert anchors_of(rec) == b.anchors
    assert addr(rec["kaslr_offset"]) == b.anchors["_text"] - 0xFFFFFFFF81000000
    # The first boot's record and module history, as they were before boot B.
    assert ctl(state, "show", a.boot_id, as_boot=b.boot_id) == first.show
    assert ctl(state, "modules", "--boot", a.boot_id, "--all", as_boot=b.boot_id) == first.modules
    # Boot B's history is its own: the dummy it loaded, at its own addresses.
    (dummy,) = second.incs("dummy")
    assert dummy["boot_id"] == b.boot_id
    assert seen_first_by_an_event(b, dummy["seen_by"], "add", "dummy"), dummy["seen_by"]
    m = b.module("dummy")
    assert {k: addr(v) for k, v in dummy["sections"].items()} == m.sections
    assert all(i["boot_id"] == b.boot_id for i in second.modules)
    if b.anchors["_text"] == a.anchors["_text"]:
        pytest.skip("KASLR picked the same slot on both boots (about 1 in 500): rerun")
    assert rec["anchors"]["text"] != first.show["anchors"]["text"]


def test_host_reads_a_store_recorded_elsewhere(first: Boot, state: Path) -> None:
    """The point of the store: symbolize later, on another machine (here: the host,
    whose own boot is not in the guest's store)."""
    f = first.facts
    assert ctl(state, "show", f.boot_id) == first.show
    text = f.module("dummy1").sections[".text"] + 0x10
    t = str(f.mono("dummy1.copied"))
    got = ctl(state, "resolve", f"{text:#x}", "--boot", f.boot_id, "--at", t)
    assert got[0]["image"] == "dummy"


# -- 3b. the symbol cache: one kernel table for the build, kallsyms per boot -----------


def kreld_log(facts: Facts) -> list[dict[str, Any]]:
    out = []
    for line in (facts.dir / "kreld.log").read_text().splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


@dataclass
class KallsymsAtT:
    """The guest's /proc/kallsyms read at T (between ``t0`` and ``t1``, CLOCK_MONOTONIC)."""

    text: str
    t0: int
    t1: int
    meta: dict[str, Any]

    @classmethod
    def read(cls, facts: Facts) -> KallsymsAtT:
        meta = json.loads((facts.dir / "kallsyms-T.json").read_text())
        text = (facts.dir / "kallsyms-at-T").read_text()
        return cls(text, int(meta["t0"]), int(meta["t1"]), meta)


@dataclass
class Split:
    """kallsyms lines: the core kernel's (no owner) and each owner's ([module], [bpf])."""

    core: list[str]
    owners: dict[str, list[str]]
    order: list[str]  # owners in the order their lines (first) appear
    scattered: list[str]  # owners whose lines are not one contiguous run

    @classmethod
    def of(cls, text: str) -> Split:
        core: list[str] = []
        owners: dict[str, list[str]] = {}
        order: list[str] = []
        scattered: list[str] = []
        last = None
        for line in text.splitlines():
            _, tab, owner = line.partition("\t")
            if not tab:
                core.append(line)
                continue
            name = owner.strip("[]")
            if name not in owners:
                owners[name] = []
                order.append(name)
            elif name != last and name not in scattered:
                scattered.append(name)
            owners[name].append(line)
            last = name
        return cls(core, owners, order, scattered)


def export_kallsyms(state: Path, boot_id: str, t: int, out: Path) -> str:
    """``kreldctl --state-dir S export kallsyms --boot B --at T --clock monotonic -o FILE``
    on the host (no daemon, the host's own boot not in the store)."""
    cp = host_ctl(
        state, "export", "kallsyms", "--boot", boot_id, "--at", str(t), "--clock", "monotonic",
        "-o", str(out), timeout=120,
    )  # fmt: skip
    assert cp.returncode == 0, f"kreldctl export kallsyms -> {cp.returncode}\n{cp.stderr}"
    return out.read_text()


def fields(line: str) -> tuple[str, str, str]:
    addr_, typ, rest = line.split(" ", 2)
    return addr_, typ, rest.partition("\t")[0]


def diff_core(kernel: list[str], kreld: list[str]) -> str | None:
    """None if equal line for line, else what differs."""
    if kernel == kreld:
        return None
    first = next(
        (i for i, (a, b) in enumerate(zip(kernel, kreld, strict=False)) if a != b),
        min(len(kernel), len(kreld)),
    )
    only_k = sorted(set(kernel) - set(kreld))
    only_x = sorted(set(kreld) - set(kernel))
    return (
        f"core kernel lines: kernel {len(kernel)}, export {len(kreld)}; first difference at "
        f"line {first}: kernel {kernel[first : first + 1]} export {kreld[first : first + 1]}; "
        f"{len(only_k)} lines only in the kernel's (e.g. {only_k[:3]}), "
        f"{len(only_x)} only in the export (e.g. {only_x[:3]})"
        + ("; same lines, other order" if not only_k and not only_x else "")
    )


def diff_owner(name: str, kernel: list[str], kreld: list[str]) -> str | None:
    """None if *name*'s lines are equal line for line, else how they differ."""
    if kernel == kreld:
        return None
    if sorted(kernel) == sorted(kreld):
        return f"[{name}]: the same {len(kernel)} lines in another order"
    kf = [fields(x) for x in kernel]
    xf = [fields(x) for x in kreld]
    parts = [f"[{name}]: kernel {len(kernel)} lines, export {len(kreld)}"]
    kn: dict[str, set[tuple[str, str]]] = {}
    for a, t, n in kf:
        kn.setdefault(n, set()).add((a, t))
    xn: dict[str, set[tuple[str, str]]] = {}
    for a, t, n in xf:
        xn.setdefault(n, set()).add((a, t))
    missing = [n for n in kn if n not in xn]
    extra = [n for n in xn if n not in kn]
    if missing:
        types = sorted({t for a, t, n in kf if n in set(missing)})
        examples = [x for x in kernel if fields(x)[2] in set(missing[:4])][:4]
        parts.append(f"{len(missing)} names missing from the export (types {types}): {examples}")
    if extra:
        types = sorted({t for a, t, n in xf if n in set(extra)})
        examples = [x for x in kreld if fields(x)[2] in set(extra[:4])][:4]
        parts.append(f"{len(extra)} names only in the export (types {types}): {examples}")
    both = [n for n in kn if n in xn]
    types_differ = [n for n in both if {t for _, t in kn[n]} != {t for _, t in xn[n]}]
    addrs_differ = [n for n in both if {a for a, _ in kn[n]} != {a for a, _ in xn[n]}]
    if types_differ:
        pairs = Counter(
            f"{'/'.join(sorted({t for _, t in kn[n]}))}->{'/'.join(sorted({t for _, t in xn[n]}))}"
            for n in types_differ
        )
        parts.append(
            f"{len(types_differ)} names with other types (kernel->export: "
            + ", ".join(f"{k} x{v}" for k, v in pairs.most_common())
            + "), e.g. "
            + ", ".join(
                f"{n} kernel {sorted(kn[n])} export {sorted(xn[n])}" for n in types_differ[:3]
            )
        )
    if addrs_differ:
        parts.append(
            f"{len(addrs_differ)} names at other addresses, e.g. "
            + ", ".join(
                f"{n} kernel {sorted(kn[n])} export {sorted(xn[n])}" for n in addrs_differ[:3]
            )
        )
    if not (missing or extra or types_differ or addrs_differ):
        parts.append("the same names, types and addresses; other duplicates or order")
    return "; ".join(parts)


def diff_owners(kernel: Split, kreld: Split) -> list[str]:
    out = []
    missing = [m for m in kernel.order if m not in kreld.owners]
    extra = [m for m in kreld.order if m not in kernel.owners]
    if missing:
        out.append(
            "owners missing from the export: "
            + ", ".join(f"{m} ({len(kernel.owners[m])} lines)" for m in missing)
        )
    if extra:
        out.append(
            "owners only in the export: "
            + ", ".join(f"{m} ({len(kreld.owners[m])} lines)" for m in extra)
        )
    for m in kernel.order:
        if m in kreld.owners:
            d = diff_owner(m, kernel.owners[m], kreld.owners[m])
            if d:
                out.append(d)
    return out


def diff_owner_order(kernel: Split, kreld: Split) -> list[str]:
    out = []
    common_k = [m for m in kernel.order if m in kreld.owners]
    common_x = [m for m in kreld.order if m in kernel.owners]
    if common_k != common_x:
        out.append(f"kernel {common_k},\nexport {common_x}")
    if kreld.scattered:
        out.append(f"owners whose lines the export does not keep together: {kreld.scattered}")
    return out


@dataclass
class KallsymsCheck:
    label: str
    facts: Facts
    kernel: Split
    kreld: Split
    t: int
    meta: dict[str, Any]


@pytest.fixture(scope="module")
def kallsyms_checks(
    first: Boot, second: Boot, state: Path, rw: Path, request: pytest.FixtureRequest
) -> list[KallsymsCheck]:
    out = []
    for label, b in (("first", first), ("second", second)):
        at = KallsymsAtT.read(b.facts)
        exported = export_kallsyms(state, b.facts.boot_id, at.t0, rw / f"export-{label}.kallsyms")
        check = KallsymsCheck(label, b.facts, Split.of(at.text), Split.of(exported), at.t0, at.meta)
        out.append(check)
        k, x = check.kernel, check.kreld
        say(
            request,
            f"[realkernel] kallsyms {label}: T {at.t0} (waited {at.meta['waited_s']}s for "
            f"kreld's tables; not captured then: {at.meta['modules_pending'] or 'none'}); "
            f"/proc/kallsyms {len(at.text.splitlines())} lines = {len(k.core)} core + "
            f"{sum(map(len, k.owners.values()))} in {len(k.owners)} owners; export "
            f"{len(exported.splitlines())} lines = {len(x.core)} core + "
            f"{sum(map(len, x.owners.values()))} in {len(x.owners)} owners",
        )
    return out


def test_kallsyms_stored_once_for_both_boots(first: Boot, second: Boot, state: Path) -> None:
    """One kernel table for the build (values relative to _text, so both
    KASLR slides share it): stored by boot A, shared by boot B."""
    a, b = first.facts, second.facts
    logged = {}
    for label, f in (("first", a), ("second", b)):
        recs = [r for r in kreld_log(f) if str(r.get("event", "")).startswith("kernel_symbols")]
        assert recs, f"boot {label}: kreld never logged kernel_symbols"
        assert [r["event"] for r in recs] == ["kernel_symbols"], (label, recs)
        logged[label] = recs[0]
    assert logged["first"]["action"] == "stored", logged
    assert logged["second"]["action"] == "shared", logged
    key = f"k:{a.build_id}"
    assert logged["first"]["table"] == logged["second"]["table"] == key, logged
    from kreld.store import Store  # imported late: the checkout's code as it is now

    with Store(state, readonly=True) as store:

        def table_keys(txn: Any) -> list[str]:
            cur = txn.cursor(db=store.env.dbs[b"symtabs"])
            return [k.decode() for k in cur.iternext(values=False)]

        keys = store.env.read(table_keys)
        assert [k for k in keys if not k.startswith("m:")] == [key], keys
        for f in (a, b):
            rec = store.boot_symbols(f.boot_id)
            assert rec is not None and rec.kernel == key, (f.boot_id, rec)


@pytest.mark.parametrize("label", ["first", "second"])
def test_exported_kallsyms_kernel_lines_equal_the_boots_own(
    kallsyms_checks: list[KallsymsCheck], label: str
) -> None:
    """``export kallsyms --boot B --at T``: the core kernel's lines, line for line
    as the guest's /proc/kallsyms showed them at T (this boot's _text)."""
    (c,) = (c for c in kallsyms_checks if c.label == label)
    assert c.meta["kernel"] is not None, f"kreld never logged kernel_symbols in boot {label}"
    assert len(c.kernel.core) > 50_000
    text = next(x for x in c.kernel.core if x.endswith(" _text"))
    assert int(text.split()[0], 16) == c.facts.anchors["_text"]
    d = diff_core(c.kernel.core, c.kreld.core)
    assert d is None, f"boot {label}: {d}"


@pytest.mark.parametrize("label", ["first", "second"])
def test_exported_kallsyms_module_lines_equal_the_boots_own(
    kallsyms_checks: list[KallsymsCheck], label: str
) -> None:
    """Each module's lines (and any other bracketed owner's) in the export,
    line for line as the guest's /proc/kallsyms showed them at T."""
    (c,) = (c for c in kallsyms_checks if c.label == label)
    assert not c.meta["modules_changed"], c.meta
    # brd is loaded after T, for the perf recordings (section 9)
    loaded_by_the_test = {
        d.name.rstrip("0123456789")
        for d in (c.facts.dir / "mod").iterdir()
        if d.name.rstrip("0123456789") != "brd"
    }
    assert loaded_by_the_test <= set(c.kernel.owners)
    problems = diff_owners(c.kernel, c.kreld)
    pending = c.meta["modules_pending"]
    # Where kreld took each module build's table from (logged by the boot that stored it).
    sources = {
        str(r.get("module")): str(r.get("source"))
        for k in kallsyms_checks
        for r in kreld_log(k.facts)
        if r.get("event") == "module_symbols"
    }
    differing = [m for m in c.kernel.order if any(x.startswith(f"[{m}]") for x in problems)]
    assert not problems, (
        f"boot {label}: module lines of the export differ from /proc/kallsyms at T "
        f"(modules kreld had still not logged module_symbols for after waiting "
        f"{c.meta['waited_s']}s: {pending or 'none'}; kreld's tables of the differing ones "
        f"came from: {', '.join(f'{m} {sources.get(m)}' for m in differing) or '-'}):\n"
        + "\n".join(problems)
    )


@pytest.mark.parametrize("label", ["first", "second"])
def test_exported_kallsyms_lists_modules_in_the_kernels_order(
    kallsyms_checks: list[KallsymsCheck], label: str
) -> None:
    """The kernel prints each module's lines together, newest load first (the
    order of /proc/modules); the export must too."""
    (c,) = (c for c in kallsyms_checks if c.label == label)
    problems = diff_owner_order(c.kernel, c.kreld)
    assert not problems, f"boot {label}: module order of the export:\n" + "\n".join(problems)


# -- 4. a profiler's view: Subscribe -----------------------------------------------------


def test_subscriber_in_the_guest_sees_dummy_load_and_unload(first: Boot) -> None:
    """A client in the guest subscribed with ``Subscribe`` (guest_subscribe.py,
    ``kreld.client``) before any test module was loaded: the snapshot of the
    modules recorded loaded and kreld's first look at them, then dummy's load,
    veth's, dummy's unload (the same seq) and the second dummy's load, each as
    kreld recorded it."""
    f = first.facts
    rc = (f.dir / "watch.rc").read_text().strip()
    err = (f.dir / "watch.err").read_text()
    assert rc == "143" and not err, f"the subscriber exited {rc} before SIGTERM:\n{err}"
    msgs = [json.loads(x) for x in (f.dir / "watch.jsonl").read_text().splitlines() if x.strip()]
    assert msgs and msgs[0]["event"] == "snapshot", msgs[:1]
    startup = {i["name"] for i in first.modules if i["seen_by"] == "startup"}
    # The socket answers while kreld starts: what its first look finds comes
    # after the snapshot (of what the store held loaded: nothing on a first
    # start), as loads seen by that look.
    first_look = [
        m for m in msgs[1:] if m["event"] == "load" and m["module"]["seen_by"] == "startup"
    ]
    known = {m["name"] for m in msgs[0]["modules"]} | {m["module"]["name"] for m in first_look}
    assert set(f.modules_at_start) <= known <= startup | set(f.modules_at_ready), known
    later = [m for m in msgs[1:] if m not in first_look]
    events = [(m["event"], m["module"]["name"], m["module"]["seq"]) for m in later]
    dummy1, dummy2 = first.incs("dummy")
    (veth,) = first.incs("veth")
    assert [e for e in events if e[0] in ("load", "unload")] == [
        ("load", "dummy", dummy1["seq"]),
        ("load", "veth", veth["seq"]),
        ("unload", "dummy", dummy1["seq"]),
        ("load", "dummy", dummy2["seq"]),
    ], events
    assert all(e[0] == "update" for e in events if e[0] not in ("load", "unload")), events
    by = {(m["event"], m["module"]["seq"]): m["module"] for m in later}
    # A load may be told first as a look or a uevent saw it, then updated with the
    # module tracepoint's exact time: the last word on it is what kreld recorded.
    latest = {m["module"]["seq"]: m["module"] for m in msgs[1:] if m["event"] in ("load", "update")}
    for label, inc in (("dummy1", dummy1), ("veth", veth), ("dummy2", dummy2)):
        loaded = by[("load", inc["seq"])]
        assert {k: addr(v) for k, v in loaded["sections"].items()} == f.module(label).sections
        assert loaded["build_id"] == inc["build_id"]
        assert latest[inc["seq"]]["loaded"] == inc["loaded"], (loaded, latest[inc["seq"]])
    gone = by[("unload", dummy1["seq"])]
    assert gone["unloaded"] == dummy1["unloaded"], (gone, dummy1)


# -- 9. perf: a perf.data finds its own boot ------------------------------------------------

PERF_KERNEL_ROW = re.compile(r"^\s*([0-9.]+)%\s+\[k\]\s+(\S+)\s*$")
PERF_UNKNOWN = re.compile(r"\b([0-9a-f]{16}) \[unknown\] \(")


def perf_kernel_rows(report: str) -> list[tuple[str, str]]:
    """(overhead, symbol) of each kernel row of ``perf report --sort sym``."""
    return [(m[1], m[2]) for ln in report.splitlines() if (m := PERF_KERNEL_ROW.match(ln))]


def host_perf(command: str, data: Path, kallsyms: Path, scratch: Path, *args: str) -> str:
    """``perf report`` or ``perf script`` on the host as a user would run it with
    kreld's export: an empty --symfs (or perf takes the host's own brd.ko and
    vmlinux) and a HOME with no build-id cache."""
    perf = shutil.which("perf")
    if perf is None:
        pytest.skip("perf is not installed on the host (Debian package linux-perf)")
    (scratch / "empty").mkdir(parents=True, exist_ok=True)
    (scratch / "home").mkdir(exist_ok=True)
    argv = [perf, command, "-i", str(data), f"--kallsyms={kallsyms}", f"--symfs={scratch}/empty"]
    cp = subprocess.run(
        [*argv, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HOME": str(scratch / "home")},
        check=False,
    )
    assert cp.returncode == 0, cp.stderr
    return cp.stdout


def test_export_for_a_perf_data_reports_as_its_own_boot_did_live(
    first: Boot, second: Boot, state: Path, tmp_path: Path
) -> None:
    """For the perf.data of each boot, ``export kallsyms --for`` (no --boot, on
    the host) gives a ``perf report --sort sym`` equal, row for row, to the one
    the guest made live from its own /proc/kallsyms, brd's functions included;
    brd lay at another base in each boot, and each recording's map says so."""
    from kreld.perf.reader import read_perf_header

    starts = []
    for b in (first, second):
        data = b.facts.dir / "perf-brd.data"
        brd = next(m for m in read_perf_header(data).modules if m.name == "brd")
        assert brd.start == b.facts.module("brd").core_base
        starts.append(brd.start)
        ks = tmp_path / f"kallsyms-{b.facts.boot_id}"
        cp = host_ctl(state, "export", "kallsyms", "--for", str(data), "-o", str(ks), timeout=120)
        assert cp.returncode == 0, cp.stderr
        assert f"boot {b.facts.boot_id}" in cp.stderr
        live = perf_kernel_rows((b.facts.dir / "perf-brd.report").read_text())
        assert any(sym.startswith("brd_") for _, sym in live), live[:20]
        ours = perf_kernel_rows(
            host_perf("report", data, ks, tmp_path / b.facts.boot_id, "--stdio", "--sort", "sym")
        )
        assert ours == live
    assert starts[0] != starts[1], "brd loaded at one base in both boots: nothing was shown"


def test_export_for_a_perf_data_of_another_boot_build_fails_with_exit_3(
    first: Boot, state: Path, tmp_path: Path
) -> None:
    """A recording whose _text no boot had is refused with exit code 3 and the
    nearest boots (same build, another _text) listed."""
    data = (first.facts.dir / "perf-brd.data").read_bytes()
    text = first.facts.anchors["_text"]
    head = 1 << 16  # the kernel map's start and pgoff (_text) are in the synthesized prefix
    moved = data[:head].replace(struct.pack("<Q", text), struct.pack("<Q", text + 0x200000))
    moved += data[head:]
    assert moved != data
    (tmp_path / "moved.data").write_bytes(moved)
    cp = host_ctl(state, "export", "kallsyms", "--for", str(tmp_path / "moved.data"), timeout=60)
    assert cp.returncode == 3, cp.stderr
    assert first.facts.boot_id in cp.stderr and f"{text:x}" in cp.stderr


def test_symbolize_for_names_a_module_loaded_after_perf_record_started(
    second: Boot, state: Path, tmp_path: Path
) -> None:
    """brd, loaded by the workload of a ``perf record -k monotonic`` that had
    already started, has no map in the recording: on the host, ``perf script``
    with the ``export --for`` kallsyms prints its samples as ``[unknown]``.
    ``symbolize --for`` names each as the brd function the guest's own perf
    named from its live /proc/kallsyms, at the same offset, with ``[brd]`` as
    the image, and leaves every other line as it was."""
    from kreld.perf.reader import read_perf_header

    d = second.facts.dir
    data = d / "perf-late.data"
    h = read_perf_header(data)
    assert h.clockid == 1 and h.clock_data is not None  # CLOCK_MONOTONIC
    assert "brd" not in {m.name for m in h.modules}
    base, size = second.facts.module("brd").loaded["brd"]
    ks = tmp_path / "kallsyms"
    cp = host_ctl(state, "export", "kallsyms", "--for", str(data), "-o", str(ks), timeout=120)
    assert cp.returncode == 0, cp.stderr
    script = host_perf("script", data, ks, tmp_path)
    lines = script.splitlines(keepends=True)
    live = (d / "perf-late.script").read_text().splitlines(keepends=True)
    assert len(live) == len(lines)
    in_brd = {
        i
        for i, ln in enumerate(lines)
        if (m := PERF_UNKNOWN.search(ln)) and base <= int(m[1], 16) < base + size
    }
    assert len(in_brd) >= 5, "too few brd samples to show anything"
    cp = subprocess.run(
        [str(CTL), "--state-dir", str(state), "symbolize", "--for", str(data)],
        input=script,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cp.returncode == 0, cp.stderr
    assert "approximate" not in cp.stderr
    out = cp.stdout.splitlines(keepends=True)
    assert len(out) == len(lines)
    for i, (before, after) in enumerate(zip(lines, out, strict=True)):
        if i in in_brd:
            m = re.search(r" (brd_[\w.]+\+0x[0-9a-f]+) \(\[brd\]\)$", after)
            assert m, after
            assert f" {m[1]} (" in live[i], (after, live[i])
        elif "[unknown]" not in before:
            assert after == before


def test_inject_names_in_perf_report_the_samples_of_a_module_loaded_mid_recording(
    second: Boot, state: Path, tmp_path: Path
) -> None:
    """brd, unloaded, then loaded again and kept busy by the workload of a
    per-task ``perf record -k monotonic``: on the host, ``perf report
    --symfs=<empty> --kallsyms=<export --for OUT>`` of ``kreldctl inject``'s OUT
    names as brd functions the samples that IN's report leaves ``[unknown]``,
    and agrees with it on every other line; ``perf script`` of OUT names each
    such sample as the guest's own perf did from its live /proc/kallsyms, and
    prints no warning."""
    from kreld.perf.reader import read_perf_header

    d = second.facts.dir
    data = d / "perf-task.data"
    h = read_perf_header(data)
    assert h.clockid == 1 and "brd" not in {m.name for m in h.modules}
    brd = second.facts.module("brd2")
    base, size = brd.loaded["brd"]
    out = tmp_path / "out.data"
    cp = host_ctl(state, "inject", "-i", str(data), "-o", str(out), timeout=120)
    assert cp.returncode == 0, cp.stderr
    assert "approximate" not in cp.stderr
    ks = tmp_path / "kallsyms"
    cp = host_ctl(state, "export", "kallsyms", "--for", str(out), "-o", str(ks), timeout=120)
    assert cp.returncode == 0, cp.stderr
    rows = {}
    for name, f in (("in", data), ("out", out)):
        text = host_perf("report", f, ks, tmp_path, "--stdio", "--sort", "dso,sym")
        rows[name] = [ln.split() for ln in text.splitlines() if ln.strip() and ln[0] != "#"]
    unknown = [r for r in rows["in"] if r[1] == "[unknown]" and base <= int(r[3], 16) < base + size]
    assert len(unknown) >= 3, rows["in"][:30]
    named = [r for r in rows["out"] if r[1] == "[brd]"]
    assert named and all(r[3].startswith("brd_") for r in named), named
    total = sum(float(r[0].rstrip("%")) for r in unknown)
    assert abs(sum(float(r[0].rstrip("%")) for r in named) - total) < 0.02 * len(unknown) + 0.05
    assert [r for r in rows["out"] if r[1] != "[brd]"] == [
        r for r in rows["in"] if r not in unknown
    ]
    script = host_perf("script", out, ks, tmp_path)
    live = (d / "perf-task.script").read_text().splitlines()
    lines = script.splitlines()
    assert len(lines) == len(live)
    in_brd = 0
    for mine, theirs in zip(lines, live, strict=True):
        m = re.search(r" ([0-9a-f]{16}) (brd_[\w.]+\+0x[0-9a-f]+) \(\[brd\]\)$", mine)
        if m and base <= int(m[1], 16) < base + size:
            in_brd += 1
            assert f" {m[2]} (" in theirs, (mine, theirs)
    assert in_brd >= 5


# -- 5. source lines of the recorded boot, from Debian's -dbg files on the host ---------------

DBG = Path("/var/cache/kreld-vm/dbg/usr/lib/debug")
BRD_TEXT = (".text", ".text.unlikely", ".init.text", ".exit.text")


@pytest.fixture(scope="module")
def debuginfo_dir(second: Boot, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A debuginfo dir in Debian's layout holding the -dbg vmlinux and brd.ko
    and nothing else (hard links to scripts/setup-vm's extracted copies)."""
    release = second.facts.release
    files = {
        f"boot/vmlinux-{release}": DBG / f"boot/vmlinux-{release}",
        f"lib/modules/{release}/kernel/drivers/block/brd.ko":
            DBG / f"lib/modules/{release}/kernel/drivers/block/brd.ko",
    }  # fmt: skip
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        pytest.skip(f"no -dbg files (scripts/setup-vm extracts them): {missing}")
    root = tmp_path_factory.mktemp("debuginfo")
    for rel, src in files.items():
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
    return root


def _spread(values: list[int], n: int) -> list[int]:
    return values[:: max(1, len(values) // n)][:n]


def test_lines_of_the_image_and_of_each_brd_text_section_equal_the_references(
    second: Boot, state: Path, debuginfo_dir: Path
) -> None:
    """The second boot loaded brd (its sysfs sections copied), unloaded it,
    and stopped.  ``kreldctl resolve --lines --json --boot B --at T --debuginfo-dir DIR`` on
    the host, T the time brd was loaded: every frame (function, file, line,
    innermost first) of addresses spread over the kernel image equals
    ``llvm-symbolizer --inlines`` on vmlinux at the address minus the KASLR
    offset, and over each of brd's text sections equals ``eu-addr2line -i -f
    -j SECTION -e brd.ko OFFSET``, at the bases the guest's sysfs showed.
    Where only the DWARF line program covers the code (assembly such as
    ``irq_entries_start``) kreld gives the reference's function without a
    line: at most 1 %, never a wrong line (kreld/debuginfo/lines.py says why)."""
    from kreld.debuginfo.lines_reloc import symbol_value  # the checkout's code as it is now

    f = second.facts
    brd = second.incs("brd")[0]
    assert brd["unloaded"] is not None, brd
    bases = f.module("brd").sections
    assert {k: addr(v) for k, v in brd["sections"].items()} == bases
    vmlinux = debuginfo_dir / f"boot/vmlinux-{f.release}"
    ko = debuginfo_dir / f"lib/modules/{f.release}/kernel/drivers/block/brd.ko"
    with open(vmlinux, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
        link_text = symbol_value(m, str(vmlinux), "_text")
    assert link_text is not None
    slide = f.anchors["_text"] - link_text
    image = _spread(list(range(link_text + 0x1000, f.anchors["_etext"] - slide, 4099)), 300)
    code = instructions(ko)
    assert set(BRD_TEXT) <= set(code) <= set(bases), sorted(code)
    picks = [(s, o) for s in BRD_TEXT for o in _spread(code[s], 60)]
    addresses = [a + slide for a in image] + [bases[s] + o for s, o in picks]
    t = str(brd["loaded"]["monotonic"])
    cp = host_ctl(state, "resolve", "--lines", "--json", "--boot", f.boot_id, "--at", t,
                  "--debuginfo-dir", str(debuginfo_dir), *map(hex, addresses),
                  timeout=600)  # fmt: skip
    assert cp.returncode == 0, cp.stderr
    got = json.loads(cp.stdout)
    refs = llvm(vmlinux, image)
    for sec in BRD_TEXT:
        refs += eu(ko, sec, [o for s, o in picks if s == sec])
    where = [("kernel", hex(a)) for a in image] + [(s, hex(o)) for s, o in picks]
    compared, by_section, wrong, no_line = 0, Counter[str](), [], 0
    for w, ans, ref in zip(where, got, refs, strict=True):
        if not ref or ref[0][0] in ("", "??"):
            continue  # padding between functions: no reference names it
        ours = [(fr["function"], fr["file"], fr["line"]) for fr in ans.get("frames", [])]
        compared += 1
        by_section[w[0]] += 1
        if ours == [(fn, p, n) for fn, p, n, _ in ref]:
            continue
        if len(ref) == 1 and ref[0][2] > 0 and ours == [(ref[0][0], None, 0)]:
            no_line += 1  # only the line program covers it (assembly): the name, no line
            continue
        wrong.append(f"{w}: kreld {ours or ans.get('no_lines')} reference {ref}")
    assert not wrong, f"{len(wrong)} of {compared} differ:\n" + "\n".join(wrong[:20])
    assert no_line * 100 <= compared, (no_line, compared)
    assert by_section["kernel"] >= 250 and all(by_section[s] >= 5 for s in BRD_TEXT), by_section
