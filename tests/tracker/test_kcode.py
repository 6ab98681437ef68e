"""Kernel code followed from side-band records (kreld/tracker/kernel_code_plan.py),
reconciled against kallsyms, and kept in the store with bounded retention
(kreld/store/kernel_code.py)."""

from __future__ import annotations

from pathlib import Path

from kreld.core.kernel_code import CodeEvent, CodeKind, CodeSeen, LossReason
from kreld.core.model import BOOT_START, Clock, Timestamp
from kreld.kernel.bpfinfo import ProgramInfo
from kreld.kernel.info import Root
from kreld.kernel.kallsyms import CodeLine, KallsymsText
from kreld.kernel.sideband import BpfEvent, Ksymbol, Lost, merge_by_time
from kreld.store import Store
from kreld.tracker.kernel_code import KernelCodeFollower
from kreld.tracker.kernel_code_plan import CodeState

BOOT = "0d3c5f0e-9a61-4a8e-8f4e-0c1a2b3c4d5e"
A = 0xFFFFFFFFC0010000
NAME = "bpf_prog_0123456789abcdef_vfs_read"


def stamp(t: int) -> Timestamp:
    return Timestamp(t, t + 1_000, t + 10**18)


def reg(t: int, cpu: int, addr: int = A, name: str = NAME, unregister: bool = False) -> Ksymbol:
    return Ksymbol(t, cpu, addr, 0x80, 1, unregister, name)


def test_a_load_on_one_cpu_and_its_unload_on_another_make_one_closed_record() -> None:
    st = CodeState(BOOT, 0, [])
    cpu0 = [reg(100, 0), BpfEvent(101, 0, 1, 42, "0123456789abcdef")]
    cpu1 = [reg(200, 1, unregister=True)]
    ch = st.apply(merge_by_time([cpu1, cpu0]), stamp, opened=50)
    (code,) = ch.written.values()
    assert code.kind is CodeKind.BPF_PROGRAM and code.owner == "bpf"
    assert (code.prog_id, code.tag, code.length) == (42, "0123456789abcdef", 0x80)
    assert code.loaded == stamp(100) and code.unloaded == stamp(200)
    assert code.unloaded_after is None and code.unload_seen_by is CodeSeen.KSYMBOL
    assert [e for e, _ in ch.events] == [CodeEvent.LOAD, CodeEvent.UNLOAD]
    assert not st.live and not ch.losses
    assert code.certain_at(Clock.MONOTONIC, 150) and not code.possible_at(Clock.MONOTONIC, 200)
    assert code.certain_at(Clock.BOOTTIME, 1_150)


def test_lost_records_make_a_window_from_the_cpus_last_record_and_ask_for_a_look() -> None:
    st = CodeState(BOOT, 0, [])
    st.apply([reg(100, 0)], stamp, opened=50)
    ch = st.apply([Lost(900, 0, 7), Lost(950, 1, 2)], stamp, opened=50)
    w0, w1 = ch.losses
    assert (w0.start, w0.end, w0.lost) == (stamp(100), stamp(900), 7)
    assert w0.reason is LossReason.LOST_RECORDS
    assert w1.start == stamp(50)  # CPU 1 gave nothing before: since the source opened
    assert st.need_look and st.lost == 9


def test_a_loss_told_by_the_count_and_again_by_a_lost_record_is_one_window() -> None:
    """The kernel tells each loss twice (the event's count, then a LOST record
    before the next record that fits): one window, from the last record drained
    before the count was read."""
    st = CodeState(BOOT, 0, [])
    ch = st.apply([reg(100, 0), reg(120, 0, A + 0x800, "bpf_prog_1111111111111111_b")], stamp, 50)
    st.lost_counted(0, 5, stamp(400), stamp, 50, ch)
    st.lost_counted(1, 0, stamp(400), stamp, 50, ch)
    (w,) = ch.losses
    assert (w.start, w.end, w.lost) == (stamp(120), stamp(400), 5) and st.need_look
    later = st.apply(
        [Lost(500, 0, 5), reg(510, 0, A + 0x1000, "bpf_prog_2222222222222222_c")], stamp, 50
    )
    st.lost_counted(0, 5, stamp(600), stamp, 50, later)
    assert not later.losses and st.lost == 5


