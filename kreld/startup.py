"""How the daemon starts: what opens first, and the heavy work after it.

Module events open before anything slow (the store's lock and checks, a
vmlinux read), so that what happens while kreld starts is recorded; the boot
record, the module tracker, the symbol capture and the publisher follow.
"""

from __future__ import annotations

__all__ = ["Startup", "Tracking"]

import argparse
import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from systemd import daemon as sd

from kreld.config.settings import Config
from kreld.core import log as klog
from kreld.core.errors import KernelReadError, KreldError, NoSuchBoot, NotReady
from kreld.core.model import AddressSource, BootSnapshot, HintAction, Incarnation
from kreld.core.stopping import StopEvent
from kreld.core.supervise import Supervisor, supervisor
from kreld.kernel.addresses import ModuleAddresses
from kreld.kernel.info import Root, read_boot_id
from kreld.kernel.kallsyms import KallsymsText
from kreld.kernel.snapshot import log_boot, take_snapshot
from kreld.server.listener import Server, bind_socket
from kreld.server.sdnotify import Notifier
from kreld.store.lock import WriterLock, open_writable
from kreld.symbols.capture import SymbolCapture
from kreld.symbols.table_sources import TableSources
from kreld.tracker.kernel_code import KernelCodeFollower
from kreld.tracker.modevents import start_tracepoints
from kreld.tracker.modules import ModuleTracker
from kreld.tracker.sources import (
    EventSource,
    UeventSource,
    WatchSource,
    event_sources,
    poll_interval,
)

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from kreld.fleet.publish import Publisher
    from kreld.server.linebuild import LineBuilder


class Tracking:
    """What the daemon runs once the boot is recorded: the module tracker and its
    thread, the event sources that wake it, the symbol capture and the fleet
    publisher.  Made whole by :meth:`Startup.start_tracking`, so that nothing in it
    is ever half there."""

    __slots__ = ("publisher", "sources", "symbols", "thread", "tracker", "watch")

    def __init__(
        self,
        tracker: ModuleTracker,
        sources: list[EventSource],
        symbols: SymbolCapture,
        thread: threading.Thread,
        watch: WatchSource,
    ) -> None:
        self.tracker = tracker
        self.sources = sources
        self.symbols = symbols
        self.thread = thread
        self.watch = watch
        self.publisher: Publisher | None = None

    def reconfigure(self, cfg: Config) -> None:
        """A reloaded configuration's [modules] intervals, at once."""
        self.tracker.recheck_interval = cfg.poll_interval
        if self.tracker.heartbeat_interval != cfg.heartbeat_interval:
            self.tracker.heartbeat_interval = cfg.heartbeat_interval
            # A full look now: the reconciler's wait is timed anew after it.
            self.tracker.notify(self.watch.seen_by, HintAction.RESCAN)
        self.adjust_poll(cfg)

    def adjust_poll(self, cfg: Config) -> None:
        """Poll sys/module slowly while kernel events flow, fast once none does
        (a full look then, for what a failed source may have missed)."""
        if self.watch.set_interval(poll_interval(cfg, self.sources)):
            self.tracker.notify(self.watch.seen_by, HintAction.RESCAN)

    def healthy(self) -> bool:
        return self.thread.is_alive()

    def counters(self) -> dict[str, int]:
        """How often each worker has turned over since the start (see Counters in
        the IDL): cheap to keep, and what shows that a pass after a given moment ran."""
        return {
            "tracker_passes": self.tracker.passes,
            "tracker_idle_checks": self.tracker.idle_checks,
            "symbol_loads_queued": self.symbols.loads_queued,
            "symbol_loads_handled": self.symbols.loads_handled,
            "publish_rounds": 0 if self.publisher is None else self.publisher.rounds,
        }

    def stop(self) -> None:
        """Stop the sources, the tracker thread and the publisher (the caller has
        set the threads' stop event)."""
        for s in self.sources:
            s.stop()
        self.thread.join(timeout=5)
        if self.publisher is not None:
            self.publisher.stop()


