"""The line-table provider: a build's table from the store, else built from
its debug file found by build-id and kept, else the reason none can be had."""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from kreld.debuginfo.cache import DebugCache
from kreld.debuginfo.finder import DebuginfoFinder
from kreld.debuginfo.lines import BUILDER, LineTable
from kreld.debuginfo.places import Kind, Wanted, search_roots
from kreld.store import Store
from kreld.symbols.linetables import LineTableProvider

from support.debuginfo_elves import build, build_id_of

SRC = Path(__file__).parent / "lines_src"
R = "6.1.0-57-cloud-amd64"

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def module_ko(out: Path) -> str:
    """prog.c as a module is: compiled, then ``ld -r`` with a build-id."""
    out.parent.mkdir(parents=True, exist_ok=True)
    obj = out.with_suffix(".o")
    subprocess.run(["gcc", "-c", "-g", "-O2", "-o", str(obj), "prog.c"], cwd=SRC, check=True)
    subprocess.run(["ld", "-r", "--build-id=sha1", "-o", str(out), str(obj)], check=True)
    obj.unlink()
    return build_id_of(out)


def finder(tmp_path: Path, *dirs: Path) -> DebuginfoFinder:
    system = tmp_path / "sysroot"
    (tmp_path / "state").mkdir(exist_ok=True, mode=0o700)
    return DebuginfoFinder(
        search_roots(system, (), [str(d) for d in dirs]),
        cache=DebugCache(tmp_path / "state" / "debuginfo", 1 << 30),
        system_root=system,
    )


def test_a_module_table_is_built_from_its_debug_file_kept_and_read_back_without_looking(
    tmp_path: Path,
) -> None:
    d = tmp_path / "debug"
    bid = module_ko(d / "lib" / "modules" / R / "kernel" / "drivers" / "prog.ko")
    want = Wanted(bid, Kind.MODULE, R, name="prog")
    with Store(tmp_path / "state") as store:
        provider = LineTableProvider(finder(tmp_path, d), store.line_tables, store.line_tables.put)
        table = provider.table(want)
        assert isinstance(table, LineTable)
        assert ".text" in table.sections
        assert provider.table(want) is table  # held in memory
        (info,) = provider.listing()
        assert info.build_id == bid and info.size > 0
        assert "prog.ko" in info.source and info.what == f"module prog of {R}"
        assert not provider.unkept
    shutil.rmtree(d)  # from now on only the store has it
    with Store(tmp_path / "state", readonly=True) as store:
        again = LineTableProvider(finder(tmp_path), store.line_tables).table(want)
        assert isinstance(again, LineTable) and again.to_bytes() == table.to_bytes()


def test_a_table_kept_by_an_older_builder_is_built_again_where_its_debug_file_is_found(
    tmp_path: Path,
) -> None:
    """A kept table whose header names no builder, or an older one, lacks
    what a newer builder adds: it is built again (and kept in its place)
    where the debug file can be had, and answered as it is where it cannot."""
    d = tmp_path / "debug"
    bid = module_ko(d / "lib" / "modules" / R / "kernel" / "drivers" / "prog.ko")
    want = Wanted(bid, Kind.MODULE, R, name="prog")
    with Store(tmp_path / "state") as store:
        kept = store.line_tables
        table = LineTableProvider(finder(tmp_path, d), kept, kept.put).table(want)
        assert isinstance(table, LineTable) and table.meta["builder"] == BUILDER
        older = LineTable.from_bytes(table.to_bytes())
        del older.meta["builder"]
        kept.put(bid, older.to_bytes(), "an older kreld")
        provider = LineTableProvider(finder(tmp_path, d), kept, kept.put)
        again = provider.table(want)
        assert isinstance(again, LineTable) and again.meta["builder"] == BUILDER
        assert bid in provider.built  # read from the debug file, not the store
        (info,) = provider.listing()
        assert "prog.ko" in info.source  # the new build took the old one's place
        kept.put(bid, older.to_bytes(), "an older kreld")
    shutil.rmtree(d)
    with Store(tmp_path / "state", readonly=True) as store:
        provider = LineTableProvider(finder(tmp_path), store.line_tables)
        last = provider.table(want)
        assert isinstance(last, LineTable) and "builder" not in last.meta
        assert last.to_bytes() == older.to_bytes()


