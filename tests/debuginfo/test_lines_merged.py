"""C code no DWARF function gives an address: gcc's merged functions.

merged.c (gcc -O2 -g): noop_b and noop_c are copies of noop_a (``-fipa-icf``
merges them, each keeping an address of its own), and their subprograms in
the DWARF have no address, so the SymCache names them without a line while
the references give the unit's line program's row.  ``stub`` is assembly in
the C unit, which no row of its program covers: no line, as the references
say.  Every instruction of ``.text`` against ``llvm-symbolizer --inlines``
(an executable) and ``eu-addr2line -i -f -j .text`` (a relocatable object).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kreld.debuginfo.lines import LineTable
from kreld.debuginfo.lines_build import build_line_table

from support.linerefs import NEEDS_REFERENCES, Frames, comparable, eu, instructions, llvm, ours

SRC = Path(__file__).parent / "lines_src"
MERGED = str(SRC / "merged.c")
# Each merged copy's line: its declaration's, as the line program says.
COPIES = {"noop_b": 13, "noop_c": 14}

pytestmark = NEEDS_REFERENCES


def _check(ours: list[Frames], refs: list[Frames], keys: list[int]) -> None:
    """Equal to the reference wherever it names a function with a line; the
    copies each with their line, and ``stub`` without one, as there."""
    copies: dict[str, set[int]] = {}
    stub = []
    for key, got, ref in zip(keys, ours, refs, strict=True):
        if comparable(ref):
            assert got == ref, hex(key)
        if got and got[0][0] in COPIES:
            assert got[0][1] == MERGED, (hex(key), got)
            copies.setdefault(got[0][0], set()).add(got[0][2])
        if got and got[0][0] == "stub":
            assert ref == [("stub", None, 0, False)], ref
            stub.append(got)
    assert copies == {name: {line} for name, line in COPIES.items()}
    assert stub and all(s == [("stub", None, 0, False)] for s in stub)


@pytest.mark.parametrize("dwarf", ["-gdwarf-4", "-gdwarf-5"])
def test_merged_functions_get_the_line_programs_line_as_llvm_symbolizer_gives_it(
    tmp_path: Path, dwarf: str
) -> None:
    exe = tmp_path / "exe"
    subprocess.run(["gcc", "-g", dwarf, "-O2", "-o", str(exe), "merged.c"], cwd=SRC, check=True)
    # Kept and read back: those lines are part of the table.
    table = LineTable.from_bytes(build_line_table(exe).to_bytes())
    addresses = instructions(exe)[".text"]
    _check(ours(table, addresses), llvm(exe, addresses), addresses)


def test_merged_functions_in_a_relocatable_object_get_their_lines_as_eu_addr2line_gives_them(
    tmp_path: Path,
) -> None:
    obj = tmp_path / "merged.o"
    subprocess.run(["gcc", "-g", "-O2", "-c", "-o", str(obj), "merged.c"], cwd=SRC, check=True)
    table = build_line_table(obj)
    offsets = instructions(obj)[".text"]
    addresses = [table.section_address(".text", o) for o in offsets]
    assert None not in addresses
    _check(ours(table, addresses), eu(obj, ".text", offsets), offsets)  # type: ignore[arg-type]


def test_without_aranges_no_line_is_given_there_rather_than_a_wrong_one(tmp_path: Path) -> None:
    """The unit of such code is found by ``.debug_aranges``: without it the
    copies keep their names, without a line, and nothing else changes."""
    exe, bare = tmp_path / "exe", tmp_path / "bare"
    subprocess.run(["gcc", "-g", "-O2", "-o", str(exe), "merged.c"], cwd=SRC, check=True)
    subprocess.run(["objcopy", "--remove-section=.debug_aranges", str(exe), str(bare)],
                   check=True)  # fmt: skip
    addresses = instructions(exe)[".text"]
    with_ = ours(build_line_table(exe), addresses)
    without = ours(build_line_table(bare), addresses)
    for got, was in zip(without, with_, strict=True):
        if was and was[0][0] in COPIES:
            assert got == [(was[0][0], None, 0, False)]
        else:
            assert got == was
