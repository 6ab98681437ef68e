"""Address resolution over recorded incarnations (pure: no daemon, no store).

The layouts mirror what a real 6.1 kernel showed (tests/vm): a module's
core is one allocation of coresize bytes at its /proc/modules base; its
.init.* sections and the full .symtab/.strtab live in a separate init
allocation that is freed once init has run.
"""

from __future__ import annotations

import json
from pathlib import Path

from kreld.client import resolutions
from kreld.core import record
from kreld.core.model import (
    Clock,
    SeenBy,
    Timestamp,
)
from kreld.server.service import Service
from kreld.store import Store
from kreld.symbols.queries import AddressMap
from kreld.varlink.requests import Resolve, parse

from support.queries import T0, boot, incarnation

T1 = Timestamp(2_000, 2_000, 2_000)
T2 = Timestamp(3_000, 3_000, 3_000)


def where(amap: AddressMap, addr: int) -> tuple[str, str] | None:
    """The image and section Resolve places *addr* in."""
    (r,) = resolutions([addr], json.loads(amap.resolve([addr]).to_json()))
    return (r["image"], r["section"]) if "image" in r else None


def test_freed_init_layout_of_one_module_does_not_capture_anothers_core() -> None:
    # crc's init allocation (freed at boot) lies where dummy's core now is.
    crc = incarnation("crc32_pclmul", 1, 0xFFFFFFFFC0600000, 0x4000, 0xFFFFFFFFC0790000)
    dummy = incarnation("dummy", 2, 0xFFFFFFFFC0790000 + 0x100, 0x3000, 0xFFFFFFFFC0900000)
    amap = AddressMap(boot(), [crc, dummy], Clock.MONOTONIC, None)
    for off in range(0, 0x3000, 0x80):
        assert where(amap, 0xFFFFFFFFC0790100 + off)[0] == "dummy", hex(off)
    assert where(amap, 0xFFFFFFFFC0790100 + 0x2000 + 8) == ("dummy", ".data")


def test_an_address_past_a_modules_core_is_not_its() -> None:
    kvm = incarnation("kvm_amd", 1, 0xFFFFFFFFC0000000, 0x3000, 0xFFFFFFFFC0900000)
    amap = AddressMap(boot(), [kvm], Clock.MONOTONIC, None)
    assert where(amap, 0xFFFFFFFFC0002900) == ("kvm_amd", ".bss")
    assert where(amap, 0xFFFFFFFFC0003000) is None  # the first byte past the core
    assert where(amap, 0xFFFFFFFFC0050000) is None


def test_sections_end_where_the_next_begins() -> None:
    m = incarnation("m", 1, 0xFFFFFFFFC0000000, 0x4000, 0xFFFFFFFFC0900000)
    amap = AddressMap(boot(), [m], Clock.MONOTONIC, None)
    assert where(amap, 0xFFFFFFFFC0000FFF) == ("m", ".text")
    assert where(amap, 0xFFFFFFFFC0001000) == ("m", ".rodata")


def test_init_layout_sections_resolve_only_while_init_is_live() -> None:
    m = incarnation(
        "m", 1, 0xFFFFFFFFC0000000, 0x4000, 0xFFFFFFFFC0900000, init_live=True, init_done=T1
    )
    before = AddressMap(boot(), [m], Clock.MONOTONIC, T0.monotonic + 1)
    after = AddressMap(boot(), [m], Clock.MONOTONIC, T2.monotonic)
    assert where(before, 0xFFFFFFFFC0900010) == ("m", ".init.text")
    assert where(before, 0xFFFFFFFFC0900810) == ("m", ".symtab")
    assert where(after, 0xFFFFFFFFC0900010) is None
    assert where(after, 0xFFFFFFFFC0900810) is None
    assert where(after, 0xFFFFFFFFC0000010) == ("m", ".text")


def test_unloaded_module_is_only_found_at_times_it_was_loaded() -> None:
    m = incarnation("m", 1, 0xFFFFFFFFC0000000, 0x4000, 0xFFFFFFFFC0900000, unloaded=T1)
    assert where(AddressMap(boot(), [m], Clock.MONOTONIC, T0.monotonic + 5), 0xFFFFFFFFC0000010)
    assert where(AddressMap(boot(), [m], Clock.MONOTONIC, T2.monotonic), 0xFFFFFFFFC0000010) is None
    assert where(AddressMap(boot(), [m], Clock.MONOTONIC, None), 0xFFFFFFFFC0000010) is None


def test_resolve_on_a_recorded_boot_reuses_its_map_until_an_event(tmp_path: Path) -> None:
    """Resolve on another boot (real store) builds that boot's map at that time once:
    the same incarnations live -> the same map; another set -> another map; a recorded
    event (here: dummy's unload learnt later) drops them, and the answer follows."""
    old = boot()
    current = record.replace(old, boot_id="00000000-0000-0000-0000-000000000002")
    with Store(tmp_path / "st") as store:
        store.boots.record_boot(old)
        store.boots.record_boot(current)
        dummy = incarnation("dummy", 0, 0xFFFFFFFFC0000000, 0x4000, 0xFFFFFFFFC0100000)
        (dummy,) = store.modules.apply_module_changes(old.boot_id, [dummy], [], [], None)
        svc = Service(
            store, current_boot=lambda: current, current_id=lambda: current.boot_id,
            loaded=lambda: [],
        )  # fmt: skip

        def resolve(at: int) -> str | None:
            params = {"addresses": ["0xffffffffc0000010"], "boot_id": old.boot_id, "at": at}
            reply = json.loads(svc.resolve(parse(Resolve, params)))  # type: ignore[arg-type]
            (r,) = resolutions([0xFFFFFFFFC0000010], reply)
            return str(r["image"]) if "image" in r else None

        assert resolve(T1.monotonic) == "dummy"
        first = list(svc._maps.values())
        assert resolve(T2.monotonic) == "dummy" and list(svc._maps.values()) == first
        assert resolve(T0.monotonic - 1) is None and len(svc._maps) == 2
        gone = record.replace(dummy, unloaded=T1, unload_seen_by=SeenBy.POLL)
        store.modules.apply_module_changes(old.boot_id, [], [], [gone], None)
        assert resolve(T2.monotonic) == "dummy"  # no event told the service yet
        svc.invalidate()
        assert not svc._maps
        assert resolve(T2.monotonic) is None and resolve(T0.monotonic + 1) == "dummy"
