"""``kreld``: the resident daemon.

Starts, records the boot, follows modules, serves varlink, and stays in the
foreground until SIGTERM or SIGINT (exit 0).  No fork, no PID file.  Under
systemd it takes its socket from socket activation, says ``READY=1`` once
the store is open, the boot recorded and the socket listening, pings the
watchdog, and reloads its configuration on SIGHUP.
"""

from __future__ import annotations

import sys

__all__ = [
    "Daemon",
    "build_parser",
    "check_config",
    "epilog",
    "main",
]

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from systemd import daemon as sd

from kreld import __version__
from kreld.config.options import build_parser, epilog, leave, resolve_config
from kreld.config.settings import RESTART_KEYS, Config
from kreld.core import heap, supervise
from kreld.core import log as klog
from kreld.core.errors import ExitCode, KernelReadError, KreldError
from kreld.core.model import AddressSource, BootSnapshot, HintAction, Timestamp
from kreld.core.record import fields, replace
from kreld.core.supervise import Supervisor, supervisor
from kreld.ctl.render import status_line
from kreld.kernel.addresses import ModuleAddresses
from kreld.kernel.info import Root, read_boot_id
from kreld.kernel.kallsyms import KallsymsText
from kreld.kernel.snapshot import log_boot, take_snapshot
from kreld.server.access import policy_of
from kreld.server.listener import Server, bind_socket, limits_of, raise_fd_limit
from kreld.server.service import Service
from kreld.store.lock import WriterLock, damaged_stores, open_writable
from kreld.symbols.capture import SymbolCapture
from kreld.tracker.kernel_code import KernelCodeFollower
from kreld.tracker.modevents import start_tracepoints
from kreld.tracker.modules import ModuleTracker
from kreld.tracker.sources import (
    EventSource,
    UeventSource,
    WatchSource,
    event_sources,
    health,
    module_followers,
    poll_interval,
)

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from kreld.fleet.publish import Publisher


def check_config(cfg: Config) -> None:
    """:func:`kreld.fleet.publish.check_config`, imported only when ``[publish]`` is
    set: fleet publishing (zstandard, the S3 client) is not every host's."""
    if cfg.publish_url:
        from kreld.fleet.publish import check_config as check_publishing

        check_publishing(cfg)


