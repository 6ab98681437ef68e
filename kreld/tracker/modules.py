"""Following module loads and unloads: the reconciler.

Event sources (uevents, a watchdog observer) only *hint* that something
changed; every batch of hints ends in a reconciliation against the real
``sys/module`` directory, so a dropped or reordered event never loses a
module.  An add hint that finds its module already gone still proves the
load happened: it is recorded as an incarnation that was gone before it could
be read.  Each source's add hints are paired with incarnations one to one,
so a module seen by two sources is recorded once.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from kreld.core import consts
from kreld.core.errors import KreldError, StoreFull
from kreld.core.model import HintAction, Incarnation, ModuleEvent, SeenBy, Timestamp
from kreld.core.record import replace
from kreld.core.stopping import wake_on_stop
from kreld.kernel.addresses import ModuleAddresses
from kreld.kernel.info import Root
from kreld.kernel.modules_sysfs import ProcModule, list_modules, read_proc_modules
from kreld.store import Store
from kreld.tracker.modules_plan import (
    Changes,
    Hint,
    Tracked,
    complete,
    new_incarnation,
    plan,
    same_load,
    to_read,
)

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

__all__ = ["Hint", "Listener", "ModuleTracker"]

Listener = Callable[[ModuleEvent, Incarnation], None]
_STARTUP = frozenset({SeenBy.STARTUP})


class ModuleTracker:
    """Keeps the store's incarnations of one boot in step with ``sys/module``."""

    def __init__(
        self,
        store: Store,
        root: Root,
        boot_id: str,
        log: FilteringBoundLogger,
        *,
        recheck_interval: float = consts.DEFAULT_POLL_INTERVAL,
        heartbeat_interval: float = consts.HEARTBEAT_INTERVAL,
        addresses: ModuleAddresses | None = None,
    ) -> None:
        self.store = store
        self.addresses = addresses if addresses is not None else ModuleAddresses(root, log)
        self.root = root
        self.boot_id = boot_id
        self.log = log
        self.recheck_interval = recheck_interval
        self.heartbeat_interval = heartbeat_interval
        self.listeners: list[Listener] = []
        # Called with hints in hand, before the look: a source whose records the
        # kernel wrote before those hints' events (the module tracepoints fire
        # before a module's uevents) hands them now, so the look has their times.
        self.catch_up: Callable[[], None] | None = None
        # A hint, or hints that belong together (a tracepoint drain: a load and
        # its free read in one batch give both exact times).
        self._hints: queue.SimpleQueue[Hint | list[Hint]] = queue.SimpleQueue()
        self._open: dict[str, Tracked] = {}
        self._recent: dict[str, deque[Tracked]] = {}
        self._last_scan: Timestamp | None = None
        self._last_heartbeat = 0
        self.reconciliations = 0  # passes that wrote something
        self.passes = self.idle_checks = 0  # looks at the directory; hint-less intervals
        self.lock = threading.Lock()
        self._reading = False

    # -- what sources call ----------------------------------------------------

    def notify(self, source: SeenBy, action: HintAction, name: str | None = None) -> None:
        """Thread-safe: queue a hint for the reconciler."""
        self._hints.put(Hint(source, action, name))

    def notify_all(self, hints: list[Hint]) -> None:
        """Thread-safe: queue *hints* to be reconciled in one batch."""
        if hints:
            self._hints.put(list(hints))

    # -- queries ------------------------------------------------------------------

    def busy(self) -> bool:
        """Whether hints wait or a reconciliation runs: sysfs to read, now."""
        return self._reading or not self._hints.empty()

    def loaded(self) -> list[Incarnation]:
        with self.lock:
            return sorted((t.inc for t in self._open.values()), key=lambda i: i.seq)

    # -- startup ------------------------------------------------------------------

    def startup(self) -> None:
        """Continue the incarnations a previous run left open; close those that
        vanished while kreld was down; open what is new.

        Start the event sources first: a load between this scan and their
        start would otherwise go unseen until the next full look.  Their hints
        wait in the queue; an add hint for a module this scan already found
        pairs with it (nothing here is marked as paired), so no load is
        recorded twice.
        """
        now = Timestamp.now()
        self.store.modules.close_other_boots(self.boot_id)
        present = list_modules(self.root)
        proc = read_proc_modules(self.root)
        closed, continued = self._continue_open(present, proc, now)
        opened: list[Incarnation] = []
        # /proc/modules lists the newest load first: give the oldest the lowest
        # seq, so an exported kallsyms lists modules as the kernel does.
        newest_first = [n for n in proc if n in present]
        order = newest_first[::-1] + sorted(set(present) - set(newest_first))
        states = self.addresses.read([n for n in order if n not in self._open], proc)
        read = Timestamp.now()  # a module read live had its init over by then
        for state in states.values():
            if state is not None:
                opened.append(new_incarnation(state, now, SeenBy.STARTUP, read=read))
        try:
            stored = self.store.modules.apply_module_changes(self.boot_id, opened, [], closed, now)
        except StoreFull as e:
            # A full disk: kreld starts on what the store holds.  What this scan found
            # is left to the reconciliations after it: a load not tracked is opened,
            # and an unload tracked as still open is closed, once there is room.
            self.log.error("startup_scan_held_back", error=str(e), kind=type(e).__name__)
            with self.lock:
                for inc in closed:
                    still = replace(inc, unloaded=None, unloaded_after=None, unload_seen_by=None)
                    self._open[inc.name] = Tracked(still, _STARTUP)
            stored, closed = [], []
        with self.lock:
            for inc in stored:
                self._open[inc.name] = Tracked(inc, _STARTUP)
        self._last_scan = now
        self._last_heartbeat = now.monotonic
        self.log.info(
            "modules_startup",
            continued=continued,
            opened=len(stored),
            closed_while_down=len(closed),
        )
        for inc in closed:
            self.log.info(
                "module_unloaded_while_down",
                module=inc.name,
                seq=inc.seq,
                build_id=inc.state.build_id,
            )
        self._emit(
            [(ModuleEvent.LOAD, i) for i in stored] + [(ModuleEvent.UNLOAD, i) for i in closed]
        )

    def _continue_open(
        self, present: Mapping[str, int], proc: Mapping[str, ProcModule], now: Timestamp
    ) -> tuple[list[Incarnation], int]:
        """Keep tracking what a previous run left open and is still the same
        load; return the rest closed (unloaded while kreld was down) and how
        many continue."""
        last = self.store.modules.last_watched(self.boot_id)
        closed: list[Incarnation] = []
        continued = 0
        incs = self.store.modules.open_incarnations(self.boot_id)
        states = self.addresses.read([i.name for i in incs if i.name in present], proc)
        for inc in incs:
            state = states.get(inc.name)
            if state is not None and same_load(inc.state, state):
                self._open[inc.name] = Tracked(inc, _STARTUP)
                continued += 1
                continue
            after = (
                last if last is not None and last.monotonic > inc.loaded.monotonic else inc.loaded
            )
            closed.append(
                replace(inc, unloaded=now, unloaded_after=after, unload_seen_by=SeenBy.STARTUP)
            )
        return closed, continued

    # -- the reconciler loop ----------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Process hints until *stop* is set (run this in its own thread)."""
        # Blocks until a hint comes, something is due or stop is set.
        fallback = wake_on_stop(stop, lambda: self._hints.put([]))
        while not stop.is_set():
            try:
                first = self._hints.get(timeout=_next_due(self, fallback))
            except queue.Empty:
                try:
                    self._idle()
                except Exception as e:  # a full disk now must not end tracking for good
                    self.log.error("idle_check_failed", error=str(e), kind=type(e).__name__)
                    stop.wait(min(self.recheck_interval, 1.0))
                continue
            if stop.is_set():
                break
            self._reading = True
            batch = _flat(first)
            if self.catch_up is not None:
                with contextlib.suppress(KreldError, OSError):  # the source's own to report
                    self.catch_up()
            while True:
                try:
                    batch += _flat(self._hints.get_nowait())
                except queue.Empty:
                    break
            try:
                self.reconcile(batch)
            except Exception as e:  # the daemon must outlive any one bad batch
                self.log.error("reconcile_failed", error=str(e), kind=type(e).__name__)
                stop.wait(min(self.recheck_interval, 1.0))
                for h in batch:
                    self._hints.put(h)
            finally:
                self._reading = False

    def _idle(self) -> None:
        """No hints: re-read modules still loading; now and then look at the whole
        directory and write a heartbeat.

        The full look is a safety net for what no source reported (a load between
        the startup scan and a source's start, an event lost in an overflow).  A
        module that stays incomplete (e.g. its sections unreadable) must not keep
        the heartbeat from being written.
        """
        incomplete = [t.inc.name for t in self._open.values() if not complete(t.inc.state)]
        if incomplete:
            self.reconcile([Hint(SeenBy.POLL, HintAction.CHANGE, n) for n in incomplete])
        now = Timestamp.now()
        if now.monotonic - self._last_heartbeat >= self.heartbeat_interval * 1e9:
            self.reconcile([])
            self.store.modules.heartbeat(self.boot_id, self._last_scan or now)
            self._last_heartbeat = now.monotonic
            stale = self.store.env.clear_stale_readers()
            if stale:
                self.log.warning("stale_readers_cleared", readers=stale)
        self.idle_checks += 1

    def reconcile(self, hints: list[Hint]) -> None:
        """One pass: look at the directory, plan what changed, apply the plan."""
        now = Timestamp.now()
        present = list_modules(self.root)
        names = to_read(self._open, present, hints)
        # /proc/modules only when a module is read (not for an unload).
        proc = read_proc_modules(self.root) if names else {}
        states = self.addresses.read(names, proc)
        changes = plan(
            self._open,
            present,
            states,
            hints,
            recent=self._recent,
            now=now,
            previous=self._last_scan or now,
            read=Timestamp.now(),
        )
        self._apply(changes, now)
        self.passes += 1

    def _apply(self, changes: Changes, now: Timestamp) -> None:
        """Commit *changes*, then bring memory in step, then log and tell listeners.

        Nothing in memory changes until the store has committed: a failed
        write (a full disk) leaves the batch to be retried whole.  Pairings
        are kept even when there is nothing to write (a load the directory
        showed before its event came): else a later load's hint would pair
        with the same incarnation and that load be lost.
        """
        if not changes.writes:
            with self.lock:
                self._keep_pairs(changes.paired)
            self._last_scan = now
            return
        updated, closed = list(changes.updated), [t.inc for t in changes.closed]
        stored = self.store.modules.apply_module_changes(
            self.boot_id, changes.new, updated, closed, now
        )
        with self.lock:
            for t in changes.closed:
                if (o := self._open.get(t.inc.name)) is not None and o.inc.seq == t.inc.seq:
                    del self._open[t.inc.name]
            for inc in changes.updated:
                self._open[inc.name] = Tracked(inc, self._open[inc.name].hinted)
            self._keep_pairs(changes.paired)
            n = len(changes.transients)
            for inc in stored[:n]:
                self._remember(Tracked(inc, frozenset({inc.seen_by})))
            # Only the hints paired with it: one still on its way (the
            # directory was listed before its event came) pairs later,
            # instead of becoming a phantom load that came and went.
            for inc, t in zip(stored[n:], changes.opened, strict=True):
                self._open[inc.name] = Tracked(inc, t.hinted)
            for t in changes.closed:
                used = changes.paired.get(t.inc.seq, frozenset())
                self._remember(Tracked(t.inc, t.hinted | used))
        self._last_scan = now
        self.reconciliations += 1
        _log_changes(self.log, stored, closed)
        self._emit(
            [(ModuleEvent.LOAD, i) for i in stored]
            + [(ModuleEvent.UPDATE, i) for i in updated]
            + [(ModuleEvent.UNLOAD, i) for i in closed]
        )

    def _keep_pairs(self, paired: Mapping[int, frozenset[SeenBy]]) -> None:
        """Record which sources' hints each tracked incarnation has used (lock held)."""
        if not paired:
            return
        for name, t in self._open.items():
            if t.inc.seq in paired:
                self._open[name] = Tracked(t.inc, t.hinted | paired[t.inc.seq])
        for recent in self._recent.values():
            for i, t in enumerate(recent):
                if t.inc.seq in paired:
                    recent[i] = Tracked(t.inc, t.hinted | paired[t.inc.seq])

    def _remember(self, t: Tracked) -> None:
        self._recent.setdefault(t.inc.name, deque(maxlen=4)).append(t)

    def _emit(self, events: list[tuple[ModuleEvent, Incarnation]]) -> None:
        for kind, inc in events:
            for listener in list(self.listeners):
                try:
                    listener(kind, inc)
                except Exception as e:
                    self.log.error("listener_failed", error=str(e))


