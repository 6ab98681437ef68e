"""kreld and kreldctl as real subprocesses: paths, runs, raw socket exchanges, sd_notify."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kreld.client import connect_unix

from support.faketree import FakeTree
from support.kreldproc import KreldProcess

BIN = Path(sys.executable).parent


def bin_path(name: str) -> str:
    p = BIN / name
    return str(p) if p.exists() else name


def kreldctl(
    *args: str, check: bool = True, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run kreldctl as a real subprocess; with --json in args, parse stdout via .json()."""
    cp = subprocess.run(
        [bin_path("kreldctl"), *args], capture_output=True, text=True, timeout=timeout
    )
    if check and cp.returncode != 0:
        raise AssertionError(
            f"kreldctl {' '.join(args)} -> {cp.returncode}\n{cp.stdout}\n{cp.stderr}"
        )
    return cp


def ctl_json(*args: str) -> Any:
    return json.loads(kreldctl(*args, "--json").stdout)


# kreld as a subprocess (tests/support/kreldproc.py, which the benchmarks share).
Daemon = KreldProcess


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
