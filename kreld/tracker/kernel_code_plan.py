"""The pure plan of what side-band records and a look at kallsyms change in
the kernel code kreld knows to be live.  No I/O: the follower
(:mod:`kreld.tracker.kernel_code`) reads the rings and kallsyms, hands both here,
and writes the :class:`Changes` to the store.

What each input means:

* a KSYMBOL register opens a record of kernel code at its exact time, address and
  length; a BPF_EVENT load that follows on the same CPU gives the programs
  registered since the last one their program id (the kernel writes the
  KSYMBOLs of a program's functions, then its BPF_EVENT: perf_event_bpf_event());
* a KSYMBOL unregister closes the record at that address;
* a LOST record (or a lost count that grew) is a :class:`LossWindow` from the
  last record that CPU gave to now, and asks for a reconciliation.  The kernel
  counts a loss twice, in the ring (a LOST record, written before the next
  record that fits) and in the event's count (PERF_FORMAT_LOST, read at once);
  each CPU's losses are given a window once, by whichever tells them first.
  The count is read before the ring is drained (:meth:`CodeState.lost_counted`):
  every record written before a counted loss is then drained with it, so the
  look that follows sees what those records opened;
* a reconciliation against the ``[bpf]`` and ``[__builtin__*]`` lines of
  kallsyms opens what kallsyms lists and kreld did not know (its load somewhere
  in the window) and closes what kreld held live and kallsyms no longer lists
  (its unload somewhere in the window).  Programs are listed only with
  ``bpf_jit_kallsyms=1`` and ``bpf_jit_harden=0``: otherwise none is closed
  for its absence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from kreld.core import consts
from kreld.core.kernel_code import (
    CodeEvent,
    CodeKind,
    CodeSeen,
    CodeSource,
    KernelCode,
    LossReason,
    LossWindow,
    kind_of,
    owner_of,
)
from kreld.core.model import BOOT_START, Timestamp
from kreld.core.record import replace
from kreld.kernel.bpfinfo import ProgramInfo
from kreld.kernel.kallsyms import CodeLine
from kreld.kernel.sideband import BpfEvent, BpfEventType, Ksymbol, Lost, SideRecord

__all__ = [
    "CodeState",
    "Stamp",
]

_ONE_PAGE = (CodeKind.BPF_TRAMPOLINE, CodeKind.BPF_DISPATCHER, CodeKind.KPROBE_PAGE)
# Unregisters remembered for a close kallsyms made first (one look's worth).
_RECENT_CAP = 65536

Stamp = Callable[[int], Timestamp]  # a record's CLOCK_MONOTONIC ns on the three clocks


class Changes:
    """What one step changed: records to write (by seq), loss windows, events."""

    __slots__ = ("events", "losses", "written")

    def __init__(self) -> None:
        self.written: dict[int, KernelCode] = {}
        self.losses: list[LossWindow] = []
        self.events: list[tuple[CodeEvent, KernelCode]] = []

    def put(self, event: CodeEvent, code: KernelCode) -> None:
        self.written[code.seq] = code
        self.events.append((event, code))

    def __bool__(self) -> bool:
        return bool(self.written or self.losses)


class CodeState:
    """The live kernel code of one boot, by address, and the step functions."""

    def __init__(self, boot_id: str, next_seq: int, live: Iterable[KernelCode]) -> None:
        self.boot_id = boot_id
        self.next_seq = next_seq
        self.live: dict[int, KernelCode] = {c.addr: c for c in live}
        self.last_time: dict[int, int] = {}  # each CPU's last record time
        self._since_event: dict[int, list[int]] = {}  # CPU -> addrs registered since its BPF_EVENT
        self._closed_by_look: dict[int, int] = {}  # addr -> seq closed by kallsyms
        self.written: dict[int, KernelCode] = {}  # the records closed by kallsyms, by seq
        self.lost = 0
        self.need_look = False
        self._lost_in_ring: dict[int, int] = {}  # CPU -> losses its LOST records told
        self._lost_known: dict[int, int] = {}  # CPU -> losses given a window

    # -- side-band records ----------------------------------------------------

    def apply(self, records: Iterable[SideRecord], stamp: Stamp, opened: int) -> Changes:
        """Apply records merged by time; *opened*: when the source opened (CLOCK_MONOTONIC)."""
        ch = Changes()
        for r in records:
            if isinstance(r, Ksymbol):
                if r.unregister:
                    self._unregister(r, stamp, ch)
                else:
                    self._register(r, stamp, ch)
            elif isinstance(r, BpfEvent):
                self._bpf_event(r, ch)
            elif isinstance(r, Lost):
                told = self._lost_in_ring.get(r.cpu, 0) + r.lost
                self._lost_in_ring[r.cpu] = told
                self._lost_up_to(r.cpu, told, stamp(r.time), stamp, opened, ch)
            self.last_time[r.cpu] = max(self.last_time.get(r.cpu, 0), r.time)
        return ch

    def ring_opened(self, cpu: int) -> None:
        """A new event on *cpu* (its CPU came online again): its counts start at 0."""
        self._lost_in_ring.pop(cpu, None)
        self._lost_known.pop(cpu, None)

    def lost_counted(
        self, cpu: int, total: int, now: Timestamp, stamp: Stamp, opened: int, ch: Changes
    ) -> None:
        """The kernel's count of *cpu*'s losses was *total*, read before the records
        just applied were drained: the losses no LOST record told yet came after
        every record drained (any record written after a loss follows a LOST record)."""
        self._lost_up_to(cpu, total, now, stamp, opened, ch)

    def _lost_up_to(
        self, cpu: int, total: int, now: Timestamp, stamp: Stamp, opened: int, ch: Changes
    ) -> None:
        known = self._lost_known.get(cpu, 0)
        if total > known:
            self._lost_known[cpu] = total
            self.lose(cpu, total - known, now, stamp, opened, ch)

    def lose(
        self, cpu: int, count: int, now: Timestamp, stamp: Stamp, opened: int, ch: Changes
    ) -> None:
        """*count* records of *cpu* were lost before *now*: a loss window since its last record."""
        start = stamp(self.last_time.get(cpu, opened))
        ch.losses.append(LossWindow(start, now, LossReason.LOST_RECORDS, count))
        self.lost += count
        self.need_look = True

    def _new_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def _close(
        self, old: KernelCode, at: Timestamp, after: Timestamp | None, seen: CodeSeen, ch: Changes
    ) -> KernelCode:
        del self.live[old.addr]
        done = replace(old, unloaded=at, unloaded_after=after, unload_seen_by=seen)
        ch.put(CodeEvent.UNLOAD, done)
        return done

    def _register(self, r: Ksymbol, stamp: Stamp, ch: Changes) -> None:
        at = stamp(r.time)
        old = self.live.get(r.addr)
        if old is not None and _found_by_look_before(old, r):
            # What a look at kallsyms found first: exact now.
            new = replace(
                old,
                length=r.length,
                loaded=at,
                loaded_after=None,
                seen_by=CodeSeen.KSYMBOL,
                source=CodeSource.PERF,
            )
            self.live[r.addr] = new
            ch.put(CodeEvent.UPDATE, new)
            self._since_event.setdefault(r.cpu, []).append(r.addr)
            return
        if old is not None:
            if old.name == r.name and old.loaded == at:
                return  # the same record twice
            # Its unregister was never seen (lost): present at its load, gone now.
            self._close(old, at, old.loaded, CodeSeen.KSYMBOL, ch)
        new = self._from_ksymbol(r, at)
        self.live[r.addr] = new
        ch.put(CodeEvent.LOAD, new)
        self._since_event.setdefault(r.cpu, []).append(r.addr)

    def _unregister(self, r: Ksymbol, stamp: Stamp, ch: Changes) -> None:
        old = self.live.get(r.addr)
        if old is not None and old.name == r.name:
            t = max(r.time, old.loaded.monotonic)
            self._close(old, stamp(t), None, CodeSeen.KSYMBOL, ch)
            return
        seq = self._closed_by_look.pop(r.addr, None)
        done = self.written.get(seq) if seq is not None else None
        if done is not None and done.name == r.name and _closed_by_look_after(done, r):
            # kallsyms closed it first: the exact time now.
            exact = replace(done, unloaded=stamp(r.time), unloaded_after=None)
            exact = replace(exact, unload_seen_by=CodeSeen.KSYMBOL)
            ch.put(CodeEvent.UPDATE, exact)
            return
        # Kernel code kreld never saw come (before it looked, and kallsyms did not list
        # it): it was there some time before this unregister.
        at = stamp(r.time)
        ghost = self._from_ksymbol(r, at)
        ghost = replace(
            ghost, loaded_after=BOOT_START, unloaded=at, unload_seen_by=CodeSeen.KSYMBOL
        )
        ch.put(CodeEvent.UNLOAD, ghost)

    def _from_ksymbol(self, r: Ksymbol, at: Timestamp) -> KernelCode:
        """New kernel code as its register record tells it, loaded *at*."""
        kind = kind_of(r.name)
        return KernelCode(
            boot_id=self.boot_id,
            seq=self._new_seq(),
            kind=kind,
            name=r.name,
            owner=owner_of(kind),
            addr=r.addr,
            length=r.length,
            loaded=at,
            seen_by=CodeSeen.KSYMBOL,
            source=CodeSource.PERF,
        )

    def _bpf_event(self, r: BpfEvent, ch: Changes) -> None:
        addrs = self._since_event.pop(r.cpu, [])
        if r.type != BpfEventType.PROG_LOAD:
            return
        for addr in addrs:
            code = self.live.get(addr)
            if code is None or code.kind is not CodeKind.BPF_PROGRAM or code.prog_id is not None:
                continue
            tag = r.tag if code.name.startswith(f"bpf_prog_{r.tag}") else None
            new = replace(code, prog_id=r.prog_id, tag=tag)
            self.live[addr] = new
            if code.seq in ch.written:  # loaded in this step: one record, one event
                ch.written[code.seq] = new
                ch.events = [(e, new if c.seq == new.seq else c) for e, c in ch.events]
            else:
                ch.put(CodeEvent.UPDATE, new)

    # -- a look at kallsyms -----------------------------------------------------

    def reconcile(
        self,
        lines: list[CodeLine],
        now: Timestamp,
        since: Timestamp,
        programs_listed: bool,
        funcs: Mapping[int, tuple[int, ProgramInfo]] | None = None,
    ) -> Changes:
        """Bring the live set in step with kallsyms read at *now*; *since*: the
        last time kreld knew the truth (the loss window's start, or the start
        of the boot), when anything opened or closed here happened.  *funcs*:
        the loaded programs' functions by address (:mod:`kreld.kernel.bpfinfo`),
        which give a program kallsyms lists its length, id and tag."""
        funcs = funcs or {}
        ch = Changes()
        self._closed_by_look.clear()
        self.written.clear()
        listed: dict[int, CodeLine] = {ln.addr: ln for ln in lines if ln.addr}
        for addr, old in list(self.live.items()):
            ln = listed.get(addr)
            if ln is not None and ln.name == old.name:
                told = _with_info(old, funcs[addr]) if old.length is None and addr in funcs else old
                if told is not old:
                    self.live[addr] = told
                    ch.put(CodeEvent.UPDATE, told)
                continue
            if ln is None and old.kind is CodeKind.BPF_PROGRAM and not programs_listed:
                continue
            if old.loaded.monotonic >= now.monotonic:
                continue  # came after the look
            after = since if since.monotonic > old.loaded.monotonic else old.loaded
            done = self._close(old, now, after, CodeSeen.KALLSYMS, ch)
            if len(self._closed_by_look) < _RECENT_CAP:
                self._closed_by_look[addr] = done.seq
                self.written[done.seq] = done
        for addr, ln in listed.items():
            if addr in self.live:
                continue
            kind = kind_of(ln.name)
            new = KernelCode(
                boot_id=self.boot_id,
                seq=self._new_seq(),
                kind=kind,
                name=ln.name,
                owner=ln.owner,
                addr=addr,
                length=consts.KERNEL_CODE_PAGE if kind in _ONE_PAGE else None,
                loaded=now,
                seen_by=CodeSeen.KALLSYMS,
                source=CodeSource.KALLSYMS,
                loaded_after=since,
            )
            if kind is CodeKind.BPF_PROGRAM and addr in funcs:
                new = _with_info(new, funcs[addr])
            self.live[addr] = new
            ch.put(CodeEvent.LOAD, new)
        self.need_look = False
        return ch


def _with_info(code: KernelCode, func: tuple[int, ProgramInfo]) -> KernelCode:
    """*code* with the length of its function and its program's id and tag, when
    its name bears that tag: the address may have been reused between the read of
    kallsyms and the walk of the programs (a tag is a digest of the code)."""
    length, prog = func
    if not code.name.startswith(f"bpf_prog_{prog.tag}"):
        return code
    return replace(code, length=length or code.length, prog_id=prog.prog_id, tag=prog.tag)


def _found_by_look_before(old: KernelCode, r: Ksymbol) -> bool:
    """Whether *r* registers what a look at kallsyms opened after it happened."""
    return (
        old.name == r.name and old.seen_by is CodeSeen.KALLSYMS and r.time <= old.loaded.monotonic
    )


def _closed_by_look_after(done: KernelCode, r: Ksymbol) -> bool:
    return done.unloaded is not None and r.time <= done.unloaded.monotonic
