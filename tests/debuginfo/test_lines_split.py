"""A large ``.debug_info`` read by two readers at once, half of its units
each (kreld.debuginfo.lines_build._halves, lines_child's part mapping,
kreld.debuginfo.symcache.merge).

The fixture is an executable of four units (gcc -O2 -g: merged.c,
merged_more.c, clones.c and an assembly unit), built with the split forced
(its threshold lowered to nothing) and without it: the two tables name every
``.text`` instruction alike, and as ``llvm-symbolizer --inlines`` does; the
cut is a unit's start as readelf lists them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from kreld.core.errors import LineTableError
from kreld.debuginfo import lines_build, lines_spawn
from kreld.debuginfo.lines_build import build_line_table
from kreld.debuginfo.symcache import SymCache, merge

from support.linerefs import NEEDS_REFERENCES, comparable, instructions, llvm, ours

SRC = Path(__file__).parent / "lines_src"

pytestmark = NEEDS_REFERENCES


@pytest.fixture(scope="module")
def exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("split") / "exe"
    subprocess.run(["gcc", "-g", "-O2", "-o", str(out), "merged.c", "merged_more.c", "clones.c",
                    "asm_add.S"], cwd=SRC, check=True)  # fmt: skip
    return out


def _units(exe: Path) -> tuple[int, int, list[int]]:
    """.debug_info's file offset and size, and its units' offsets, as readelf
    lists them."""
    sections = subprocess.run(["readelf", "-SW", str(exe)], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    m = re.search(r"\.debug_info\s+PROGBITS\s+\S+\s+(\S+)\s+(\S+)", sections)
    assert m is not None
    dump = subprocess.run(["readelf", "--debug-dump=info", str(exe)], capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    units = [int(u, 16) for u in re.findall(r"Compilation Unit @ offset (0x[0-9a-f]+|0):", dump)]
    return int(m.group(1), 16), int(m.group(2), 16), units


def test_two_readers_on_halves_of_the_units_name_every_instruction_as_one_does(
    exe: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lines_build, "SPLIT_OVER", 0)
    halves = lines_build._halves(exe)
    assert halves is not None
    _, ((first, cut), (second, rest)) = halves
    info, size, units = _units(exe)
    assert len(units) == 4 and first == info and second == info + cut and cut + rest == size
    assert cut in units[1:]  # a unit's start, not the first's
    split = build_line_table(exe)
    monkeypatch.setattr(lines_build, "SPLIT_OVER", 1 << 62)
    assert lines_build._halves(exe) is None
    one = build_line_table(exe)
    addresses = instructions(exe)[".text"]
    got = ours(split, addresses)
    assert got == ours(one, addresses)
    compared = 0
    for a, frames, ref in zip(addresses, got, llvm(exe, addresses), strict=True):
        if comparable(ref):
            assert frames == ref, hex(a)
            compared += 1
    assert compared > 100
    # Both readers' peaks are the build's (they ran at once).
    assert split.reader_peak_rss > one.reader_peak_rss


def test_each_reader_reads_only_its_half_and_the_halves_merge_to_the_whole(exe: Path) -> None:
    """The two readers' SymCaches: each names functions of its own units
    only; merged, their ranges are those of the one reader's."""
    halves = lines_build._halves(exe, 0)
    assert halves is not None
    raws, _, _ = lines_spawn.start_parts(str(exe), lines_spawn.DEFAULT_BOUND, None,
                                         *halves).meanwhile(lambda: None)  # fmt: skip
    a, b = (SymCache.parse(raw, str(exe)) for raw in raws)
    whole_raw, _ = lines_spawn.start(str(exe), str(exe)).finish()
    whole = SymCache.parse(whole_raw, str(exe))

    def dwarf_names(c: SymCache) -> set[bytes]:
        named = c.funcs[c.funcs[:, 3] != 0xFFFFFFFF, 0]  # a language: a function of the DWARF
        return {c.strings[o + 1 : o + 1 + c.strings[o]] for o in named.tolist()}

    assert dwarf_names(a) and dwarf_names(b)
    assert b"main" in dwarf_names(a) - dwarf_names(b)  # merged.c, in the first half
    assert b"use_clones" in dwarf_names(b) - dwarf_names(a)  # clones.c, in the second
    assert dwarf_names(a) | dwarf_names(b) == dwarf_names(whole)
    merged = merge(a, b)
    assert merged.starts.tolist() == whole.starts.tolist()
    again = SymCache.parse(merged.to_bytes(), "merged")
    assert again.starts.tolist() == merged.starts.tolist()
    assert again.locs.tolist() == merged.locs.tolist() and again.strings == merged.strings


def test_one_reader_where_the_section_is_small_compressed_or_one_core_is_ours(
    exe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert lines_build._halves(exe, 1 << 30) is None  # under the threshold
    assert lines_build._halves(exe, 0) is not None
    zexe = tmp_path / "zexe"
    subprocess.run(["objcopy", "--compress-debug-sections=zlib", str(exe), str(zexe)], check=True)
    assert lines_build._halves(zexe, 0) is None
    monkeypatch.setattr(lines_build.os, "sched_getaffinity", lambda _pid: {0})
    assert lines_build._halves(exe, 0) is None


def test_a_part_whose_section_header_lies_past_the_file_is_refused_by_name(exe: Path) -> None:
    size = exe.stat().st_size
    reading = lines_spawn.start(str(exe), str(exe), part=(size, 0, 16))
    with pytest.raises(LineTableError, match="no section header at"):
        reading.finish()


def test_a_file_whose_sections_cannot_be_read_is_left_to_one_reader(tmp_path: Path) -> None:
    """Section headers past the file's end: no split is tried; the one reader
    refuses the file with its own reason."""
    bad = tmp_path / "bad"
    head = bytearray(64)
    head[:6] = b"\x7fELF\x02\x01"
    head[0x28:0x30] = (1 << 40).to_bytes(8, "little")  # e_shoff far past the end
    head[0x3A:0x3E] = (64).to_bytes(2, "little") + (3).to_bytes(2, "little")
    bad.write_bytes(bytes(head) + b"\0" * 4096)
    assert lines_build._halves(bad, 0) is None
    with pytest.raises(LineTableError):
        build_line_table(bad)
