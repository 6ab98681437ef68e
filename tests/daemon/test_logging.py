"""Logging: the journal under systemd, JSON lines or console otherwise, levels.

There is no journald on the test machines, so the journal tests bind the
journal's native socket themselves and parse what libsystemd sends there,
exactly as journald would receive it.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import pty
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import structlog

from kreld.client import Client
from kreld.core import log as klog

from support.faketree import FakeTree
from support.run import notify_messages, notify_socket

KRELD = str(Path(sys.executable).parent / "kreld")
JOURNAL_SOCKET = Path("/run/systemd/journal/socket")
SYSLOG_PRIORITIES = {"debug": 7, "info": 6, "warning": 4, "error": 3}


# --- the journal's native protocol ------------------------------------------------


def parse_native(data: bytes) -> dict[str, bytes]:
    """One datagram of the native journal protocol (systemd's JOURNAL_NATIVE_PROTOCOL).

    Each field is ``KEY=value\\n``, or for a value that may hold a newline
    ``KEY\\n`` + the value's length as little-endian 64-bit + value + ``\\n``.
    """
    fields: dict[str, bytes] = {}
    i = 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            i = nl + 1
        else:
            key = line
            (size,) = struct.unpack_from("<Q", data, nl + 1)
            value = data[nl + 9 : nl + 9 + size]
            assert data[nl + 9 + size : nl + 10 + size] == b"\n", "binary field not ended by \\n"
            i = nl + 10 + size
        fields[key.decode("ascii")] = value
    return fields


@dataclass
class Entry:
    pid: int
    fields: dict[str, bytes]

    def __getitem__(self, key: str) -> str:
        return self.fields[key].decode()

    def get(self, key: str) -> str | None:
        v = self.fields.get(key)
        return None if v is None else v.decode()


@dataclass
class Journal:
    """A stand-in for journald's socket: records every entry with the sender's pid."""

    sock: socket.socket
    entries: list[Entry] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        ucred = struct.calcsize("3i")
        fds_size = socket.CMSG_SPACE(4 * array.array("i").itemsize)
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                data, anc, _, _ = self.sock.recvmsg(1 << 20, socket.CMSG_SPACE(ucred) + fds_size)
            except TimeoutError:
                continue
            except OSError:
                return
            pid = -1
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("3i", payload[:ucred])[0]
                elif level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    # Too large for a datagram: libsystemd passes a sealed memfd.
                    fds = array.array("i")
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                    for fd in fds:
                        with os.fdopen(fd, "rb") as f:
                            data = f.read()
            if data:
                with self.lock:
                    self.entries.append(Entry(pid, parse_native(data)))

    def of(self, pid: int) -> list[Entry]:
        with self.lock:
            return [e for e in self.entries if e.pid == pid]

    def wait_for(self, pid: int, timeout: float = 20, **match: str) -> Entry:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.of(pid):
                if all(e.get(k) == v for k, v in match.items()):
                    return e
            time.sleep(0.02)
        events = [e.get("KRELD_EVENT") for e in self.of(pid)]
        raise AssertionError(f"no journal entry {match} from pid {pid}; got {events}")


@contextlib.contextmanager
def journal_directory() -> Iterator[None]:
    """/run/systemd/journal/ for the test, or a skip where it cannot or must not be."""
    if JOURNAL_SOCKET.exists() or JOURNAL_SOCKET.is_symlink():
        pytest.skip(
            f"{JOURNAL_SOCKET} exists (a journald runs here, another test run holds it, "
            "or one was interrupted and left it); these tests stand in for journald only "
            "where there is none"
        )
    if os.geteuid() != 0:
        pytest.skip(f"creating {JOURNAL_SOCKET} needs root")
    created = [d for d in (JOURNAL_SOCKET.parent.parent, JOURNAL_SOCKET.parent) if not d.exists()]
    for d in created:
        d.mkdir(mode=0o755)
    try:
        yield
    finally:
        JOURNAL_SOCKET.unlink(missing_ok=True)
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()


@pytest.fixture
def journal() -> Iterator[Journal]:
    """Bind the journal's socket where libsystemd sends to, if no journald has it."""
    with journal_directory():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        try:
            sock.bind(str(JOURNAL_SOCKET))
        except OSError as e:
            sock.close()
            pytest.skip(f"cannot bind {JOURNAL_SOCKET}: {e}")
        j = Journal(sock)
        reader = threading.Thread(target=j.run, daemon=True)
        reader.start()
        try:
            yield j
        finally:
            j.stop.set()
            reader.join(timeout=5)
            sock.close()


@pytest.fixture
def dead_journal() -> Iterator[None]:
    """The journal's socket file with nobody reading it: sends are refused."""
    with journal_directory():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(JOURNAL_SOCKET))
        sock.close()
        yield


