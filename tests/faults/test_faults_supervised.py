"""Each supervised thread, task and pool of the daemon made to fail.

The fault is a real exception raised inside the running daemon through its
test hook (``KRELD_TEST_FAULTS`` beside ``KRELD_TEST=1``, see
kreld.core.supervise): in a thread at the next line of kreld's own code it
runs after the first watchdog ping, in a task at its next step, in a pool at
its worker's start.  Then Status names what failed and why, the log holds its
traceback once, ``WATCHDOG=1`` stops on a real NOTIFY_SOCKET, and a restart
(what systemd does on the watchdog's silence: SIGABRT, then a new start)
loses no record, as kreldctl reads them back.  The restart by systemd itself
is tests/vm/test_vm_supervised.py.

The notify socket is read all along, as systemd reads it; a reader that falls
behind must not stop the daemon either (the last test).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kreld.client import Client, ConnectError

from support.faketree import FakeTree
from support.kreldproc import KreldProcess
from support.run import ctl_json, notify_socket
from support.wait import quick_heartbeat, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

BASE = 0xFFFFFFFFC2000000
PING_USEC = 400_000  # WATCHDOG=1 every 0.2 s


class Notifications:
    """Every sd_notify message sent to a socket, read as systemd reads them
    (at once, on a thread of its own), with when each came."""

    def __init__(self, path: Path) -> None:
        self.sock = notify_socket(path)
        self.sock.settimeout(0.2)
        self.got: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except (TimeoutError, OSError):
                continue
            now = time.monotonic()
            with self._lock:
                self.got.extend((now, m) for m in data.decode().split("\n") if m)

    def pings_since(self, t: float) -> int:
        with self._lock:
            return sum(1 for when, m in self.got if m == "WATCHDOG=1" and when >= t)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@contextmanager
def notifications(path: Path) -> Iterator[Notifications]:
    n = Notifications(path)
    try:
        yield n
    finally:
        n.close()


def start(
    tree: FakeTree, tmp: Path, sock: Path, notify: Path, faults: str, *extra: str
) -> KreldProcess:
    env_faults = {"KRELD_TEST_FAULTS": faults, "KRELD_TEST": "1"} if faults else {}
    k = KreldProcess(
        [
            *("--root", str(tree.root), "--state-dir", str(tmp / "state")),
            *("--socket", str(sock), *extra),
        ],
        tmp / "kreld.log",
    )
    saved = dict(os.environ)
    os.environ.update(NOTIFY_SOCKET=str(notify), WATCHDOG_USEC=str(PING_USEC), **env_faults)
    os.environ.update(
        AWS_ACCESS_KEY_ID="test",
        AWS_SECRET_ACCESS_KEY="test",
        AWS_REGION="us-east-1",
        AWS_ALLOW_HTTP="true",
    )
    try:
        return k.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def degraded(sock: Path) -> list[dict[str, object]]:
    with Client(str(sock)) as c:
        out: list[dict[str, object]] = c.call("Status")["degraded"]
        return out


def recorded(tmp: Path, boot: str) -> set[tuple[str, int]]:
    """(name, seq) of every module incarnation of *boot*, as kreldctl reads the store."""
    out = ctl_json("--state-dir", str(tmp / "state"), "modules", "--boot", boot, "--all")
    return {(m["name"], m["seq"]) for m in out}


# Every thread, task and pool the daemon runs on a fake tree, and what makes it
# run a line of its own code once the fault is armed.  The uevent and the
# module tracepoints' threads open kernel sources a fake tree has not (they are
# made to fail in tests/vm/test_vm_supervised.py); a subscriber's watcher is one
# connection's (transient: logged, never a restart).
TRIGGERS = {
    "tracker": "nothing: it wakes for its heartbeat (each second here)",
    "symbols": "a load: it captures the module's symbols",
    "kernel-code": "nothing: without rings it looks at kallsyms every minute",
    "calls": "a call that is not quick (ListBoots): the pool's worker starts",
    "status-updates": "nothing: a task's next step",
    "retention": "nothing: a task's next step",
    "watchdog": "nothing: the pinger's next step",
    "poll-pace": "a load: Status changes, the poll's pace is looked at",
    "publisher": "nothing: with [publish] it tries a round every 0.1 s",
}


def publishing(tmp: Path) -> list[str]:
    """A [publish] configuration whose endpoint refuses: the publisher's rounds
    fail and are retried (no server is needed to run its code).  Credentials
    are in the environment (start() sets them), so that the S3 client asks no
    metadata service for any."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    cfg = tmp / "publish.toml"
    cfg.write_text(
        f'[publish]\nurl = "s3://fleet/x"\nendpoint_url = "http://127.0.0.1:{port}"\n'
        "interval = 0.1\n"
    )
    return ["--config", str(cfg)]


