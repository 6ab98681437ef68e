"""A module whose load kreld knows only as an interval (seen by a look, not by
the tracepoint: absent at ``loaded_after``, there at ``loaded``) is answered
for a time inside that interval as kernel code in a window is: marked
``possible``, and named, so that no sample is left unnamed because kreld learnt
of the load late.  The daemon as a subprocess over a fake tree and real LMDB."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kreld.client import Client, resolutions
from kreld.core.model import Clock, SeenBy, Timestamp
from kreld.core.record import replace
from kreld.symbols.queries import AddressMap

from support.faketree import FakeTree
from support.queries import boot, incarnation
from support.run import kreldctl, start

BASE = 0xFFFFFFFFC0400000


def _late_load(daemon_factory: Any, tree: FakeTree, tmp_path: Path) -> tuple[Any, Path, dict]:
    """kreld running, then ``late`` loaded and seen by the look at sys/module."""
    sock = tmp_path / "kreld.sock"
    conf = tmp_path / "kreld.toml"
    conf.write_text("[modules]\nwatch = 'poll'\npoll_interval = 0.5\n")
    d = start(daemon_factory, tree, tmp_path / "state", sock, "--config", str(conf))
    tree.add_module("late", BASE)
    d.wait_for("module_loaded", module="late", timeout=60)
    with Client(str(sock)) as c:
        late = next(m for m in c.call("GetModules")["modules"] if m["name"] == "late")
    return d, sock, late


def test_a_time_inside_a_late_seen_loads_interval_is_answered_possible_and_named(
    tree: FakeTree, tmp_path: Path, daemon_factory: Any
) -> None:
    d, sock, late = _late_load(daemon_factory, tree, tmp_path)
    assert late["seen_by"] == "poll"
    lo, hi = late["loaded_after"]["monotonic"], late["loaded"]["monotonic"]
    assert lo < hi
    addr = f"{BASE + 0x10:#x}"
    with Client(str(sock)) as c:
        inside = resolutions([addr], c.call("Resolve", addresses=[addr], at=(lo + hi) // 2))[0]
        before = resolutions([addr], c.call("Resolve", addresses=[addr], at=lo - 1))[0]
        after = resolutions([addr], c.call("Resolve", addresses=[addr], at=hi))[0]
    assert inside["image"] == "late" and inside["section"] == ".text"
    assert inside["possible"] is True and inside["seq"] == late["seq"]
    assert before == {"address": addr}  # certainly not loaded yet: nothing
    assert after["image"] == "late" and "possible" not in after  # certain from loaded on
    cli = json.loads(
        kreldctl(
            "--socket", str(sock), "resolve", "--at", str((lo + hi) // 2), addr, "--json"
        ).stdout
    )  # fmt: skip
    row = cli[0] if isinstance(cli, list) else cli["results"][0]
    assert row["image"] == "late" and row.get("possible") is True
    assert d.stop() == 0


def test_a_module_certainly_there_wins_over_one_possibly_there() -> None:
    """One look saw ``first`` gone and ``late`` at the same place: between the
    two looks ``first`` counts as there (its unload is not known to have
    happened) and ``late`` only possibly; ``first`` is the answer, certain, and
    ``late``'s init text, which nothing else held, is named possible with its
    init live (init had not been seen to end)."""
    t0, t1 = Timestamp(2000, 2000, 2000), Timestamp(3000, 3000, 3000)  # after T0
    first = incarnation("first", 1, BASE, 0x3000, BASE + 0x100000, unloaded=t1, unloaded_after=t0)
    late = replace(
        incarnation("late", 2, BASE, 0x3000, BASE + 0x200000, init_live=True),
        loaded=t1,
        loaded_after=t0,
        seen_by=SeenBy.POLL,
    )
    amap = AddressMap(boot(), [first, late], Clock.MONOTONIC, 2500)
    core, init = BASE + 0x10, BASE + 0x200010
    res = json.loads(amap.resolve([core, init]).to_json())
    rows = resolutions([hex(core), hex(init)], res)
    assert rows[0]["image"] == "first" and "possible" not in rows[0]
    assert rows[1]["image"] == "late" and rows[1]["section"] == ".init.text"
    assert rows[1]["possible"] is True
    # Before late's interval, nothing of it.
    after = json.loads(
        AddressMap(boot(), [first, late], Clock.MONOTONIC, 1500).resolve([init]).to_json()
    )
    assert resolutions([hex(init)], after)[0] == {"address": hex(init)}


def _neighbour(**kw: object) -> Any:
    """``kvm``, loaded before ``late`` below it: its ``.orc_header`` lies outside
    its text allocation (Linux 6.4 on), bounded by the module's size alone,
    over late's text and init text."""
    nb = BASE - 0x400000
    kvm = incarnation("kvm", 1, nb, 0x180000, nb + 0x1000000, **kw)
    sections = {".text": nb, ".orc_header": nb + 0x3F0000}
    return replace(kvm, state=replace(kvm.state, sections=sections)), nb + 0x3F0000


def _late(t0: Timestamp, t1: Timestamp) -> Any:
    late = incarnation("late", 2, BASE, 0x3000, BASE + 0x100000, init_live=True)
    return replace(late, loaded=t1, loaded_after=t0, seen_by=SeenBy.POLL)


def test_a_load_possibly_there_is_named_above_a_neighbours_bound() -> None:
    """kvm, certainly there, was still loaded when late's load was seen: the
    two lay apart, and kvm's bound (sysfs gives no sizes) does not hide late."""
    t0, t1 = Timestamp(2000, 2000, 2000), Timestamp(3000, 3000, 3000)
    kvm, orc = _neighbour()
    amap = AddressMap(boot(), [kvm, _late(t0, t1)], Clock.MONOTONIC, 2500)
    wanted = [BASE + 0x10, BASE + 0x100010, orc + 8]
    rows = resolutions([hex(a) for a in wanted], json.loads(amap.resolve(wanted).to_json()))
    assert [(r["image"], r["section"], r.get("possible")) for r in rows] == [
        ("late", ".text", True),
        ("late", ".init.text", True),
        ("kvm", ".orc_header", None),
    ]


def test_a_neighbour_gone_before_the_load_was_seen_keeps_its_bound() -> None:
    """kvm was seen gone (at 2300) before late was seen loaded (at 3000): late
    may have taken memory kvm held, so at 2100, when kvm was certainly there,
    kvm's bound wins over late, only possibly there."""
    t0, t1 = Timestamp(2000, 2000, 2000), Timestamp(3000, 3000, 3000)
    gone = Timestamp(2300, 2300, 2300)
    kvm, _ = _neighbour(unloaded=gone, unloaded_after=Timestamp(2200, 2200, 2200))
    amap = AddressMap(boot(), [kvm, _late(t0, t1)], Clock.MONOTONIC, 2100)
    (row,) = resolutions([hex(BASE + 0x10)], json.loads(amap.resolve([BASE + 0x10]).to_json()))
    assert (row["image"], row["section"], row.get("possible")) == ("kvm", ".orc_header", None)
