"""The daemon's line tables: built by one background thread, never by a call.

A Resolve with ``lines`` asks :meth:`LineBuilder.source_for` for each build's
table.  A table in hand (or a build found without debuginfo, remembered for
:data:`RETRY_AFTER_S`) answers at once.  Anything else is handed to the
builder thread, ``line-tables`` under the supervisor, which asks the
:class:`~kreld.symbols.linetables.LineTableProvider` (the store's copy, else
the debug file found by build-id, read by a process of its own under
``[kernel] line_build_memory``): one build at a time, in the order asked, so
memory holds one build's reading and the recorder's threads are never held
by it.  A table built is handed to the calls waiting for it first.  It is
completed (the lines of gcc's merged functions read: each call reads those its
own addresses need, :mod:`kreld.debuginfo.lines_later`) and kept in the store
once no build is asked for and no Resolve is answering lines, or
:data:`KEEP_AFTER_S` after it was built, whichever comes first: the builder's
reading would otherwise take half of a call's interpreter time.

The call then waits for the build up to :data:`WAIT_S`.  What a profiler
wants is the lines, not a retry protocol: a kernel's table takes a few seconds
to build once, then every later call answers in milliseconds, so the first
call waiting those seconds is the cheapest for it.  Past the bound (a slow
debuginfod, a loaded machine) the addresses answer "being built: ask again"
rather than hold the daemon's one call worker longer.

A host with no debuginfo does the finder's look-up once per build per
:data:`RETRY_AFTER_S` (a few ``open`` calls), then answers from memory: the
provider's :class:`~kreld.symbols.absences.Absences`, which the builder
hands it and reads without waiting for the builder thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kreld.core import heap
from kreld.symbols.absences import Absences

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from kreld.core.supervise import Supervisor
    from kreld.debuginfo.lines import LineTable
    from kreld.debuginfo.places import Wanted
    from kreld.symbols.linequery import TableSource
    from kreld.symbols.linetables import LineTableProvider

__all__ = ["KEEP_AFTER_S", "RETRY_AFTER_S", "THREAD", "WAIT_S", "LineBuilder"]

THREAD = "line-tables"
# How long a Resolve waits for a build it started (see the module's docstring).
WAIT_S = 20.0
# How long a build found without debuginfo is answered from memory.
RETRY_AFTER_S = 300.0
# Tables held in memory for calls, at most (a kernel's is ~40 MiB).
MEMORY = 256 << 20
# A table built is completed and kept at the latest this long after, even
# while calls go on answering lines.
KEEP_AFTER_S = 10.0
# Builds waiting at most: one call names at most a few hundred builds (the
# kernel and every module loaded then), and more would only be asked again.
MAX_QUEUED = 4096


class LineBuilder:
    """See the module's docstring."""

    def __init__(
        self,
        make_provider: Callable[[Absences], LineTableProvider],
        listing: Callable[[], list[dict[str, Any]]],
        *,
        wait_s: float = WAIT_S,
        retry_after_s: float = RETRY_AFTER_S,
        memory: int = MEMORY,
        clock: Callable[[], float] = time.monotonic,
        log: FilteringBoundLogger | None = None,
    ) -> None:
        # Made by the builder thread when first needed: the finder, the
        # debuginfod client and the DWARF reader stay out of a daemon that is
        # never asked for lines.  It remembers builds without debuginfo in
        # the builder's absences, which calls read.
        self.absences = Absences(retry_after_s, clock)
        self._make_provider = make_provider
        self._provider: LineTableProvider | None = None
        self._listing = listing
        self.wait_s = wait_s
        self.memory = memory
        self._clock = clock
        self._log = log
        self._cond = threading.Condition()
        self._queue: OrderedDict[str, Wanted] = OrderedDict()
        self._ready: OrderedDict[str, tuple[LineTable, int]] = OrderedDict()
        self._held = 0
        self._building: tuple[Wanted, int] | None = None  # and since (CLOCK_MONOTONIC ns)
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Resolve calls answering lines now; when the tables built and not
        # yet kept were first due (CLOCK_MONOTONIC s; None: none are).
        self._answering = 0
        self._unkept_since: float | None = None
        #: How often the builder found nothing to do and waited (what shows
        #: that it looked, and did not keep a table while calls answered).
        self.idle_turns = 0

    # -- the builder thread ---------------------------------------------------------
    def start(self, supervisor: Supervisor) -> None:
        self._thread = supervisor.thread(THREAD, self.run)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def run(self) -> None:
        """Build what is asked for, one build at a time, until stopped; keep
        what was built when nothing else is to be done (see the module's
        docstring)."""
        while True:
            with self._cond:
                while not self._queue and not self._stopping and not self._keep_due():
                    self.idle_turns += 1
                    self._cond.wait(self._keep_wait())
                if self._stopping:
                    return
                if not self._queue:
                    want = None
                else:
                    _, want = self._queue.popitem(last=False)
                    self._building = (want, time.monotonic_ns())
            if want is None:
                self._keep()
            else:
                self._build(want)

    def _build(self, want: Wanted) -> None:
        if self._provider is None:
            self._provider = self._make_provider(self.absences)
        # A KreldError comes back as a reason, remembered in the absences
        # (by the provider, or here for a reason it gives without looking).
        t0 = time.monotonic()
        got = self._provider.table(want)
        if self._log is not None and not isinstance(got, str):
            # The reader's peak is the build's (None: read back from the store).
            self._log.info("line_table", build_id=want.build_id, what=want.describe(),
                           seconds=round(time.monotonic() - t0, 3), bytes=got.nbytes(),
                           reader_peak_rss=got.reader_peak_rss)  # fmt: skip
        if isinstance(got, str) and self.absences.why(want.build_id) is None:
            self.absences.remember(want.build_id, got)
        heap.trim()  # the build's conversion is freed
        with self._cond:
            self._building = None
            if not isinstance(got, str):
                self._hold(want.build_id, got)
            if self._provider.has_pending and self._unkept_since is None:
                self._unkept_since = self._clock()
            self._cond.notify_all()

    def _keep_due(self) -> bool:
        """Whether the tables built are to be completed and kept now (under
        the condition's lock)."""
        if self._unkept_since is None:
            return False
        return self._answering == 0 or self._clock() >= self._unkept_since + KEEP_AFTER_S

    def _keep_wait(self) -> float | None:
        if self._unkept_since is None:
            return None
        return max(0.0, min(1.0, self._unkept_since + KEEP_AFTER_S - self._clock()))

    def _keep(self) -> None:
        """Complete and keep the tables built, pausing while calls answer."""
        if self._provider is not None:  # made by the first build, which made them
            self._provider.keep_pending(self._pause)
            heap.trim()
        with self._cond:
            self._unkept_since = None

    def _pause(self) -> None:
        """Between the turns of a table's completion: wait while calls answer
        lines (up to :data:`KEEP_AFTER_S` after it was due), unless a build is
        asked for (or under way): a call that waits for it holds
        ``answering`` too, so the completion goes on at once and the build
        follows."""
        with self._cond:
            while (
                not self._stopping
                and not self._queue
                and self._building is None
                and not self._keep_due()
            ):
                self._cond.wait(self._keep_wait())

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """Held by a Resolve while it answers lines: tables are completed and
        kept only between such calls (see the module's docstring)."""
        with self._cond:
            self._answering += 1
        try:
            yield
        finally:
            with self._cond:
                self._answering -= 1
                self._cond.notify_all()

    def _hold(self, build_id: str, table: LineTable) -> None:
        size = table.nbytes()
        self._ready[build_id] = (table, size)
        self._held += size
        while self._held > self.memory and len(self._ready) > 1:
            _, (_, dropped) = self._ready.popitem(last=False)
            self._held -= dropped

    # -- for calls -------------------------------------------------------------------
    def source_for(self, wanted: dict[str, Wanted]) -> TableSource:
        """The build-id -> table (or why not) function a Resolve's lines take,
        for the builds *wanted* describes (:func:`~kreld.symbols.linetables.wanted_of`)."""
        from kreld.symbols.linetables import table_source

        return table_source(self.table, wanted)

    def table(self, want: Wanted) -> LineTable | str:
        """*want*'s table, waiting for its build up to :attr:`wait_s`; else why not."""
        bid = want.build_id
        deadline = self._clock() + self.wait_s
        with self._cond:
            while True:
                got = self._answer(bid)
                if got is not None:
                    return got
                if self._thread is None or not self._thread.is_alive():
                    return "the line-table builder is not running (see Status degraded)"
                if bid not in self._queue and not self._is_building(bid):
                    if len(self._queue) >= MAX_QUEUED:
                        return f"the line table of build {bid} waits behind too many builds"
                    self._queue[bid] = want
                    self._cond.notify_all()
                left = deadline - self._clock()
                if left <= 0:
                    return (
                        f"the line table of {want.describe()} (build {bid}) is being built:"
                        " ask again"
                    )
                # Woken by the build's end; at least once a second to see the
                # builder still alive.
                self._cond.wait(min(left, 1.0))

    def _answer(self, bid: str) -> LineTable | str | None:
        hit = self._ready.get(bid)
        if hit is not None:
            self._ready.move_to_end(bid)
            return hit[0]
        return self.absences.why(bid)

    def _is_building(self, bid: str) -> bool:
        return self._building is not None and self._building[0].build_id == bid

    def status(self) -> dict[str, Any]:
        """Status's ``line_tables`` (see ``LineTables`` in io.kreld.varlink)."""
        kept = self._listing()
        with self._cond:
            building = self._building
            queued = len(self._queue)
        return {
            "kept": kept,
            "building": None
            if building is None
            else f"{building[0].build_id} ({building[0].describe()})",
            "building_since_ns": None if building is None else building[1],
            "queued": queued,
            "missing": self.absences.current(),
        }
