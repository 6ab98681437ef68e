"""Filling the symbol cache: the kernel's table once per build, each module's
once per module build.

Tables come from ``/proc/kallsyms`` (what the kernel itself prints) and, for
a module kallsyms does not show (restricted pointers), from its ``.ko``
(also ``.ko.xz`` and ``.ko.zst``) found under ``lib/modules/<release>`` with
a build-id that must match (read by :mod:`kreld.kernel.modfile`).  A worker
thread does the reading, coalescing a burst of module loads into one read of
kallsyms, so the tracker never waits.

The worker never parses all of kallsyms for a module: it takes the module's
lines out of the raw text (:class:`kreld.kernel.kallsyms.KallsymsText`), and once
the kernel's table is captured it keeps only the text's bracketed tail, the
core lines streamed through a small buffer and dropped.  It reads kallsyms
only for loads that need it (still loaded, and of a build with no table yet
or one whose table keeps per-cpu values), and it stands aside while the
tracker is reading a module's sections: those vanish with the module, a
table does not.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kreld.core import consts, heap
from kreld.core.errors import KernelReadError, KreldError
from kreld.core.model import AddressSource, BootSnapshot, Incarnation, ModuleState
from kreld.core.stopping import wake_on_stop
from kreld.core.supervise import supervisor
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

__all__ = ["SymbolCapture"]

# A batch whose tables could not be stored is tried again after this many
# seconds, doubling up to RETRY_MAX while the store keeps failing.
RETRY_FIRST = 1.0
RETRY_MAX = 60.0
# How long the worker stands aside while the tracker reads modules, at most.
DEFER_MAX = 1.0


class _Quiet:
    """A logger that says nothing (kreldctl's own snapshot)."""

    def __getattr__(self, _name: str) -> Any:
        return lambda *args, **kwargs: None


class SymbolCapture:
    """Keeps the symbol cache filled for one boot (a worker thread)."""

    def __init__(
        self,
        store: Store,
        root: Root,
        boot: BootSnapshot,
        log: FilteringBoundLogger | None,
        extra_dirs: Iterable[str] = (),
        defer: Callable[[], bool] | None = None,
    ) -> None:
        self.store = store
        self.root = root
        self.boot = boot
        self.log: FilteringBoundLogger | _Quiet = log if log is not None else _Quiet()
        self.dirs = list(extra_dirs)
        self.files = ModuleFiles(root, boot.release, self.dirs)
        self._pending: queue.SimpleQueue[Incarnation | _Wake | None] = queue.SimpleQueue()
        self.captured = 0
        # Loads given to this worker, and those it has dealt with (their table
        # captured, found stored already, or found gone): equal when it has
        # nothing left to do.
        self.loads_queued = 0
        self.loads_handled = 0
        self.addresses = ModuleAddresses(root)  # kptr_restrict=2: the daemon's kernel memory
        self.healthy = True
        self.last_error: str | None = None
        self.name = "symbols"
        self.idle = threading.Event()
        # True while capture should wait (the tracker has modules to read).
        self.defer = defer
        self._initial: KallsymsText | None = None
        self._kernel_done = False  # the kernel's table captured

    @property
    def events(self) -> int:
        return self.captured

    def on_event(self, kind: str, inc: Incarnation) -> None:
        """A tracker listener: queue each new load whose build has no table yet."""
        if kind == "load":
            self.idle.clear()
            self.loads_queued += 1
            self._pending.put(inc)

    def start(
        self,
        stop: threading.Event,
        loaded: list[Incarnation],
        kallsyms: KallsymsText | None = None,
    ) -> None:
        """Capture the kernel's table and *loaded*'s, then follow loads.  The
        start's own read of kallsyms (*kallsyms*) serves the first turn."""
        self.idle.clear()
        self._initial = kallsyms
        for inc in loaded:
            self._pending.put(inc)
        self.loads_queued += len(loaded)
        self._pending.put(None)  # marks the kernel's turn, first
        supervisor().thread("symbols", self._run, stop)

    def _run(self, stop: threading.Event) -> None:
        self._kernel_done = False
        held: list[Incarnation | None] = []  # a batch whose capture failed, for a retry
        backoff = RETRY_FIRST
        retry_at = 0.0
        # Blocks until a load comes, a retry is due or stop is set: an idle
        # daemon's capture thread does not wake.
        fallback = wake_on_stop(stop, lambda: self._pending.put(_WAKE))
        while not stop.is_set():
            if held and time.monotonic() >= retry_at:
                for inc in held:
                    self._pending.put(inc)
                held = []
            try:
                first = self._pending.get(timeout=_until(retry_at, fallback) if held else fallback)
            except queue.Empty:
                if not held:
                    self.idle.set()
                continue
            if isinstance(first, _Wake):
                continue
            batch = self._gather(first, stop)
            self._stand_aside(stop)
            try:
                self._capture_batch([i for i in batch if i is not None])
            except KreldError as e:
                # A store error (a full disk): nothing of the batch is lost,
                # it is tried again later, as new loads come or after a while.
                self.healthy = False
                self.last_error = str(e)
                held = [*held, *batch]
                retry_at = time.monotonic() + backoff
                self.log.error(
                    "symbol_capture_failed",
                    error=str(e),
                    kind=type(e).__name__,
                    held=len(held),
                    retry_in_s=backoff,
                )
                backoff = min(backoff * 2, RETRY_MAX)
                continue
            if not self.healthy:
                self.healthy = True
                self.log.info("symbol_capture_recovered", last_error=self.last_error)
            backoff = RETRY_FIRST
            self.loads_handled += sum(i is not None for i in batch)
            if self._pending.empty() and not held:
                self.idle.set()

    def _gather(self, first: Incarnation | None, stop: threading.Event) -> list[Incarnation | None]:
        """*first* and the loads queued behind it: a burst becomes one read."""
        batch = [first]
        stop.wait(0.05)
        while True:
            try:
                item = self._pending.get_nowait()
            except queue.Empty:
                return batch
            if not isinstance(item, _Wake):
                batch.append(item)

    def _capture_batch(self, incs: list[Incarnation]) -> None:
        """The kernel's table (first time) and *incs*' tables, from one read of
        kallsyms where any needs it."""
        stale = self._initial is not None
        whole = not self._kernel_done
        if not whole and not any(self._loaded(i) and self._needs_kallsyms(i) for i in incs):
            ks = None
        else:
            ks = self._read(whole)
        if whole:
            self.capture_kernel(ks)
            self._kernel_done = True
        missing = self.capture_modules(incs, ks, stale=stale and ks is not None)
        if missing:
            # Loaded after the start's read: a read of now shows them.
            self.capture_modules(missing, self._read(whole=False))
        if ks is not None and whole:
            # The raw text (megabytes) must not outlive its batch: drop it and
            # give the heap it grew back (see kreld.core.heap).  A read of the
            # tail alone never held the core lines.
            del ks
            heap.trim()

    def _stand_aside(self, stop: threading.Event) -> None:
        """Wait (up to DEFER_MAX) while the tracker is reading modules."""
        if self.defer is None:
            return
        deadline = time.monotonic() + DEFER_MAX
        while self.defer() and time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.002)

    def _loaded(self, inc: Incarnation) -> bool:
        """Whether *inc* is still loaded (its sysfs directory the one it was read
        from).  Once it is not, kallsyms shows none of its lines:
        free_module() (kernel/module/main.c) tears down the module's sysfs
        directory, then marks it MODULE_STATE_UNFORMED, which
        module_get_kallsym() skips.  So a load gone before its batch (a burst
        unloaded at once) costs no read."""
        if inc.state.inode is None:
            return True
        try:
            return os.stat(self.root / consts.SYS_MODULE / inc.name).st_ino == inc.state.inode
        except OSError:
            return False

    def _needs_kallsyms(self, inc: Incarnation) -> bool:
        """Whether capturing *inc* needs kallsyms: its build has no table from
        kallsyms yet, or that table keeps per-cpu values this load may move."""
        s = inc.state
        key = module_symbol_key(s.build_id, s.name, s.srcversion)
        if key is None:
            return False
        if self.store.symbols.table_source(key) in (None, FROM_ELF):
            return True
        return bool(self.store.with_tables([key], lambda t: absolute_entries(t.get(key))))

    def _read(self, whole: bool) -> KallsymsText | None:
        """The start's read, the first time; then a read of now: of all of
        kallsyms when *whole* (the kernel's table), else of its bracketed tail
        only (modules' lines)."""
        if self._initial is not None:
            ks, self._initial = self._initial, None
            return ks
        try:
            ks = KallsymsText.read(self.root) if whole else KallsymsText.read_tail(self.root)
        except KernelReadError as e:
            self.log.warning("kallsyms_unreadable", error=str(e))
            return None
        return ks

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


class _Wake:
    """What stop puts in the capture queue to end a blocked wait."""


_WAKE = _Wake()


def _until(when: float, cap: float | None) -> float:
    """Seconds until monotonic *when* (none past), at most *cap* where given."""
    left = max(0.0, when - time.monotonic())
    return left if cap is None else min(left, cap)
