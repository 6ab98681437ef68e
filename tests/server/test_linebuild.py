"""The daemon's line-table builder, in process: builds happen on its own
supervised thread, a call waits for one only up to its bound, and a failed
builder is named by the supervisor and answered for, never waited on."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kreld.core.supervise import Supervisor
from kreld.debuginfo.cache import DebugCache
from kreld.debuginfo.finder import DebuginfoFinder
from kreld.debuginfo.lines import LineTable
from kreld.debuginfo.places import Kind, Wanted, search_roots
from kreld.server.linebuild import KEEP_AFTER_S, RETRY_AFTER_S, THREAD, LineBuilder
from kreld.store import Store
from kreld.symbols.absences import Absences
from kreld.symbols.linetables import LineTableProvider

from support.debuginfo_elves import build_id_of
from support.wait import wait_until

SRC = Path(__file__).parents[1] / "debuginfo" / "lines_src"
R = "6.1.0-lines"

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def _module(out: Path, optimize: str = "-O2") -> str:
    out.parent.mkdir(parents=True, exist_ok=True)
    obj = out.with_suffix(".o")
    subprocess.run(["gcc", "-c", "-g", optimize, "-o", str(obj), "prog.c"], cwd=SRC, check=True)
    subprocess.run(["ld", "-r", "--build-id=sha1", "-o", str(out), str(obj)], check=True)
    obj.unlink()
    return build_id_of(out)


def _builder(
    tmp_path: Path, store: Store, debug: Path, wait_s: float, clock: Any = time.monotonic
) -> LineBuilder:
    def make(absences: Absences) -> LineTableProvider:
        finder = DebuginfoFinder(
            search_roots(tmp_path / "sysroot", (), [str(debug)]),
            cache=DebugCache(tmp_path / "cache", 1 << 30),
            system_root=tmp_path / "sysroot",
        )
        return LineTableProvider(
            finder,
            store.line_tables,
            store.line_tables.put,
            memory=0,
            absences=absences,
            keep_later=True,
        )

    def listing() -> list[dict[str, object]]:
        return [{"build_id": b, **m} for b, m in store.line_tables.listing().items()]

    return LineBuilder(make, listing, wait_s=wait_s, clock=clock)


def test_a_call_past_its_wait_hears_being_built_and_the_next_gets_the_kept_table(
    tmp_path: Path,
) -> None:
    debug = tmp_path / "debug"
    bid = _module(debug / "lib/modules" / R / "kernel/prog.ko")
    want = Wanted(bid, Kind.MODULE, R, name="prog")
    sup = Supervisor()
    with Store(tmp_path / "state") as store:
        lines = _builder(tmp_path, store, debug, wait_s=0)
        lines.start(sup)
        try:
            first = lines.table(want)  # queued, not waited for
            assert isinstance(first, str) and "being built: ask again" in first
            table = wait_until(
                "the build", lambda: (t := lines.table(want)) and not isinstance(t, str) and t, 60
            )
            assert isinstance(table, LineTable) and ".text" in table.sections
            # Kept in the store once answered.
            st = wait_until("the table kept", lambda: (s := lines.status())["kept"] and s, 30)
            assert [t["build_id"] for t in st["kept"]] == [bid]
            assert st["building"] is None and st["queued"] == 0 and st["missing"] == {}
            assert sup.failures() == []
        finally:
            sup.stopping.set()
            lines.stop()


def test_a_build_without_debuginfo_is_answered_from_memory_until_its_retry(
    tmp_path: Path,
) -> None:
    debug = tmp_path / "debug"
    debug.mkdir()
    want = Wanted("ab" * 20, Kind.IMAGE, R)
    sup = Supervisor()
    now = [1000.0]
    with Store(tmp_path / "state") as store:
        lines = _builder(tmp_path, store, debug, wait_s=60, clock=lambda: now[0])
        lines.start(sup)
        try:
            why = lines.table(want)
            assert isinstance(why, str) and f"build {'ab' * 20}" in why and str(debug) in why
            assert lines.status()["missing"] == {"ab" * 20: why}
            # A debug file put there now is not looked for: the answer is remembered.
            decoy = _module(debug / "boot" / f"vmlinux-{R}")
            assert lines.table(want) == why
            # Past the retry, the builder asks its provider again, which looks
            # again: one memory of the absence, not one in each.
            now[0] += RETRY_AFTER_S + 1
            assert lines.status()["missing"] == {}
            later = lines.table(want)
            assert isinstance(later, str) and f"build-id {decoy}, refused" in later
            assert lines.status()["missing"] == {"ab" * 20: later}
        finally:
            sup.stopping.set()
            lines.stop()


def test_a_builder_that_raised_is_a_named_failure_and_calls_are_told_so(tmp_path: Path) -> None:
    debug = tmp_path / "debug"
    bid = _module(debug / "lib/modules" / R / "kernel/prog.ko")
    sup = Supervisor(faults=THREAD)
    sup.arm()
    with Store(tmp_path / "state") as store:
        lines = _builder(tmp_path, store, debug, wait_s=60)
        lines.start(sup)
        try:
            why = lines.table(Wanted(bid, Kind.MODULE, R, name="prog"))
            assert why == "the line-table builder is not running (see Status degraded)"
            (failed,) = sup.failures()
            assert failed.name == THREAD and "InjectedFault" in failed.reason
        finally:
            sup.stopping.set()
            lines.stop()


def test_a_table_built_is_kept_once_no_call_answers_lines_or_at_the_latest_keep_after(
    tmp_path: Path,
) -> None:
    """Completing and keeping a table reads DWARF in Python: the builder
    waits while a Resolve answers lines (it would take half of the call's
    interpreter time), and no longer than KEEP_AFTER_S."""
    debug = tmp_path / "debug"
    first = Wanted(_module(debug / "lib/modules" / R / "kernel/prog.ko"), Kind.MODULE, R, "prog")
    second = Wanted(_module(debug / "lib/modules" / R / "kernel/prog1.ko", "-O1"), Kind.MODULE,
                    R, "prog1")  # fmt: skip
    assert first.build_id != second.build_id
    now = [1000.0]
    sup = Supervisor()
    with Store(tmp_path / "state") as store:
        lines = _builder(tmp_path, store, debug, wait_s=60, clock=lambda: now[0])
        lines.start(sup)

        def kept() -> list[str]:
            return [t["build_id"] for t in lines.status()["kept"]]

        def looked_twice() -> None:
            # The builder waited twice since: it looked, and found nothing due.
            turns = lines.idle_turns
            wait_until("the builder to look", lambda: lines.idle_turns >= turns + 2, 30)

        try:
            with lines.answering():
                assert isinstance(lines.table(first), LineTable)
                looked_twice()
                assert kept() == []
            wait_until("the table kept once the call is done", lambda: kept() == [first.build_id])
            # A call answering past KEEP_AFTER_S does not hold the table back.
            with lines.answering():
                assert isinstance(lines.table(second), LineTable)
                looked_twice()
                assert second.build_id not in kept()
                now[0] += KEEP_AFTER_S + 1
                wait_until("kept at the latest", lambda: second.build_id in kept())
            assert sup.failures() == []
        finally:
            sup.stopping.set()
            lines.stop()


def test_a_completion_paused_for_calls_goes_on_once_one_of_them_asks_for_a_build(
    tmp_path: Path,
) -> None:
    """A table's completion waits while calls answer lines; a call that asks
    for another build answers lines (and waits for that build) meanwhile:
    the completion must not wait for it (KEEP_AFTER_S), but go on, so that
    the build follows at once."""
    debug = tmp_path / "debug"
    first = Wanted(_module(debug / "lib/modules" / R / "kernel/prog.ko"), Kind.MODULE, R, "prog")
    second = Wanted(_module(debug / "lib/modules" / R / "kernel/prog1.ko", "-O1"), Kind.MODULE,
                    R, "prog1")  # fmt: skip
    sup = Supervisor()
    with Store(tmp_path / "state") as store:
        lines = _builder(tmp_path, store, debug, wait_s=60)
        lines.start(sup)
        try:
            assert isinstance(lines.table(first), LineTable)
            wait_until("the first table kept", lambda: lines.status()["kept"])
            paused = threading.Event()
            went_on = threading.Event()

            def pausing() -> None:  # as the builder's completion does between its turns
                paused.set()
                lines._pause()
                went_on.set()

            with lines.answering():  # a call answering lines
                t = threading.Thread(target=pausing)
                lines._unkept_since = time.monotonic()  # a table built, due to be kept
                t.start()
                paused.wait(10)
                assert not went_on.wait(0.5)  # held while the call answers
                # The call asks for another build: the completion goes on.
                assert isinstance(lines.table(second), LineTable)
                assert went_on.wait(KEEP_AFTER_S / 2)
            t.join(10)
            assert sup.failures() == []
        finally:
            sup.stopping.set()
            lines.stop()
