"""Waiting on a condition with a deadline (never a bare sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


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


def counters(socket: str) -> dict[str, int]:
    """The daemon's Status counters: how often each of its workers turned over."""
    from kreld.client import Client

    with Client(socket) as c:
        got: dict[str, int] = c.call("Status")["counters"]
    return got


def quick_heartbeat(config: Path, seconds: float = 1.0) -> list[str]:
    """``--config`` of a file written at *config* that sets the tracker's
    heartbeat to *seconds*.  At rest the tracker's idle checks come once per
    heartbeat (30 s by default): a test that waits on them waits this long."""
    config.write_text(f"[modules]\nheartbeat_interval = {seconds}\n")
    return ["--config", str(config)]


def wait_for_turns(socket: str, counter: str, turns: int = 2, timeout: float = 60) -> None:
    """Until *counter* has gone up *turns* times from now.

    What proves that something did not happen, instead of a sleep: with
    ``turns=2`` a whole pass (or round) began after this call and ended.  The
    idle checks of the tracker come only once no event is left for it."""
    start = counters(socket)[counter]
    wait_until(
        f"{turns} more {counter}", lambda: counters(socket)[counter] >= start + turns, timeout
    )


def wait_for_symbols_done(socket: str, timeout: float = 60) -> None:
    """Until the tracker has been idle once more and the symbol worker has dealt
    with every load given to it by then: a read either would make has been made."""
    wait_for_turns(socket, "tracker_idle_checks", 1, timeout)
    queued = counters(socket)["symbol_loads_queued"]
    wait_until(
        "the symbol worker done",
        lambda: counters(socket)["symbol_loads_handled"] >= queued,
        timeout,
    )
