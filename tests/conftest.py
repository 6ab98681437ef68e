"""Shared fixtures: fake trees, the daemon as a real subprocess, kreldctl runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from faketree import FakeTree

BIN = Path(sys.executable).parent


def _bin(name: str) -> str:
    p = BIN / name
    return str(p) if p.exists() else name


@pytest.fixture
def tree(tmp_path: Path) -> FakeTree:
    return FakeTree(tmp_path / "root")


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


def kreldctl(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run kreldctl as a real subprocess; with --json in args, parse stdout via .json()."""
    cp = subprocess.run([_bin("kreldctl"), *args], capture_output=True, text=True, timeout=timeout)
    if check and cp.returncode != 0:
        raise AssertionError(f"kreldctl {' '.join(args)} -> {cp.returncode}\n{cp.stdout}\n{cp.stderr}")
    return cp


def ctl_json(*args: str) -> Any:
    return json.loads(kreldctl(*args, "--json").stdout)


class Daemon:
    """kreld as a subprocess, logging JSON lines to a file."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.args = args
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait_ready: bool = True, timeout: float = 20) -> Daemon:
        self._log = open(self.log_path, "ab")
        self._offset = self.log_path.stat().st_size
        self.proc = subprocess.Popen(
            [_bin("kreld"), "--log-format", "json", *self.args],
            stdout=self._log, stderr=self._log, start_new_session=True,
        )
        if wait_ready:
            self.wait_for("ready", timeout=timeout)
        return self

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def wait_for(self, event: str, timeout: float = 20, count: int = 1, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events() if e.get("event") == event
                     and all(e.get(k) == v for k, v in match.items())]
            if len(found) >= count:
                return found[count - 1]
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"kreld exited {self.proc.returncode}:\n{self.log_path.read_text()}")
            time.sleep(0.02)
        raise AssertionError(f"no {event!r} {match} in {timeout}s:\n{self.log_path.read_text()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        rc = self.proc.wait(timeout=timeout)
        self._log.close()
        return rc


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
