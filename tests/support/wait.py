"""Waiting on a condition with a deadline (never a bare sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable
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
