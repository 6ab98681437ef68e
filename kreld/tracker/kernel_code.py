"""The follower of kernel code: reads the side-band rings of every CPU, plans
with :mod:`kreld.tracker.kernel_code_plan`, writes to the store's kernel-code table and
tells listeners (Subscribe).  An event source like those of
:mod:`kreld.tracker.sources`: the daemon starts it, stops it and reports on it.

Start order (the daemon's): the rings are opened (:class:`KernelCodeFollower`'s
constructor) before kallsyms is read for the start-up look (:meth:`begin`), so
nothing falls between the look and the first record; records drained after
the look refine or extend what it found.  After any loss, kallsyms is looked
at again, at most once a :data:`~kreld.core.consts.KERNEL_CODE_RECONCILE_INTERVAL`.
Where the rings cannot be opened (perf_event_paranoid, no CAP_PERFMON, a
seccomp filter) the follower says why in Status, looks at kallsyms at the
start and then every :data:`_UNFOLLOWED_LOOK` seconds, and records the time
between two looks as a loss window of reason ``not_followed``.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kreld.core import consts
from kreld.core.errors import KernelReadError, KreldError
from kreld.core.kernel_code import (
    OWNER_BPF,
    CodeEvent,
    CodeKind,
    KernelCode,
    LossReason,
    LossWindow,
    kind_of,
)
from kreld.core.model import BOOT_START, Timestamp
from kreld.core.supervise import supervisor
from kreld.kernel.bpfinfo import bpf_functions, bpf_programs
from kreld.kernel.info import Root, bpf_programs_listed, set_thread_name
from kreld.kernel.kallsyms import KallsymsText
from kreld.kernel.perfring import SidebandRings
from kreld.kernel.sideband import merge_by_time
from kreld.store.kernel_code import KernelCodeTables
from kreld.tracker.kernel_code_plan import Changes, CodeState, Stamp

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from kreld.store import Store

__all__ = [
    "THREAD_NAME",
    "CodeListener",
    "KernelCodeFollower",
    "reconcile_with",
    "stamper",
]

CodeListener = Callable[[CodeEvent, KernelCode], None]
THREAD_NAME = "kreld-kernel-code"  # the follower thread's OS name
_BATCH_DELAY = 0.05  # s: records that come together are written together
_POLL_MS = 1000  # ms between wakes while a look or a write is due
_IDLE_POLL_MS = 5000  # ms idle, as between checks of the CPUs (stop wakes it at once)
_CPU_CHECK = 5.0  # s between looks for CPUs come online and rings stopped
_UNFOLLOWED_LOOK = 60.0  # s between looks at kallsyms without rings
_PRUNE_EVERY = 10_000  # records written between two retention passes


def stamper() -> Stamp:
    """CLOCK_MONOTONIC ns to the three clocks, at their offsets now."""
    now = Timestamp.now()
    boot, real = now.boottime - now.monotonic, now.realtime - now.monotonic
    return lambda t: Timestamp(t, t + boot, t + real)


class KernelCodeFollower:
    """BPF programs, trampolines, ftrace and kprobe pages of one boot, followed live."""

    name = "kernel_code"

    def __init__(
        self,
        root: Root,
        log: FilteringBoundLogger,
        pages: int = consts.KERNEL_CODE_RING_PAGES,
        *,
        enabled: bool = True,
    ) -> None:
        self.root, self.log = root, log
        self.enabled = enabled  # [kernel] follow_code: off, nothing is opened, read or kept
        self.rings: SidebandRings | None = None
        # On the real root only, like uevents: a fake tree's kernel is not this one.
        follow = enabled and os.path.realpath(root.path) == "/"
        self.reason: str | None = None if follow else "kreld does not run on the real root"
        if not enabled:
            self.reason = "turned off in the configuration ([kernel] follow_code = false)"
        self.opened = time.monotonic_ns()
        if follow:
            try:
                self.rings = SidebandRings(root, pages)
            except KernelReadError as e:
                self.reason = e.reason
                log.warning("kernel_code_unfollowed", reason=e.reason)
        self.listeners: list[CodeListener] = []
        # stop() wakes the poll through it (closed by stop() once the thread ended)
        self._wake: tuple[int, int] | None = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.healthy = True
        self.last_error: str | None = None
        self.records = 0
        self.windows = 0
        self.state: CodeState | None = None
        self.tables: KernelCodeTables | None = None
        self._boots: Callable[[], set[str]] = set
        self._pending: list[Changes] = []
        self._thread: threading.Thread | None = None
        self._last_look = 0.0
        self._last_write = time.monotonic()
        self._loss_start: Timestamp | None = None
        opened = Timestamp.now()
        self._cpus_checked = (opened, opened)  # the looks at the CPUs before last, and last
        self._since_prune = 0

    @property
    def events(self) -> int:
        return self.records

    # -- the start-up look ----------------------------------------------------------

    def begin(self, store: Store, boot_id: str, ks: KallsymsText | None) -> None:
        """Take the boot's open records, look at kallsyms (*ks*, read after the
        rings opened), and apply retention once (then every _PRUNE_EVERY records).

        The look is timed now, after the read: a record drained later whose
        time is before it refines what the look found (kreld/tracker/kernel_code_plan.py)."""
        if not self.enabled:
            return
        look = Timestamp.now()
        tables = store.kernel_code
        self.tables, self._boots = tables, lambda: {b.boot_id for b in store.list_boots()}
        self.state = CodeState(boot_id, tables.next_seq(boot_id), tables.open_codes(boot_id))
        watch = tables.watch(boot_id)
        ch = Changes()
        if watch is not None:  # kreld was stopped since: what came and went is unknown
            ch.losses.append(LossWindow(watch, look, LossReason.NOT_RUNNING))
        if ks is not None and not ks.zeroed():
            ch = _joined(ch, self._reconcile(ks, look, watch or BOOT_START))
        self._last_look = time.monotonic()
        try:
            self._write(ch)
            self.prune()
        except KreldError as e:  # a full disk: held, written by a later step
            self._failed(e)

    def _reconcile(self, ks: KallsymsText, look: Timestamp, since: Timestamp) -> Changes:
        if self.state is None:
            return Changes()
        return reconcile_with(self.state, ks, look, since, bpf_programs_listed(self.root))

    # -- running ----------------------------------------------------------------------

    def start(self, stop: threading.Event) -> None:
        if not self.enabled:
            return
        self._thread = supervisor().thread("kernel-code", self.run, stop)

    def stop(self) -> None:
        """Wake the thread (the daemon set its stop event) and end it; a last
        look if one is due, and the watch time."""
        if self._wake is not None:
            with contextlib.suppress(BlockingIOError):  # full: a wake is pending already
                os.write(self._wake[1], b"!")
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._wake is not None and (self._thread is None or not self._thread.is_alive()):
            wake, self._wake = self._wake, None
            for fd in wake:
                os.close(fd)
        if self.rings is None:
            return
        if self._thread is None or not self._thread.is_alive():  # else its write is unknown
            with contextlib.suppress(KreldError):  # logged by the write's failure already
                if self.state is not None and self.state.need_look:
                    self.step()
                    self.look(None)  # a loss not looked at yet: what it hid is closed now
                self._beat()  # followed up to now: a restart's window starts here
        self.rings.close()
        self.rings = None

    def _beat(self) -> None:
        """Say that every record up to now has been read (the watch time)."""
        if self.tables is not None and self.state is not None:
            self.tables.apply(self.state.boot_id, [], [], Timestamp.now())
        self._last_write = time.monotonic()

    def run(self, stop: threading.Event) -> None:
        set_thread_name(THREAD_NAME)
        last_cpu_check = time.monotonic()
        while not stop.is_set():
            try:
                if self.rings is None:
                    stop.wait(_UNFOLLOWED_LOOK)
                    if not stop.is_set():
                        self.look(LossReason.NOT_FOLLOWED)
                    continue
                if self._wait(stop):
                    self.step()
                if self._look_due():
                    self.look(None)
                if time.monotonic() - last_cpu_check >= _CPU_CHECK:
                    last_cpu_check = time.monotonic()
                    self.check_cpus()
                if time.monotonic() - self._last_write >= consts.HEARTBEAT_INTERVAL:
                    self._beat()
            except KreldError as e:
                self._failed(e)
                stop.wait(1.0)

    def _look_due(self) -> bool:
        """After a loss, and at most once a KERNEL_CODE_RECONCILE_INTERVAL."""
        if self.state is None or not self.state.need_look:
            return False
        return time.monotonic() - self._last_look >= consts.KERNEL_CODE_RECONCILE_INTERVAL

    def _wait(self, stop: threading.Event) -> bool:
        """Wait for records; True when there may be some to read."""
        if self.rings is None:
            return False
        busy = self._pending or (self.state is not None and self.state.need_look)
        wake = self._wake[0] if self._wake is not None else -1
        if not _poll_rings(self.rings, wake, _POLL_MS if busy else _IDLE_POLL_MS):
            return bool(self._pending)
        stop.wait(_BATCH_DELAY)
        return True

    def step(self) -> None:
        """Drain every ring, apply the records merged by time, write them.

        The kernel's lost counts are read first: a record written before a loss
        counted here is in its ring now, so it is applied before the look that
        the loss asks for (read after the drain, a loss could be counted whose
        earlier records are still in the ring, opened after the look for good)."""
        if self.rings is None or self.state is None:
            return
        stamp = stamper()
        rings = list(self.rings.rings.values())
        counted = [(r.cpu, r.lost()) for r in rings] if self.rings.counts_lost else []
        parsed = [r.drain().records for r in rings]
        ch = self.state.apply(merge_by_time(parsed), stamp, self.opened)
        now = Timestamp.now()
        for cpu, total in counted:
            self.state.lost_counted(cpu, total, now, stamp, self.opened, ch)
        self._note_losses(ch)
        self._write(ch)

    def check_cpus(self) -> None:
        """Open a ring for each CPU come online, and a new one where the kernel
        stopped the event (its CPU went offline, maybe to come back: see
        :mod:`kreld.kernel.perfring`).  That CPU's records since the last check
        are lost: a ``cpu_hotplug`` window, and a look at kallsyms."""
        if self.rings is None or self.state is None:
            return
        self.step()  # what the rings hold, first
        dead, added = self.rings.reopen()
        now = Timestamp.now()
        # A stopped event accrued no enabled time since the last check, and some
        # since the one before: it stopped after that one.  A CPU come online
        # (or back) was offline, or its ring open, at the last check.
        before, last = self._cpus_checked
        self._cpus_checked = (last, now)
        ch = Changes()
        for cpu in added:
            self.state.ring_opened(cpu)
            since = before if cpu in dead else last
            ch.losses.append(LossWindow(since, now, LossReason.CPU_HOTPLUG))
            self.state.need_look = True
        if dead or added:
            self.log.info("kernel_code_cpus", closed=dead, opened=added, cpus=len(self.rings.rings))
        self._note_losses(ch)
        self._write(ch)

    def _note_losses(self, ch: Changes) -> None:
        """Keep the earliest start of the losses not yet looked at: what the next
        look finds gone went after it, not after the look's own time."""
        for w in ch.losses:
            if self._loss_start is None or w.start.monotonic < self._loss_start.monotonic:
                self._loss_start = w.start
            self.log.warning(
                "kernel_code_records_lost",
                lost=w.lost,
                reason=w.reason.value,
                since_monotonic=w.start.monotonic,
            )

    def look(self, reason: LossReason | None) -> None:
        """Look at kallsyms again: after a loss (*reason* None), or without rings."""
        if self.state is None:
            return
        start = self._window_start()
        ks = KallsymsText.read_tail(self.root)
        look = Timestamp.now()
        ch = self._reconcile(ks, look, start)
        if reason is not None:
            ch.losses.append(LossWindow(start, look, reason))
        self._last_look = time.monotonic()
        self._write(ch)
        self._loss_start = None
        events = [e.value for e, _ in ch.events]
        self.log.info(
            "kernel_code_look",
            opened=events.count("code_load"),
            closed=events.count("code_unload"),
            since_monotonic=start.monotonic,
        )

    def _window_start(self) -> Timestamp:
        """Since when the look must assume anything came or went: the first loss
        not yet looked at, or else the last time every record was read."""
        if self._loss_start is not None:
            return self._loss_start
        watch = self.tables.watch(self.state.boot_id) if self.tables and self.state else None
        return watch or BOOT_START

    def _write(self, ch: Changes) -> None:
        if self.tables is None or self.state is None:
            return
        self._pending.append(ch)
        todo = _joined(*self._pending)
        if not todo:
            self._pending.clear()
            return
        self.tables.apply(self.state.boot_id, todo.written.values(), todo.losses, Timestamp.now())
        self._pending.clear()
        self._last_write = time.monotonic()
        self.records += len(todo.written)
        self.windows += len(todo.losses)
        self.healthy, self.last_error = True, None
        for event, code in todo.events:
            for listener in list(self.listeners):
                listener(event, code)
        self._since_prune += len(todo.written)
        if self._since_prune >= _PRUNE_EVERY:
            self.prune()

    def prune(self) -> dict[str, int]:
        """Retention (kreld/store/kernel_code.py): this boot's old records, and gone boots'."""
        self._since_prune = 0
        if self.tables is None or self.state is None:
            return {}
        dropped = self.tables.prune(self.state.boot_id)
        gone = self.tables.drop_boots(self._boots() | {self.state.boot_id})
        if dropped or gone:
            self.log.info("kernel_code_retention", dropped=dropped, other_boots_keys=gone)
        return {"kernel_code": dropped, "kernel_code_keys_of_gone_boots": gone}

    def _failed(self, e: KreldError) -> None:
        self.healthy, self.last_error = False, str(e)
        self.log.error("kernel_code_failed", error=str(e), held=len(self._pending))

    def status(self) -> dict[str, Any]:
        """Status's ``kernel_code`` member."""
        st = self.state
        return {
            "state": "off" if not self.enabled else "open" if self.rings else "unavailable",
            "reason": self.reason,
            "cpus": 0 if self.rings is None else len(self.rings.rings),
            "lost": 0 if st is None else st.lost,
            "loss_windows": self.windows,
            "live": 0 if st is None else len(st.live),
            "records": self.records,
        }


