"""Event sources that hint the module tracker: kernel uevents and watchdog.

None of them is trusted alone: each only says "look again", and the tracker
reconciles against ``sys/module``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)

from kreld.core.errors import KernelReadError
from kreld.core.model import HintAction, ModuleState, SeenBy, Timestamp
from kreld.core.record import record
from kreld.kernel.modtrace import ModuleTrace, ModuleTraceRings, TraceEvent
from kreld.tracker.reconcile import Hint

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from kreld.config.settings import Config
    from kreld.kernel.info import Root

__all__ = [
    "SYSFS_MAGIC",
    "WATCHED",
    "DirentListing",
    "EventSource",
    "Health",
    "Notify",
    "NotifyAll",
    "TracepointSource",
    "Uevent",
    "UeventSource",
    "WatchSource",
    "event_sources",
    "health",
    "is_sysfs",
    "module_event",
    "open_tracepoints",
    "parse_uevent",
    "poll_interval",
]

SYSFS_MAGIC = 0x62656572  # include/uapi/linux/magic.h


class Notify(Protocol):
    def __call__(self, source: SeenBy, action: HintAction, name: str | None = None) -> None: ...


class NotifyAll(Protocol):
    """Hints that belong together (one drain of the tracepoint rings), queued as one."""

    def __call__(self, hints: list[Hint]) -> None: ...


class Health(Protocol):
    """What Status says of a source of events (its ``sources`` member)."""

    name: str
    healthy: bool
    last_error: str | None

    @property
    def events(self) -> int: ...


def health(s: Health) -> dict[str, Any]:
    return {"name": s.name, "healthy": s.healthy, "events": s.events, "last_error": s.last_error}


class EventSource(Health, Protocol):
    """What the daemon starts, stops and reports on."""

    def start(self, stop: threading.Event) -> None: ...

    def stop(self) -> None: ...


@record
class Uevent:
    action: str
    devpath: str
    subsystem: str | None
    properties: Mapping[str, str]


def parse_uevent(raw: bytes) -> Uevent | None:
    """Parse a kernel uevent datagram: ``ACTION@DEVPATH\\0KEY=VALUE\\0...``.

    Messages from udev (they start with ``libudev\\0``) and malformed ones
    give ``None``.
    """
    parts = raw.split(b"\0")
    if not parts or b"@" not in parts[0]:
        return None
    props: dict[str, str] = {}
    for p in parts[1:]:
        key, sep, value = p.partition(b"=")
        if sep:
            props[key.decode("ascii", "replace")] = value.decode("utf-8", "replace")
    action, _, devpath = parts[0].decode("utf-8", "replace").partition("@")
    return Uevent(
        props.get("ACTION", action), props.get("DEVPATH", devpath), props.get("SUBSYSTEM"), props
    )


def module_event(ev: Uevent) -> tuple[str, str] | None:
    """``(action, module)`` for a module uevent, ``None`` for anything else."""
    if ev.subsystem != "module" or not ev.devpath.startswith("/module/"):
        return None
    name = ev.devpath[len("/module/") :]
    if not name or "/" in name:
        return None
    return ev.action, name


class UeventSource:
    """Kernel uevents (netlink ``NETLINK_KOBJECT_UEVENT``) through pyudev."""

    def __init__(
        self, notify: Notify, log: FilteringBoundLogger, buffer_bytes: int = 4 << 20
    ) -> None:
        import pyudev

        self._notify = notify
        self.log = log
        self.context = pyudev.Context()
        self.monitor = pyudev.Monitor.from_netlink(self.context, source="kernel")
        try:
            # Above net.core.rmem_max this needs CAP_NET_ADMIN (SO_RCVBUFFORCE),
            # which the hardened unit does not grant: keep the default then;
            # an overrun (ENOBUFS) only costs a rescan.
            self.monitor.set_receive_buffer_size(buffer_bytes)
        except OSError as e:
            log.info("uevent_buffer_default", wanted=buffer_bytes, error=str(e))
        self.monitor.start()
        self.name = "uevent"
        self.received = 0
        self.ignored = 0
        self.overruns = 0
        self.healthy = True
        self.last_error: str | None = None
        self._thread: threading.Thread | None = None

    @property
    def events(self) -> int:
        return self.received

    def following(self) -> bool:
        return self.healthy

    def start(self, stop: threading.Event) -> None:
        self._thread = threading.Thread(target=self._run, args=(stop,), name="uevent", daemon=True)
        self._thread.start()

    def handle(self, ev: Uevent) -> None:
        self.received += 1
        me = module_event(ev)
        if me is None:
            self.ignored += 1
            self.log.debug(
                "uevent_ignored", action=ev.action, devpath=ev.devpath, subsystem=ev.subsystem
            )
            return
        self.log.debug("uevent", action=me[0], module=me[1])
        self._notify(SeenBy.UEVENT, HintAction.of(me[0]), me[1])

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                device = self.monitor.poll(timeout=0.5)
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    self.overruns += 1
                    self.log.warning("uevent_overrun", overruns=self.overruns, action="rescan")
                    self._notify(SeenBy.UEVENT, HintAction.RESCAN)
                    continue
                self.healthy = False
                self.last_error = str(e)
                self.log.error("uevent_source_failed", error=str(e))
                return
            if device is None:
                continue
            props = {k: device.properties[k] for k in device.properties}
            self.handle(
                Uevent(
                    device.action or props.get("ACTION", ""),
                    props.get("DEVPATH", device.device_path),
                    device.subsystem,
                    props,
                )
            )

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=2)


def is_sysfs(path: str) -> bool:
    """Whether *path* lies on sysfs (where inotify sees nothing)."""
    import ctypes  # loaded at start anyway (heap.py); ctypes.util's find_library
    # would run ldconfig in a subprocess: the process's own symbols have statfs.

    class Statfs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 120)]

    libc = ctypes.CDLL(None, use_errno=True)
    buf = Statfs()
    if libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        return True  # unknown: polling works everywhere
    return bool((buf.f_type & 0xFFFFFFFF) == SYSFS_MAGIC)


class DirentListing:
    """``listdir`` and ``stat`` for watchdog's polling snapshot of one directory:
    each entry's inode and type as the listing gave them (``getdents``), not a
    ``stat`` of every entry.

    A snapshot of ``/sys/module`` (some 80 entries, most of them built in)
    stat-ed each one on every poll: about two thirds of an idle daemon's CPU.
    The snapshot needs only an identity (inode, device) and whether an entry is
    a directory; a load, an unload and a reload (the same name, a new inode)
    show in those alone, and modification times are of no use here (a module's
    directory is made whole, and sysfs keeps no times of its own).  The
    directory itself is still stat-ed, once per poll, for its device.
    """

    def __init__(self) -> None:
        self._entries: dict[str, os.DirEntry[str]] = {}
        self._dev = 0

    def listdir(self, path: str | None) -> Iterator[os.DirEntry[str]]:
        entries = list(os.scandir(path))
        self._entries = {e.path: e for e in entries}
        return iter(entries)

    def stat(self, path: str) -> os.stat_result:
        entry = self._entries.get(path)
        if entry is None:  # the directory itself (each snapshot starts with it)
            st = os.stat(path)
            self._dev = st.st_dev
            return st
        kind = stat.S_IFDIR if entry.is_dir(follow_symlinks=False) else stat.S_IFREG
        return os.stat_result((kind, entry.inode(), self._dev, 0, 0, 0, 0, 0, 0, 0))


# What a WatchSource asks its observer for (inotify: IN_CREATE, IN_DELETE, IN_MOVE).
WATCHED: list[type[FileSystemEvent]] = [DirCreatedEvent, DirDeletedEvent, DirMovedEvent]


class _Handler(FileSystemEventHandler):
    def __init__(self, source: WatchSource) -> None:
        self.source = source

    def on_any_event(self, event: FileSystemEvent) -> None:
        self.source.handle(event)


class WatchSource:
    """A watchdog observer on ``sys/module``: polling on sysfs, inotify elsewhere."""

    def __init__(
        self, notify: Notify, path: str, method: str, interval: float, log: FilteringBoundLogger
    ) -> None:
        self._notify = notify
        self.path = path
        self.log = log
        if method == "auto":
            method = "poll" if is_sysfs(path) else "inotify"
        self.method = method
        self.name = f"watch-{method}"
        self.seen_by = SeenBy.POLL if method == "poll" else SeenBy.INOTIFY
        self.interval = interval
        self.observer: Any = self._observer(interval)
        self.events = 0
        self.healthy = True
        self.last_error: str | None = None

    def _observer(self, interval: float) -> Any:
        if self.method == "poll":  # each observer's module only when it is the one used
            from watchdog.observers.polling import PollingObserverVFS

            listing = DirentListing()
            observer: Any = PollingObserverVFS(
                listing.stat, listing.listdir, polling_interval=interval
            )
        else:
            from watchdog.observers.inotify import InotifyObserver

            observer = InotifyObserver()
        # Only module directories coming and going: the tracker's own reads of
        # sys/module (listing it, opening each module's directory) would
        # otherwise come back as opened/closed events on every load, each
        # decoded and dispatched by watchdog's threads to be thrown away.
        observer.schedule(_Handler(self), self.path, recursive=False, event_filter=WATCHED)
        return observer

    def set_interval(self, interval: float) -> bool:
        """Poll every *interval* seconds from now on (a new observer: watchdog's
        keeps its interval); True when it changed.  Nothing is missed across
        the switch: the caller asks the tracker for a full look."""
        if self.method != "poll" or interval == self.interval or not self.observer.is_alive():
            return False
        old, self.observer = self.observer, self._observer(interval)
        self.interval = interval
        self.observer.start()
        old.stop()
        old.join(timeout=5)
        self.log.info("poll_interval", seconds=interval)
        return True

    def _name(self, path: str | bytes) -> str | None:
        p = os.fsdecode(path)
        parent, name = os.path.split(p.rstrip("/"))
        return name if os.path.normpath(parent) == os.path.normpath(self.path) else None

    def handle(self, event: FileSystemEvent) -> None:
        if isinstance(event, DirMovedEvent):
            old, new = self._name(event.src_path), self._name(event.dest_path)
            if old:
                self._notify(self.seen_by, HintAction.REMOVE, old)
            if new:
                self._notify(self.seen_by, HintAction.ADD, new)
            return
        if isinstance(event, DirCreatedEvent | DirDeletedEvent):
            name = self._name(event.src_path)
            if name:
                self.events += 1
                action = HintAction.ADD if isinstance(event, DirCreatedEvent) else HintAction.REMOVE
                self._notify(self.seen_by, action, name)

    def start(self, stop: threading.Event) -> None:
        try:
            self.observer.start()
        except OSError as e:
            self.healthy = False
            self.last_error = str(e)
            self.log.error("watch_source_failed", path=self.path, error=str(e))

    def stop(self) -> None:
        if self.observer.is_alive():
            self.observer.stop()
            self.observer.join(timeout=5)


def poll_interval(cfg: Config, sources: Iterable[EventSource]) -> float:
    """How often to look at ``sys/module``: slowly while a source of kernel
    events works (every path ends in a reconciliation, and the look is only the
    safety net), at the fast interval only where nothing else tells of loads."""
    flowing = any(
        s.healthy and isinstance(s, TracepointSource | UeventSource) and s.following()
        for s in sources
    )
    return cfg.poll_interval_events if flowing else cfg.poll_interval


def module_followers(
    cfg: Config, sources: Iterable[EventSource], watch: WatchSource
) -> list[dict[str, Any]]:
    """Status's ``module_followers``: each way kreld learns of module loads,
    whether it follows them now, why not, and the look's interval."""
    out: list[dict[str, Any]] = []
    tp = next((s for s in sources if isinstance(s, TracepointSource)), None)
    if tp is not None:
        why = tp.last_error if not tp.healthy else tp.reason
        out.append({"name": tp.name, "following": tp.following() and tp.healthy, "reason": why})
    ue = next((s for s in sources if isinstance(s, UeventSource)), None)
    if ue is not None:
        out.append({"name": ue.name, "following": ue.healthy, "reason": ue.last_error})
    elif not cfg.uevents:
        out.append({"name": "uevent", "following": False, "reason": _UEVENTS_OFF})
    elif os.path.realpath(cfg.root) != "/":
        out.append({"name": "uevent", "following": False, "reason": _FAKE_ROOT})
    else:
        out.append({"name": "uevent", "following": False, "reason": "no netlink socket"})
    out.append(
        {
            "name": watch.name,
            "following": watch.healthy,
            "reason": watch.last_error,
            "interval_s": watch.interval,
        }
    )
    return out


