"""Kernel code in answers about addresses: which BPF program,
trampoline, ftrace or kprobe page held an address at a time, as regions of
an address map, and for ``symbolize --for``.  Pure functions over the model.

What is answered:

* kernel code certainly there at the time (:meth:`KernelCode.certain_at`) is a
  region named after it, from its address over its length; where only
  kallsyms showed it (no length), up to the next record's start and at most a
  page;
* kernel code that may or may not have been there (its load or unload fell in a
  window) is an ``uncertain`` region that names nothing;
* at a time inside a loss window, every address of the kernel-code area
  (:data:`~kreld.core.consts.KERNEL_CODE_AREA`) that no other region holds is
  ``uncertain`` too: something loaded and gone there is unknowable.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from kreld.core import consts
from kreld.core.kernel_code import OWNER_BPF, OWNER_FTRACE, KernelCode, LossWindow
from kreld.core.model import Clock
from kreld.core.record import record
from kreld.kernel.kallsyms import is_code_line

__all__ = [
    "CodeHistory",
    "CodeIndex",
    "CodeSpan",
    "code_history",
    "code_spans",
    "in_loss",
    "kallsyms_lines",
]


class CodeHistory:
    """The kernel code of one boot and its loss windows, with the records that
    may have been there at a time found by bisection (:meth:`candidates`): a
    boot keeps up to 50,000 closed records, most of them gone long before
    the time asked."""

    __slots__ = ("_by_end", "codes", "losses")

    def __init__(self, codes: Sequence[KernelCode] = (), losses: Sequence[LossWindow] = ()) -> None:
        self.codes = tuple(codes)
        self.losses = tuple(losses)
        self._by_end: dict[Clock, tuple[list[int], list[KernelCode]]] = {}

    def candidates(self, clock: Clock, t: int | None) -> list[KernelCode]:
        """The records that may have been there at *t* (None: now), in seq order."""
        if t is None:
            return [c for c in self.codes if c.unloaded is None]
        index = self._by_end.get(clock)
        if index is None:
            ordered = sorted(self.codes, key=lambda c: _end(c, clock))
            index = self._by_end[clock] = ([_end(c, clock) for c in ordered], ordered)
        ends, ordered = index
        live = ordered[bisect.bisect_right(ends, t) :]
        return sorted((c for c in live if c.possible_at(clock, t)), key=lambda c: c.seq)

    def updated(self, codes: Sequence[KernelCode], losses: Sequence[LossWindow]) -> CodeHistory:
        """This history with *codes* put in (a later record of a seq wins) and
        the boot's loss windows now *losses*."""
        by_seq = {c.seq: c for c in self.codes}
        by_seq.update((c.seq, c) for c in codes)
        return CodeHistory([by_seq[k] for k in sorted(by_seq)], losses)


def _end(c: KernelCode, clock: Clock) -> int:
    return 1 << 64 if c.unloaded is None else c.unloaded.on(clock)


def code_history(store: Any, boot_id: str, known: CodeHistory | None = None) -> CodeHistory:
    """The kernel code of *boot_id* in *store*, the host's or a fleet bucket
    (none where it keeps none: a store written before kreld followed kernel
    code).  With *known*, an earlier read: only the records it held open and
    those written since are read again (a closed record changes no more, but
    for an unload a look at kallsyms bounded and its own record made exact:
    *known* keeps the bound, never wrong)."""
    tables = getattr(store, "kernel_code", None)
    if tables is None:
        return CodeHistory()
    if known is None:
        return CodeHistory(tables.codes(boot_id), tables.losses(boot_id))
    reread = {c.seq for c in known.codes if c.unloaded is None}
    since = max((c.seq for c in known.codes), default=-1) + 1
    return known.updated(tables.codes(boot_id, reread, since), tables.losses(boot_id))


def in_loss(losses: Sequence[LossWindow], clock: Clock, t: int | None) -> bool:
    return t is not None and any(w.covers(clock, t) for w in losses)


@record
class CodeSpan:
    """A range of kernel code at one time: named (*code* set, not uncertain),
    uncertain (*code* may be set: the record that may have been there), or a gap."""

    base: int
    limit: int
    code: KernelCode | None
    uncertain: bool


