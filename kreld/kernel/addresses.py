"""How to read a module's addresses now: in sysfs, or where the kernel shows
zeros there (``kptr_restrict=2``, also when raised while kreld runs) in
kernel memory, opened the first time it is needed.

One :class:`ModuleAddresses` per daemon, shared by the tracker (section
bases), the symbol capture (a module's own table) and the snapshot (the
kernel's anchors).  A failed open is tried again at most once per
``consts.KERNEL_MEMORY_RETRY`` seconds, with the same checks as at start
(``kernel_memory_for``); until then restricted reads carry the reason.
Once open, kernel memory stays open: a read that sysfs answers (the
kernel's pointers shown again) never touches it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from kreld.core import consts
from kreld.core.errors import KernelReadError
from kreld.core.model import AddressSource, ModuleState
from kreld.core.record import replace
from kreld.kernel.info import Root
from kreld.kernel.kallsyms import KallsymsText
from kreld.kernel.modules_sysfs import ProcModule, read_module
from kreld.kernel.seethrough import KernelMemory, not_yet, see_through
from kreld.kernel.snapshot import kernel_memory_for

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

__all__ = ["ModuleAddresses"]


class ModuleAddresses:
    """Reads modules' addresses from sysfs, or from kernel memory opened lazily."""

    def __init__(
        self,
        root: Root,
        log: FilteringBoundLogger | None = None,
        *,
        retry_interval: float = consts.KERNEL_MEMORY_RETRY,
    ) -> None:
        self.root = root
        self.log = log
        self.retry_interval = retry_interval
        self.memory: KernelMemory | None = None
        self.why: str | None = None  # why kernel memory is not open (after a try)
        self._tried: float | None = None  # monotonic seconds of the last failed try
        self._lock = threading.Lock()
        # How the last read that found a module went: zeros in sysfs or not, and
        # whether kernel memory answered (None: no read found one yet).
        self.last: tuple[bool, bool] | None = None

    def open(self, kallsyms: bytes | None = None) -> KernelMemory | None:
        """Kernel memory, opened now if it is not yet and no try failed within
        the retry interval; *kallsyms*: a read of it already made (zeroed)."""
        with self._lock:
            if self.memory is not None:
                return self.memory
            now = time.monotonic()
            if self._tried is not None and now - self._tried < self.retry_interval:
                return None
            if kallsyms is None:
                try:
                    kallsyms = KallsymsText.read(self.root).data
                except KernelReadError as e:
                    self._failed(now, str(e))
                    return None
            self.memory, why = kernel_memory_for(self.root, kallsyms)
            if self.memory is None:
                self._failed(now, why or "kernel memory unreadable")
                return None
            self.why = None
            if self.log is not None:
                self.log.info(
                    "kernel_memory",
                    system_map=self.memory.system_map,
                    symbols=self.memory.symbols_from,
                    why=None,
                )
            return self.memory

    def _failed(self, now: float, why: str) -> None:
        self._tried, self.why = now, why
        if self.log is not None:
            self.log.info("kernel_memory", system_map=None, why=why)

    def read(
        self, names: Iterable[str], proc: Mapping[str, ProcModule]
    ) -> dict[str, ModuleState | None]:
        """Read *names* in sysfs; where it shows zeros, with their sections from
        kernel memory (one walk of the module list for them all), or with the
        reason kernel memory cannot be read among their faults."""
        states = {n: read_module(self.root, n, proc) for n in names}
        hidden = {n for n, s in states.items() if s is not None and s.restricted}
        if not hidden:
            if any(s is not None for s in states.values()):
                self.last = (False, False)
            return states
        memory = self.open()
        self.last = (True, memory is not None)
        if memory is None:
            why = f"kernel memory: {self.why}"
            return {
                n: replace(s, faults=(*s.faults, why)) if n in hidden and s is not None else s
                for n, s in states.items()
            }
        try:
            found = memory.modules(hidden)
        except KernelReadError as e:
            if self.log is not None:
                self.log.warning("kernel_memory_walk_failed", error=str(e), kind=type(e).__name__)
            return {
                n: not_yet(s, str(e)) if n in hidden and s is not None else s
                for n, s in states.items()
            }
        return {n: None if s is None else see_through(s, found.get(n)) for n, s in states.items()}

    def reading(
        self, start: tuple[bool, str | None, AddressSource | None]
    ) -> tuple[bool, str | None, AddressSource | None]:
        """(restricted, why, source) of reading addresses now, for Status: as at
        the *start* until a module is read; then as the last module read went
        (pointers shown: kallsyms; hidden: kernel memory, or restricted and why)."""
        if self.last is None:
            return start
        hidden, through_memory = self.last
        if not hidden:  # shown again (or all along)
            shown = not start[0] and start[2] is not AddressSource.KCORE
            return start if shown else (False, None, AddressSource.KALLSYMS)
        if through_memory:
            return (False, None, AddressSource.KCORE)
        return (True, f"kernel memory: {self.why}", None)

    def close(self) -> None:
        with self._lock:
            if self.memory is not None:
                self.memory.close()
                self.memory = None
