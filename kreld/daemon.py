"""``kreld``: the resident daemon.

Starts, records the boot, follows modules, and stays in the foreground until
SIGTERM or SIGINT (exit 0).  No fork, no PID file.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from kreld import log as klog
from kreld.config import Config
from kreld.errors import ExitCode, KreldError
from kreld.kernel import Root
from kreld.model import BootSnapshot, Timestamp
from kreld.options import add_common, resolve_config
from kreld.snapshot import take_snapshot
from kreld.sources import UeventSource, WatchSource
from kreld.store import Store
from kreld.tracker import ModuleTracker

EPILOG = """\
exit status:
  0  stopped cleanly on SIGTERM or SIGINT
  1  an error kept it from running (logged)
  5  the store is unusable: corrupt, truncated, foreign or from a newer kreld
  6  the configuration is invalid (the message names the file and key)
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kreld",
        description="Record the kernel's and its modules' relocations for profilers.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common(p)
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default=None)
    p.add_argument("--log-format", choices=("auto", "console", "json"), default=None)
    return p


def log_boot(log: Any, snap: BootSnapshot, added: bool, changed: bool, notes: list[str]) -> None:
    """One event per fact, as the brief asks."""
    log.info("boot", boot_id=snap.boot_id, new=added, updated=changed)
    log.info("kernel_release", release=snap.release, version=snap.version)
    log.info("kernel_build_id", build_id=snap.build_id)
    for name, value in snap.anchors.to_json().items():
        log.info("kernel_symbol", symbol=name, address=value)
    if snap.kaslr is not None:
        log.info(
            "kaslr_offset",
            offset=f"{snap.kaslr.value:#x}",
            source=snap.kaslr.source.value,
            path=snap.kaslr.path,
        )
    else:
        log.info("kaslr_offset", offset=None, source=None)
        for note in notes:
            log.debug("kaslr_source_skipped", reason=note)
    if snap.restricted:
        log.warning("addresses_restricted", reason=snap.restricted_reason)
    for fault in snap.faults:
        log.warning("kernel_read_fault", fault=fault)


class Daemon:
    def __init__(self, cfg: Config, log: Any) -> None:
        self.cfg = cfg
        self.log = log
        self.stop = threading.Event()
        self.root = Root(Path(cfg.root))
        self.store = Store(cfg.state_dir)
        self.sources: list[Any] = []
        self.tracker: ModuleTracker | None = None
        self.boot: BootSnapshot | None = None

    def start(self) -> None:
        snap, notes = take_snapshot(self.root, self.cfg.debuginfo_dirs)
        stored, added, changed = self.store.record_boot(snap)
        self.boot = stored
        log_boot(self.log, stored, added, changed, notes)
        self.tracker = ModuleTracker(
            self.store,
            self.root,
            stored.boot_id,
            self.log,
            recheck_interval=self.cfg.poll_interval,
        )
        self.tracker.startup()
        tracker = self.tracker
        watch = WatchSource(
            tracker.notify,
            str(self.root / "sys/module"),
            self.cfg.watch,
            self.cfg.poll_interval,
            self.log,
        )
        self.sources.append(watch)
        if self.cfg.uevents and self.cfg.root == "/":
            try:
                self.sources.append(UeventSource(tracker.notify, self.log))
            except Exception as e:  # no netlink (container, seccomp): polling still works
                self.log.warning("uevent_source_unavailable", error=str(e))
        threading.Thread(target=tracker.run, args=(self.stop,), name="tracker", daemon=True).start()
        for s in self.sources:
            s.start(self.stop)
        self.log.info(
            "watching",
            path=watch.path,
            method=watch.method,
            uevents=any(isinstance(s, UeventSource) for s in self.sources),
        )

    def shutdown(self) -> None:
        self.stop.set()
        for s in self.sources:
            s.stop()
        if self.tracker is not None:
            try:
                self.store.heartbeat(self.tracker.boot_id, Timestamp.now())
            except KreldError as e:
                self.log.error("final_heartbeat_failed", error=str(e))
        self.store.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = resolve_config(args)
    except KreldError as e:
        print(f"kreld: {e}", file=sys.stderr)
        return int(e.exit_code)
    klog.configure(args.log_level or cfg.log_level, args.log_format or cfg.log_format)
    log = klog.get()

    stopping = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal", signal=signal.Signals(signum).name)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        daemon = Daemon(cfg, log)
    except KreldError as e:
        log.error("startup_failed", error=str(e), kind=type(e).__name__)
        return int(e.exit_code)
    try:
        daemon.start()
        log.info("ready", state_dir=cfg.state_dir, root=cfg.root)
        while not stopping.wait(3600):
            pass
    except KreldError as e:
        log.error("startup_failed", error=str(e), kind=type(e).__name__)
        daemon.shutdown()
        return int(e.exit_code)
    daemon.shutdown()
    log.info("stopped")
    return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
