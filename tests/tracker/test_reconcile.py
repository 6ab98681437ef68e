"""The reconciliation plan on its own: plain records in, plain records out.

No tree, no thread, no store: each test states what the tracker knows (what
is open, what closed lately), what one look at ``sys/module`` showed and read,
and which hints came, then checks what :func:`kreld.tracker.modules_plan.plan` decides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kreld.core import record
from kreld.core.model import Incarnation, ModuleState, SeenBy, Timestamp
from kreld.tracker.modules_plan import (
    GONE_FAULT,
    Changes,
    Hint,
    Tracked,
    new_incarnation,
    plan,
    to_read,
)

BASE = 0xFFFFFFFFC0400000
T0 = Timestamp(1_000, 2_000, 3_000)
PREV = Timestamp(5_000, 6_000, 7_000)
NOW = Timestamp(9_000, 10_000, 11_000)
UE, INO = SeenBy.UEVENT, SeenBy.INOTIFY


def state(name: str, inode: int, text: int = BASE, initstate: str = "live") -> ModuleState:
    return ModuleState(
        name=name,
        build_id="ab" * 20,
        sections={".text": text},
        coresize=4096,
        initsize=0,
        initstate=initstate,
        srcversion="S",
        taint="",
        core_base=text,
        restricted=False,
        inode=inode,
    )


def stored(st: ModuleState, seq: int, *, by: SeenBy = UE, gone: bool = False) -> Incarnation:
    inc = record.replace(new_incarnation(st, T0, by), boot_id="b", seq=seq)
    if gone:
        return record.replace(inc, unloaded=PREV, unloaded_after=T0, unload_seen_by=by)
    return inc


def look(
    open_: Mapping[str, Tracked],
    present: Mapping[str, int],
    reads: Mapping[str, ModuleState | None],
    hints: Sequence[Hint],
    recent: Mapping[str, Sequence[Tracked]] | None = None,
) -> Changes:
    """One look: the tracker reads exactly what to_read names (from *reads*)."""
    states = {n: reads.get(n) for n in to_read(open_, present, hints)}
    return plan(open_, present, states, hints, recent=recent or {}, now=NOW, previous=PREV)


def test_a_present_module_not_open_is_opened_by_the_source_whose_add_hint_came_first() -> None:
    a = state("a", inode=7)
    changes = look({}, {"a": 7}, {"a": a}, [Hint(INO, "add", "a"), Hint(UE, "add", "a")])
    (opened,) = changes.opened
    assert opened.inc.state == a and opened.inc.seq == -1
    assert opened.inc.seen_by is INO and opened.inc.loaded == NOW
    assert opened.inc.loaded_after == PREV  # absent at the look before: loaded in between
    assert opened.hinted == {INO, UE}  # both sources' hints stand for this one load
    assert not changes.transients and not changes.closed and changes.writes


def test_a_module_found_by_a_full_look_without_a_hint_is_seen_by_poll_and_unpaired() -> None:
    changes = look({}, {"a": 7}, {"a": state("a", 7)}, [])
    (opened,) = changes.opened
    assert opened.inc.seen_by is SeenBy.POLL and opened.hinted == frozenset()


def test_an_open_module_gone_from_the_directory_is_closed_between_the_two_looks() -> None:
    t = Tracked(stored(state("a", 7), seq=3), frozenset({UE}))
    changes = look({"a": t}, {}, {}, [Hint(INO, "remove", "a")])
    (closed,) = changes.closed
    assert closed.inc.seq == 3 and closed.hinted == {UE}
    assert closed.inc.unloaded == NOW and closed.inc.unloaded_after == PREV
    assert closed.inc.unload_seen_by is INO
    assert not changes.opened and not changes.transients


def test_an_unload_before_the_previous_look_is_bounded_by_the_load_itself() -> None:
    """A module loaded after the previous look cannot have been gone before it loaded."""
    late = record.replace(stored(state("a", 7), seq=0), loaded=Timestamp(8_000, 0, 0))
    (closed,) = look({"a": Tracked(late)}, {}, {}, []).closed
    assert closed.inc.unloaded_after == late.loaded


def test_an_open_module_that_vanishes_while_read_is_closed() -> None:
    t = Tracked(stored(state("a", 7, initstate="coming"), seq=0))
    changes = look({"a": t}, {"a": 7}, {"a": None}, [])
    assert [c.inc.seq for c in changes.closed] == [0] and not changes.opened


def test_a_reload_closes_the_old_incarnation_and_opens_the_new_one_paired_with_its_hint() -> None:
    old = Tracked(stored(state("a", 7), seq=0), frozenset({UE}))
    new = state("a", inode=8, text=BASE + 0x10000)
    hints = [Hint(UE, "remove", "a"), Hint(UE, "add", "a")]
    changes = look({"a": old}, {"a": 8}, {"a": new}, hints)
    assert [c.inc.seq for c in changes.closed] == [0]
    (opened,) = changes.opened
    assert opened.inc.state.sections[".text"] == BASE + 0x10000 and opened.hinted == {UE}
    assert opened.inc.loaded_after == PREV
    assert not changes.transients and not changes.paired


def test_a_module_that_came_and_went_between_two_looks_is_a_transient() -> None:
    hints = [Hint(UE, "add", "flap"), Hint(UE, "remove", "flap")]
    changes = look({}, {}, {}, hints)
    (gone,) = changes.transients
    assert gone.name == "flap" and gone.seen_by is UE
    assert gone.loaded == NOW and gone.unloaded == NOW and gone.unload_seen_by is UE
    assert gone.state.faults == (GONE_FAULT,) and gone.state.sections == {}
    assert changes.new == [gone]


def test_two_add_hints_of_one_source_with_nothing_to_pair_are_two_transients() -> None:
    """Without an incarnation to pair with, each add hint of a source is a
    load of its own: two loads came and went between the looks."""
    changes = look({}, {}, {}, [Hint(UE, "add", "x"), Hint(UE, "add", "x")])
    assert len(changes.transients) == 2


def test_add_hints_of_two_sources_for_one_vanished_load_pair_through_recent_memory() -> None:
    """The second source's hint pairs with the transient the first one made,
    once the tracker remembers it (recent, with the first source paired)."""
    first = look({}, {}, {}, [Hint(UE, "add", "x")])
    (gone,) = first.transients
    remembered = Tracked(record.replace(gone, boot_id="b", seq=9), frozenset({UE}))
    second = look({}, {}, {}, [Hint(INO, "add", "x")], recent={"x": [remembered]})
    assert second.paired == {9: {INO}} and not second.transients


def test_a_late_add_hint_pairs_with_the_open_incarnation_and_writes_nothing() -> None:
    """The directory showed the load before its event came: the event pairs
    with the open incarnation instead of inventing a load."""
    t = Tracked(stored(state("a", 7), seq=5, by=SeenBy.POLL))
    changes = look({"a": t}, {"a": 7}, {"a": state("a", 7)}, [Hint(UE, "add", "a")])
    assert changes.paired == {5: {UE}}
    assert not changes.writes and changes.new == []


def test_a_source_already_paired_with_the_open_load_makes_a_transient_on_its_next_add() -> None:
    """A second add from the same source means a second load: one that came
    and went before the look (the open one keeps its inode)."""
    t = Tracked(stored(state("a", 7), seq=5), frozenset({UE}))
    changes = look({"a": t}, {"a": 7}, {"a": state("a", 7)}, [Hint(UE, "add", "a")])
    assert not changes.paired
    (gone,) = changes.transients
    assert gone.name == "a" and gone.seen_by is UE


def test_an_add_hint_pairs_with_the_incarnation_this_look_closes() -> None:
    t = Tracked(stored(state("a", 7), seq=2, by=SeenBy.POLL))
    changes = look({"a": t}, {}, {}, [Hint(INO, "add", "a"), Hint(INO, "remove", "a")])
    assert changes.paired == {2: {INO}} and not changes.transients
    assert [c.inc.seq for c in changes.closed] == [2]


def test_an_add_hint_pairs_with_a_recently_closed_incarnation_oldest_first() -> None:
    older = Tracked(stored(state("a", 7), seq=1, gone=True), frozenset({UE}))
    newer = Tracked(stored(state("a", 8), seq=2, gone=True), frozenset())
    changes = look({}, {}, {}, [Hint(INO, "add", "a")], recent={"a": [older, newer]})
    assert changes.paired == {1: {INO}} and not changes.transients
    changes = look({}, {}, {}, [Hint(UE, "add", "a")], recent={"a": [older, newer]})
    assert changes.paired == {2: {UE}}  # UE was already paired with the older one


def test_a_source_pairs_once_per_incarnation_within_one_batch() -> None:
    t = Tracked(stored(state("a", 7), seq=4, by=SeenBy.POLL))
    hints = [Hint(UE, "add", "a"), Hint(UE, "remove", "a"), Hint(UE, "add", "a")]
    changes = look({"a": t}, {}, {}, hints)
    assert changes.paired == {4: {UE}}
    assert len(changes.transients) == 1  # the second add: a load that came and went


def test_only_changed_hinted_or_incomplete_modules_are_read_again() -> None:
    done = Tracked(stored(state("done", 1), seq=0))
    loading = Tracked(stored(state("loading", 2, initstate="coming"), seq=1))
    hinted = Tracked(stored(state("hinted", 3), seq=2))
    reloaded = Tracked(stored(state("reloaded", 4), seq=3))
    present = {"done": 1, "loading": 2, "hinted": 3, "reloaded": 40, "new": 5}
    open_ = {t.inc.name: t for t in (done, loading, hinted, reloaded)}
    names = to_read(open_, present, [Hint(UE, "change", "hinted")])
    assert names == ["hinted", "loading", "new", "reloaded"]


def test_a_read_again_refreshes_without_moving_any_address() -> None:
    coming = state("a", 7, initstate="coming")
    t = Tracked(stored(record.replace(coming, build_id=None), seq=0))
    later = record.replace(
        state("a", 7, text=BASE + 0x999), sections={".text": BASE + 0x999, ".data": BASE + 0x8000}
    )
    changes = look({"a": t}, {"a": 7}, {"a": later}, [])
    (inc,) = changes.updated
    assert inc.seq == 0 and inc.init_done == NOW and inc.state.initstate == "live"
    assert inc.state.sections == {".text": BASE, ".data": BASE + 0x8000}
    assert inc.state.build_id == "ab" * 20
    assert not changes.opened and not changes.closed


def test_init_is_over_when_the_read_that_showed_live_ended_not_when_the_look_began() -> None:
    """A look takes its time before it lists and reads the directory: a
    module's init may still run then (a sample in its init text 0.9 ms after
    the look's time was seen on a loaded guest).  ``init_done`` is when the
    reads ended, for a load read again, a load first seen, and a load timed
    by a tracepoint alike."""
    read = Timestamp(9_500, 10_500, 11_500)  # the reads ended after NOW
    coming = Tracked(stored(state("a", 7, initstate="coming"), seq=0))
    reads = {"a": state("a", 7), "b": state("b", 8), "c": state("c", 9)}
    hints = [Hint(TP, "add", "c", AT)]
    states = {n: reads.get(n) for n in to_read({"a": coming}, {"a": 7, "b": 8, "c": 9}, hints)}
    changes = plan({"a": coming}, {"a": 7, "b": 8, "c": 9}, states, hints, recent={}, now=NOW,
                   previous=PREV, read=read)  # fmt: skip
    (refreshed,) = changes.updated
    first, timed = sorted((t.inc for t in changes.opened), key=lambda i: i.name)
    assert refreshed.init_done == first.init_done == timed.init_done == read
    assert first.loaded == NOW and timed.loaded == AT  # the look's time, or the exact one


def test_a_look_that_finds_everything_as_it_was_changes_nothing() -> None:
    t = Tracked(stored(state("a", 7), seq=0), frozenset({UE}))
    changes = look({"a": t}, {"a": 7}, {"a": state("a", 7)}, [Hint(UE, "change", "a")])
    assert changes == Changes()


def test_a_look_with_no_look_before_it_bounds_no_load_from_below() -> None:
    """The start-up look is also the first: what it finds may have loaded at boot."""
    states = {"a": state("a", 7)}
    changes = plan({}, {"a": 7}, states, [], recent={}, now=NOW, previous=NOW)
    (opened,) = changes.opened
    assert opened.inc.loaded == NOW and opened.inc.loaded_after is None


# -- exact times from the module tracepoints ---------------------------------------

TP = SeenBy.TRACEPOINT
AT = Timestamp(6_000, 7_000, 8_000)  # between PREV and NOW
FREED = Timestamp(8_000, 9_000, 10_000)


def test_a_load_a_tracepoint_timed_is_loaded_at_that_instant_with_its_init_live() -> None:
    a = state("a", inode=7)  # read after its init ended: initstate live
    changes = look({}, {"a": 7}, {"a": a}, [Hint(TP, "add", "a", AT)])
    (opened,) = changes.opened
    assert opened.inc.seen_by is TP and opened.inc.loaded == AT and opened.inc.loaded_after == AT
    assert opened.inc.init_live  # before do_init_module(): its .init.* held its init code
    assert opened.inc.init_done == NOW  # seen live by this look, not at the load


def test_a_load_and_free_timed_in_one_batch_keep_both_times_and_the_sections_read_at_once() -> None:
    early = state("b", inode=9, initstate="coming")  # the source's read at the load
    hints = [Hint(TP, "add", "b", AT, early), Hint(TP, "remove", "b", FREED)]
    changes = look({}, {}, {}, hints)
    (gone,) = changes.transients
    assert (gone.loaded, gone.unloaded, gone.unloaded_after) == (AT, FREED, FREED)
    assert gone.state.sections == early.sections and GONE_FAULT not in gone.state.faults
    assert gone.seen_by is TP and gone.unload_seen_by is TP


def test_a_tracepoint_free_closes_an_open_incarnation_at_its_own_time() -> None:
    a = stored(state("a", 7), 3)
    changes = look({"a": Tracked(a)}, {}, {}, [Hint(TP, "remove", "a", FREED)])
    (closed,) = changes.closed
    assert (closed.inc.unloaded, closed.inc.unloaded_after) == (FREED, FREED)


def test_a_load_the_start_up_scan_found_takes_the_tracepoints_earlier_time() -> None:
    later = Timestamp(8_500, 9_500, 10_500)
    found = record.replace(new_incarnation(state("a", 7), later, SeenBy.STARTUP), seq=4)
    tracked = {"a": Tracked(found, frozenset({SeenBy.STARTUP}))}
    changes = look(tracked, {"a": 7}, {"a": state("a", 7)}, [Hint(TP, "add", "a", AT)])
    (updated,) = changes.updated
    assert updated.seq == 4 and updated.loaded == AT and updated.seen_by is TP
    assert not changes.opened and not changes.transients


def test_a_tracepoint_time_before_a_look_that_did_not_see_the_module_refines_nothing() -> None:
    inc = record.replace(new_incarnation(state("a", 7), NOW, UE, after=PREV), seq=4)
    early = Timestamp(4_000, 5_000, 6_000)  # before PREV, when "a" was not there
    changes = look(
        {"a": Tracked(inc, frozenset({UE}))}, {"a": 7}, {}, [Hint(TP, "add", "a", early)]
    )
    assert not changes.updated
