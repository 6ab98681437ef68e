"""The uevent path: parsing real kernel uevent datagrams, filtering, a real netlink socket."""

from __future__ import annotations

import io
import json
import os
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import structlog
from watchdog.events import FileSystemEvent

from kreld.core.model import SeenBy
from kreld.tracker.sources import (
    DirentListing,
    Uevent,
    UeventSource,
    WatchSource,
    module_event,
    parse_uevent,
)

from support.wait import wait_until

MEM_NULL_UEVENT = "/sys/devices/virtual/mem/null/uevent"


def datagram(header: str, **props: str) -> bytes:
    """A kernel uevent as it travels on NETLINK_KOBJECT_UEVENT."""
    return b"".join(s.encode() + b"\0" for s in [header, *(f"{k}={v}" for k, v in props.items())])


MODULE_ADD = (
    b"add@/module/dummy\0ACTION=add\0DEVPATH=/module/dummy\0SUBSYSTEM=module\0SEQNUM=1234\0"
)
MODULE_REMOVE = datagram(
    "remove@/module/dummy",
    ACTION="remove",
    DEVPATH="/module/dummy",
    SUBSYSTEM="module",
    SEQNUM="1240",
)
MEM_CHANGE = datagram(
    "change@/devices/virtual/mem/null",
    ACTION="change",
    DEVPATH="/devices/virtual/mem/null",
    SUBSYSTEM="mem",
    MAJOR="1",
    MINOR="3",
    DEVNAME="null",
    DEVMODE="0666",
    SEQNUM="1235",
)
# A driver binding is sent with SUBSYSTEM=drivers, a path under /bus: not a module load.
DRIVER_BIND = datagram(
    "add@/bus/pci/drivers/e1000e",
    ACTION="add",
    DEVPATH="/bus/pci/drivers/e1000e",
    SUBSYSTEM="drivers",
    SEQNUM="1236",
)


def udev_message() -> bytes:
    """What udevd multicasts: "libudev\\0", a binary header, then properties."""
    props = b"ACTION=add\0DEVPATH=/module/dummy\0SUBSYSTEM=module\0SEQNUM=1234\0"
    header = struct.pack("<8sIIIIIIII", b"libudev", 0xFEEDCAFE, 40, 40, len(props), 0, 0, 0, 0)
    return header + props


def test_parse_module_add() -> None:
    ev = parse_uevent(MODULE_ADD)
    assert ev is not None
    assert ev.action == "add"
    assert ev.devpath == "/module/dummy"
    assert ev.subsystem == "module"
    assert ev.properties["SEQNUM"] == "1234"
    assert module_event(ev) == ("add", "dummy")


def test_parse_module_remove() -> None:
    ev = parse_uevent(MODULE_REMOVE)
    assert ev is not None
    assert (ev.action, ev.devpath, ev.subsystem) == ("remove", "/module/dummy", "module")
    assert module_event(ev) == ("remove", "dummy")


def test_module_name_with_underscores_and_dashes() -> None:
    raw = datagram(
        "add@/module/nf_conntrack_netlink",
        ACTION="add",
        DEVPATH="/module/nf_conntrack_netlink",
        SUBSYSTEM="module",
        SEQNUM="9",
    )
    ev = parse_uevent(raw)
    assert ev is not None
    assert module_event(ev) == ("add", "nf_conntrack_netlink")


def test_non_module_subsystem_is_ignored() -> None:
    ev = parse_uevent(MEM_CHANGE)
    assert ev is not None
    assert ev.subsystem == "mem"
    assert ev.action == "change"
    assert ev.devpath == "/devices/virtual/mem/null"
    assert ev.properties["DEVNAME"] == "null"
    assert module_event(ev) is None

    bind = parse_uevent(DRIVER_BIND)
    assert bind is not None
    assert module_event(bind) is None


def test_module_subsystem_with_a_deeper_path_or_no_name_is_ignored() -> None:
    for devpath in ("/module/dummy/holders/x", "/module/", "/devices/module/dummy"):
        raw = datagram(f"add@{devpath}", ACTION="add", DEVPATH=devpath, SUBSYSTEM="module")
        ev = parse_uevent(raw)
        assert ev is not None
        assert module_event(ev) is None, devpath


def test_module_path_without_subsystem_is_ignored() -> None:
    raw = b"add@/module/dummy\0ACTION=add\0DEVPATH=/module/dummy\0SEQNUM=7\0"
    ev = parse_uevent(raw)
    assert ev is not None
    assert ev.subsystem is None
    assert module_event(ev) is None


