"""What one look at ``sys/module`` changes: a pure plan, no I/O, no clock.

The tracker lists the directory, reads the modules :func:`to_read` names, and
hands the result to :func:`plan`, which says what to open, refresh and close
and how the batch's hints pair with incarnations.  The tracker then commits
the :class:`Changes` and applies them to its memory.

The pairing rule: each source's add hint stands for one load.  A hint pairs
first with an incarnation this look opens, then with the open incarnation of
its name, then with one this look closes, then with one recently closed --
each only if that source's hint has not been paired with it already.  A hint
left over is a load that came and went between two looks: it is recorded as
a *transient*, an incarnation gone before it could be read.  So a module seen
by two sources is recorded once, and a load a source saw but no look found is
still recorded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kreld.core.model import HintAction, Incarnation, ModuleState, SeenBy, Timestamp
from kreld.core.record import field, record, replace

__all__ = [
    "GONE_FAULT",
    "Changes",
    "Hint",
    "Tracked",
    "complete",
    "gone_state",
    "new_incarnation",
    "plan",
    "refresh",
    "same_load",
    "to_read",
]

GONE_FAULT = "gone before it could be read"


@record
class Hint:
    """A source's word that a module may have changed: only a reason to look.

    *at*: when it happened, where the source knows it exactly (the module
    tracepoints); the incarnation it pairs with is then loaded (or unloaded)
    at that instant instead of at the look that found it."""

    source: SeenBy
    action: HintAction
    name: str | None
    at: Timestamp | None = None
    state: ModuleState | None = None  # read by the source at once (a load's sections)


@record
class Tracked:
    """An incarnation and the sources whose add hints have been paired with it."""

    inc: Incarnation
    hinted: frozenset[SeenBy] = frozenset()


@record
class Changes:
    """One look's outcome.

    ``transients`` (gone before they could be read) and ``opened`` are new
    incarnations, in that order, without a seq yet; ``updated`` are open ones
    read again; ``closed`` were open and are gone (with the hints paired
    before this look); ``paired`` maps the seq of an incarnation already
    stored to the sources whose hints this look paired with it.
    """

    opened: tuple[Tracked, ...] = ()
    transients: tuple[Incarnation, ...] = ()
    updated: tuple[Incarnation, ...] = ()
    closed: tuple[Tracked, ...] = ()
    paired: Mapping[int, frozenset[SeenBy]] = field(default_factory=dict)

    @property
    def writes(self) -> bool:
        """Whether the store has anything to record."""
        return bool(self.opened or self.transients or self.updated or self.closed)

    @property
    def new(self) -> list[Incarnation]:
        """What the store assigns seqs to, in this order: a load that came and
        went happened before the load of the same name still present."""
        return [*self.transients, *(t.inc for t in self.opened)]


def complete(state: ModuleState) -> bool:
    """Whether a read has all it will get: past ``coming`` and with sections
    (or with addresses the reader may not see)."""
    return state.initstate != "coming" and (bool(state.sections) or state.restricted)


def same_load(old: ModuleState, new: ModuleState) -> bool:
    """Whether two reads show the same load (no address or identity differs)."""
    if old.inode is not None and new.inode is not None and old.inode != new.inode:
        return False
    for name in (".text", ".data"):
        a, b = old.sections.get(name), new.sections.get(name)
        if a is not None and b is not None and a != b:
            return False
    if old.core_base and new.core_base and old.core_base != new.core_base:
        return False
    return old.build_id == new.build_id and old.srcversion == new.srcversion


def new_incarnation(
    state: ModuleState,
    when: Timestamp,
    by: SeenBy,
    gone: Timestamp | None = None,
    after: Timestamp | None = None,
    read: Timestamp | None = None,
) -> Incarnation:
    """A load first seen at *when*, not seen at *after* (the look before; None when
    unknown), and, for a transient, gone by *when* too.  Read ``live``, its init
    was over by *read* (when the read of *state* had ended; default *when*)."""
    return Incarnation(
        boot_id="",
        seq=-1,
        state=state,
        loaded=when,
        seen_by=by,
        init_live=state.initstate == "coming",
        init_done=(read or when) if state.initstate == "live" else None,
        unloaded=gone,
        unloaded_after=when if gone else None,
        unload_seen_by=by if gone else None,
        loaded_after=after,
    )


def refresh(inc: Incarnation, state: ModuleState, now: Timestamp) -> Incarnation:
    """What a later read adds to an open incarnation: never changes an address."""
    old = inc.state
    merged = replace(
        old,
        sections={**state.sections, **old.sections},
        build_id=old.build_id or state.build_id,
        coresize=old.coresize if old.coresize is not None else state.coresize,
        initsize=old.initsize if old.initsize is not None else state.initsize,
        initstate=state.initstate,
        srcversion=old.srcversion or state.srcversion,
        taint=state.taint,
        core_base=old.core_base or state.core_base,
        restricted=old.restricted or state.restricted,
        faults=state.faults,
    )
    init_done = inc.init_done
    if init_done is None and state.initstate == "live":
        init_done = now
    return replace(inc, state=merged, init_done=init_done)


def gone_state(name: str) -> ModuleState:
    """The state of a load no look found: only its name is known."""
    return ModuleState(
        name=name,
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
        faults=(GONE_FAULT,),
    )


def to_read(
    tracked: Mapping[str, Tracked], present: Mapping[str, int], hints: Iterable[Hint]
) -> list[str]:
    """The modules a look must read: new ones, reloaded ones (another inode),
    ones a hint names, and open ones still incomplete."""
    recheck = {h.name for h in hints if h.name}
    out = []
    for name in sorted(present):
        t = tracked.get(name)
        if (
            t is None
            or present[name] != t.inc.state.inode
            or name in recheck
            or not complete(t.inc.state)
        ):
            out.append(name)
    return out


@record
class _Diff:
    opened: tuple[Incarnation, ...]
    updated: tuple[Incarnation, ...]
    closed: tuple[Tracked, ...]


def _diff(
    tracked: Mapping[str, Tracked],
    present: Mapping[str, int],
    states: Mapping[str, ModuleState | None],
    hints: Sequence[Hint],
    now: Timestamp,
    previous: Timestamp,
    read: Timestamp,
) -> _Diff:
    """Compare the directory with what is open: close what went (or was
    reloaded), refresh what was read again, open what is new."""
    source = hints[0].source if hints else SeenBy.POLL
    said: dict[tuple[str | None, HintAction], SeenBy] = {}  # the first source to say so
    exact: dict[tuple[str | None, HintAction], Hint] = {}  # the last one with a time
    for h in hints:
        said.setdefault((h.name, h.action), h.source)
        if h.at is not None and h.at.monotonic <= now.monotonic:
            exact[(h.name, h.action)] = h
    opened: list[Incarnation] = []
    updated: list[Incarnation] = []
    closed: list[Tracked] = []
    for name, t in tracked.items():
        state = states.get(name) if name in present else None
        if state is None or present[name] != t.inc.state.inode:
            if name in present and name not in states:  # not read: unchanged
                continue
            by = said.get((name, HintAction.REMOVE), source)
            after = previous if previous.monotonic > t.inc.loaded.monotonic else t.inc.loaded
            done = replace(t.inc, unloaded=now, unloaded_after=after, unload_seen_by=by)
            gone = exact.get((name, HintAction.REMOVE))
            if gone is not None and gone.at is not None and _within(gone.at, t.inc.loaded, now):
                done = replace(
                    done, unloaded=gone.at, unloaded_after=gone.at, unload_seen_by=gone.source
                )
            closed.append(Tracked(done, t.hinted))
            continue
        new = refresh(t.inc, state, read)
        if new != t.inc:
            updated.append(new)
    closing = {t.inc.name for t in closed}
    absent_at = previous if previous.monotonic < now.monotonic else None
    for name in sorted(present):
        state = states.get(name)
        if state is not None and (name not in tracked or name in closing):
            by = said.get((name, HintAction.ADD), source)
            came = exact.get((name, HintAction.ADD))
            if came is not None and came.at is not None:  # known to the instant
                opened.append(_exact(new_incarnation(state, came.at, came.source), came.at, read))
            else:
                opened.append(new_incarnation(state, now, by, after=absent_at, read=read))
    return _Diff(tuple(opened), tuple(updated), tuple(closed))


def _within(t: Timestamp, lo: Timestamp, hi: Timestamp) -> bool:
    return lo.monotonic <= t.monotonic <= hi.monotonic


def _exact(inc: Incarnation, at: Timestamp, seen: Timestamp) -> Incarnation:
    """*inc*, first seen at *seen*, loaded at *at* exactly: absent just before
    (``loaded_after``), its init not yet run then (the tracepoint fires before
    do_init_module()), and done by *seen* if the read showed it ``live``."""
    done = inc.init_done
    if done is not None and done.monotonic < seen.monotonic:
        done = seen
    return replace(inc, loaded=at, loaded_after=at, init_live=True, init_done=done)


def _refined(inc: Incarnation, at: Timestamp, by: SeenBy) -> Incarnation | None:
    """*inc*, first seen by a look, with the exact load time a source gave later
    (a load while kreld started: the start-up scan found it before the
    tracepoint's record was read); None when *at* tells nothing new."""
    if at.monotonic >= inc.loaded.monotonic:
        return None
    if inc.loaded_after is not None and at.monotonic < inc.loaded_after.monotonic:
        return None  # before a look that did not see it: another load's record
    return replace(inc, loaded=at, loaded_after=at, seen_by=by, init_live=True)


def _gone_at(hints: Sequence[Hint], name: str, after: Timestamp) -> Hint | None:
    """The first exact remove of *name* at or after *after* in the batch."""
    for h in hints:
        if (
            h.action == HintAction.REMOVE
            and h.name == name
            and h.at is not None
            and h.at.monotonic >= after.monotonic
        ):
            return h
    return None


def _transient(h: Hint, hints: Sequence[Hint], now: Timestamp) -> Incarnation:
    """A load no look found: gone by *now*, or at the exact remove that followed it."""
    if h.at is None or h.name is None or h.at.monotonic > now.monotonic:
        return new_incarnation(gone_state(h.name or ""), now, h.source, gone=now)
    read = h.state if h.state is not None and h.state.name == h.name else gone_state(h.name)
    inc = _exact(new_incarnation(read, h.at, h.source, gone=now), h.at, now)
    gone = _gone_at(hints, h.name, h.at)
    if gone is not None and gone.at is not None:
        inc = replace(inc, unloaded=gone.at, unloaded_after=gone.at, unload_seen_by=gone.source)
    return inc


def _with_refined(
    updated: Sequence[Incarnation], refined: Mapping[int, Incarnation]
) -> tuple[Incarnation, ...]:
    """The look's refreshed incarnations, with the exact load times a batch gave."""
    out = []
    for inc in updated:
        r = refined.get(inc.seq)
        out.append(
            inc
            if r is None
            else replace(inc, loaded=r.loaded, loaded_after=r.loaded_after, seen_by=r.seen_by)
        )
    have = {inc.seq for inc in updated}
    out += [r for seq, r in refined.items() if seq not in have]
    return tuple(out)


def plan(
    tracked: Mapping[str, Tracked],
    present: Mapping[str, int],
    states: Mapping[str, ModuleState | None],
    hints: Sequence[Hint],
    *,
    recent: Mapping[str, Sequence[Tracked]],
    now: Timestamp,
    previous: Timestamp,
    read: Timestamp | None = None,
) -> Changes:
    """What one look changes.

    *tracked* is what is open now, *present* the directory listing (name ->
    inode), *states* the reads of the names :func:`to_read` gave (None: gone
    when read), *recent* what closed lately per name (oldest first), *now* the
    time of the look (before its reads), *previous* that of the look before,
    *read* when its reads had ended (a module read ``live``: init over by then).
    """
    diff = _diff(tracked, present, states, hints, now, previous, read or now)
    closing = {t.inc.name for t in diff.closed}
    opened_hinted: list[set[SeenBy]] = [set() for _ in diff.opened]
    new_index = {inc.name: i for i, inc in enumerate(diff.opened)}
    paired: dict[int, set[SeenBy]] = {}
    transients: list[Incarnation] = []
    refined: dict[int, Incarnation] = {}

    def free(t: Tracked, source: SeenBy) -> bool:
        return source not in t.hinted and source not in paired.get(t.inc.seq, ())

    for h in hints:
        if h.action != HintAction.ADD or h.name is None:
            continue
        i = new_index.get(h.name)
        if i is not None and h.source not in opened_hinted[i]:
            opened_hinted[i].add(h.source)
            continue
        candidates: list[Tracked] = []
        if h.name in tracked and h.name not in closing:
            candidates.append(tracked[h.name])
        candidates += [t for t in diff.closed if t.inc.name == h.name]
        candidates += recent.get(h.name, ())
        match = next((c for c in candidates if free(c, h.source)), None)
        if match is not None:
            paired.setdefault(match.inc.seq, set()).add(h.source)
            if h.at is not None and h.name in tracked and match is tracked[h.name]:
                base = refined.get(match.inc.seq, match.inc)
                better = _refined(base, h.at, h.source)
                if better is not None:
                    refined[match.inc.seq] = better
        else:
            transients.append(_transient(h, hints, now))
    hinted = zip(diff.opened, opened_hinted, strict=True)
    return Changes(
        opened=tuple(Tracked(inc, frozenset(s)) for inc, s in hinted),
        transients=tuple(transients),
        updated=_with_refined(diff.updated, refined),
        closed=tuple(diff.closed),
        paired={seq: frozenset(s) for seq, s in paired.items()},
    )