def test_a_build_without_debuginfo_answers_why_and_is_not_looked_for_again_at_once(
    tmp_path: Path,
) -> None:
    d = tmp_path / "debug"
    d.mkdir()
    now = [0.0]
    provider = LineTableProvider(finder(tmp_path, d), retry_after=60, clock=lambda: now[0])
    want = Wanted("ab" * 20, Kind.IMAGE, R)
    why = provider.table(want)
    assert isinstance(why, str)
    assert f"build {'ab' * 20}" in why and f"looked in {d}" in why
    decoy = build(d / "boot" / f"vmlinux-{R}", 7)  # not looked at until retry_after
    assert provider.table(want) == why
    now[0] = 61.0
    later = provider.table(want)
    assert isinstance(later, str) and f"build-id {decoy}, refused" in later


def test_a_store_that_cannot_be_written_only_costs_the_keeping(tmp_path: Path) -> None:
    d = tmp_path / "debug"
    bid = module_ko(d / "lib" / "modules" / R / "kernel" / "prog.ko")
    with Store(tmp_path / "state"):
        pass
    with Store(tmp_path / "state", readonly=True) as store:
        provider = LineTableProvider(finder(tmp_path, d), store.line_tables, store.line_tables.put)
        table = provider.table(Wanted(bid, Kind.MODULE, R, name="prog"))
        assert isinstance(table, LineTable)
        assert bid in provider.unkept and bid in provider.built


def test_a_table_held_in_memory_is_answered_while_another_build_is_being_looked_for(
    tmp_path: Path,
) -> None:
    d = tmp_path / "debug"
    bid = module_ko(d / "lib" / "modules" / R / "kernel" / "prog.ko")
    inner = finder(tmp_path, d)
    entered, gate = threading.Event(), threading.Event()

    class Slow:
        """The finder, held at the door for the image's build (a slow download)."""

        def find(self, want: Wanted) -> object:
            if want.kind is Kind.IMAGE:
                entered.set()
                gate.wait(60)
            return inner.find(want)

    provider = LineTableProvider(Slow())  # type: ignore[arg-type]
    module = Wanted(bid, Kind.MODULE, R, name="prog")
    table = provider.table(module)
    assert isinstance(table, LineTable)
    answers: list[object] = []
    looking = threading.Thread(
        target=lambda: answers.append(provider.table(Wanted("ab" * 20, Kind.IMAGE, R)))
    )
    looking.start()
    try:
        assert entered.wait(60)
        assert provider.table(module) is table  # not queued behind the image's look-up
        assert provider.cached("ab" * 20) is None and answers == []
    finally:
        gate.set()
        looking.join(60)
    (why,) = answers
    assert isinstance(why, str) and "ab" * 20 in why
    assert provider.cached("ab" * 20) == why


def test_the_listing_reads_every_manifest_and_steps_over_the_tables_chunks(
    tmp_path: Path,
) -> None:
    """Tables of several chunks each, their build-ids sorting next to each
    other: each is listed once, with its own manifest, whatever its size."""
    from kreld.store.linetabs import CHUNK

    sizes = {"aa" * 20: 3 * CHUNK + 5, "aa" * 19 + "ab": 1, "ab" + "00" * 19: 2 * CHUNK}
    with Store(tmp_path / "state") as store:
        for bid, size in sizes.items():
            store.line_tables.put(bid, bytes([len(bid) % 251]) * size, f"from {bid}", "a build")
        listed = store.line_tables.listing()
        assert sorted(listed) == sorted(sizes)
        assert {bid: m["source"] for bid, m in listed.items()} == {b: f"from {b}" for b in sizes}
        assert {bid: store.line_tables.get(bid).data for bid in sizes} == {  # type: ignore[union-attr]
            bid: bytes([len(bid) % 251]) * size for bid, size in sizes.items()
        }