class Tracking:
    """What the daemon runs once the boot is recorded: the module tracker and its
    thread, the event sources that wake it, the symbol capture and the fleet
    publisher.  Made whole by :meth:`Daemon.start_tracking`, so that nothing in it
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

    def adjust_poll(self, cfg: Config) -> None:
        """Poll sys/module slowly while kernel events flow, fast once none does
        (a full look then, for what a failed source may have missed)."""
        if self.watch.set_interval(poll_interval(cfg, self.sources)):
            self.tracker.notify(self.watch.seen_by, HintAction.RESCAN)

    def healthy(self) -> bool:
        return self.thread.is_alive()

    def stop(self) -> None:
        """Stop the sources, the tracker thread and the publisher (the caller has
        set the threads' stop event)."""
        for s in self.sources:
            s.stop()
        self.thread.join(timeout=5)
        if self.publisher is not None:
            self.publisher.stop()


def counters(tracking: Tracking) -> dict[str, int]:
    """How often each worker has turned over since the start (see Counters in
    the IDL): cheap to keep, and what shows that a pass after a given moment ran."""
    tracker, symbols, publisher = tracking.tracker, tracking.symbols, tracking.publisher
    return {
        "tracker_passes": tracker.passes,
        "tracker_idle_checks": tracker.idle_checks,
        "symbol_loads_queued": symbols.loads_queued,
        "symbol_loads_handled": symbols.loads_handled,
        "publish_rounds": 0 if publisher is None else publisher.rounds,
    }


class Daemon:
    def __init__(self, cfg: Config, args: argparse.Namespace, log: FilteringBoundLogger) -> None:
        self.cfg = cfg
        self.args = args
        self.log = log
        self.started = time.monotonic_ns()
        self.stop_threads = threading.Event()
        self.supervisor: Supervisor = supervisor()
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
        self.reading: tuple[bool, str | None, AddressSource | None] = (False, None, None)
        self.tracking: Tracking | None = None
        self.server: Server | None = None
        self.bound: tuple[str, int] | None = None
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
            raise KreldError("the boot is not recorded yet")
        return self.boot

    def start_tracking(self) -> Tracking:
        # One read of kallsyms per start: the snapshot and the symbol capture share it.
        try:
            ks: KallsymsText | None = KallsymsText.read(self.root)
        except KernelReadError:
            ks = None  # the snapshot reads it again and records why
        if ks is not None and ks.zeroed():  # kptr_restrict=2: kernel memory, where readable
            self.addresses.open(ks.data)
        stored, _, _ = self.record_boot(ks.data if ks else None)
        self.kernel_code.begin(self.store, stored.boot_id, ks)
        tracker = ModuleTracker(
            self.store, self.root, stored.boot_id, self.log, recheck_interval=self.cfg.poll_interval
        )
        tracker.addresses = self.addresses  # the same kernel memory for the snapshot and symbols
        self.tracepoints.bind(tracker.notify_all)  # what came since the start, in the queue
        watch, sources = event_sources(
            self.cfg, self.root, tracker.notify, self.log, self.tracepoints
        )
        sources.insert(0, self.kernel_code)  # opened first of all, started with the others
        # Sources first, then the scan: see ModuleTracker.startup().
        for src in sources:
            src.start(self.stop_threads)
        tracker.startup()
        symbols = SymbolCapture(
            self.store, self.root, stored, self.log, self.cfg.debuginfo_dirs, tracker.busy
        )
        symbols.addresses = self.addresses
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

    def status(self) -> dict[str, Any]:
        boot, tracking = self.current_boot(), self.started_tracking()
        tracker = tracking.tracker
        counts = self.store.boots.counts()
        reading = self.addresses.reading(self.reading)  # as the last module read went
        return {
            "version": __version__,
            "uptime_ns": time.monotonic_ns() - self.started,
            "boot_id": boot.boot_id,
            "boots": counts["boots"],
            "builds": counts["builds"],
            "incarnations": counts["incarnations"],
            "loaded_modules": len(tracker.loaded()),
            "store_bytes": self.store.env.size_bytes(),
            "store_full": self.store.env.full,
            "restricted": reading[0],
            "restricted_reason": reading[1],
            "address_source": None if reading[2] is None else reading[2].value,
            "damaged_stores": damaged_stores(self.cfg.state_dir),
            "sources": [
                *map(health, tracking.sources),
                health(tracking.symbols),
                {
                    "name": "tracker",
                    "healthy": self.healthy(),
                    "events": tracker.reconciliations,
                    "last_error": None,
                },
            ],
            "module_followers": module_followers(self.cfg, tracking.sources, tracking.watch),
            "publish": None if tracking.publisher is None else tracking.publisher.health(),
            "kernel_code": self.kernel_code.status(),
            "counters": counters(tracking),
            "degraded": [f.to_json() for f in self.supervisor.failures()],
        } | ({} if self.server is None else self.server.counts())  # connections, once served

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

    # -- the main loop -------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._loop = loop
        stop = asyncio.Event()

        def on_stop(sig: signal.Signals) -> None:
            self.log.info("signal", signal=sig.name)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_stop, sig)
        loop.add_signal_handler(signal.SIGHUP, self.reload)

        tracker = self.start_tracking().tracker
        service = Service(
            self.store,
            current_boot=self.current_boot,
            current_id=self.current_id,
            loaded=tracker.loaded,
            snapshot=self.record_boot,
            status=self.status,
        )
        self.server = Server(
            service, policy_of(self.cfg, self.log), limits_of(self.cfg, self.log), self.log
        )
        await self.server.start(self.listening_socket())
        tracker.listeners.append(self.server.publish)
        self.kernel_code.listeners.append(self.server.publish)
        tracker.listeners.append(self.status_changed)
        self.supervisor.on_change(self.status_changed)
        line = status_line(self.status())
        sd.notify(f"READY=1\nSTATUS={line}")
        self.log.info(
            "ready", state_dir=self.cfg.state_dir, root=self.cfg.root, socket=self.cfg.socket
        )
        sup = self.supervisor
        tasks = [
            sup.task("status-updates", self._status_updates(line)),
            sup.task("retention", self._retention()),
        ]
        usec = _watchdog_usec()
        if usec:
            # The one periodic wake of an idle daemon that systemd asks for.
            tasks.append(sup.task("watchdog", sup.pinger(usec / 2e6, sd.notify)))
        else:
            sup.arm()
        await stop.wait()
        sup.stopping.set()
        sd.notify("STOPPING=1")
        for t in tasks:
            t.cancel()
        await self.server.close()
        self.shutdown()
        return int(ExitCode.OK)

    async def _retention(self) -> None:
        """Apply the retention policy at start and then daily, off the loop."""
        loop = asyncio.get_running_loop()
        pool = self.supervisor.executor("retention")
        while True:
            if self.cfg.keep_boots or self.cfg.keep_days:
                try:
                    removed = await loop.run_in_executor(pool, self.gc)
                    if any(removed.values()):
                        self.log.info("retention", **removed)
                    if self.server is not None:
                        self.server.service.invalidate()
                except KreldError as e:
                    self.log.error("retention_failed", error=str(e))
            await asyncio.sleep(86400)

    def gc(self) -> dict[str, int]:
        return self.store.retention.gc(
            self.cfg.keep_boots, self.cfg.keep_days, self.current_boot().boot_id, time.time_ns()
        )

    async def _status_updates(self, last: str) -> None:
        """STATUS= when the summary changes (*last*: the line sent with READY=1)."""
        while True:
            # A change asks for a line at once; every 10 s the look's pace is checked
            # too (slow while module events flow, fast when none do).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    await self._status_due.wait()
                    await asyncio.sleep(1)  # a burst of loads: one line
            self._status_due.clear()
            if self.tracking is not None:
                await asyncio.get_running_loop().run_in_executor(
                    None, self.tracking.adjust_poll, self.cfg
                )
            line = status_line(self.status())
            if line != last:
                sd.notify(f"STATUS={line}")
                last = line

    def reload(self) -> None:
        """SIGHUP: take the new configuration, or keep the old one and say why."""
        _reload(self)

    def shutdown(self) -> None:
        self.supervisor.stopping.set()
        self.stop_threads.set()
        self.tracepoints.stop()  # also a source of tracking's: stopping twice is nothing
        if self.tracking is not None:
            self.tracking.stop()
            try:
                self.store.modules.heartbeat(self.tracking.tracker.boot_id, Timestamp.now())
            except KreldError as e:
                self.log.error("final_heartbeat_failed", error=str(e))
        if self.bound is not None:
            path, ino = self.bound
            try:
                if os.stat(path).st_ino == ino:
                    os.unlink(path)
            except OSError:
                pass
        self.addresses.close()
        self.store.close()
        self.lock.release()