def test_properties_override_the_header() -> None:
    # The kernel's header and properties agree; the properties are authoritative.
    raw = b"change@/module/x\0ACTION=remove\0DEVPATH=/module/dummy\0SUBSYSTEM=module\0"
    ev = parse_uevent(raw)
    assert ev is not None
    assert module_event(ev) == ("remove", "dummy")


def test_udev_message_is_not_a_kernel_uevent() -> None:
    assert parse_uevent(udev_message()) is None


@pytest.mark.parametrize(
    "raw",
    [b"", b"\0", b"\0\0\0\0", b"hello world", b"\xff\xfe\xfd\0KEY=VALUE\0", b"ACTION=add\0"],
)
def test_garbage_is_none(raw: bytes) -> None:
    assert parse_uevent(raw) is None


class Recorder:
    """A real notify target: remembers every hint it was given."""

    def __init__(self) -> None:
        self.hints: list[tuple[SeenBy, str, str | None]] = []
        self.lock = threading.Lock()

    def __call__(self, source: SeenBy, action: str, name: str | None = None) -> None:
        with self.lock:
            self.hints.append((source, action, name))


def json_logger(buf: io.StringIO) -> Any:
    return structlog.wrap_logger(
        structlog.PrintLogger(buf),
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
    )


def log_lines(buf: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def open_source(notify: Recorder, buf: io.StringIO) -> UeventSource:
    try:
        return UeventSource(notify, json_logger(buf))
    except (OSError, ImportError) as e:
        pytest.skip(f"cannot open a NETLINK_KOBJECT_UEVENT socket here: {e}")


def test_handle_counts_ignored_and_notifies_modules() -> None:
    rec, buf = Recorder(), io.StringIO()
    src = open_source(rec, buf)
    for raw in [MODULE_ADD, MEM_CHANGE, DRIVER_BIND, MODULE_REMOVE, MEM_CHANGE]:
        ev = parse_uevent(raw)
        assert ev is not None
        src.handle(ev)
    assert src.received == 5
    assert src.ignored == 3
    assert rec.hints == [
        (SeenBy.UEVENT, "add", "dummy"),
        (SeenBy.UEVENT, "remove", "dummy"),
    ]
    ignored = [e for e in log_lines(buf) if e["event"] == "uevent_ignored"]
    assert [e["devpath"] for e in ignored] == [
        "/devices/virtual/mem/null",
        "/bus/pci/drivers/e1000e",
        "/devices/virtual/mem/null",
    ]
    assert ignored[0]["subsystem"] == "mem"


def test_handle_of_a_hand_built_uevent() -> None:
    rec, buf = Recorder(), io.StringIO()
    src = open_source(rec, buf)
    src.handle(Uevent("add", "/module/loop", "module", {}))
    src.handle(Uevent("add", "/devices/virtual/block/loop0", "block", {}))
    assert (src.received, src.ignored) == (2, 1)
    assert rec.hints == [(SeenBy.UEVENT, "add", "loop")]


def test_real_netlink_uevent_reaches_the_monitor_and_is_ignored() -> None:
    if os.geteuid() != 0:
        pytest.skip("writing to /sys/.../uevent to trigger a kernel uevent needs root")
    if not os.path.exists(MEM_NULL_UEVENT):
        pytest.skip(f"{MEM_NULL_UEVENT} does not exist here")
    rec, buf = Recorder(), io.StringIO()
    src = open_source(rec, buf)
    stop = threading.Event()
    src.start(stop)
    try:
        try:
            with open(MEM_NULL_UEVENT, "w") as f:
                f.write("change")
        except OSError as e:
            pytest.skip(f"cannot trigger a uevent through {MEM_NULL_UEVENT}: {e}")
        deadline = time.monotonic() + 15
        seen: list[dict[str, Any]] = []
        while time.monotonic() < deadline and not seen:
            seen = [
                e
                for e in log_lines(buf)
                if e["event"] == "uevent_ignored" and e["devpath"] == "/devices/virtual/mem/null"
            ]
            time.sleep(0.02)
        assert seen, f"no uevent for /dev/null arrived; log:\n{buf.getvalue()}"
        assert seen[0]["action"] == "change"
        assert seen[0]["subsystem"] == "mem"
        assert src.received >= 1
        assert src.ignored >= 1
        assert src.healthy
        # Not a module: the tracker was never told to look.
        assert all(h[2] != "null" for h in rec.hints)
    finally:
        stop.set()
        src.stop()


class _Seen(WatchSource):
    """A real WatchSource that also keeps the type of every event its observer delivers."""

    def __init__(self, notify: Recorder, path: str) -> None:
        self.delivered: list[str] = []
        super().__init__(notify, path, "inotify", 1.0, json_logger(io.StringIO()))

    def handle(self, event: FileSystemEvent) -> None:
        self.delivered.append(type(event).__name__)
        super().handle(event)


def test_the_inotify_watch_is_woken_only_by_module_directories_coming_and_going(
    tmp_path: Path,
) -> None:
    """Listing the directory and reading a module's files (what the tracker does
    on every load) deliver no event; a directory created, renamed in and
    deleted is still each a hint."""
    mods = tmp_path / "module"
    (mods / "old" / "sections").mkdir(parents=True)
    rec = Recorder()
    src = _Seen(rec, str(mods))
    stop = threading.Event()
    src.start(stop)
    try:
        for _ in range(3):
            assert [e.name for e in os.scandir(mods)] == ["old"]
            (mods / "old" / "initstate").write_text("live\n")
            (mods / "old" / "initstate").read_text()
            os.close(os.open(mods / "old", os.O_RDONLY | os.O_DIRECTORY))
        (mods / "new").mkdir()
        (tmp_path / "stage").mkdir()
        os.rename(tmp_path / "stage", mods / "moved")
        (mods / "new").rmdir()
        want = [
            (SeenBy.INOTIFY, "add", "new"),
            (SeenBy.INOTIFY, "add", "moved"),
            (SeenBy.INOTIFY, "remove", "new"),
        ]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and rec.hints != want:
            time.sleep(0.02)
        assert rec.hints == want
        assert set(src.delivered) <= {"DirCreatedEvent", "DirMovedEvent", "DirDeletedEvent"}
    finally:
        stop.set()
        src.stop()


def first_poll_done(src_dir: Path, rec: Recorder) -> None:
    """Wait until the poller has its first snapshot: probe directories made one
    after another until one is told (made after the snapshot); wait for the rest
    made after it, then remove them all and wait for every removal (each probe is
    in a snapshot by then), so that none is told later; *rec*'s hints start empty."""
    made: list[str] = []

    def told() -> set[str]:
        with rec.lock:
            return {n for _s, a, n in rec.hints if a == "add" and n in made}

    def probe() -> bool:
        made.append(f"probe{len(made)}")
        (src_dir / made[-1]).mkdir()
        return bool(told())

    wait_until("the poller's first snapshot", probe, 10, step=0.05)
    first = min(made.index(n) for n in told())
    wait_until("every later probe told", lambda: set(made[first:]) <= told(), 10)
    for n in made:
        (src_dir / n).rmdir()
    wait_until(
        "the probes' removals told",
        lambda: {n for _s, a, n in rec.hints if a == "remove"} >= set(made),
        10,
    )
    with rec.lock:
        rec.hints.clear()


def test_the_polling_snapshot_sees_loads_unloads_and_a_reload_under_the_same_name(
    tmp_path: Path,
) -> None:
    """The poll lists the directory without a stat of each entry, and still
    tells a module directory that appears, one that goes, and one removed and
    made again under the same name (a new inode) between two polls."""
    mods = tmp_path / "module"
    (mods / "builtin" / "parameters").mkdir(parents=True)
    (mods / "reloaded").mkdir()
    rec = Recorder()
    src = WatchSource(rec, str(mods), "poll", 0.1, json_logger(io.StringIO()))
    stop = threading.Event()
    src.start(stop)
    try:
        first_poll_done(src_dir=mods, rec=rec)
        (mods / "new").mkdir()
        # Moved away, not removed: a disk filesystem would give the new
        # directory the freed inode (kernfs numbers each directory anew).
        os.rename(mods / "reloaded", tmp_path / "unloaded")
        (mods / "reloaded").mkdir()
        (mods / "builtin" / "parameters" / "x").write_text("1")
        want = [
            (SeenBy.POLL, "add", "new"),
            (SeenBy.POLL, "add", "reloaded"),
            (SeenBy.POLL, "remove", "reloaded"),
        ]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sorted(rec.hints) != want:
            time.sleep(0.02)
        assert sorted(rec.hints) == want
        (mods / "new").rmdir()
        while time.monotonic() < deadline and len(rec.hints) < 4:
            time.sleep(0.02)
        assert rec.hints[3:] == [(SeenBy.POLL, "remove", "new")]
    finally:
        stop.set()
        src.stop()


def test_a_listed_entry_has_the_identity_and_kind_a_stat_gives(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    listing = DirentListing()
    root = listing.stat(str(tmp_path))
    assert root.st_ino == os.stat(tmp_path).st_ino
    for entry in listing.listdir(str(tmp_path)):
        got, real = listing.stat(entry.path), os.stat(entry.path)
        assert (got.st_ino, got.st_dev) == (real.st_ino, real.st_dev)
        assert stat.S_ISDIR(got.st_mode) == stat.S_ISDIR(real.st_mode)