class Startup:
    """The daemon's parts in the order they open (:class:`kreld.daemon.Daemon`
    runs them)."""

    def __init__(self, cfg: Config, args: argparse.Namespace, log: FilteringBoundLogger) -> None:
        self.cfg = cfg
        self.args = args
        self.log = log
        self.started = time.monotonic_ns()
        self.stop_threads = StopEvent()  # wakes the threads blocked at rest
        self.supervisor: Supervisor = supervisor()
        self.notify = Notifier()  # never blocks the loop: see kreld.server.sdnotify
        self._loop: asyncio.AbstractEventLoop | None = None
        self._status_due = asyncio.Event()
        self.root = Root(Path(cfg.root))
        self.addresses = ModuleAddresses(self.root, log)  # sysfs, or kernel memory
        # Module events first of all, before anything slow (the store's checks,
        # a vmlinux read): a load meanwhile is read at once and held for the tracker.
        self.tracepoints = start_tracepoints(
            self.root, self.addresses, self.stop_threads, log, enabled=cfg.tracepoints
        )
        try:
            self.lock = WriterLock.taken(cfg.state_dir, log)
            try:
                self.store = open_writable(Path(cfg.state_dir), log)
            except BaseException:
                self.lock.release()
                raise
        except BaseException:
            self.stop_threads.set()
            self.tracepoints.stop()
            raise
        # The rings open before kallsyms is read.
        self.kernel_code = KernelCodeFollower(self.root, log, enabled=cfg.follow_code)
        self.boot: BootSnapshot | None = None
        # The boot's id, read now (cheap): while the boot's record is made, the
        # socket answers about it from what the store holds.
        self.early_id: str | None = None
        with contextlib.suppress(KreldError):
            self.early_id = read_boot_id(self.root)
        # Called with every module event from the tracker's first look on (the
        # server's subscribers, STATUS=): set before start_tracking runs.
        self.tracker_listeners: list[Callable[..., None]] = []
        self.reading: tuple[bool, str | None, AddressSource | None] = (False, None, None)
        self.tracking: Tracking | None = None
        self.server: Server | None = None
        self.bound: tuple[str, int] | None = None
        self.lines: LineBuilder | None = None  # started with the server
        self._snapshot_lock = threading.Lock()

    # -- startup ----------------------------------------------------------------

    def record_boot(self, kallsyms: bytes | None = None) -> tuple[BootSnapshot, bool, bool]:
        """Snapshot the kernel and record what is new (also the Snapshot method);
        *kallsyms*: a read of it already made."""
        with self._snapshot_lock:
            snap, notes = take_snapshot(
                self.root, self.cfg.debuginfo_dirs, kallsyms, self.addresses.memory
            )
            stored, added, changed = self.store.boots.record_boot(snap)
            self.boot = stored
            # What kreld can read now; the boot's record keeps what it learnt
            # before (a restart after kptr_restrict went up still knows _text).
            self.reading = (snap.restricted, snap.restricted_reason, snap.address_source)
        klog.journal_context["KRELD_BOOT_ID"] = stored.boot_id
        log_boot(self.log, stored, added, changed, notes)
        self.status_changed()
        return stored, added, changed

    def current_boot(self) -> BootSnapshot:
        if self.boot is None:
            raise NotReady(self.starting())
        return self.boot

    def starting(self) -> list[str]:
        """What is still starting, in order (Status's ``starting``)."""
        if self.boot is None:
            return ["boot", "modules"]
        return ["modules"] if self.tracking is None else []

    # -- answers while starting: from what the store holds -------------------------

    def serving_boot(self) -> BootSnapshot:
        """The current boot: its record, or while it is made the one the store
        holds from an earlier run (NotReady where there is none)."""
        if self.boot is not None:
            return self.boot
        if self.early_id is not None:
            with contextlib.suppress(NoSuchBoot):
                return self.store.get_boot(self.early_id)
        raise NotReady(self.starting())

    def serving_id(self) -> str | None:
        return self.early_id if self.boot is None else self.boot.boot_id

    def serving_loaded(self) -> list[Incarnation]:
        """The modules loaded now: the tracker's, or while it has not looked
        yet those the store records as loaded (its first look then sends an
        event for each change)."""
        if self.tracking is not None:
            return self.tracking.tracker.loaded()
        if self.early_id is None:
            raise NotReady(self.starting())
        try:
            incs = self.store.incarnations(self.early_id)
        except NoSuchBoot:
            return []
        return [i for i in incs if i.unloaded is None]

    def serving_snapshot(self) -> tuple[BootSnapshot, bool, bool]:
        """Snapshot: not while the start makes the boot's record itself."""
        if self.tracking is None:
            raise NotReady(self.starting())
        return self.record_boot()

    def start_tracking(self) -> Tracking:
        # One read of kallsyms per start: the snapshot and the symbol capture share it.
        try:
            ks: KallsymsText | None = KallsymsText.read(self.root)
        except KernelReadError:
            ks = None  # the snapshot reads it again and records why
        if ks is not None and ks.zeroed():  # kptr_restrict=2: kernel memory, where readable
            self.addresses.open(ks.data)
        _stall_for_tests()
        stored, _, _ = self.record_boot(ks.data if ks else None)
        self.kernel_code.begin(self.store, stored.boot_id, ks)
        tracker = ModuleTracker(
            self.store,
            self.root,
            stored.boot_id,
            self.log,
            recheck_interval=self.cfg.poll_interval,
            heartbeat_interval=self.cfg.heartbeat_interval,
        )
        tracker.addresses = self.addresses  # the same kernel memory for the snapshot and symbols
        tracker.listeners.extend(self.tracker_listeners)  # before its first look
        self.tracepoints.bind(tracker.notify_all)  # what came since the start, in the queue
        if self.tracepoints.following():
            tracker.catch_up = self.tracepoints.step
        watch, sources = event_sources(
            self.cfg, self.root, tracker.notify, self.log, self.tracepoints
        )
        sources.insert(0, self.kernel_code)  # opened first of all, started with the others
        # Sources first, then the scan: see ModuleTracker.startup().
        for src in sources:
            src.start(self.stop_threads)
        tracker.startup()
        tables = TableSources(
            self.store, self.root, stored, self.log, self.cfg.debuginfo_dirs, self.addresses
        )
        symbols = SymbolCapture(tables, tracker.busy)
        tracker.listeners.append(symbols.on_event)
        symbols.start(self.stop_threads, tracker.loaded(), ks)
        del ks
        thread = self.supervisor.thread("tracker", tracker.run, self.stop_threads)
        self.tracking = Tracking(tracker, sources, symbols, thread, watch)
        self.log.info(
            "watching",
            path=watch.path,
            method=watch.method,
            interval_s=watch.interval,
            uevents=any(isinstance(src, UeventSource) for src in sources),
            tracepoints=self.tracepoints.following(),
        )
        if self.cfg.publish_url:
            self.configure_publishing(self.cfg)
        return self.tracking

    def configure_publishing(self, cfg: Config) -> None:
        """Start, retarget or stop fleet publishing (imported only when used)."""
        from kreld.fleet.publish import configure

        tracking = self.started_tracking()
        tracking.publisher = configure(
            tracking.publisher,
            cfg,
            self.store,
            self.root,
            self.current_id,
            self.log,
            self.stop_threads,
        )

    def current_id(self) -> str:
        return self.current_boot().boot_id

    def listening_socket(self) -> socket.socket:
        fds = sd.listen_fds()
        if fds:
            fd = fds[0]
            if not sd.is_socket_unix(fd, socket.SOCK_STREAM, 1):
                raise KreldError(f"socket activation passed fd {fd}, not a listening Unix socket")
            self.log.info("socket_activated", fd=fd, count=len(fds))
            return socket.socket(fileno=fd)
        sock = bind_socket(self.cfg.socket, self.cfg.socket_group, self.log)
        self.bound = (self.cfg.socket, os.stat(self.cfg.socket).st_ino)
        self.log.info(
            "socket_bound", path=self.cfg.socket, mode="0660", group=self.cfg.socket_group
        )
        return sock

    def started_tracking(self) -> Tracking:
        if self.tracking is None:
            raise KreldError("module tracking has not started")
        return self.tracking

    def healthy(self) -> bool:
        return self.tracking is not None and self.tracking.healthy()

    def status_changed(self, *_: object) -> None:
        """Something STATUS= says may have changed (from any thread): a module
        event, a failure, a Snapshot.  The line is sent when it changes, with
        no timer of its own to wake an idle daemon."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: stopping
                self._loop.call_soon_threadsafe(self._status_due.set)


#: Test hook, documented in kreld(8) next to ``KRELD_TEST_FAULTS``: the path of
#: a FIFO the start reads to its end before it records the boot, so that a test
#: holds the start where a large vmlinux would (the socket answering meanwhile).
STALL_ENV = "KRELD_TEST_STALL_BOOT"


def _stall_for_tests() -> None:
    path = os.environ.get(STALL_ENV)
    if not path:
        return
    with contextlib.suppress(OSError), open(path, "rb") as fifo:
        while fifo.read(4096):
            pass