def code_spans(
    hist: CodeHistory, clock: Clock, t: int | None, taken: Sequence[tuple[int, int]]
) -> list[CodeSpan]:
    """The spans of kernel code at *t*; *taken*: the (base, limit) of the
    other regions (kernel, modules), sorted, which the gaps of a loss window avoid."""
    maybe = hist.candidates(clock, t)
    certain = sorted((c for c in maybe if c.certain_at(clock, t)), key=lambda c: c.addr)
    starts = [c.addr for c in certain]
    out: list[CodeSpan] = []
    for i, c in enumerate(certain):
        nxt = starts[i + 1] if i + 1 < len(starts) else 1 << 64
        limit = c.addr + c.length if c.length else min(nxt, c.addr + consts.KERNEL_CODE_PAGE)
        out.append(CodeSpan(c.addr, limit, c, False))
    named = [(s.base, s.limit) for s in out]
    for c in maybe:
        if c.certain_at(clock, t):
            continue
        span = (c.addr, c.addr + (c.length or consts.KERNEL_CODE_PAGE))
        if not _overlaps(named, starts, span):
            out.append(CodeSpan(span[0], span[1], c, True))
    if in_loss(hist.losses, clock, t):
        held = sorted([*taken, *((s.base, s.limit) for s in out)])
        out += [CodeSpan(lo, hi, None, True) for lo, hi in _gaps(held, *consts.KERNEL_CODE_AREA)]
    return out


def _overlaps(named: list[tuple[int, int]], starts: list[int], span: tuple[int, int]) -> bool:
    i = bisect.bisect_left(starts, span[1]) - 1
    return i >= 0 and named[i][1] > span[0]


def _gaps(held: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of [lo, hi) that no (sorted) range of *held* covers."""
    out = []
    cur = lo
    for base, limit in held:
        if limit <= cur:
            continue
        if base >= hi:
            break
        if base > cur:
            out.append((cur, base))
        cur = max(cur, limit)
        if cur >= hi:
            return out
    if cur < hi:
        out.append((cur, hi))
    return out


class CodeIndex:
    """The kernel code of one boot, asked about one address at a time
    (``symbolize --for``: each sample at its own time)."""

    def __init__(self, hist: CodeHistory) -> None:
        self.hist = hist
        self._starts = sorted({c.addr for c in hist.codes})
        self._holders: dict[int, list[KernelCode]] = {}

    def holders(self, address: int) -> list[KernelCode]:
        """The records whose range ever held *address* (unknown lengths: a page)."""
        found = self._holders.get(address)
        if found is None:
            found = [
                c
                for c in self.hist.codes
                if c.addr <= address < c.addr + (c.length or consts.KERNEL_CODE_PAGE)
                and (c.length or not self._starts_between(c.addr, address))
            ]
            if len(self._holders) < 1 << 16:
                self._holders[address] = found
        return found

    def _starts_between(self, lo: int, address: int) -> bool:
        i = bisect.bisect_right(self._starts, lo)
        return i < len(self._starts) and self._starts[i] <= address

    def at(self, address: int, clock: Clock, t: int | None) -> KernelCode | None:
        """The record certainly at *address* at *t* (None: not known, or uncertain).

        Without a time, or with a time on no clock kreld keeps (*t* None), a
        record is named only when it is the one record that ever held the
        address and nothing was lost in the boot."""
        holders = self.holders(address)
        if t is None:
            one = len(holders) == 1 and not self.hist.losses
            return holders[0] if one else None
        certain = [c for c in holders if c.certain_at(clock, t)]
        if len(certain) != 1:
            return None
        others = [c for c in holders if c is not certain[0] and c.possible_at(clock, t)]
        return certain[0] if not others else None


def kallsyms_lines(
    hist: CodeHistory, extras: Sequence[str], clock: Clock, t: int | None
) -> list[str]:
    """The kallsyms lines of kernel code at *t*, in the kernel's order
    (``[__builtin__ftrace]``, then ``[bpf]`` in load order, then the other
    ``[__builtin__*]``, kernel/kallsyms.c's update_iter_mod()), after the
    recorded *extras* of other owners.  A boot without records of its code (a
    store written before kreld followed kernel code) keeps its *extras* as they are."""
    if not hist.codes:
        return list(extras)
    kept = [x for x in extras if not is_code_line(x)]
    live = [c for c in hist.candidates(clock, t) if c.certain_at(clock, t)]
    rank = {OWNER_FTRACE: 0, OWNER_BPF: 1}
    live.sort(key=lambda c: (rank.get(c.owner, 2), c.owner, c.loaded.monotonic, c.seq))
    return kept + [f"{c.addr:016x} t {c.name}\t[{c.owner}]" for c in live]