def _reload(self: Daemon) -> None:
    """SIGHUP: take the new configuration, or keep the old one and say why."""
    self.log.info("signal", signal="SIGHUP")
    try:
        new = resolve_config(self.args)
        check_config(new)
    except KreldError as e:
        self.log.error("config_reload_failed", error=str(e), kept="running configuration")
        return
    sd.notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
    changed = [f.name for f in fields(Config) if getattr(new, f.name) != getattr(self.cfg, f.name)]
    for key in changed:
        if key in RESTART_KEYS:
            self.log.warning("config_change_needs_restart", key=key)
    applied = replace(new, **{k: getattr(self.cfg, k) for k in RESTART_KEYS})
    self.cfg = applied
    klog.configure(
        self.args.log_level or applied.log_level, self.args.log_format or applied.log_format
    )
    self.log = klog.get()
    if self.server is not None:
        self.server.policy = policy_of(applied, self.log)
        self.server.limits = limits_of(applied, self.log)
    if self.tracking is not None:
        self.tracking.tracker.recheck_interval = applied.poll_interval
        self.tracking.adjust_poll(applied)
        if self.tracking.publisher is not None or applied.publish_url:
            self.configure_publishing(applied)
    self.log.info("config_reloaded", changed=changed, files=list(applied.sources))
    sd.notify("READY=1")


def _watchdog_usec() -> int:
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return 0
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return 0
    return max(usec, 0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = resolve_config(args)
        check_config(cfg)
    except KreldError as e:
        print(f"kreld: {e}", file=sys.stderr)
        return int(e.exit_code)
    # --debug: debug-level logs (unless --log-level says otherwise) and the
    # traceback of an error that stops kreld.
    level = args.log_level or ("debug" if args.debug else cfg.log_level)
    klog.configure(level, args.log_format or cfg.log_format)
    log = klog.get()
    supervise.configure(log)  # before the first thread starts
    heap.tune()  # before the first large buffer: see kreld.core.heap
    # Every journal entry carries the boot; if it cannot be read, the snapshot
    # says why below.
    with contextlib.suppress(KreldError):
        klog.journal_context["KRELD_BOOT_ID"] = read_boot_id(Root(Path(cfg.root)))
    raise_fd_limit()
    try:
        daemon = Daemon(cfg, args, log)
    except KreldError as e:
        log.error("startup_failed", error=str(e), kind=type(e).__name__, exc_info=args.debug)
        return int(e.exit_code)
    try:
        rc = asyncio.run(daemon.run())
    except KreldError as e:
        log.error("startup_failed", error=str(e), kind=type(e).__name__, exc_info=args.debug)
        daemon.shutdown()
        return int(e.exit_code)
    log.info("stopped")
    return leave(rc)


if __name__ == "__main__":
    sys.exit(main())
