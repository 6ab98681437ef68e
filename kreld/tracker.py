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

import dataclasses
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

from kreld import consts
from kreld.kernel import Root
from kreld.model import HintAction, Incarnation, ModuleEvent, ModuleState, SeenBy, Timestamp
from kreld.modules import list_modules, read_module, read_proc_modules
from kreld.store import Store

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

Listener = Callable[[ModuleEvent, Incarnation], None]


@dataclass(frozen=True, slots=True)
class Hint:
    source: SeenBy
    action: HintAction
    name: str | None


@dataclass
class _Tracked:
    inc: Incarnation
    hinted: set[SeenBy] = field(default_factory=set)


def _complete(state: ModuleState) -> bool:
    return state.initstate != "coming" and (bool(state.sections) or state.restricted)


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
    ) -> None:
        self.store = store
        self.root = root
        self.boot_id = boot_id
        self.log = log
        self.recheck_interval = recheck_interval
        self.heartbeat_interval = heartbeat_interval
        self.listeners: list[Listener] = []
        self._hints: queue.SimpleQueue[Hint] = queue.SimpleQueue()
        self._open: dict[str, _Tracked] = {}
        self._recent: dict[str, deque[_Tracked]] = {}
        self._last_scan: Timestamp | None = None
        self._last_heartbeat = 0
        self.reconciliations = 0
        self.lock = threading.Lock()
        self._reading = False

    # -- what sources call ----------------------------------------------------

    def notify(self, source: SeenBy, action: HintAction, name: str | None = None) -> None:
        """Thread-safe: queue a hint for the reconciler."""
        self._hints.put(Hint(source, action, name))

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
        self.store.close_other_boots(self.boot_id)
        last = self.store.last_watched(self.boot_id)
        present = list_modules(self.root)
        proc = read_proc_modules(self.root)
        closed: list[Incarnation] = []
        continued = 0
        for inc in self.store.open_incarnations(self.boot_id):
            state = read_module(self.root, inc.name, proc) if inc.name in present else None
            if state is not None and self._same_load(inc.state, state):
                self._open[inc.name] = _Tracked(inc, {SeenBy.STARTUP})
                continued += 1
                continue
            after = (
                last if last is not None and last.monotonic > inc.loaded.monotonic else inc.loaded
            )
            closed.append(
                dataclasses.replace(
                    inc, unloaded=now, unloaded_after=after, unload_seen_by=SeenBy.STARTUP
                )
            )
        opened: list[Incarnation] = []
        # /proc/modules lists the newest load first: give the oldest the lowest
        # seq, so an exported kallsyms lists modules as the kernel does.
        newest_first = [n for n in proc if n in present]
        order = newest_first[::-1] + sorted(set(present) - set(newest_first))
        for name in order:
            if name in self._open:
                continue
            state = read_module(self.root, name, proc)
            if state is not None:
                opened.append(self._new(state, now, SeenBy.STARTUP))
        stored = self.store.apply_module_changes(self.boot_id, opened, [], closed, now)
        with self.lock:
            for inc in stored:
                self._open[inc.name] = _Tracked(inc, {SeenBy.STARTUP})
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

    @staticmethod
    def _same_load(old: ModuleState, new: ModuleState) -> bool:
        if old.inode is not None and new.inode is not None and old.inode != new.inode:
            return False
        for name in (".text", ".data"):
            a, b = old.sections.get(name), new.sections.get(name)
            if a is not None and b is not None and a != b:
                return False
        if old.core_base and new.core_base and old.core_base != new.core_base:
            return False
        return old.build_id == new.build_id and old.srcversion == new.srcversion

    @staticmethod
    def _new(
        state: ModuleState, when: Timestamp, by: SeenBy, gone: Timestamp | None = None
    ) -> Incarnation:
        return Incarnation(
            boot_id="",
            seq=-1,
            state=state,
            loaded=when,
            seen_by=by,
            init_live=state.initstate == "coming",
            init_done=when if state.initstate == "live" else None,
            unloaded=gone,
            unloaded_after=when if gone else None,
            unload_seen_by=by if gone else None,
        )

    # -- the reconciler loop ----------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Process hints until *stop* is set (run this in its own thread)."""
        while not stop.is_set():
            try:
                first = self._hints.get(timeout=self.recheck_interval)
            except queue.Empty:
                try:
                    self._idle()
                except Exception as e:  # a full disk now must not end tracking for good
                    self.log.error("idle_check_failed", error=str(e), kind=type(e).__name__)
                    stop.wait(min(self.recheck_interval, 1.0))
                continue
            self._reading = True
            batch = [first]
            while True:
                try:
                    batch.append(self._hints.get_nowait())
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
        incomplete = [t.inc.name for t in self._open.values() if not _complete(t.inc.state)]
        if incomplete:
            self.reconcile([Hint(SeenBy.POLL, HintAction.CHANGE, n) for n in incomplete])
        now = Timestamp.now()
        if now.monotonic - self._last_heartbeat >= self.heartbeat_interval * 1e9:
            self.reconcile([])
            self.store.heartbeat(self.boot_id, self._last_scan or now)
            self._last_heartbeat = now.monotonic
            stale = self.store.clear_stale_readers()
            if stale:
                self.log.warning("stale_readers_cleared", readers=stale)

    def reconcile(self, hints: list[Hint]) -> None:
        """One pass: compare the directory with what is open, pair the hints."""
        now = Timestamp.now()
        previous = self._last_scan or now
        present = list_modules(self.root)
        proc = read_proc_modules(self.root)
        source = hints[0].source if hints else SeenBy.POLL
        opened: list[tuple[Incarnation, SeenBy]] = []
        updated: list[Incarnation] = []
        closed: list[Incarnation] = []
        closed_tracked: list[_Tracked] = []
        recheck = {h.name for h in hints if h.name}

        # Nothing in memory changes until the store has committed: a failed
        # write (a full disk) leaves the batch to be retried whole.
        gone: list[tuple[str, _Tracked]] = []
        refreshed: list[tuple[_Tracked, Incarnation]] = []
        paired: dict[int, set[SeenBy]] = {}

        def close(name: str, t: _Tracked, by: SeenBy) -> None:
            after = previous if previous.monotonic > t.inc.loaded.monotonic else t.inc.loaded
            done = dataclasses.replace(t.inc, unloaded=now, unloaded_after=after, unload_seen_by=by)
            closed.append(done)
            closed_tracked.append(_Tracked(done, t.hinted))
            gone.append((name, t))

        # Which source first said so, per (module, action): one pass over the batch.
        said: dict[tuple[str | None, str], SeenBy] = {}
        for h in hints:
            said.setdefault((h.name, h.action), h.source)

        for name, t in list(self._open.items()):
            by = said.get((name, "remove"), source)
            if name not in present or present[name] != t.inc.state.inode:
                close(name, t, by)
                continue
            if name in recheck or not _complete(t.inc.state):
                state = read_module(self.root, name, proc)
                if state is None:
                    close(name, t, by)
                    continue
                new = self._refresh(t.inc, state, now)
                if new != t.inc:
                    refreshed.append((t, new))
                    updated.append(new)
        closing = {name for name, _ in gone}
        for name in sorted(present):
            if name in self._open and name not in closing:
                continue
            state = read_module(self.root, name, proc)
            if state is not None:
                by = said.get((name, "add"), source)
                opened.append((self._new(state, now, by), by))

        # Pair add hints with incarnations; an unpaired one is a load that came
        # and went between two looks at the directory.
        new_by_name: dict[str, list[int]] = {}
        for i, (inc, _) in enumerate(opened):
            new_by_name.setdefault(inc.name, []).append(i)
        hinted_new: dict[int, set[SeenBy]] = {i: set() for i in range(len(opened))}
        transients: list[Incarnation] = []

        def free(t: _Tracked, src: SeenBy) -> bool:
            return src not in t.hinted and src not in paired.get(id(t), set())

        for h in hints:
            if h.action != "add" or h.name is None:
                continue
            if any(h.source not in hinted_new[i] for i in new_by_name.get(h.name, [])):
                i = next(i for i in new_by_name[h.name] if h.source not in hinted_new[i])
                hinted_new[i].add(h.source)
                continue
            candidates = [
                t
                for t in ([self._open[h.name]] if h.name in self._open else [])
                if h.name not in closing
            ]
            candidates += [t for t in closed_tracked if t.inc.name == h.name]
            candidates += list(self._recent.get(h.name, ()))
            match = next((c for c in candidates if free(c, h.source)), None)
            if match is not None:
                paired.setdefault(id(match), set()).add(h.source)
                continue
            gone_state = ModuleState(
                name=h.name,
                build_id=None,
                sections={},
                coresize=None,
                initsize=None,
                initstate=None,
                srcversion=None,
                taint=None,
                core_base=None,
                restricted=False,
                inode=None,
                faults=("gone before it could be read",),
            )
            transients.append(self._new(gone_state, now, h.source, gone=now))

        if not (opened or updated or closed or transients):
            # Nothing to commit, but hints may have paired (a load the directory
            # showed before its event came): remember that, or a later load's
            # hint would pair with the same incarnation and be lost.
            with self.lock:
                self._keep_pairs(paired, [])
            self._last_scan = now
            return
        # A load that came and went happened before the load of the same name
        # still present: record it first, so seqs follow the order of loads.
        all_new = transients + [inc for inc, _ in opened]
        stored = self.store.apply_module_changes(self.boot_id, all_new, updated, closed, now)
        with self.lock:
            for name, t in gone:
                if self._open.get(name) is t:
                    del self._open[name]
            for t, new in refreshed:
                t.inc = new
            self._keep_pairs(paired, closed_tracked)
            for i, inc in enumerate(stored):
                if i < len(transients):
                    self._remember(_Tracked(inc, {inc.seen_by}))
                else:
                    # Only the hints paired with it: one still on its way (the
                    # directory was listed before its event came) pairs later,
                    # instead of becoming a phantom load that came and went.
                    self._open[inc.name] = _Tracked(inc, hinted_new[i - len(transients)])
            for t in closed_tracked:
                self._remember(t)
        self._last_scan = now
        self.reconciliations += 1
        for inc in stored:
            self.log.info(
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
                self.log.warning("module_read_fault", module=inc.name, seq=inc.seq, fault=fault)
        for inc in closed:
            self.log.info(
                "module_unloaded", module=inc.name, seq=inc.seq, seen_by=inc.unload_seen_by
            )
        self._emit(
            [(ModuleEvent.LOAD, i) for i in stored]
            + [(ModuleEvent.UPDATE, i) for i in updated]
            + [(ModuleEvent.UNLOAD, i) for i in closed]
        )

    def _keep_pairs(self, paired: dict[int, set[SeenBy]], closed: list[_Tracked]) -> None:
        """Record which sources' hints each tracked incarnation has used (lock held)."""
        if not paired:
            return
        for t in [*self._open.values(), *closed, *chain.from_iterable(self._recent.values())]:
            t.hinted |= paired.get(id(t), set())

    @staticmethod
    def _refresh(inc: Incarnation, state: ModuleState, now: Timestamp) -> Incarnation:
        """What a later read adds to an open incarnation: never changes an address."""
        sections = dict(state.sections)
        sections.update(inc.state.sections)
        merged = dataclasses.replace(
            inc.state,
            sections=sections,
            build_id=inc.state.build_id or state.build_id,
            coresize=inc.state.coresize if inc.state.coresize is not None else state.coresize,
            initsize=inc.state.initsize if inc.state.initsize is not None else state.initsize,
            initstate=state.initstate,
            srcversion=inc.state.srcversion or state.srcversion,
            taint=state.taint,
            core_base=inc.state.core_base or state.core_base,
            restricted=inc.state.restricted or state.restricted,
            faults=state.faults,
        )
        init_done = inc.init_done
        if init_done is None and state.initstate == "live":
            init_done = now
        return dataclasses.replace(inc, state=merged, init_done=init_done)

    def _remember(self, t: _Tracked) -> None:
        self._recent.setdefault(t.inc.name, deque(maxlen=4)).append(t)

    def _emit(self, events: list[tuple[ModuleEvent, Incarnation]]) -> None:
        for kind, inc in events:
            for listener in list(self.listeners):
                try:
                    listener(kind, inc)
                except Exception as e:
                    self.log.error("listener_failed", error=str(e))
