"""kreld on a real kernel (tests/vm/conftest.py boots it): every module load and
unload recorded with the kernel's sections, addresses resolved to the
incarnation loaded at the time, and a subscriber in the guest told each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support import harness
from support.realboot import Boot, host_module_build_id, seen_first_by_an_event
from support.realkernel import addr, ctl

pytestmark = [pytest.mark.realkernel, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", autouse=True)
def _selected(request: pytest.FixtureRequest) -> None:
    harness.skip_unless_selected(request.config.getoption("markexpr"))


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
