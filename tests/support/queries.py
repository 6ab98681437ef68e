"""A boot and module incarnations shaped as a real 6.1 kernel showed them (store queries)."""

from __future__ import annotations

from kreld.core.model import (
    Anchors,
    BootSnapshot,
    Incarnation,
    ModuleState,
    SeenBy,
    Timestamp,
)

T0 = Timestamp(1_000, 1_000, 1_000)


def boot() -> BootSnapshot:
    return BootSnapshot(
        boot_id="00000000-0000-0000-0000-000000000001",
        release="6.1.0",
        version="#1",
        build_id="ab" * 20,
        anchors=Anchors(0xFFFFFFFF81000000, 0xFFFFFFFF81000000, 0xFFFFFFFF82000000),
        kaslr=None,
        restricted=False,
        restricted_reason=None,
        kptr_restrict=0,
        first_seen=T0,
    )


def incarnation(
    name: str, seq: int, core: int, coresize: int, init: int, **kw: object
) -> Incarnation:
    sections = {
        ".text": core,
        ".rodata": core + 0x1000,
        ".data": core + 0x2000,
        ".gnu.linkonce.this_module": core + 0x2400,
        ".bss": core + 0x2800,
        ".init.text": init,
        ".init.data": init + 0x400,
        ".symtab": init + 0x800,
        ".strtab": init + 0xC00,
    }
    state = ModuleState(
        name=name,
        build_id=f"{seq:02x}" * 20,
        sections=sections,
        coresize=coresize,
        initsize=0x1000,
        initstate="live",
        srcversion=None,
        taint=None,
        core_base=core,
        restricted=False,
        inode=seq,
    )
    defaults: dict[str, object] = {"init_live": False, "init_done": None, "unloaded": None}
    defaults.update(kw)
    return Incarnation(
        boot_id=boot().boot_id,
        seq=seq,
        state=state,
        loaded=T0,
        seen_by=SeenBy.STARTUP,
        **defaults,  # type: ignore[arg-type]
    )
