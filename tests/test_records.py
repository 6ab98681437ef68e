"""The stored form of an incarnation round-trips every field, and is compact."""

from __future__ import annotations

import json

from kreld import records
from kreld.model import Incarnation, ModuleState, SeenBy, Timestamp

NAMES = [".text", ".init.text", ".exit.text", ".data", ".rodata", ".gnu.linkonce.this_module",
         "__param", "__mcount_loc", ".bss", ".symtab", ".strtab", ".init.data", ".note.Linux",
         ".note.gnu.build-id", ".data..read_mostly", ".altinstructions", ".retpoline_sites",
         ".return_sites", "__bug_table", ".rodata.str1.1"]  # fmt: skip


def incarnation(**kw: object) -> Incarnation:
    base = 0xFFFFFFFFC03BB000
    state = ModuleState(
        name="dummy",
        build_id="4bd0a1f1c9c4f23a" * 2 + "abcd0123",
        sections={n: base + i * 0x400 for i, n in enumerate(NAMES)},
        coresize=16384,
        initsize=4096,
        initstate="live",
        srcversion="ABCDEF0123456789ABCDEF0",
        taint="",
        core_base=base,
        restricted=False,
        inode=12345,
        faults=("sections/x: unreadable",),
    )
    t = Timestamp(32_652_141_668, 32_652_141_700, 1_796_214_896_021_961_415)
    fields: dict[str, object] = {
        "init_live": True,
        "init_done": Timestamp(32_652_200_000, 32_652_200_100, 1_796_214_896_022_000_000),
    }
    fields.update(kw)
    return Incarnation(
        "4e5fd6e0-ca47-4d0d-9917-575640bbb1aa", 28, state, t, SeenBy.UEVENT, **fields
    )  # type: ignore[arg-type]


def roundtrip(inc: Incarnation) -> Incarnation:
    raw, key, names = records.encode(inc)
    layouts = {key: names}
    return records.decode(raw, inc.boot_id, inc.seq, layouts.__getitem__)


def test_every_field_survives() -> None:
    loaded = incarnation()
    assert roundtrip(loaded) == loaded
    gone = incarnation(
        unloaded=Timestamp(40_121_514_158, 40_121_514_200, 1_796_214_903_491_333_905),
        unloaded_after=Timestamp(40_000_000_000, 40_000_000_042, 1_796_214_903_370_000_000),
        unload_seen_by=SeenBy.POLL,
    )
    assert roundtrip(gone) == gone


def test_restricted_and_sectionless_records_survive() -> None:
    inc = incarnation()
    bare = Incarnation(
        inc.boot_id, 3, ModuleState("m", None, {}, None, None, None, None, None, None, True, None),
        inc.loaded, SeenBy.STARTUP, False,
    )  # fmt: skip
    assert roundtrip(bare) == bare


def test_same_names_share_one_layout_and_the_record_is_a_third_of_the_wire_form() -> None:
    a, b = incarnation(), incarnation()
    assert records.encode(a)[1] == records.encode(b)[1]
    raw = records.encode(a)[0]
    assert len(raw) * 3 < len(json.dumps(a.to_json()))


def test_schema_1_records_are_still_read() -> None:
    inc = incarnation()
    old = json.dumps(inc.to_json()).encode()
    assert records.decode(old, inc.boot_id, inc.seq, {}.__getitem__) == inc
