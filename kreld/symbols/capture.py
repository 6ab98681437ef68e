"""The worker that keeps the symbol cache filled as modules load: when to read
kallsyms, and for which loads.  Where each table comes from (kallsyms, kernel
memory, a vmlinux, a ``.ko``) is :mod:`kreld.symbols.table_sources`.

A worker thread does the reading, coalescing a burst of module loads into one
read of kallsyms, so the tracker never waits.  A batch whose tables could not
be stored (a full disk) is held and tried again, backing off.

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
from collections.abc import Callable
from typing import TYPE_CHECKING

from kreld.core import consts, heap
from kreld.core.errors import KernelReadError, KreldError
from kreld.core.model import Incarnation
from kreld.core.stopping import wake_on_stop
from kreld.core.supervise import supervisor
from kreld.kernel.kallsyms import KallsymsText
from kreld.symbols.table_sources import TableSources

if TYPE_CHECKING:
    pass

__all__ = ["SymbolCapture"]

# A batch whose tables could not be stored is tried again after this many
# seconds, doubling up to RETRY_MAX while the store keeps failing.
RETRY_FIRST = 1.0
RETRY_MAX = 60.0
# How long the worker stands aside while the tracker reads modules, at most.
DEFER_MAX = 1.0


class SymbolCapture:
    """Keeps the symbol cache filled for one boot (a worker thread)."""

    def __init__(self, tables: TableSources, defer: Callable[[], bool] | None = None) -> None:
        """A worker storing through *tables* (the boot's, its store, root and log);
        *defer* says when capture should wait (the tracker has modules to read)."""
        self.tables = tables
        self.root = tables.root
        self.log = tables.log
        self._pending: queue.SimpleQueue[Incarnation | _Wake | None] = queue.SimpleQueue()
        # Loads given to this worker, and those it has dealt with (their table
        # captured, found stored already, or found gone): equal when it has
        # nothing left to do.
        self.loads_queued = 0
        self.loads_handled = 0
        self.healthy = True
        self.last_error: str | None = None
        self.name = "symbols"
        self.idle = threading.Event()
        self.defer = defer
        self._initial: KallsymsText | None = None
        self._kernel_done = False  # the kernel's table captured

    @property
    def events(self) -> int:
        return self.tables.captured

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
        if not whole and not any(self._loaded(i) and self.tables.needs_kallsyms(i) for i in incs):
            ks = None
        else:
            ks = self._read(whole)
        if whole:
            self.tables.capture_kernel(ks)
            self._kernel_done = True
        missing = self.tables.capture_modules(incs, ks, stale=stale and ks is not None)
        if missing:
            # Loaded after the start's read: a read of now shows them.
            self.tables.capture_modules(missing, self._read(whole=False))
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


class _Wake:
    """What stop puts in the capture queue to end a blocked wait."""


_WAKE = _Wake()


def _until(when: float, cap: float | None) -> float:
    """Seconds until monotonic *when* (none past), at most *cap* where given."""
    left = max(0.0, when - time.monotonic())
    return left if cap is None else min(left, cap)