def test_a_lost_record_before_the_count_is_read_is_not_counted_again() -> None:
    st = CodeState(BOOT, 0, [])
    ch = st.apply(
        [reg(100, 0), Lost(300, 0, 4), reg(310, 0, A + 0x800, "bpf_prog_1111111111111111_b")],
        stamp,
        50,
    )
    st.lost_counted(0, 6, stamp(400), stamp, 50, ch)  # 2 more since, no record after them yet
    first, tail = ch.losses
    assert (first.start, first.end, first.lost) == (stamp(100), stamp(300), 4)
    assert (tail.start, tail.end, tail.lost) == (stamp(310), stamp(400), 2)
    assert st.lost == 6


def test_reconciliation_after_a_loss_closes_the_gone_and_opens_the_new_inside_the_window() -> None:
    st = CodeState(BOOT, 0, [])
    st.apply([reg(100, 0)], stamp, opened=50)
    lines = [CodeLine(A + 0x1000, "t", "bpf_trampoline_6442", "bpf")]
    ch = st.reconcile(lines, stamp(1000), since=stamp(500), programs_listed=True)
    gone = next(c for c in ch.written.values() if c.name == NAME)
    new = next(c for c in ch.written.values() if c.name != NAME)
    assert gone.unloaded == stamp(1000) and gone.unloaded_after == stamp(500)
    assert gone.certain_at(Clock.MONOTONIC, 400) and not gone.certain_at(Clock.MONOTONIC, 700)
    assert gone.possible_at(Clock.MONOTONIC, 700) and not gone.possible_at(Clock.MONOTONIC, 1000)
    assert new.kind is CodeKind.BPF_TRAMPOLINE and new.length == 4096
    assert new.loaded_after == stamp(500) and new.seen_by is CodeSeen.KALLSYMS
    assert new.possible_at(Clock.MONOTONIC, 700) and not new.certain_at(Clock.MONOTONIC, 700)
    assert not st.need_look


def test_programs_absent_from_kallsyms_are_not_closed_when_kallsyms_lists_no_programs() -> None:
    """bpf_jit_kallsyms=0 (or harden): kallsyms lists no program, which proves nothing."""
    st = CodeState(BOOT, 0, [])
    st.apply([reg(100, 0)], stamp, opened=50)
    ch = st.reconcile([], stamp(1000), since=stamp(500), programs_listed=False)
    assert not ch and A in st.live


def test_a_program_only_kallsyms_lists_gets_its_length_id_and_tag_from_bpf() -> None:
    """At a look, bpf(2)'s program info (kreld/kernel/bpfinfo.py) gives what
    kallsyms does not; a program an earlier look opened without it gets it later;
    info whose tag the name does not bear is another program's and is not taken."""
    prog = ProgramInfo(42, "0123456789abcdef", ((A, 0x58),))
    st = CodeState(BOOT, 0, [])
    (found,) = st.reconcile(
        [CodeLine(A, "t", NAME, "bpf")], stamp(1000), BOOT_START, True
    ).written.values()
    assert (found.length, found.prog_id, found.tag) == (None, None, None)
    ch = st.reconcile(
        [CodeLine(A, "t", NAME, "bpf")], stamp(2000), stamp(1000), True, {A: (0x58, prog)}
    )
    (told,) = ch.written.values()
    assert told.seq == found.seq and (told.length, told.prog_id, told.tag) == (0x58, 42, prog.tag)
    assert [e for e, _ in ch.events] == [CodeEvent.UPDATE] and told.loaded == found.loaded
    other = CodeState(BOOT, 0, [])
    other_name = "bpf_prog_fedcba9876543210_x"
    line = CodeLine(A, "t", other_name, "bpf")
    (new,) = other.reconcile(
        [line], stamp(1000), BOOT_START, True, {A: (0x58, prog)}
    ).written.values()
    # Another program's tag: the address was reused between kallsyms and bpf(2).
    assert (new.length, new.prog_id, new.tag) == (None, None, None)


def test_a_load_found_first_by_kallsyms_is_made_exact_by_its_earlier_ksymbol() -> None:
    """At the start, the rings open before kallsyms is read: a register drained
    after the look refines the record the look opened, one record, one seq."""
    st = CodeState(BOOT, 0, [])
    look = st.reconcile([CodeLine(A, "t", NAME, "bpf")], stamp(1000), BOOT_START, True)
    (found,) = look.written.values()
    ch = st.apply([reg(900, 0)], stamp, opened=800)
    (exact,) = ch.written.values()
    assert exact.seq == found.seq and exact.loaded == stamp(900) and exact.length == 0x80
    assert exact.seen_by is CodeSeen.KSYMBOL and exact.loaded_after is None


