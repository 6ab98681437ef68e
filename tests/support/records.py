"""Boot snapshots and incarnations built in memory, for the store's tests."""

from __future__ import annotations

import uuid

from kreld.core.model import (
    Anchors,
    BootSnapshot,
    Incarnation,
    KaslrOffset,
    ModuleState,
    SeenBy,
    Timestamp,
)

TEXT = 0xFFFFFFFF9D000000


BUILD_ID = "0123456789abcdef0123456789abcdef01234567"


def snap(
    boot_id: str | None = None,
    *,
    n: int = 0,
    text: int | None = TEXT,
    kaslr: KaslrOffset | None = None,
    restricted: bool = False,
    build_id: str | None = BUILD_ID,
    kptr_restrict: int | None = 0,
) -> BootSnapshot:
    anchors = Anchors() if text is None else Anchors(text, text, text + 0x1000000)
    return BootSnapshot(
        boot_id=boot_id or str(uuid.uuid4()),
        release="6.1.0-fake",
        version="#1 SMP",
        build_id=build_id,
        anchors=anchors,
        kaslr=kaslr,
        restricted=restricted,
        restricted_reason="kernel.kptr_restrict=2 hides kernel pointers" if restricted else None,
        kptr_restrict=kptr_restrict,
        first_seen=Timestamp(1_000 + n, 2_000 + n, 1_700_000_000_000_000_000 + n),
    )


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