def test_native_protocol_parser_reads_both_field_forms() -> None:
    data = b"PRIORITY=6\nMESSAGE\n" + struct.pack("<Q", 5) + b"a\nb=c\nKRELD_X=1=2\n"
    assert parse_native(data) == {"PRIORITY": b"6", "MESSAGE": b"a\nb=c", "KRELD_X": b"1=2"}


def test_journal_renderer_sends_fields_a_journal_indexes(journal: Journal) -> None:
    """In-process, through the real systemd.journal.send: text and binary fields."""
    klog.journal_context["KRELD_BOOT_ID"] = "0123-boot"
    try:
        with pytest.raises(structlog.DropEvent):
            klog.JournalRenderer()(
                None,
                "error",
                {
                    "event": "reconcile_failed",
                    "level": "error",
                    "timestamp": "2026-01-01T00:00:00Z",
                    "module": "veth",
                    "build_id": "ab" * 20,
                    "error": "first line\nsecond line",
                    "queued-events": 3,
                    "skipped": None,
                },
            )
    finally:
        klog.journal_context.clear()
    e = journal.wait_for(os.getpid(), KRELD_EVENT="reconcile_failed")
    assert e["PRIORITY"] == "3" and e["SYSLOG_IDENTIFIER"] == "kreld"
    assert e["KRELD_BOOT_ID"] == "0123-boot"
    assert (e["MODULE"], e["BUILD_ID"]) == ("veth", "ab" * 20)
    assert e.fields["KRELD_ERROR"] == b"first line\nsecond line"  # sent in the binary form
    assert e["KRELD_QUEUED_EVENTS"] == "3"
    assert "KRELD_SKIPPED" not in e.fields and "KRELD_TIMESTAMP" not in e.fields
    assert e["MESSAGE"].startswith("reconcile_failed module=veth")


# --- the daemon as systemd starts it ------------------------------------------------


