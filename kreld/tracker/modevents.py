"""Module loads and frees from the module tracepoints, as a source of hints
for the module tracker (kreld/kernel/modtrace.py reads the rings)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from kreld.core.errors import KernelReadError
from kreld.core.model import HintAction, ModuleState, SeenBy, Timestamp
from kreld.core.supervise import supervisor
from kreld.kernel.modtrace import ModuleTrace, ModuleTraceRings, TraceEvent
from kreld.tracker.modules_plan import Hint

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from kreld.kernel.addresses import ModuleAddresses
    from kreld.kernel.info import Root

__all__ = ["FAKE_ROOT", "NotifyAll", "TracepointSource", "open_tracepoints", "start_tracepoints"]

FAKE_ROOT = "kreld does not run on the real root"


class NotifyAll(Protocol):
    """Hints that belong together (one drain of the tracepoint rings), queued as one."""

    def __call__(self, hints: list[Hint]) -> None: ...


# Seconds between looks for CPUs come online (their rings opened then) while no
# record comes: a CPU's records between its coming online and this look are
# lost, and the full look that follows finds what they told.
_CPU_CHECK = 60.0


class TracepointSource:
    """Module loads and frees from the module tracepoints (kreld/kernel/modtrace.py).

    Opened first of all by the daemon (:func:`open_tracepoints`), and started
    at once: a load during kreld's own start (a vmlinux read, the store's
    checks) has its sections read at once by *read* and its hint held until
    the tracker is bound (:meth:`bind`).  A ring that overflowed asks for a
    full look (``rescan``); each hint carries the record's exact time.
    """

    name = "tracepoint"

    def __init__(
        self,
        rings: ModuleTraceRings | None,
        reason: str | None,
        log: FilteringBoundLogger,
    ) -> None:
        self.rings = rings
        self.reason = reason  # why the tracepoints are not followed
        self.log = log
        self.healthy = True  # False once it failed while following
        self.last_error: str | None = None
        self.records = 0
        self.lost = 0
        self.read: Callable[[str], ModuleState | None] | None = None
        self._notify: NotifyAll | None = None
        self._held: list[Hint] = []
        self._lock = threading.Lock()
        self._draining = threading.Lock()  # its thread, or the tracker catching up
        self._thread: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None

    @property
    def events(self) -> int:
        return self.records

    def following(self) -> bool:
        return self.rings is not None

    def bind(self, notify: NotifyAll) -> None:
        """Hand every hint from now on, and those held since the start, to *notify*."""
        with self._lock:
            self._notify = notify
            held, self._held = self._held, []
        if held:
            notify(held)

    def start(self, stop: threading.Event) -> None:
        if self.rings is None or self._thread is not None:
            return
        self._wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # It may end by itself when its rings are closed: only an exception is a failure.
        self._thread = supervisor().thread("module-tracepoints", self._run, stop, forever=False)

    def _run(self, stop: threading.Event) -> None:
        import select

        last_cpus = time.monotonic()
        while not stop.is_set() and self.rings is not None:
            try:
                poller = select.poll()
                for fd in self.rings.fds():
                    poller.register(fd, select.POLLIN)
                if self._wake is not None:
                    poller.register(self._wake[0], select.POLLIN)
                poller.poll(int(_CPU_CHECK * 1000))
                if stop.is_set():
                    break
                self.step()
                if time.monotonic() - last_cpus >= _CPU_CHECK:
                    last_cpus = time.monotonic()
                    if self.rings.reopen():
                        self.log.info("module_tracepoint_cpus", cpus=self.rings.cpus())
                        self._hand([Hint(SeenBy.TRACEPOINT, HintAction.RESCAN, None)])
            except (KernelReadError, OSError) as e:
                self.healthy, self.last_error = False, str(e)
                self.log.error("module_tracepoints_failed", error=str(e))
                self._hand([Hint(SeenBy.TRACEPOINT, HintAction.RESCAN, None)])
                return

    def step(self) -> None:
        """Drain the rings: a hint per load or free, at its time; a rescan on a loss."""
        with self._draining:
            self._step()

    def _step(self) -> None:
        if self.rings is None:
            return
        drained = self.rings.drain()
        if not drained.traces and not drained.lost:
            return
        stamp = _stamper()
        hints = [self._hint(t, stamp(t.time)) for t in drained.traces]
        self.records += len(drained.traces)
        if drained.lost:
            self.lost += drained.lost
            self.log.warning("module_tracepoint_records_lost", lost=drained.lost, action="rescan")
            hints.append(Hint(SeenBy.TRACEPOINT, HintAction.RESCAN, None))
        self._hand(hints)

    def _hint(self, t: ModuleTrace, at: Timestamp) -> Hint:
        if t.event is TraceEvent.FREE:
            return Hint(SeenBy.TRACEPOINT, HintAction.REMOVE, t.name, at)
        state = None
        if self.read is not None:  # at once: the module may be gone by the tracker's look
            try:
                state = self.read(t.name)
            except KernelReadError as e:
                self.log.warning("module_read_at_load_failed", module=t.name, error=str(e))
        self.log.debug("module_tracepoint", tracepoint=t.event.value, module=t.name, time=t.time)
        return Hint(SeenBy.TRACEPOINT, HintAction.ADD, t.name, at, state)

    def _hand(self, hints: list[Hint]) -> None:
        with self._lock:
            notify = self._notify
            if notify is None:
                self._held += hints
                return
        notify(hints)

    def stop(self) -> None:
        if self._wake is not None:
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake[1], b"!")
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._thread is None or not self._thread.is_alive():
            if self._wake is not None:
                for fd in self._wake:
                    os.close(fd)
                self._wake = None
            if self.rings is not None:
                self.rings.close()
                self.rings = None

    def status(self) -> dict[str, Any]:
        """What Status says of following modules by their tracepoints."""
        return {
            "state": "open" if self.rings is not None else "unavailable",
            "reason": self.reason,
            "cpus": 0 if self.rings is None else self.rings.cpus(),
            "records": self.records,
            "lost": self.lost,
        }


def _stamper() -> Callable[[int], Timestamp]:
    """CLOCK_MONOTONIC ns to the three clocks, at their offsets now."""
    now = Timestamp.now()
    boot, real = now.boottime - now.monotonic, now.realtime - now.monotonic
    return lambda t: Timestamp(t, t + boot, t + real)


def open_tracepoints(
    root: Root, log: FilteringBoundLogger, *, enabled: bool = True
) -> TracepointSource:
    """The module tracepoints' rings, opened now (before anything slow), or
    the reason they cannot be: off in the configuration, a fake root (its
    kernel is not this one), no tracefs, no privilege, no perf_event_open."""
    if not enabled:
        return TracepointSource(
            None, "turned off in the configuration ([modules] tracepoints = false)", log
        )
    if os.path.realpath(root.path) != "/":
        return TracepointSource(None, FAKE_ROOT, log)
    try:
        rings = ModuleTraceRings(root)
    except KernelReadError as e:
        log.warning("module_tracepoints_unavailable", reason=str(e))
        return TracepointSource(None, str(e), log)
    log.info("module_tracepoints", cpus=rings.cpus())
    return TracepointSource(rings, None, log)


def start_tracepoints(
    root: Root,
    addresses: ModuleAddresses,
    stop: threading.Event,
    log: FilteringBoundLogger,
    *,
    enabled: bool = True,
) -> TracepointSource:
    """:func:`open_tracepoints`, each load's state read at once with *addresses*,
    and the source started: the daemon's first step."""
    from kreld.kernel.modules_sysfs import read_proc_modules

    src = open_tracepoints(root, log, enabled=enabled)
    src.read = lambda name: addresses.read([name], read_proc_modules(root)).get(name)
    src.start(stop)
    return src