_UEVENTS_OFF = "turned off in the configuration ([modules] uevents = false)"
_FAKE_ROOT = "kreld does not run on the real root"


def event_sources(
    cfg: Config,
    root: Root,
    notify: Notify,
    log: FilteringBoundLogger,
    tracepoints: TracepointSource | None = None,
) -> tuple[WatchSource, list[EventSource]]:
    """The sources that wake the module tracker (*notify*): the module
    tracepoints where they opened (*tracepoints*, opened first of all by the
    daemon), the kernel's uevents on the real root where netlink can be had,
    and the watch of ``sys/module`` always, slow where either follows."""
    sources: list[EventSource] = []
    if tracepoints is not None:
        sources.append(tracepoints)
    if cfg.uevents and os.path.realpath(cfg.root) == "/":
        try:
            sources.append(UeventSource(notify, log))
        except Exception as e:  # no netlink here (container, seccomp): polling still works
            log.warning("uevent_source_unavailable", error=str(e))
    interval = poll_interval(cfg, sources)
    watch = WatchSource(notify, str(root / "sys/module"), cfg.watch, interval, log)
    return watch, [watch, *sources]


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
        self._thread = threading.Thread(
            target=self._run, args=(stop,), name="module-tracepoints", daemon=True
        )
        self._thread.start()

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
        return TracepointSource(None, _FAKE_ROOT, log)
    try:
        rings = ModuleTraceRings(root)
    except KernelReadError as e:
        log.warning("module_tracepoints_unavailable", reason=str(e))
        return TracepointSource(None, str(e), log)
    log.info("module_tracepoints", cpus=rings.cpus())
    return TracepointSource(rings, None, log)