def test_an_unregister_drained_after_a_look_that_closed_it_gives_the_exact_unload() -> None:
    st = CodeState(BOOT, 0, [])
    st.apply([reg(100, 0)], stamp, opened=50)
    st.reconcile([], stamp(1000), since=stamp(500), programs_listed=True)
    ch = st.apply([reg(600, 1, unregister=True)], stamp, opened=50)
    (exact,) = ch.written.values()
    assert exact.unloaded == stamp(600) and exact.unloaded_after is None


def test_a_reused_address_closes_the_old_piece_whose_unregister_was_lost() -> None:
    st = CodeState(BOOT, 0, [])
    st.apply([reg(100, 0)], stamp, opened=50)
    ch = st.apply([reg(300, 0, name="bpf_prog_fedcba9876543210_other")], stamp, opened=50)
    old = next(c for c in ch.written.values() if c.name == NAME)
    assert old.unloaded == stamp(300) and old.unloaded_after == stamp(100)
    assert st.live[A].name == "bpf_prog_fedcba9876543210_other"


def test_an_unregister_of_a_piece_never_seen_is_uncertain_before_it_never_certain() -> None:
    st = CodeState(BOOT, 0, [])
    (ghost,) = st.apply([reg(300, 0, unregister=True)], stamp, opened=50).written.values()
    assert not ghost.certain_at(Clock.MONOTONIC, 200) and ghost.possible_at(Clock.MONOTONIC, 200)


def test_kallsyms_code_lines_are_the_bpf_and_builtin_owners_only() -> None:
    text = (
        b"ffffffff81000000 T _text\n"
        b"ffffffffc0002000 t dummy_init\t[dummy]\n"
        b"ffffffffc0201000 t ftrace_trampoline\t[__builtin__ftrace]\n"
        b"ffffffffc0023918 t bpf_prog_59f4a931744dcdc6_kreldtest\t[bpf]\n"
        b"ffffffffc0300000 t kprobe_insn_page\t[__builtin__kprobes]\n"
    )
    ks = KallsymsText.of(text)
    lines = ks.code_lines()
    assert [(ln.name, ln.owner) for ln in lines] == [
        ("ftrace_trampoline", "__builtin__ftrace"),
        ("bpf_prog_59f4a931744dcdc6_kreldtest", "bpf"),
        ("kprobe_insn_page", "__builtin__kprobes"),
    ]
    assert not ks.tail_zeroed()
    zeroed = KallsymsText.of(b"".join(b"0" * 16 + ln[16:] for ln in text.splitlines(True)))
    assert zeroed.tail_zeroed() and zeroed.zeroed()


def test_the_store_keeps_records_losses_and_the_watch_time_and_reopens_the_live(
    tmp_path: Path,
) -> None:
    st = CodeState(BOOT, 0, [])
    ch = st.apply([reg(100, 0), reg(110, 0, A + 0x800, "bpf_prog_1111111111111111_b")], stamp, 50)
    ch2 = st.apply([reg(200, 1, unregister=True), Lost(300, 1, 3)], stamp, 50)
    with Store(tmp_path / "s") as store:
        kc = store.kernel_code
        kc.apply(BOOT, ch.written.values(), ch.losses, stamp(110))
        kc.apply(BOOT, ch2.written.values(), ch2.losses, stamp(300))
        assert [c.name for c in kc.codes(BOOT)] == [NAME, "bpf_prog_1111111111111111_b"]
        assert [c.addr for c in kc.open_codes(BOOT)] == [A + 0x800]
        assert kc.next_seq(BOOT) == 2 and kc.watch(BOOT) == stamp(300)
        assert [w.lost for w in kc.losses(BOOT)] == [3]
    with Store(tmp_path / "s", readonly=True) as store:
        assert len(store.kernel_code.codes(BOOT)) == 2


