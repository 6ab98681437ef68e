"""Event sources that hint the module tracker: kernel uevents and watchdog.

None of them is trusted alone: each only says "look again", and the tracker
reconciles against ``sys/module``.
"""

from __future__ import annotations

import errno
import os
import select
import stat
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)

from kreld.core.model import HintAction, SeenBy
from kreld.core.record import record
from kreld.core.stopping import WakeFd, wake_on_stop
from kreld.core.supervise import supervisor
from kreld.kernel.info import on_sysfs
from kreld.tracker.modevents import FAKE_ROOT, TracepointSource

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from kreld.config.settings import Config
    from kreld.kernel.info import Root

__all__ = [
    "WATCHED",
    "DirentListing",
    "EventSource",
    "Health",
    "Notify",
    "Uevent",
    "UeventSource",
    "WatchSource",
    "event_sources",
    "health",
    "module_event",
    "parse_uevent",
    "poll_interval",
]


class Notify(Protocol):
    def __call__(self, source: SeenBy, action: HintAction, name: str | None = None) -> None: ...


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
        # It returns when netlink fails for good: said in its health, and a
        # failure of the daemon's (the module tracker hears no more uevents).
        self._thread = supervisor().thread("uevent", self._run, stop)

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
        # Blocks on the netlink socket and a wake for stop: no timeout at rest.
        wake = WakeFd()
        try:
            self._follow(stop, wake)
        finally:
            wake.close()

    def _follow(self, stop: threading.Event, wake: WakeFd) -> None:
        timeout = wake_on_stop(stop, wake.wake)
        poller = select.poll()
        poller.register(self.monitor.fileno(), select.POLLIN)
        poller.register(wake.fileno(), select.POLLIN)
        while not stop.is_set():
            try:
                if not poller.poll(None if timeout is None else int(timeout * 1000)):
                    continue
                device = self.monitor.poll(timeout=0)
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
            method = "poll" if on_sysfs(path) else "inotify"
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
            supervisor().watch(self.name, self.observer.is_alive)  # watchdog's own thread
        except OSError as e:
            self.healthy = False
            self.last_error = str(e)
            self.log.error("watch_source_failed", path=self.path, error=str(e))

    def stop(self) -> None:
        supervisor().unwatch(self.name)
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
        out.append({"name": "uevent", "following": False, "reason": FAKE_ROOT})
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
