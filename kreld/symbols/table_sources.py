"""Where a symbol table comes from, and storing it: the kernel's once per
build, each module's once per module build.

The kernel's table is kallsyms' core lines; where the kernel hides its
pointers (``kptr_restrict=2``), the same lines with their addresses read from
kernel memory, and failing that a vmlinux whose build-id matches.  A module's
is its kallsyms lines (their addresses from kernel memory under
``kptr_restrict=2``), else its ``.ko`` (also ``.ko.xz`` and ``.ko.zst``, found
under ``lib/modules/<release>`` with a matching build-id, read by
:mod:`kreld.kernel.modfile`); a table read from a ``.ko`` is replaced once
kallsyms shows the module.  A load of a build already stored adds only its
per-cpu values where they differ.  When to read kallsyms, and for which loads,
is the capture worker's (:mod:`kreld.symbols.capture`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kreld.core.errors import KernelReadError
from kreld.core.model import AddressSource, BootSnapshot, Incarnation, ModuleState
from kreld.core.symtab import (
    FROM_ELF,
    MODULE_ABSOLUTE,
    SymbolTable,
    kernel_symbol_key,
    kernel_table,
    module_symbol_key,
    module_table,
)
from kreld.kernel.addresses import ModuleAddresses
from kreld.kernel.elf import elf_symbol_entries, elf_symbols
from kreld.kernel.info import Root
from kreld.kernel.kallsyms import KallsymsText, Line
from kreld.kernel.kaslr import matching_vmlinux
from kreld.kernel.modfile import ModuleFiles
from kreld.kernel.modules_sysfs import list_modules
from kreld.kernel.seethrough import kernel_lines
from kreld.store import Store
from kreld.symbols.sections import init_gone, section_sizes

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

__all__ = ["TableSources", "absolute_entries"]


class _Quiet:
    """A logger that says nothing (kreldctl's own snapshot)."""

    def __getattr__(self, _name: str) -> Any:
        return lambda *args, **kwargs: None


class TableSources:
    """Makes and stores the symbol tables of one boot, from the kallsyms read
    it is given, kernel memory, a vmlinux or a module's file."""

    def __init__(
        self,
        store: Store,
        root: Root,
        boot: BootSnapshot,
        log: FilteringBoundLogger | None,
        extra_dirs: Iterable[str] = (),
        addresses: ModuleAddresses | None = None,
    ) -> None:
        self.store = store
        self.root = root
        self.boot = boot
        self.log: FilteringBoundLogger | _Quiet = log if log is not None else _Quiet()
        self.dirs = list(extra_dirs)
        self.files = ModuleFiles(root, boot.release, self.dirs)
        # kptr_restrict=2: the daemon's kernel memory, opened when the tracker
        # first saw zeros.
        self.addresses = addresses if addresses is not None else ModuleAddresses(root)
        self.captured = 0  # tables stored

    def needs_kallsyms(self, inc: Incarnation) -> bool:
        """Whether capturing *inc* needs kallsyms: its build has no table from
        kallsyms yet, or that table keeps per-cpu values this load may move."""
        s = inc.state
        key = module_symbol_key(s.build_id, s.name, s.srcversion)
        if key is None:
            return False
        if self.store.symbols.table_source(key) in (None, FROM_ELF):
            return True
        return bool(self.store.with_tables([key], lambda t: absolute_entries(t.get(key))))

    def capture_kernel(self, ks: KallsymsText | None) -> None:
        """The kernel's table: from kallsyms, or where the kernel hid its
        pointers, from a vmlinux whose build-id matches (relative to its
        link-time ``_text``)."""
        text = self.boot.anchors.text
        if self.store.boot_symbols(self.boot.boot_id) is not None:
            return
        kmem = self.addresses.memory
        if ks is not None and ks.zeroed() and kmem is not None and text is not None:
            # kptr_restrict=2: kallsyms' own lines, their addresses from kernel memory.
            try:
                from_vmlinux = self.boot.address_source is AddressSource.VMLINUX
                ks, fields = kernel_lines(ks, kmem, from_vmlinux)
                self.log.info("kernel_symbols_from_memory", **fields)
            except KernelReadError as e:  # the map changed since it was checked
                self.log.warning("kernel_symbols_unreadable", error=str(e))
        if ks is not None and ks.zeroed():
            # Pointers hidden since the boot was recorded (a restart after
            # kptr_restrict went up): zeros are no table.
            self.log.warning("kernel_symbols_zeroed", reason="kallsyms shows zero addresses")
            ks = None
        if ks is not None and text is not None and not self.boot.restricted:
            key = kernel_symbol_key(self.boot.build_id, self.boot.boot_id)
            packed = kernel_table(ks.core(), text)
            extras = ks.owned(set(list_modules(self.root)))
            n = SymbolTable(packed).count
        else:
            vmlinux = matching_vmlinux(self.root, self.boot.release, self.boot.build_id, self.dirs)
            link = elf_symbols(vmlinux, {"_text"}).get("_text") if vmlinux else None
            if vmlinux is None or link is None or self.boot.build_id is None:
                self.log.info("kernel_symbols_unavailable", restricted=self.boot.restricted)
                return
            entries = elf_symbol_entries(vmlinux)
            key, packed, extras, n = (
                f"v:{self.boot.build_id}",
                kernel_table(entries, link, FROM_ELF),
                [],
                len(entries),
            )
            self.log.info("kernel_symbols_from_vmlinux", path=str(vmlinux))
        used, action = self.store.symbols.record_kernel_table(
            self.boot.boot_id, key, packed, extras
        )
        self.captured += 1
        if action == "differs":
            self.log.warning(
                "kernel_symbols_differ_from_build", build_id=self.boot.build_id, table=used
            )
        else:
            self.log.info("kernel_symbols", table=used, action=action, symbols=n, bytes=len(packed))

    def capture_modules(
        self, incs: list[Incarnation], ks: KallsymsText | None, stale: bool = False
    ) -> list[Incarnation]:
        """Each load's build gets a table: from kallsyms, else from its ``.ko``.

        A table read from a ``.ko`` (the module gone from kallsyms before it
        was read, or its lines not matching) lacks what the kernel adds, so a
        later load that kallsyms shows replaces it.  With *stale* (*ks* may be
        older than some loads), the loads *ks* does not show are left alone and
        returned, for a read of now."""
        missing: list[Incarnation] = []
        for inc in incs:
            s = inc.state
            key = module_symbol_key(s.build_id, s.name, s.srcversion)
            if key is None:
                continue
            lines = ks.module(s.name) if ks is not None else None
            source = "kallsyms"
            if lines and not any(v for v, _t, _n in lines):
                # kptr_restrict=2: names without addresses are no table; kernel memory has one
                mem = self.addresses.memory  # opened when the tracker first saw zeros
                lines, source = (mem.symbols(s) if mem else None), "kcore"
            if stale and not lines and not s.restricted:
                missing.append(inc)
                continue
            stored = self.store.symbols.table_source(key)
            if stored is not None and stored != FROM_ELF:
                self._capture_absolutes(inc, key, lines)
                continue
            packed = None
            if lines and not s.restricted:
                packed = module_table(lines, s.sections, section_sizes(inc))
            if packed is not None and lines and init_gone(inc, lines):  # read late
                packed, source = _with_init_of_ko(self.files, inc, lines, packed, source)
            if packed is not None and stored is not None:
                self.store.symbols.put_table(key, packed, replace=True)
                self.captured += 1
                self.log.info(
                    "module_symbols", module=s.name, build_id=s.build_id, source=source,
                    replaced="ko",
                )  # fmt: skip
                continue
            if stored is not None:
                continue  # the .ko's table stays until kallsyms shows the module
            if packed is None:
                packed, source = _from_file(self.files, s, self.log), "ko"
            if packed is None:
                self.log.info("module_symbols_unavailable", module=s.name, build_id=s.build_id)
                continue
            if self.store.symbols.put_table(key, packed):
                self.captured += 1
                self.log.info("module_symbols", module=s.name, build_id=s.build_id, source=source)
        return missing

    def _capture_absolutes(self, inc: Incarnation, key: str, lines: list[Line] | None) -> None:
        """A load of a build whose table is stored: its per-cpu variables print
        at this load's per-cpu offsets (type ``a``), which the table holds for
        the load it was captured on; keep this load's where they differ."""
        s = inc.state
        if not lines or s.restricted:
            return
        printed = [(v, name.decode("utf-8", "replace")) for v, t, name in lines if t in b"aA"]
        if not printed or module_table(lines, s.sections, section_sizes(inc)) is None:
            return  # nothing absolute, or the lines are another load's
        stored = self.store.with_tables([key], lambda tables: absolute_entries(tables.get(key)))
        if [n for _, n in printed] != [n for _, n in stored]:
            # A table read from the .ko keeps no per-cpu entries of its own.
            self.log.debug("module_absolutes_not_kept", module=s.name, build_id=s.build_id)
            return
        values = [v for v, _ in printed]
        if values != [v for v, _ in stored]:
            self.store.symbols.put_absolutes(inc.boot_id, inc.seq, values)
            self.log.info("module_absolute_values", module=s.name, seq=inc.seq, count=len(values))


def _from_file(
    files: ModuleFiles, s: ModuleState, log: FilteringBoundLogger | _Quiet
) -> bytes | None:
    """A module's table from its own file; each file refused is logged."""
    refused: list[str] = []
    packed = files.table(s.name, s.build_id, refused)
    for why in refused:
        log.warning("module_file_refused", module=s.name, error=why)
    return packed


def _with_init_of_ko(
    files: ModuleFiles, inc: Incarnation, lines: list[Line], packed: bytes, source: str
) -> tuple[bytes, str]:
    """kallsyms' lines of a load read after its init ended, with the init
    symbols its ``.ko`` names placed at the load's init bases: the rest as the
    kernel shows it (a ``.ko`` alone lacks what the kernel adds and what lies
    in sections sysfs does not list, such as an empty ``.bss``)."""
    ko = files.table(inc.state.name, inc.state.build_id, [])
    if ko is None:
        return packed, source
    table = SymbolTable(ko)
    bases = inc.state.sections
    init = [
        (bases[sec] + e.value, e.type.encode(), e.name.encode())
        for e in table
        if (sec := table.sections[e.section] if e.section < len(table.sections) else "")
        and sec.startswith(".init")
        and sec in bases
    ]
    merged = module_table([*lines, *init], bases, section_sizes(inc)) if init else None
    return (packed, source) if merged is None else (merged, f"{source}+ko")


def absolute_entries(table: SymbolTable | None) -> list[tuple[int, str]]:
    """(value, name) of a module table's absolute entries, in the kernel's order."""
    if table is None:
        return []
    idx = table.section_index(MODULE_ABSOLUTE)
    return [] if idx is None else [(e.value, e.name) for e in table if e.section == idx]
