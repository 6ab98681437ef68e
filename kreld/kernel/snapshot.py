"""Putting the readers together: one snapshot of the running kernel."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kreld.core import consts
from kreld.core.errors import KernelReadError
from kreld.core.model import Anchors, BootSnapshot, Timestamp, hexaddr
from kreld.kernel.elf import elf_symbols
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
from kreld.kernel.kaslr import find_offset, matching_vmlinux

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

__all__ = ["log_boot", "take_snapshot"]


def take_snapshot(
    root: Root, debuginfo_dirs: Iterable[str] = (), kallsyms: bytes | None = None
) -> tuple[BootSnapshot, list[str]]:
    """Snapshot the kernel; returns it and notes on what could not be learnt.

    Only the boot-id and the release are required: without them there is
    nothing to key a record by.  Everything else degrades to ``None`` with a
    fault or a note saying why.  *kallsyms* is a read of it already made (the
    daemon's start reads it once, for this and the symbol capture).
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
    try:
        anchors, zeroed = read_anchors(root, kallsyms)
    except KernelReadError as e:
        anchors, zeroed = Anchors(), False
        faults.append(str(e))
    reason = None
    if zeroed:
        reason = restriction_reason(
            kptr, read_int_sysctl(root, consts.PERF_EVENT_PARANOID), has_cap_syslog()
        )
    dirs = list(debuginfo_dirs)
    kaslr, notes = find_offset(root, anchors, build_id, release, dirs)
    if not anchors.known() and kaslr is not None:
        # The kernel hid its pointers from us, but VMCOREINFO gave the slide:
        # a matching vmlinux's link-time anchors, moved by it, are the runtime ones.
        vmlinux = matching_vmlinux(root, release, build_id, dirs)
        if vmlinux is not None:
            link = elf_symbols(vmlinux, set(consts.ANCHOR_SYMBOLS))
            anchors = Anchors.from_symbols({k: v + kaslr.value for k, v in link.items()})
            notes.append(f"anchors from {vmlinux} moved by the {kaslr.source.value} offset")
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