def _poll_rings(rings: SidebandRings, wake: int, timeout_ms: int) -> bool:
    """Wait up to *timeout_ms* for records in *rings* or a byte on *wake* (read
    here: stop() wrote it, the caller then looks at the stop event); True when
    a ring has records."""
    poller = select.poll()
    for fd in rings.fds():
        poller.register(fd, select.POLLIN)
    if wake >= 0:
        poller.register(wake, select.POLLIN)
    ready = poller.poll(timeout_ms)
    if any(fd == wake for fd, _ in ready):
        with contextlib.suppress(BlockingIOError):
            os.read(wake, 64)
    return any(fd != wake for fd, _ in ready)


def reconcile_with(
    state: CodeState, ks: KallsymsText, look: Timestamp, since: Timestamp, listed: bool
) -> Changes:
    """The changes a look at kallsyms (*ks*, read at *look*) makes; none where it
    shows zeros (kptr_restrict): an absent address then says nothing of what is
    loaded.  Programs it gives no length of are asked of bpf(2)."""
    if ks.tail_zeroed():
        return Changes()
    lines = ks.code_lines()
    live = state.live
    unknown = [
        ln
        for ln in lines
        if ln.owner == OWNER_BPF
        and kind_of(ln.name) is CodeKind.BPF_PROGRAM
        and (ln.addr not in live or live[ln.addr].length is None)
    ]
    funcs = None
    if unknown:  # programs kallsyms alone would give no length, id or tag
        programs = bpf_programs()
        funcs = bpf_functions(programs) if programs is not None else None
    return state.reconcile(lines, look, since, listed, funcs)


def _joined(*parts: Changes) -> Changes:
    """Several steps' changes as one write, in order (a later record of a seq wins)."""
    out = Changes()
    for p in parts:
        out.written.update(p.written)
        out.losses += p.losses
        out.events += p.events
    return out
