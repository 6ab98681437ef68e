"""Giving the worker thread's freed heap back to the kernel once its calls stop.

A call on the server's worker thread (a Resolve of thousands of addresses, a
listing of many boots) leaves megabytes of freed buffers in glibc's arenas:
kreld.core.heap fixes the trim threshold above them, so that the next call of
a burst finds their pages still there instead of faulting them in again.
Once no call has ended for :data:`TRIM_QUIET` seconds the burst is over, and
:func:`kreld.core.heap.trim` hands those pages back, on the worker thread
(the trim walks every arena).  One timer a burst, none at rest.

The calls also read the store's map (a kernel's symbol table is megabytes of
it): those pages leave the resident set at the same time (the store's
``drop_pages``, handed in), to be read from the page cache by the next call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from kreld.core import heap

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

__all__ = ["TRIM_QUIET", "QuietTrim"]

# Seconds without a call ending on the worker thread before its freed heap goes
# back: longer than a profiler that symbolizes as it goes leaves between its
# calls, whose next call would fault the pages in again (bench/bench_memory.py
# measures what that costs the call after a trim).
TRIM_QUIET = 5.0

P = ParamSpec("P")
T = TypeVar("T")


class QuietTrim(Executor):
    """The worker's executor, noting each call's end on the event loop that
    submitted it, and trimming the heap once they have stopped."""

    def __init__(
        self,
        inner: Executor,
        log: FilteringBoundLogger,
        drop_pages: Callable[[], object] | None = None,
    ) -> None:
        self._inner = inner
        self._log = log
        self._drop_pages = drop_pages
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.trims = 0

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        fut = self._inner.submit(fn, *args, **kwargs)
        with contextlib.suppress(RuntimeError):  # not from a running loop: nothing to note
            loop = asyncio.get_running_loop()
            fut.add_done_callback(lambda _f: _call_soon(loop, self._ended))
        return fut

    def _ended(self) -> None:
        """A call has ended (on the loop)."""
        loop = asyncio.get_running_loop()
        self._last = loop.time()
        if self._timer is None:
            self._timer = loop.call_later(TRIM_QUIET, self._due)

    def _due(self) -> None:
        loop = asyncio.get_running_loop()
        left = self._last + TRIM_QUIET - loop.time()
        if left > 0:  # calls ended meanwhile: the burst goes on
            self._timer = loop.call_later(left, self._due)
            return
        self._timer = None
        with contextlib.suppress(RuntimeError):  # shut down: kreld stops
            self._inner.submit(self._trim)  # not through submit(): no call of its own

    def _trim(self) -> None:
        before = heap.resident()
        heap.trim()
        if self._drop_pages is not None:
            self._drop_pages()
        self.trims += 1
        self._log.debug("heap_trimmed", rss_before=before, rss_after=heap.resident())

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._inner.shutdown(wait=wait, cancel_futures=cancel_futures)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop has closed: kreld has stopped
        loop.call_soon_threadsafe(fn)
