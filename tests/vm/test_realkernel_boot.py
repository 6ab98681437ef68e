"""kreld on a real kernel (tests/vm/conftest.py boots it; tests/vm/guest.sh says
what each boot does): the boot record and its KASLR offset, from
VMCOREINFO and from System.map, and two boots sharing one state dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import harness
from support.realboot import ANCHORS, Boot, seen_first_by_an_event, snapshot, symbols
from support.realkernel import addr, anchors_of, ctl

pytestmark = [pytest.mark.realkernel, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", autouse=True)
def _selected(request: pytest.FixtureRequest) -> None:
    harness.skip_unless_selected(request.config.getoption("markexpr"))


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