def _log_changes(
    log: FilteringBoundLogger, stored: list[Incarnation], closed: list[Incarnation]
) -> None:
    """One line per load and unload a pass stored, and per fault in reading a load."""
    for inc in stored:
        log.info(
            "module_loaded" if inc.unloaded is None else "module_came_and_went",
            module=inc.name,
            seq=inc.seq,
            seen_by=inc.seen_by.value,
            build_id=inc.state.build_id,
            text=f"{inc.state.sections['.text']:#x}" if ".text" in inc.state.sections else None,
            initstate=inc.state.initstate,
            restricted=inc.state.restricted,
        )
        for fault in inc.state.faults:
            log.warning("module_read_fault", module=inc.name, seq=inc.seq, fault=fault)
    for inc in closed:
        log.info("module_unloaded", module=inc.name, seq=inc.seq, seen_by=inc.unload_seen_by)


def _flat(item: Hint | list[Hint]) -> list[Hint]:
    return item if isinstance(item, list) else [item]


def _next_due(tracker: ModuleTracker, cap: float | None) -> float | None:
    """Seconds the reconciler may block for a hint (at most *cap*, where
    given): the recheck interval while a module is still loading, else until
    the heartbeat is due; at rest it wakes only for the heartbeat."""
    if any(not complete(t.inc.state) for t in tracker._open.values()):
        wait = tracker.recheck_interval
    else:
        due = tracker._last_heartbeat + int(tracker.heartbeat_interval * 1e9)
        wait = max(0.0, (due - Timestamp.now().monotonic) / 1e9)
    return wait if cap is None else min(wait, cap)
