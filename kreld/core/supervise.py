"""One supervisor for every thread, task and worker pool kreld runs.

A thread that dies of an exception nobody catches ends quietly: Python prints
its traceback to stderr and the rest of the process goes on as if nothing
happened, Status still healthy, the watchdog still fed.  So nothing in kreld
starts a thread, an asyncio task or an executor itself: each is started here,
under a name, and an end that was not asked for (any exception, or a return
from work that should run until the daemon stops) is

* logged once, with its traceback;
* kept, by name and reason, for Status (the daemon is then degraded);
* the end of the watchdog pings: :meth:`Supervisor.pinger` feeds systemd's
  watchdog only while nothing has failed, so systemd restarts the service,
  as systemd's own services crash loudly rather than limp on.

Threads that libraries start (watchdog's observer) are registered with
:meth:`Supervisor.watch`, looked at on every ping; an exception escaping any
thread at all reaches :func:`threading.excepthook`, which the supervisor
takes over once installed.

A connection's own task is *transient*: its failure is logged and counted,
never a reason to restart the daemon (one peer must not be able to restart
the service for everybody).

Fault injection, for the fault suite only: with ``KRELD_TEST_FAULTS`` set to
a comma-separated list of names in the daemon's environment, and
``KRELD_TEST=1`` beside it (alone it is ignored, with a warning), each named
thread raises :class:`InjectedFault` at its first Python call after the
first watchdog ping (or ``READY=1`` without a watchdog), each named task
raises on its first step after that, and each named executor's threads fail
their start.  The daemon honours this pair and nothing else of the kind;
it logs ``test_faults_armed`` at start when it does, and kreld(8) documents it
as a test hook, next to the one that holds the start (``KRELD_TEST_STALL_BOOT``,
kreld/startup.py).

Pure: no kernel I/O; the daemon hands in how to notify systemd.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

# What sys.settrace takes (typeshed names it only privately).
TraceFunction = Callable[[FrameType, str, Any], "TraceFunction | None"]

__all__ = [
    "FAULTS_ENV",
    "TEST_ENV",
    "Failure",
    "InjectedFault",
    "Supervisor",
    "supervisor",
]

FAULTS_ENV = "KRELD_TEST_FAULTS"
TEST_ENV = "KRELD_TEST"  # must be "1" too, or the faults are ignored (and logged)
_HERE = os.path.abspath(__file__)
_KRELD_DIR = os.path.dirname(os.path.dirname(_HERE))


class InjectedFault(BaseException):
    """Raised in a supervised thread or task named in ``KRELD_TEST_FAULTS``.

    Not an Exception: it stands for the end of a thread, which no handler of
    kreld's that absorbs errors to go on (the publisher's round, a source's
    retry) may absorb.  (Raised from a trace function it is raised once:
    CPython removes a trace function that raises.)"""


@dataclass(frozen=True, slots=True)
class Failure:
    """A supervised thread, task or pool that ended when it should not have."""

    name: str
    kind: str  # "thread", "task", "executor"
    reason: str  # "ValueError: ..." or "returned"
    when_ns: int  # CLOCK_REALTIME

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "reason": self.reason,
            "when_ns": self.when_ns,
        }


class _Quiet:
    def error(self, *_a: object, **_k: object) -> None: ...
    def info(self, *_a: object, **_k: object) -> None: ...


def _reason(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _traceback(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)).rstrip()


class Supervisor:
    """Starts and watches every thread, task and pool; feeds the watchdog."""

    def __init__(
        self,
        log: FilteringBoundLogger | None = None,
        faults: str | None = None,
    ) -> None:
        self.log: FilteringBoundLogger | _Quiet = log if log is not None else _Quiet()
        self.stopping = threading.Event()  # set: ends are asked for, not failures
        self._lock = threading.Lock()
        self._failures: list[Failure] = []
        self._transient = 0
        self._watched: dict[str, Callable[[], bool]] = {}
        self._changed: list[Callable[[], None]] = []
        self.faults = frozenset(n for n in (faults or "").split(",") if n)
        self._armed = threading.Event()

    # -- what failed ------------------------------------------------------------------

    def failures(self) -> list[Failure]:
        """Every failure so far, the watched threads found dead included."""
        self._look_at_watched()
        with self._lock:
            return list(self._failures)

    def healthy(self) -> bool:
        return not self.failures()

    @property
    def transient_failures(self) -> int:
        return self._transient

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call *callback* (from any thread) when a failure is recorded."""
        self._changed.append(callback)

    def fail(self, name: str, kind: str, exc: BaseException | None) -> None:
        """Record that *name* ended unexpectedly (*exc* None: it returned)."""
        reason = "returned" if exc is None else _reason(exc)
        with self._lock:
            if any(f.name == name for f in self._failures):
                return  # logged once
            self._failures.append(Failure(name, kind, reason, time.time_ns()))
        self.log.error(
            "supervised_failed",
            name=name,
            kind=kind,
            reason=reason,
            traceback=None if exc is None else _traceback(exc),
            action="watchdog pings stop: the service is to be restarted",
        )
        for cb in self._changed:
            cb()

    def _look_at_watched(self) -> None:
        if self.stopping.is_set():
            return
        for name, alive in list(self._watched.items()):
            if not alive():
                self.fail(name, "thread", None)

    # -- threads -----------------------------------------------------------------------

    def thread(
        self,
        name: str,
        target: Callable[..., object],
        *args: object,
        forever: bool = True,
    ) -> threading.Thread:
        """Start *target(*args)* on a daemon thread called *name*.  *forever*:
        a return before :attr:`stopping` is set is a failure too."""
        t = threading.Thread(
            target=self._run_thread, args=(name, target, args, forever), name=name, daemon=True
        )
        t.start()
        return t

    def _run_thread(
        self, name: str, target: Callable[..., object], args: tuple[object, ...], forever: bool
    ) -> None:
        try:
            if name in self.faults:
                sys.settrace(self._injector(name))
            target(*args)
        except BaseException as e:
            sys.settrace(None)  # the report runs kreld's code: no fault injected into it
            if not self.stopping.is_set() or not isinstance(e, SystemExit):
                self.fail(name, "thread", e)
            return
        finally:
            sys.settrace(None)
        if forever and not self.stopping.is_set():
            self.fail(name, "thread", None)

    def _injector(self, name: str) -> TraceFunction:
        """A trace function raising at the first line of kreld's own code run
        once armed (never inside the standard library: a lock left half
        released there would fail in ways no real fault does)."""
        armed = self._armed

        def trace(frame: FrameType, event: str, _arg: Any) -> TraceFunction | None:
            path = frame.f_code.co_filename
            if not path.startswith(_KRELD_DIR) or path == _HERE:
                return None
            if event in ("call", "line") and armed.is_set():
                raise InjectedFault(f"injected into {name} ({FAULTS_ENV})")
            return trace

        return trace

    def watch(self, name: str, alive: Callable[[], bool]) -> None:
        """Look after a thread a library started: dead while kreld runs is a failure."""
        self._watched[name] = alive

    def unwatch(self, name: str) -> None:
        self._watched.pop(name, None)

    def excepthook(self, args: threading.ExceptHookArgs) -> None:
        """For :data:`threading.excepthook`: a thread kreld did not start
        through :meth:`thread` (a library's) died of *args*."""
        name = args.thread.name if args.thread is not None else "unnamed thread"
        exc = args.exc_value if args.exc_value is not None else RuntimeError(str(args.exc_type))
        if args.exc_type is SystemExit:
            return
        self.fail(name, "thread", exc)

    def install(self) -> None:
        """Take over :data:`threading.excepthook` for this process."""
        threading.excepthook = self.excepthook
        # A pool's worker that fails its start is reported by fail(); the
        # standard library's own report of it (to stderr) would be a second.
        pools = logging.getLogger("concurrent.futures")
        pools.addHandler(logging.NullHandler())
        pools.propagate = False

    # -- tasks ----------------------------------------------------------------------

    def task(
        self,
        name: str,
        coro: Coroutine[Any, Any, object],
        *,
        forever: bool = True,
        transient: bool = False,
    ) -> asyncio.Task[None]:
        """Run *coro* as a task on the running loop.  *transient*: one
        connection's work, whose failure is logged and counted only."""
        return asyncio.get_running_loop().create_task(
            self._run_task(name, coro, forever, transient), name=name
        )

    async def _run_task(
        self, name: str, coro: Coroutine[Any, Any, object], forever: bool, transient: bool
    ) -> None:
        try:
            if name in self.faults:
                await self._until_armed(name, coro)
            await coro
        except asyncio.CancelledError:
            raise
        except (Exception, InjectedFault) as e:
            if transient:
                self._transient += 1
                self.log.error(
                    "connection_task_failed",
                    name=name,
                    reason=_reason(e),
                    traceback=_traceback(e),
                )
                return
            self.fail(name, "task", e)
            return
        if forever and not self.stopping.is_set():
            self.fail(name, "task", None)

    async def _until_armed(self, name: str, coro: Coroutine[Any, Any, object]) -> None:
        """Test only: run *coro* until the fault is armed, then raise in its
        place.  It runs meanwhile because the watchdog's own task is what arms."""
        inner = asyncio.get_running_loop().create_task(coro, name=f"{name} (faulted)")
        try:
            while not self._armed.is_set() and not inner.done():
                await asyncio.sleep(0.05)
        finally:
            inner.cancel()
        raise InjectedFault(f"injected into {name} ({FAULTS_ENV})")

    # -- pools -------------------------------------------------------------------------

    def executor(self, name: str, workers: int = 1) -> concurrent.futures.ThreadPoolExecutor:
        """A pool of *workers* threads called *name*_N.  A work item's exception
        goes to whoever waits for it; a worker that cannot start breaks the
        pool for good, and that is the failure recorded here."""
        return concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix=name, initializer=self._start_worker, initargs=(name,)
        )

    def _start_worker(self, name: str) -> None:
        try:
            if name in self.faults and self._armed.is_set():
                raise InjectedFault(f"injected into {name} ({FAULTS_ENV})")
        except (Exception, InjectedFault) as e:
            self.fail(name, "executor", e)
            raise

    # -- the watchdog -------------------------------------------------------------------

    def arm(self) -> None:
        """The daemon is serving: injected faults (test only) may fire now."""
        self._armed.set()

    async def pinger(self, interval_s: float, notify: Callable[[str], object]) -> None:
        """``WATCHDOG=1`` every *interval_s* while nothing failed; silent after,
        so that systemd's watchdog restarts the service."""
        self.log.info("watchdog", interval_s=interval_s)
        withheld = False
        while True:
            failed = self.failures()
            if not failed:
                notify("WATCHDOG=1")
                self.arm()
            elif not withheld:
                withheld = True
                self.log.error("watchdog_withheld", failed=[f.name for f in failed])
            await asyncio.sleep(interval_s)


_current: Supervisor | None = None
_current_lock = threading.Lock()


def supervisor() -> Supervisor:
    """The process's supervisor (the daemon configures it at start)."""
    global _current
    with _current_lock:
        if _current is None:
            _current = Supervisor(faults=_test_faults())
        return _current


def _test_faults() -> str | None:
    """``KRELD_TEST_FAULTS``, honoured only beside ``KRELD_TEST=1``: a stray
    variable alone (a copied unit, a shell's leftovers) cannot break a host."""
    if os.environ.get(TEST_ENV) != "1":
        return None
    return os.environ.get(FAULTS_ENV)


def configure(log: FilteringBoundLogger) -> Supervisor:
    """Give the process's supervisor the daemon's log; take over threading.excepthook."""
    sup = supervisor()
    sup.log = log
    sup.install()
    if sup.faults:
        log.warning("test_faults_armed", names=sorted(sup.faults), hook=FAULTS_ENV)
    elif os.environ.get(FAULTS_ENV):
        log.warning("test_faults_ignored", hook=FAULTS_ENV, needs=f"{TEST_ENV}=1")
    return sup
