"""Builds found without debuginfo, remembered for a while.

Looking for a build's debug file costs a few ``open`` calls and a request per
debuginfod server; a stream of addresses of a build that has none would pay
it on every call.  :class:`Absences` is the one memory of such builds: a
:class:`~kreld.symbols.linetables.LineTableProvider` writes to it, and the
daemon's builder (:class:`kreld.server.linebuild.LineBuilder`), which hands the
provider its own, reads it without waiting for a build under way.  Kept apart
from the provider so that the daemon starts without the provider's imports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

__all__ = ["DEFAULT_RETRY_AFTER", "Absences"]

# How long a build found without debuginfo is not looked for again.
DEFAULT_RETRY_AFTER = 300.0


class Absences:
    """Builds found without debuginfo, each with why, remembered for
    *retry_after* seconds: within them the reason is the answer, and the
    places are not looked in again.  Thread-safe."""

    def __init__(
        self, retry_after: float = DEFAULT_RETRY_AFTER, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.retry_after = retry_after
        self._clock = clock
        self._lock = threading.Lock()
        self._until: dict[str, tuple[float, str]] = {}

    def remember(self, build_id: str, why: str) -> None:
        with self._lock:
            self._until[build_id] = (self._clock() + self.retry_after, why)

    def why(self, build_id: str) -> str | None:
        """Why *build_id* has no table, while that is remembered; else None."""
        with self._lock:
            got = self._until.get(build_id)
            if got is None:
                return None
            if self._clock() < got[0]:
                return got[1]
            del self._until[build_id]
            return None

    def forget(self, build_ids: Iterable[str] | None = None) -> None:
        """Forget the absence of *build_ids* (all without): the next ask looks again."""
        with self._lock:
            if build_ids is None:
                self._until.clear()
            for bid in build_ids or ():
                self._until.pop(bid, None)

    def current(self) -> dict[str, str]:
        """Every absence still remembered, by build-id: why."""
        with self._lock:
            now = self._clock()
            return {b: why for b, (until, why) in self._until.items() if now < until}
