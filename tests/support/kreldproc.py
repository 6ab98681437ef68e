"""kreld as a real subprocess logging JSON lines to a file.

The one harness that starts the daemon for the tests (``tests/conftest.py``'s
``daemon_factory``) and for the benchmarks (``bench/common.py``'s ``Kreld``).
It imports nothing of kreld: it reads the daemon's log, as an operator would.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

Events = list[dict[str, Any]]


def installed(name: str) -> str:
    """A console script beside the running interpreter (kreld, kreldctl)."""
    p = Path(sys.executable).parent / name
    return str(p) if p.exists() else name


class KreldProcess:
    """``kreld --log-format json ARGS``, its output appended to *log_path*."""

    def __init__(self, args: list[str], log_path: Path, binary: str | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self.binary = binary or installed("kreld")
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._offset = 0

    def start(
        self,
        wait_ready: bool = True,
        timeout: float = 20,
        preexec: Callable[[], None] | None = None,
    ) -> KreldProcess:
        """Start kreld (*preexec* runs in the child before exec: a resource limit, say)."""
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._offset = self.log_path.stat().st_size
        self.proc = subprocess.Popen(
            [self.binary, "--log-format", "json", *self.args],
            stdout=self._log,
            stderr=self._log,
            start_new_session=True,
            preexec_fn=preexec,
        )
        if wait_ready:
            self.wait_for("ready", timeout=timeout)
        return self

    def events(self) -> Events:
        """This run's events: a log file shared by several runs is read from
        where this run started writing."""
        with open(self.log_path, "rb") as f:
            f.seek(self._offset)
            lines = f.read().decode(errors="replace").splitlines()
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_until(self, done: Callable[[Events], bool], what: str, timeout: float = 20) -> Events:
        """Wait until *done* holds of the events logged so far; fail, with the
        log's tail, when kreld exits first or *timeout* seconds pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            events = self.events()
            if done(events):
                return events
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"kreld exited {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.02)
        raise AssertionError(f"kreld: no {what} in {timeout} s:\n{self.tail()}")

    def wait_for(
        self, event: str, timeout: float = 20, count: int = 1, **match: Any
    ) -> dict[str, Any]:
        """The *count*-th event named *event* whose fields equal *match*."""

        def found(events: Events) -> Events:
            return [
                e
                for e in events
                if e.get("event") == event and all(e.get(k) == v for k, v in match.items())
            ]

        events = self.wait_until(
            lambda evs: len(found(evs)) >= count, f"{event!r} {match or ''}", timeout
        )
        return found(events)[count - 1]

    def wait_ready(self, timeout: float = 60) -> None:
        self.wait_for("ready", timeout=timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        """Signal kreld and reap it (killed when it outlasts *timeout*); its exit status."""
        if self.proc is None:
            raise RuntimeError("kreld was never started")
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        if self._log is not None:
            self._log.close()
        return rc
