"""The line-table provider: a build's table from the store, else built from
its debug file found by build-id and kept, else the reason none can be had."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kreld.debuginfo.cache import DebugCache
from kreld.debuginfo.finder import DebuginfoFinder
from kreld.debuginfo.lines import LineTable
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