def test_retention_keeps_the_open_and_newest_closed_and_turns_the_rest_into_a_window(
    tmp_path: Path,
) -> None:
    """A program a second for ever: the store keeps a bounded number of records."""
    st = CodeState(BOOT, 0, [])
    with Store(tmp_path / "s") as store:
        kc = store.kernel_code
        keep_open = st.apply([reg(1, 0, A - 0x1000, "bpf_prog_aaaaaaaaaaaaaaaa_x")], stamp, 0)
        kc.apply(BOOT, keep_open.written.values(), [], None)
        for i in range(30):
            ch = st.apply([reg(10 + 10 * i, 0), reg(15 + 10 * i, 1, unregister=True)], stamp, 0)
            kc.apply(BOOT, ch.written.values(), [], None)
        for i in range(6):
            lost = st.apply([Lost(1000 + i, 0, 1)], stamp, 0)
            kc.apply(BOOT, [], lost.losses, None)
        assert kc.prune(BOOT, keep_closed=10, keep_losses=4) == 20
        codes = kc.codes(BOOT)
        assert len(codes) == 11 and codes[0].name == "bpf_prog_aaaaaaaaaaaaaaaa_x"
        assert min(c.loaded.monotonic for c in codes[1:]) == 210
        wins = kc.losses(BOOT)
        assert len(wins) == 4
        first = wins[0]
        assert first.reason is LossReason.RETENTION and first.covers(Clock.MONOTONIC, 195)
        assert kc.prune(BOOT, keep_closed=10, keep_losses=4) == 0
        assert kc.drop_boots(set()) > 0 and kc.codes(BOOT) == []


class _NullLog:
    def __getattr__(self, _name: str) -> object:
        return lambda *a, **k: None


def _follower(tmp_path: Path) -> KernelCodeFollower:
    """A follower on a fake root: no rings (it says why), looks at the given kallsyms."""
    root = tmp_path / "root"
    (root / "proc/sys/net/core").mkdir(parents=True, exist_ok=True)
    (root / "proc/sys/net/core/bpf_jit_kallsyms").write_text("1\n")
    (root / "proc/sys/net/core/bpf_jit_harden").write_text("0\n")
    return KernelCodeFollower(Root(root), _NullLog())  # type: ignore[arg-type]


def test_a_restart_records_the_time_kreld_was_down_as_a_window_and_closes_what_went(
    tmp_path: Path,
) -> None:
    live = b"ffffffff81000000 T _text\nffffffffc0010000 t " + NAME.encode() + b"\t[bpf]\n"
    with Store(tmp_path / "s") as store:
        first = _follower(tmp_path)
        assert first.status()["state"] == "unavailable" and first.status()["reason"]
        first.begin(store, BOOT, KallsymsText.of(live))
        (found,) = store.kernel_code.open_codes(BOOT)
        assert found.name == NAME and found.loaded_after == BOOT_START
        watch = store.kernel_code.watch(BOOT)
        assert watch is not None
        again = _follower(tmp_path)
        again.begin(store, BOOT, KallsymsText.of(b"ffffffff81000000 T _text\n"))
        (down,) = store.kernel_code.losses(BOOT)
        assert down.reason is LossReason.NOT_RUNNING and down.start == watch
        (gone,) = store.kernel_code.codes(BOOT)
        assert gone.unloaded == down.end and gone.unloaded_after == watch


def test_a_look_at_a_restricted_kallsyms_closes_nothing(tmp_path: Path) -> None:
    """kptr_restrict: every address reads 0; what kallsyms seems to lack is no unload."""
    live = b"ffffffff81000000 T _text\nffffffffc0010000 t " + NAME.encode() + b"\t[bpf]\n"
    zeroed = b"0000000000000000 T _text\n0000000000000000 t " + NAME.encode() + b"\t[bpf]\n"
    with Store(tmp_path / "s") as store:
        _follower(tmp_path).begin(store, BOOT, KallsymsText.of(live))
        tail = KallsymsText(zeroed[zeroed.index(b"\n") + 1 :], 0, 0)  # as read_tail keeps it
        f = _follower(tmp_path)
        f.begin(store, BOOT, KallsymsText.of(zeroed))  # the start-up look
        f.tables = store.kernel_code
        (tmp_path / "root/proc/kallsyms").write_bytes(tail.data)
        f.look(None)  # a later look reads the tail only
        (still,) = store.kernel_code.open_codes(BOOT)
        assert still.name == NAME


def test_a_look_whose_first_module_line_is_at_zero_still_closes_what_went(
    tmp_path: Path,
) -> None:
    """A module's absolute or per-cpu symbol printed at 0 is no restriction."""
    live = b"ffffffff81000000 T _text\nffffffffc0010000 t " + NAME.encode() + b"\t[bpf]\n"
    with Store(tmp_path / "s") as store:
        _follower(tmp_path).begin(store, BOOT, KallsymsText.of(live))
        f = _follower(tmp_path)
        f.begin(store, BOOT, KallsymsText.of(live))
        (tmp_path / "root/proc/kallsyms").write_bytes(
            b"0000000000000000 A __crc_x\t[somemod]\nffffffffc0200000 t f\t[somemod]\n"
        )
        f.look(None)
        assert store.kernel_code.open_codes(BOOT) == []