class Drain:
    """Read a stream to its end in the background, so the writer never blocks."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.data = b""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # a pty's master reads EIO once the slave side is closed
                return
            if not chunk:
                return
            self.data += chunk

    def text(self) -> str:
        self.thread.join(timeout=10)
        return self.data.decode(errors="replace")


@pytest.mark.skipif(
    shutil.which("systemd-socket-activate") is None, reason="needs systemd-socket-activate"
)
def test_daemon_started_as_systemd_would_logs_structured_journal_entries(
    journal: Journal, tree: FakeTree, state_dir: Path, sockdir: Path, tmp_path: Path
) -> None:
    """Socket activation, NOTIFY_SOCKET, and stderr the JOURNAL_STREAM: auto picks the journal."""
    cfg = tmp_path / "kreld.toml"
    cfg.write_text('[access]\nallowed_groups = ["kreld-test-no-such-group"]\n')
    sock = sockdir / "kreld.sock"
    notify = notify_socket(sockdir / "notify")
    # journald hands a service a stream socket as stdout and stderr.
    stream, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    st = os.fstat(theirs.fileno())
    proc = subprocess.Popen(
        ["systemd-socket-activate", "-l", str(sock),
         "-E", f"NOTIFY_SOCKET={sockdir / 'notify'}",
         "-E", f"JOURNAL_STREAM={st.st_dev}:{st.st_ino}",
         KRELD, "--config", str(cfg), "--root", str(tree.root), "--state-dir", str(state_dir)],
        stdout=theirs, stderr=theirs, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    theirs.close()
    out = Drain(stream.fileno())
    try:
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        with Client(str(sock), timeout=30) as c:  # the first connection starts kreld
            assert c.call("GetBoot")["boot"]["boot_id"] == tree.boot_id
        notify_messages(notify, "READY=1")
        build_id = "5e" * 20
        tree.add_module("dummy", 0xFFFFFFFFC0200000, build_id=build_id)
        loaded = journal.wait_for(proc.pid, KRELD_EVENT="module_loaded", MODULE="dummy")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        journal.wait_for(proc.pid, KRELD_EVENT="stopped")
    finally:
        proc.kill()
        proc.wait()
        notify.close()
    stream.close()

    assert loaded["BUILD_ID"] == build_id
    assert loaded["KRELD_TEXT"] == "0xffffffffc0200000"
    assert loaded["KRELD_SEEN_BY"] in ("poll", "inotify")
    entries = journal.of(proc.pid)
    events = [e["KRELD_EVENT"] for e in entries]
    for e in entries:
        assert e["SYSLOG_IDENTIFIER"] == "kreld", e.fields
        assert e["KRELD_BOOT_ID"] == tree.boot_id, e.fields
        assert e["PRIORITY"] in {str(p) for p in SYSLOG_PRIORITIES.values()}, e.fields
        assert e["MESSAGE"].startswith(e["KRELD_EVENT"])
    assert {"boot", "kernel_build_id", "socket_activated", "ready", "module_loaded"} <= set(events)
    by_event = {e["KRELD_EVENT"]: e for e in entries}
    assert by_event["socket_activated"]["KRELD_FD"] == "3"
    assert by_event["kernel_build_id"]["BUILD_ID"] == tree.build_id
    assert by_event["ready"]["PRIORITY"] == "6"
    assert by_event["allowed_group_missing"]["PRIORITY"] == "4"
    assert by_event["allowed_group_missing"]["KRELD_GROUP"] == "kreld-test-no-such-group"
    # Nothing went to stderr but systemd-socket-activate's own lines.
    assert "ready" not in out.text() and "{" not in out.text()


# --- JSON lines, console, levels -----------------------------------------------------


def run_kreld(
    tree: FakeTree,
    state_dir: Path,
    sockdir: Path,
    *args: str,
    stderr: int,
    env: dict[str, str] | None = None,
) -> int:
    """Start kreld, wait for READY=1, stop it with SIGTERM; its exit status."""
    notify = notify_socket(sockdir / "notify")
    base = {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM", "NOTIFY_SOCKET")}
    proc = subprocess.Popen(
        [KRELD, "--root", str(tree.root), "--state-dir", str(state_dir),
         "--socket", str(sockdir / "k.sock"), *args],
        stdout=stderr, stderr=stderr, stdin=subprocess.DEVNULL,
        env={**base, "NOTIFY_SOCKET": str(sockdir / "notify"), **(env or {})},
    )  # fmt: skip
    try:
        notify_messages(notify, "READY=1")
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=20)
    finally:
        proc.kill()
        proc.wait()
        notify.close()
        (sockdir / "notify").unlink()


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def test_not_a_tty_gives_json_lines_even_with_a_foreign_journal_stream(
    tree: FakeTree, state_dir: Path, sockdir: Path, tmp_path: Path
) -> None:
    """JOURNAL_STREAM names another stream (a child of a service, stderr redirected)."""
    log = tmp_path / "kreld.log"
    other = os.stat(tmp_path)
    with open(log, "wb") as f:
        rc = run_kreld(
            tree, state_dir, sockdir, stderr=f.fileno(),
            env={"JOURNAL_STREAM": f"{other.st_dev}:{other.st_ino}"},
        )  # fmt: skip
    assert rc == 0
    events = json_lines(log.read_text())  # every line is one JSON object
    assert [e["event"] for e in events][-1] == "stopped"
    ready = next(e for e in events if e["event"] == "ready")
    assert ready["level"] == "info" and ready["timestamp"].endswith("Z")
    assert ready["state_dir"] == str(state_dir)


def test_a_tty_gets_console_lines(tree: FakeTree, state_dir: Path, sockdir: Path) -> None:
    master, slave = pty.openpty()
    out = Drain(master)
    try:
        rc = run_kreld(tree, state_dir, sockdir, stderr=slave)
    finally:
        os.close(slave)
    text = out.text()
    os.close(master)
    assert rc == 0
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines and not any(line.lstrip().startswith("{") for line in lines)
    ready = next(line for line in lines if " ready " in line)
    assert "[info" in ready and f"state_dir={state_dir}" in ready


def test_log_level_filters_and_the_command_line_overrides_the_config(
    tree: FakeTree, state_dir: Path, sockdir: Path, tmp_path: Path
) -> None:
    cfg = tmp_path / "kreld.toml"
    cfg.write_text(
        '[log]\nlevel = "debug"\nformat = "json"\n'
        '[access]\nallowed_groups = ["kreld-test-no-such-group"]\n'
        'socket_group = "kreld-test-no-such-group"\n'
    )
    levels = {}
    for name, args in (
        ("config-debug", ["--config", str(cfg)]),
        ("cli-warning", ["--config", str(cfg), "--log-level", "warning"]),
    ):
        log = tmp_path / f"{name}.log"
        with open(log, "wb") as f:
            assert run_kreld(tree, state_dir, sockdir, *args, stderr=f.fileno()) == 0
        levels[name] = json_lines(log.read_text())
    debug = levels["config-debug"]
    assert {"debug", "info", "warning"} <= {e["level"] for e in debug}
    assert any(e["event"] == "kaslr_source_skipped" for e in debug)  # a debug event
    warning = levels["cli-warning"]
    assert {e["level"] for e in warning} == {"warning"}
    assert sorted(e["event"] for e in warning) == ["allowed_group_missing", "socket_group_missing"]


def test_a_refusing_journal_does_not_stop_kreld(
    dead_journal: None, tree: FakeTree, state_dir: Path, sockdir: Path, tmp_path: Path
) -> None:
    """Events go to stderr with their syslog priority prefix instead."""
    log = tmp_path / "kreld.log"
    with open(log, "wb") as f:
        rc = run_kreld(tree, state_dir, sockdir, "--log-format", "journal", stderr=f.fileno())
    assert rc == 0
    lines = log.read_text().splitlines()
    assert f"<6>ready state_dir={state_dir}" in [line.split(" root=")[0] for line in lines]
    assert lines[-1] == "<6>stopped"


def test_debug_logs_at_debug_level_and_shows_the_traceback_of_a_fatal_error(
    tree: FakeTree, state_dir: Path, sockdir: Path, tmp_path: Path
) -> None:
    """kreld --debug is not ignored: debug events, and an error that stops kreld
    carries its traceback (without --debug: the named error alone)."""
    log = tmp_path / "debug.log"
    with open(log, "wb") as f:
        assert run_kreld(tree, state_dir, sockdir, "--debug", stderr=f.fileno()) == 0
    assert any(e["level"] == "debug" for e in json_lines(log.read_text()))
    garbage = tmp_path / "garbage"
    garbage.mkdir(mode=0o700)
    (garbage / "data.mdb").write_bytes(b"not an LMDB file" * 512)
    argv = [KRELD, "--root", str(tree.root), "--state-dir", str(garbage),
            "--socket", str(sockdir / "g.sock")]  # fmt: skip
    runs = {
        debug: subprocess.run(
            argv + (["--debug"] if debug else []), capture_output=True, text=True, timeout=60
        )
        for debug in (False, True)
    }
    for cp in runs.values():
        assert cp.returncode == 5, cp.stderr
        assert "not an LMDB file" in cp.stderr or "truncated" in cp.stderr, cp.stderr
    assert "Traceback" not in runs[False].stderr
    assert "Traceback" in runs[True].stderr
