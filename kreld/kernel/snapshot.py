"""Putting the readers together: one snapshot of the running kernel."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kreld.core import consts
from kreld.core.errors import KernelReadError
from kreld.core.model import AddressSource, Anchors, BootSnapshot, Timestamp, hexaddr
from kreld.kernel.elf import elf_symbols
from kreld.kernel.files import moved
from kreld.kernel.info import (
    Root,
    has_cap_syslog,
    read_anchors,
    read_boot_id,
    read_int_sysctl,
    read_kernel_build_id,
    read_release,
    read_version,
    restriction_reason,
)
from kreld.kernel.kallsyms import KallsymsText
from kreld.kernel.kaslr import find_offset, matching_vmlinux
from kreld.kernel.seethrough import KernelMemory, open_kernel_memory

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

__all__ = ["kallsyms_names", "kernel_memory_for", "log_boot", "take_snapshot"]


def take_snapshot(
    root: Root,
    debuginfo_dirs: Iterable[str] = (),
    kallsyms: bytes | None = None,
    kmem: KernelMemory | None = None,
) -> tuple[BootSnapshot, list[str]]:
    """Snapshot the kernel; returns it and notes on what could not be learnt.

    Only the boot-id and the release are required: without them there is
    nothing to key a record by.  Everything else degrades to ``None`` with a
    fault or a note saying why.  *kallsyms* is a read of it already made (the
    daemon's start reads it once, for this and the symbol capture).  Where it
    shows zeros, the anchors come from kernel memory: *kmem*, or one opened here.
    """
    seen = Timestamp.now()
    boot_id = read_boot_id(root)
    release = read_release(root)
    faults: list[str] = []
    try:
        version = read_version(root)
    except KernelReadError as e:
        version = ""
        faults.append(str(e))
    try:
        build_id = read_kernel_build_id(root)
    except KernelReadError as e:
        build_id = None
        faults.append(str(e))
    kptr = read_int_sysctl(root, consts.KPTR_RESTRICT)
    anchors, zeroed, reason, kallsyms = _kallsyms_anchors(root, kallsyms, kptr, faults)
    source = AddressSource.KALLSYMS if anchors.known() else None
    dirs = list(debuginfo_dirs)
    kaslr, notes = find_offset(root, anchors, build_id, release, dirs)
    if zeroed and kallsyms is not None:
        through = _through_memory(root, release, kallsyms, kmem, notes)
        if through is not None:
            anchors, source, zeroed, reason = (*through, False, None)
        elif reason is not None:
            reason = f"{reason}; kernel memory cannot be read either: {notes[-1]}"
    if (not anchors.known() or source is AddressSource.KCORE_KALLSYMS) and kaslr is not None:
        # The kernel hid its pointers from us, but VMCOREINFO gave the slide:
        # a matching vmlinux's link-time anchors, moved by it, are the runtime ones.
        moved = _vmlinux_anchors(root, release, build_id, dirs, kaslr.value, notes)
        if moved is not None:
            anchors, source = moved, AddressSource.VMLINUX
    snap = BootSnapshot(
        boot_id=boot_id,
        release=release,
        version=version,
        build_id=build_id,
        anchors=anchors,
        kaslr=kaslr,
        restricted=zeroed,
        restricted_reason=reason,
        kptr_restrict=kptr,
        first_seen=seen,
        faults=tuple(faults),
        address_source=source,
    )
    return snap, notes


def log_boot(
    log: FilteringBoundLogger, snap: BootSnapshot, added: bool, changed: bool, notes: list[str]
) -> None:
    """Log what the snapshot found (the daemon, at start and on Snapshot): one
    event per fact."""
    log.info("boot", boot_id=snap.boot_id, new=added, updated=changed)
    log.info("kernel_release", release=snap.release, version=snap.version)
    log.info("kernel_build_id", build_id=snap.build_id)
    for name, value in snap.anchors.to_ints().items():
        log.info("kernel_symbol", symbol=name, address=hexaddr(value))
    if snap.kaslr is not None:
        log.info(
            "kaslr_offset",
            offset=f"{snap.kaslr.value:#x}",
            source=snap.kaslr.source.value,
            path=snap.kaslr.path,
        )
    else:
        log.info("kaslr_offset", offset=None, source=None)
        for note in notes:
            log.debug("kaslr_source_skipped", reason=note)
    if snap.restricted:
        log.warning("addresses_restricted", reason=snap.restricted_reason)
    for fault in snap.faults:
        log.warning("kernel_read_fault", fault=fault)


def _kallsyms_anchors(
    root: Root, kallsyms: bytes | None, kptr: int | None, faults: list[str]
) -> tuple[Anchors, bool, str | None, bytes | None]:
    """The anchors kallsyms shows, whether it shows zeros and why, and its text."""
    try:
        if kallsyms is None:
            kallsyms = root.read_bytes(consts.KALLSYMS, consts.MAX_KALLSYMS)
        anchors, zeroed = read_anchors(root, kallsyms)
    except KernelReadError as e:
        faults.append(str(e))
        return Anchors(), False, None, None
    if not zeroed:
        return anchors, False, None, kallsyms
    paranoid = read_int_sysctl(root, consts.PERF_EVENT_PARANOID)
    return anchors, True, restriction_reason(kptr, paranoid, has_cap_syslog()), kallsyms


def _vmlinux_anchors(
    root: Root, release: str, build_id: str | None, dirs: list[str], offset: int, notes: list[str]
) -> Anchors | None:
    vmlinux = matching_vmlinux(root, release, build_id, dirs)
    if vmlinux is None:
        return None
    link = elf_symbols(vmlinux, set(consts.ANCHOR_SYMBOLS))
    notes.append(f"anchors from {vmlinux} moved by the KASLR offset")
    return Anchors.from_symbols(moved(link, offset))


def _through_memory(
    root: Root, release: str, kallsyms: bytes, kmem: KernelMemory | None, notes: list[str]
) -> tuple[Anchors, AddressSource] | None:
    """The anchors from kernel memory: *kmem*'s, or that of one opened now (and
    closed), and their source (a System.map checked there, or the kernel's own
    tables: a matching vmlinux still comes first then); ``None`` with the
    reason as the last of *notes*."""
    mem, why = (kmem, None) if kmem is not None else kernel_memory_for(root, kallsyms, release)
    if mem is None:
        notes.append(why or "kernel memory unreadable")
        return None
    notes.append(f"anchors from {mem.symbols_from} (VMCOREINFO's KERNELOFFSET)")
    anchors = mem.anchors()
    source = AddressSource.KCORE if mem.system_map is not None else AddressSource.KCORE_KALLSYMS
    if mem is not kmem:
        mem.close()
    return anchors, source


def kernel_memory_for(
    root: Root, kallsyms: bytes, release: str | None = None
) -> tuple[KernelMemory | None, str | None]:
    """Kernel memory opened, its System.map checked against *kallsyms*' names,
    or why it cannot be."""
    try:
        release = release or read_release(root)
    except KernelReadError as e:
        return None, str(e)
    return open_kernel_memory(root, release, kallsyms_names(kallsyms), kallsyms)


def kallsyms_names(kallsyms: bytes) -> list[bytes]:
    """The kernel's own names, in kallsyms' order (its addresses may be zeros)."""
    return [name for _v, _t, name in KallsymsText.of(kallsyms, 0).core()]
