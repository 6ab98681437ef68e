"""Clients that never read what they asked for.

Hundreds of peers that Subscribe (or ask for a large reply) and never read a byte:
each is dropped once its reply has waited ``[limits] write_timeout`` seconds, counted
in Status ``dropped``, and costs kreld a bounded amount meanwhile (the subscription's
first reply is one encoding shared by all, and no more than a chunk of any reply
waits in kreld per connection).  Root is capped per uid like anyone else unless
``cap_root`` is off.  Throughout, kreld goes on answering and the store stays
readable by every reader.

The peers are real sockets held by this process; kreld is a real subprocess with a
fake tree of many modules, so the first reply of a subscription is about a megabyte
(more than a socket buffer holds).
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kreld.client import Client

from support.faketree import FakeTree
from support.faultlib import history, proc_status, write_config
from support.run import kreldctl, start
from support.tmpdirs import fast_tmpdir
from support.wait import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]

BASE = 0xFFFFFFFFC0000000
MODULES = 150
SECTIONS = 60  # per module: the first reply to Subscribe is ~1 MB
WRITE_TIMEOUT = 1.0
MEMORY_CEILING_KIB = 500 << 10


def many_modules(tree: FakeTree) -> None:
    for m in range(MODULES):
        base = BASE + m * 0x100000
        secs = {".text": base} | {
            f".text.part{k:03d}": base + 0x10 * (k + 1) for k in range(SECTIONS)
        }
        tree.add_module(f"mod{m:03d}", base, sections=secs)


@pytest.fixture
def fast() -> Iterator[Path]:
    with fast_tmpdir() as d:
        yield d


def serve(daemon_factory: Any, fast: Path, tmp_path: Path, sockdir: Path, **limits: Any) -> Any:
    tree = FakeTree(fast / "root")
    many_modules(tree)
    tree.grow_kallsyms(100_000)  # ExportKallsyms: some 4 MB
    cfg = write_config(tmp_path / "kreld.toml", limits={"write_timeout": WRITE_TIMEOUT, **limits})
    sock = sockdir / "kreld.sock"
    d = start(daemon_factory, tree, fast / "state", sock, "--config", str(cfg))
    wait_until("the modules", lambda: status(sock)["loaded_modules"] == MODULES, timeout=60)
    d.wait_for("kernel_symbols", timeout=60)
    return d, tree, sock


def status(sock: Path) -> dict[str, Any]:
    with Client(str(sock)) as c:
        return dict(c.call("Status"))


def ask_and_never_read(sock: Path, call: dict[str, Any], n: int) -> list[socket.socket]:
    """*n* connections that each send *call* and never read."""
    held = []
    raw = json.dumps(call).encode() + b"\0"
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(sock))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(raw)
        held.append(s)
    return held


def first_message(s: socket.socket) -> dict[str, Any] | None:
    """What a held connection has been sent first, read now: None for a reply cut
    short (the peer was dropped while it was being sent)."""
    s.settimeout(10)
    buf = b""
    with contextlib.suppress(ConnectionResetError):
        while b"\0" not in buf:
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
    if b"\0" not in buf:
        return None
    return dict(json.loads(buf[: buf.index(b"\0")]))


def still_whole(d: Any, tree: FakeTree, sock: Path, state: Path) -> None:
    """kreld answers, and every reader reads the store."""
    assert d.proc.poll() is None
    with Client(str(sock)) as c:
        assert c.call("GetBoot")["boot"]["boot_id"] == tree.boot_id
        assert len(c.call("GetModules")["modules"]) == MODULES
    assert len(history(state, tree.boot_id)) == MODULES
    for argv in (["boots"], ["modules"], ["status"]):
        cp = kreldctl(
            "--state-dir", str(state), "--root", str(tree.root), "--socket", "/none", *argv
        )
        assert "Traceback" not in cp.stderr, (argv, cp.stderr)


SUBSCRIBE = {"method": "io.kreld.Subscribe", "parameters": {}, "more": True}
EXPORT = {"method": "io.kreld.ExportKallsyms", "parameters": {}}


@pytest.mark.parametrize(
    ("call", "clients", "limits"),
    [
        pytest.param(SUBSCRIBE, 300, {"cap_root": False}, id="300-subscribers-root-uncapped"),
        pytest.param(EXPORT, 12, {}, id="12-exports"),
        pytest.param(SUBSCRIBE, 150, {"max_connections_per_uid": 200}, id="150-subscribers"),
    ],
)
def test_peers_that_never_read_are_dropped_by_the_write_deadline_and_counted(
    daemon_factory: Any,
    fast: Path,
    tmp_path: Path,
    sockdir: Path,
    call: dict[str, Any],
    clients: int,
    limits: dict[str, Any],
) -> None:
    d, tree, sock = serve(daemon_factory, fast, tmp_path, sockdir, **limits)
    assert status(sock)["dropped"] == 0
    held = ask_and_never_read(sock, call, clients)
    try:
        # Every one of them is cut off after the deadline, and counted.
        wait_until(
            "every peer dropped",
            lambda: status(sock)["dropped"] == clients,
            timeout=30,
        )
        st = status(sock)
        assert st["connections"] == 1 and st["subscribers"] == 0, st
        dropped = [e for e in d.events() if e.get("event") == "peer_dropped"]
        assert len(dropped) == clients and all(e["unsent_bytes"] > 0 for e in dropped)
        # What each was sent before the cut is a reply cut short, never a second one.
        assert all(first_message(s) is None for s in held[:20])
    finally:
        for s in held:
            s.close()
    assert proc_status(d.proc.pid, "VmHWM") < MEMORY_CEILING_KIB
    still_whole(d, tree, sock, fast / "state")
    assert d.stop() == 0


def test_root_past_its_cap_is_refused_by_name_and_the_rest_dropped(
    daemon_factory: Any, fast: Path, tmp_path: Path, sockdir: Path
) -> None:
    """By default root is capped per uid too: 200 root subscribers that never read get
    their cap's worth admitted (then dropped by the deadline), the rest
    io.kreld.TooManyConnectionsPerUid at once."""
    cap = 32
    d, tree, sock = serve(daemon_factory, fast, tmp_path, sockdir, max_connections_per_uid=cap)
    held = ask_and_never_read(sock, SUBSCRIBE, 200)
    try:
        # (Root's own Status call would be refused too while they are held: the log says.)
        wait_until(
            "the admitted dropped",
            lambda: len([e for e in d.events() if e.get("event") == "peer_dropped"]) == cap,
            timeout=15,
        )
        firsts = [first_message(s) for s in held]
        refused = [m for m in firsts if m is not None and "error" in m]
        assert len(refused) == 200 - cap
        assert {m["error"] for m in refused} == {"io.kreld.TooManyConnectionsPerUid"}
        assert all(m["parameters"] == {"uid": 0, "limit": cap} for m in refused)
        assert firsts.count(None) == cap  # the admitted: a first reply cut short
    finally:
        for s in held:
            s.close()
    assert status(sock)["dropped"] == cap
    assert proc_status(d.proc.pid, "VmHWM") < MEMORY_CEILING_KIB
    still_whole(d, tree, sock, fast / "state")
    assert d.stop() == 0


def test_a_reader_of_a_large_reply_is_not_dropped_by_the_deadline(
    daemon_factory: Any, fast: Path, tmp_path: Path, sockdir: Path
) -> None:
    """The deadline is for peers that leave a reply unread, not for large replies: a
    4 MB export and a subscription's first reply reach a peer that reads them."""
    d, _, sock = serve(daemon_factory, fast, tmp_path, sockdir)
    with Client(str(sock)) as c:
        ks = c.call("ExportKallsyms")["kallsyms"]
        assert ks.count("\n") >= 100_000
    [s] = ask_and_never_read(sock, SUBSCRIBE, 1)
    with s:
        first = first_message(s)
        assert first is not None and len(first["parameters"]["modules"]) == MODULES
    assert status(sock)["dropped"] == 0
    assert d.stop() == 0
