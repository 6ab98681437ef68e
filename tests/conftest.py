"""Shared fixtures: fake trees, the daemon as a real subprocess, kreldctl runs."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from faketree import FakeTree
from kreldproc import KreldProcess

from kreld.client import connect_unix
from kreld.core.model import BootSnapshot
from kreld.kernel.info import Root
from kreld.kernel.kallsyms import KallsymsText
from kreld.kernel.snapshot import take_snapshot
from kreld.store import Store
from kreld.symbols.capture import SymbolCapture

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

BIN = Path(sys.executable).parent


def _bin(name: str) -> str:
    p = BIN / name
    return str(p) if p.exists() else name


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fault suite (tests/faults, marked ``faults``) is opt-in like tests/vm: its
    tests are skipped unless selected with ``-m faults``."""
    expr = config.getoption("markexpr") or ""
    if "faults" in expr and "not faults" not in expr:
        return
    skip = pytest.mark.skip(reason="the fault suite (minutes): select with -m faults")
    for item in items:
        if item.get_closest_marker("faults") is not None:
            item.add_marker(skip)


@pytest.fixture
def tree(tmp_path: Path) -> FakeTree:
    return FakeTree(tmp_path / "root")


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@contextlib.contextmanager
def symbol_worker(
    tree: FakeTree, state: Path, log: FilteringBoundLogger | None = None
) -> Iterator[tuple[Store, BootSnapshot, SymbolCapture]]:
    """A symbol worker on *tree* (no daemon), its boot recorded in a store at
    *state*, started on the start's own read of kallsyms and through that
    first capture; stopped on leaving."""
    root = Root(tree.root)
    snap, _ = take_snapshot(root, [], None)
    stop = threading.Event()
    with Store(str(state)) as store:
        stored, _, _ = store.boots.record_boot(snap)
        capture = SymbolCapture(store, root, stored, log)
        capture.start(stop, [], KallsymsText.read(root))
        try:
            assert capture.idle.wait(30)
            yield store, stored, capture
        finally:
            stop.set()


def kreldctl(
    *args: str, check: bool = True, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run kreldctl as a real subprocess; with --json in args, parse stdout via .json()."""
    cp = subprocess.run([_bin("kreldctl"), *args], capture_output=True, text=True, timeout=timeout)
    if check and cp.returncode != 0:
        raise AssertionError(
            f"kreldctl {' '.join(args)} -> {cp.returncode}\n{cp.stdout}\n{cp.stderr}"
        )
    return cp


def ctl_json(*args: str) -> Any:
    return json.loads(kreldctl(*args, "--json").stdout)


# kreld as a subprocess (tests/kreldproc.py, which the benchmarks share).
Daemon = KreldProcess


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[Daemon] = []

    def make(*args: str, log_name: str = "kreld.log") -> Daemon:
        d = Daemon(list(args), tmp_path / log_name)
        started.append(d)
        return d

    yield make
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A short, world-traversable directory (sun_path is 108 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="kreld-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def start(daemon_factory: Any, tree: FakeTree, state: Path, sock: Path, *extra: str) -> Daemon:
    d: Daemon = daemon_factory(
        "--root", str(tree.root), "--state-dir", str(state), "--socket", str(sock), *extra
    )
    return d.start()


def raw_exchange(path: Path, data: bytes, timeout: float = 5) -> list[dict[str, Any]]:
    """Send raw bytes, half-close, and read every reply until kreld closes."""
    s = connect_unix(str(path), timeout)
    buf = b""
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        while chunk := s.recv(65536):
            buf += chunk
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        s.close()
    return [json.loads(part) for part in buf.split(b"\0") if part]


def wait_until(what: str, fn: Callable[[], Any], timeout: float = 30, step: float = 0.05) -> Any:
    """Poll *fn* every *step* seconds until it returns something true, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out ({timeout}s) waiting for {what}")
        time.sleep(step)


@contextlib.contextmanager
def fast_tmpdir() -> Iterator[Path]:
    """A directory on tmpfs when there is one: bursts of thousands of file operations and
    the daemon's syncs stay quick, and tmpfs, like kernfs, does not reuse inode numbers."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        d = Path(tempfile.mkdtemp(prefix="kreld-test-", dir=shm))
    else:
        d = Path(tempfile.mkdtemp(prefix="kreld-test-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def notify_socket(path: Path) -> socket.socket:
    """A datagram socket at *path* to pass as NOTIFY_SOCKET, as systemd listens."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(20)
    return s


def notify_messages(s: socket.socket, until: str, limit: float = 20) -> list[str]:
    """sd_notify lines read from *s* until one starts with *until*."""
    got: list[str] = []
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        got.extend(s.recv(4096).decode().split("\n"))
        if any(m.startswith(until) for m in got):
            return got
    raise AssertionError(f"no {until} in {got}")
