"""Each supervised thread, task and pool of the daemon made to fail.

The fault is a real exception raised inside the running daemon through its
test hook (``KRELD_TEST_FAULTS``, see kreld.core.supervise): in a thread at the
next line of kreld's own code it runs after the first watchdog ping, in a task
at its next step, in a pool at its worker's start.  Then Status names what
failed, the log holds its traceback once, ``WATCHDOG=1`` stops on a real
NOTIFY_SOCKET, and a restart (what systemd does on the watchdog's silence:
SIGABRT, then a new start) loses no record.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from kreld.client import Client

from support.faketree import FakeTree
from support.faultlib import history
from support.kreldproc import KreldProcess
from support.run import notify_socket
from support.wait import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

BASE = 0xFFFFFFFFC2000000
PING_USEC = 400_000  # WATCHDOG=1 every 0.2 s


def pings_within(s: socket.socket, seconds: float) -> list[str]:
    """The WATCHDOG=1 messages *s* receives within *seconds*."""
    deadline = time.monotonic() + seconds
    got: list[str] = []
    while (left := deadline - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            got.extend(m for m in s.recv(4096).decode().split("\n") if m == "WATCHDOG=1")
        except TimeoutError:
            break
    return got


def start(tree: FakeTree, tmp: Path, sock: Path, notify: Path, faults: str) -> KreldProcess:
    env_faults = {"KRELD_TEST_FAULTS": faults} if faults else {}
    k = KreldProcess(
        ["--root", str(tree.root), "--state-dir", str(tmp / "state"), "--socket", str(sock)],
        tmp / "kreld.log",
    )
    saved = dict(os.environ)
    os.environ.update(NOTIFY_SOCKET=str(notify), WATCHDOG_USEC=str(PING_USEC), **env_faults)
    try:
        return k.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def degraded(sock: Path) -> list[dict[str, object]]:
    with Client(str(sock)) as c:
        out: list[dict[str, object]] = c.call("Status")["degraded"]
        return out


# name -> what makes the named part run a line of its own code after the fault is armed
TRIGGERS = {
    "tracker": "nothing: it wakes to look at sys/module",
    "symbols": "a load: it captures the module's symbols",
}


@pytest.mark.parametrize("name", list(TRIGGERS))
def test_a_failed_part_is_named_in_status_stops_the_watchdog_and_a_restart_loses_nothing(
    name: str, tree: FakeTree, tmp_path: Path, sockdir: Path
) -> None:
    tree.add_module("before", BASE)
    notify = notify_socket(sockdir / "notify")
    sock = sockdir / "k.sock"
    k = start(tree, tmp_path, sock, sockdir / "notify", name)
    try:
        if name == "symbols":
            tree.add_module("during", BASE + 0x10000)
        if name == "calls":
            with Client(str(sock)) as c:  # its reply is an error: the pool is broken
                c.send("GetModules", {"all": True})
                c.receive()
        failed = wait_until(
            f"Status naming {name}", lambda: [f for f in degraded(sock) if f["name"] == name], 120
        )
        assert "InjectedFault" in str(failed[0]["reason"])
        # The failure is known: from now on no ping, over ten of its intervals.
        pings_within(notify, 0.05)  # what was sent before
        assert pings_within(notify, 10 * PING_USEC / 2e6) == []
        logged = [e for e in k.events() if e.get("event") == "supervised_failed"]
        assert [e["name"] for e in logged if e["name"] == name] == [name]
        assert "InjectedFault" in logged[0]["traceback"]
        boot = tree.boot_id
        kept = history(tmp_path / "state", boot) if name != "calls" else None
        # What systemd's watchdog does on the silence: SIGABRT; then a restart.
        assert k.stop(signal.SIGABRT) != 0
        tree.add_module("after", BASE + 0x20000)
        k2 = start(tree, tmp_path, sock, sockdir / "notify", "")
        try:
            assert pings_within(notify, 1.0), "the restarted daemon pings"
            assert degraded(sock) == []
            names = {i["name"] for i in history(tmp_path / "state", boot)}
            assert {"before", "after"} <= names
            if name == "symbols":
                assert "during" in names
            if kept:
                assert {i["seq"] for i in kept} <= {
                    i["seq"] for i in history(tmp_path / "state", boot)
                }
        finally:
            k2.stop()
    finally:
        if k.proc is not None and k.proc.poll() is None:
            k.stop()
        notify.close()
