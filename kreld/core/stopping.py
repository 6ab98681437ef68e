"""The threads' stop flag, which also wakes whoever blocks on something else.

An idle daemon's threads block on what they serve (a queue, a netlink
socket) with no timeout: a thread that woke every half second only to see
whether it should stop cost more than all the rest of an idle kreld.  So the
flag that stops them carries callbacks, run when it is set, that put
something in the way of each blocked wait (a sentinel in a queue, a byte in a
pipe).  A plain :class:`threading.Event` (a test's) has none: whoever is
given one waits with a bounded timeout instead (:func:`wake_on_stop`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

__all__ = ["FALLBACK_WAIT", "StopEvent", "WakeFd", "wake_on_stop"]

# How long a wait may block when its stop flag cannot wake it (seconds).
FALLBACK_WAIT = 0.5


class StopEvent(threading.Event):
    """A :class:`threading.Event` that runs each registered wake when set."""

    def __init__(self) -> None:
        super().__init__()
        self._wakes: list[Callable[[], object]] = []
        self._wakes_lock = threading.Lock()

    def when_set(self, wake: Callable[[], object]) -> None:
        """Run *wake* when the flag is set (at once if it is already)."""
        with self._wakes_lock:
            if not self.is_set():
                self._wakes.append(wake)
                return
        wake()

    def set(self) -> None:
        with self._wakes_lock:
            super().set()
            wakes, self._wakes = self._wakes, []
        for wake in wakes:
            wake()


def wake_on_stop(stop: threading.Event, wake: Callable[[], object]) -> float | None:
    """Have *stop* run *wake* when set; the timeout a blocked wait then needs:
    none where *stop* wakes it, else :data:`FALLBACK_WAIT`."""
    if isinstance(stop, StopEvent):
        stop.when_set(wake)
        return None
    return FALLBACK_WAIT


class WakeFd:
    """An eventfd to wait on beside another fd: :meth:`wake` makes it readable.

    Closed under a lock, so a late wake never writes to a number the
    process has since reused for another file."""

    def __init__(self) -> None:
        self._fd: int | None = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._lock = threading.Lock()

    def fileno(self) -> int:
        fd = self._fd
        return -1 if fd is None else fd

    def wake(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.eventfd_write(self._fd, 1)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
