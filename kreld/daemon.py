"""``kreld``: the resident daemon.

Starts, records the boot, follows modules, serves varlink, and stays in the
foreground until SIGTERM or SIGINT (exit 0).  No fork, no PID file.  Under
systemd it takes its socket from socket activation, says ``READY=1`` once
the store is open, the boot recorded and the socket listening (which answers
from early on, while the start does its heavy work: kreld/startup.py), pings the
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

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kreld import __version__
from kreld.config.options import build_parser, epilog, leave, resolve_config
from kreld.config.settings import RESTART_KEYS, Config
from kreld.core import heap, supervise
from kreld.core import log as klog
from kreld.core.errors import ExitCode, KreldError, NotReady
from kreld.core.model import Timestamp
from kreld.core.record import fields, replace
from kreld.ctl.render import status_line
from kreld.kernel.info import Root, read_boot_id
from kreld.server.access import policy_of
from kreld.server.listener import Server, limits_of, raise_fd_limit
from kreld.server.service import Service
from kreld.startup import Startup
from kreld.store.lock import damaged_stores
from kreld.tracker.sources import health, module_followers

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from kreld.core.model import BootSnapshot
    from kreld.server.linebuild import LineBuilder
    from kreld.store import Store
    from kreld.symbols.absences import Absences
    from kreld.symbols.linetables import LineTableProvider


def check_config(cfg: Config) -> None:
    """:func:`kreld.fleet.publish.check_config`, imported only when ``[publish]`` is
    set: fleet publishing (zstandard, the S3 client) is not every host's."""
    if cfg.publish_url:
        from kreld.fleet.publish import check_config as check_publishing

        check_publishing(cfg)


class Daemon(Startup):
    """The running daemon: serves, keeps STATUS= and the watchdog, reloads, stops
    (what opens first and the work in the background: :class:`Startup`)."""

    def status(self) -> dict[str, Any]:
        """Status, also while the daemon starts (``starting`` says what is left:
        until the boot's record, its fields are the store's or empty)."""
        boot = self.boot or self._recorded_boot()
        counts = self.store.boots.counts()
        reading = self.addresses.reading(self.reading)  # as the last module read went
        return {
            "version": __version__,
            "uptime_ns": time.monotonic_ns() - self.started,
            "boot_id": (boot.boot_id if boot else self.early_id) or "",
            "boots": counts["boots"],
            "builds": counts["builds"],
            "incarnations": counts["incarnations"],
            "loaded_modules": len(self.serving_loaded()) if self.early_id else 0,
            "store_bytes": self.store.env.size_bytes(),
            "store_full": self.store.env.full,
            "restricted": reading[0],
            "restricted_reason": reading[1],
            "address_source": None if reading[2] is None else reading[2].value,
            "damaged_stores": damaged_stores(self.cfg.state_dir),
            **self._tracking_status(),
            "kernel_code": self.kernel_code.status(),
            "degraded": [f.to_json() for f in self.supervisor.failures()],
            "starting": self.starting(),
            "line_tables": None if self.lines is None else self.lines.status(),
        } | ({} if self.server is None else self.server.counts())  # connections, once served

    def _recorded_boot(self) -> BootSnapshot | None:
        try:
            return self.serving_boot()
        except NotReady:
            return None

    def _tracking_status(self) -> dict[str, Any]:
        """Status's sources, module followers and publishing: none while starting."""
        tracking = self.tracking
        if tracking is None:
            return {"sources": [], "module_followers": [], "publish": None, "counters": None}
        tracker = tracking.tracker
        return {
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
            "counters": tracking.counters(),
        }

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

        # The socket first, answering from what the store holds (Status says
        # what is still starting), then the heavy work (kallsyms, a vmlinux,
        # the first look at the modules) off the loop.
        server = await self._serve()
        pool = self.supervisor.executor("startup")  # its error stops the start, below
        await loop.run_in_executor(pool, self.start_tracking)
        pool.shutdown(wait=False)
        server.refresh()
        line = status_line(self.status())
        self.notify(f"READY=1\nSTATUS={line}")
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
            tasks.append(sup.task("watchdog", sup.pinger(usec / 2e6, self.notify)))
        else:
            sup.arm()
        await stop.wait()
        sup.stopping.set()
        self.notify("STOPPING=1")
        for t in tasks:
            t.cancel()
        await server.close()
        self.shutdown()
        return int(ExitCode.OK)

    async def _serve(self) -> Server:
        """Open the socket, with the line builder its Resolve asks."""
        self.lines = line_builder(self.cfg, self.store, self.log)
        self.lines.start(self.supervisor)
        service = Service(
            self.store,
            current_boot=self.serving_boot,
            current_id=self.serving_id,
            loaded=self.serving_loaded,
            snapshot=self.serving_snapshot,
            status=self.status,
            line_tables=self.lines,
            drop_pages=self.store.drop_pages,
        )
        server = Server(
            service, policy_of(self.cfg, self.log), limits_of(self.cfg, self.log), self.log
        )
        self.server = server
        server.started.clear()
        await server.start(self.listening_socket())
        self.tracker_listeners += [server.publish, self.status_changed]
        self.kernel_code.listeners.append(server.publish)
        self.supervisor.on_change(self.status_changed)
        self.log.info("listening", socket=self.cfg.socket, starting=self.starting())
        return server

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
        pool = self.supervisor.executor("poll-pace")  # a look at the files, off the loop
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
                    pool, self.tracking.adjust_poll, self.cfg
                )
            line = status_line(self.status())
            if line != last:
                self.notify(f"STATUS={line}")
                last = line

    def reload(self) -> None:
        """SIGHUP: take the new configuration, or keep the old one and say why."""
        _reload(self)

    def shutdown(self) -> None:
        self.supervisor.stopping.set()
        self.stop_threads.set()
        if self.lines is not None:
            self.lines.stop()
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
    self.notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
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
        self.tracking.reconfigure(applied)
        if self.tracking.publisher is not None or applied.publish_url:
            self.configure_publishing(applied)
    self.log.info("config_reloaded", changed=changed, files=list(applied.sources))
    self.notify("READY=1")


def line_builder(cfg: Config, store: Store, log: FilteringBoundLogger | None = None) -> LineBuilder:
    """The daemon's line-table builder: debug files found as ``kreldctl
    resolve --lines`` finds them, tables kept in the store (the provider
    holds only the one it built; the builder keeps those calls use)."""
    from kreld.server.linebuild import LineBuilder

    kept = store.line_tables

    def make(absences: Absences) -> LineTableProvider:
        from kreld.debuginfo.finder import finder_for
        from kreld.symbols.linetables import LineTableProvider

        return LineTableProvider(finder_for(cfg, cfg.root), kept, kept.put, memory=0,
                                 absences=absences, build_memory=cfg.line_build_memory,
                                 keep_later=True)  # fmt: skip

    def listing() -> list[dict[str, Any]]:
        return [{"build_id": b, "size": m.get("size", 0), "source": m.get("source", ""),
                 "what": m.get("what", "")} for b, m in sorted(kept.listing().items())]  # fmt: skip

    return LineBuilder(make, listing, log=log)


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