@pytest.mark.parametrize("name", list(TRIGGERS))
def test_a_failed_part_is_named_in_status_stops_the_watchdog_and_a_restart_loses_nothing(
    name: str, tree: FakeTree, tmp_path: Path, sockdir: Path
) -> None:
    tree.add_module("before", BASE)
    sock = sockdir / "k.sock"
    with notifications(sockdir / "notify") as note:
        extra: list[str] = []
        if name == "publisher":
            extra = publishing(tmp_path)
        elif name == "tracker":
            extra = quick_heartbeat(tmp_path / "kreld.toml")
        k = start(tree, tmp_path, sock, sockdir / "notify", name, *extra)
        try:
            wait_until("the first ping (the fault is armed)", lambda: note.pings_since(0), 60)
            if name in ("symbols", "poll-pace"):
                tree.add_module("during", BASE + 0x10000)
            if name == "calls":
                # The pool is broken: that connection is closed, the others served.
                with Client(str(sock)) as c, contextlib.suppress(ConnectError):
                    c.send("ListBoots", {})
                    c.receive()
            failed = wait_until(
                f"Status naming {name}",
                lambda: [f for f in degraded(sock) if f["name"] == name],
                150,
            )
            assert "InjectedFault" in str(failed[0]["reason"])
            # The failure is known: from then on no ping, over ten of its intervals.
            known = time.monotonic() + PING_USEC / 1e6
            wait_until("ten intervals", lambda: time.monotonic() > known + 10 * PING_USEC / 1e6)
            assert note.pings_since(known) == 0
            logged = [e for e in k.events() if e.get("event") == "supervised_failed"]
            mine = [e for e in logged if e["name"] == name]
            assert len(mine) == 1, "logged once"
            assert "InjectedFault" in mine[0]["traceback"]
            assert "Traceback" in mine[0]["traceback"]
            # ...and nowhere else: no second report on stderr (threading's, a pool's).
            others = [
                line
                for line in k.log_path.read_text().splitlines()
                if "Traceback" in line and '"supervised_failed"' not in line
            ]
            assert others == []
            boot = tree.boot_id
            kept = recorded(tmp_path, boot)
            assert "before" in {n for n, _ in kept}
            # What systemd's watchdog does on the silence: SIGABRT; then a restart.
            assert k.stop(signal.SIGABRT) != 0
            tree.add_module("after", BASE + 0x20000)
            restarted = time.monotonic()
            k2 = start(tree, tmp_path, sock, sockdir / "notify", "", *extra)
            try:
                wait_until("the restarted daemon pings", lambda: note.pings_since(restarted), 30)
                assert degraded(sock) == []
                now = recorded(tmp_path, boot)
                assert kept <= now, "no record lost"
                assert {"before", "after"} <= {n for n, _ in now}
                if name in ("symbols", "poll-pace"):
                    assert "during" in {n for n, _ in now}
            finally:
                k2.stop()
        finally:
            if k.proc is not None and k.proc.poll() is None:
                k.stop()


def test_the_fault_hook_alone_is_ignored_and_said(
    tree: FakeTree, tmp_path: Path, sockdir: Path
) -> None:
    """KRELD_TEST_FAULTS without KRELD_TEST=1 (a stray variable) breaks nothing."""
    sock = sockdir / "k.sock"
    k = KreldProcess(
        ["--root", str(tree.root), "--state-dir", str(tmp_path / "state"), "--socket", str(sock)],
        tmp_path / "kreld.log",
    )
    saved = dict(os.environ)
    os.environ.pop("KRELD_TEST", None)
    os.environ.update(KRELD_TEST_FAULTS="tracker,status-updates,watchdog")
    try:
        k.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        ignored = k.wait_for("test_faults_ignored")
        assert ignored
        tree.add_module("later", BASE)
        wait_until(
            "the later load recorded",
            lambda: "later" in {n for n, _ in recorded(tmp_path, tree.boot_id)},
            60,
        )
        assert degraded(sock) == []
    finally:
        k.stop()


def test_a_notify_reader_that_falls_behind_does_not_stop_the_daemon(
    tree: FakeTree, tmp_path: Path, sockdir: Path
) -> None:
    """A datagram socket holds a few messages only; unread, the next send
    would wait, and the daemon's loop with it.  Pings are dropped instead,
    and calls are answered."""
    s = notify_socket(sockdir / "notify")  # never read until the end
    try:
        k = start(tree, tmp_path, sockdir / "k.sock", sockdir / "notify", "")
        try:
            filled = time.monotonic() + 40 * PING_USEC / 2e6  # past any queue's length
            wait_until("forty intervals", lambda: time.monotonic() > filled, 60)
            with Client(str(sockdir / "k.sock")) as c:
                c.sock.settimeout(20)
                assert c.call("Status")["degraded"] == []
            tree.add_module("later", BASE)
            wait_until(
                "the later load recorded",
                lambda: "later" in {n for n, _ in recorded(tmp_path, tree.boot_id)},
                60,
            )
        finally:
            k.stop()
    finally:
        s.close()
