"""Assembly built with -g: code covered by the unit's line program but by no
DWARF function (a label, as a kernel's entry code is) is named as the
references name it: the ELF symbol, and the line program's file and line.

prog.c and asm_entry.S (gcc -g, so GNU as writes a ``DW_LANG_Mips_Assembler``
unit with a line program and a subprogram for the typed function only),
linked into an executable (against ``llvm-symbolizer --inlines``) and into a
relocatable object (``ld -r``, against ``eu-addr2line -i -f -j .text``);
every instruction of ``.text``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kreld.debuginfo import lines
from kreld.debuginfo.lines import LineTable
from kreld.debuginfo.lines_build import build_line_table
from kreld.debuginfo.lines_program import assembly_lines

from support.linerefs import NEEDS_REFERENCES, Frames, comparable, eu, instructions, llvm, ours

SRC = Path(__file__).parent / "lines_src"
ASM = str(SRC / "asm_entry.S")
# asm_entry's four instructions: lines 8, 9, 11 and 12 of asm_entry.S.
ENTRY_LINES = [8, 9, 11, 12]

pytestmark = NEEDS_REFERENCES


def _check(ours: list[Frames], refs: list[Frames], keys: list[int]) -> None:
    """Equal to the reference wherever it names a function, and asm_entry's
    instructions each with its line of asm_entry.S."""
    entry = []
    for key, got, ref in zip(keys, ours, refs, strict=True):
        if comparable(ref):
            assert got == ref, hex(key)
        if got and got[0][0] == "asm_entry":
            entry.append(got)
    assert entry == [[("asm_entry", ASM, n, False)] for n in ENTRY_LINES]


@pytest.mark.parametrize("dwarf", ["-gdwarf-4", "-gdwarf-5"])
def test_assembly_no_function_covers_gets_the_line_program_line_as_llvm_symbolizer_gives_it(
    tmp_path: Path, dwarf: str
) -> None:
    exe = tmp_path / "exe"
    subprocess.run(["gcc", "-g", dwarf, "-O2", "-o", str(exe), "prog.c", "asm_entry.S"],
                   cwd=SRC, check=True)  # fmt: skip
    # Kept and read back: the lines of the line program are part of the table.
    table = LineTable.from_bytes(build_line_table(exe).to_bytes())
    addresses = instructions(exe)[".text"]
    refs = llvm(exe, addresses)
    _check(ours(table, addresses), refs, addresses)


def test_assembly_in_a_relocatable_object_gets_its_lines_as_eu_addr2line_gives_them(
    tmp_path: Path,
) -> None:
    c_obj, s_obj, obj = tmp_path / "c.o", tmp_path / "s.o", tmp_path / "both.o"
    subprocess.run(["gcc", "-g", "-O2", "-c", "-o", str(c_obj), "prog.c"], cwd=SRC, check=True)
    subprocess.run(["gcc", "-g", "-c", "-o", str(s_obj), "asm_entry.S"], cwd=SRC, check=True)
    subprocess.run(["ld", "-r", "-o", str(obj), str(c_obj), str(s_obj)], check=True)
    table = build_line_table(obj)
    offsets = instructions(obj)[".text"]
    refs = eu(obj, ".text", offsets)
    addresses = [table.section_address(".text", o) for o in offsets]
    assert None not in addresses
    _check(ours(table, addresses), refs, offsets)  # type: ignore[arg-type]


def test_only_assembly_units_are_decoded_and_a_damaged_line_program_gives_no_line(
    tmp_path: Path,
) -> None:
    """C units are left to the SymCache; an assembly unit whose line program
    this reader cannot follow gives no lines rather than wrong ones."""
    exe = tmp_path / "exe"
    subprocess.run(["gcc", "-g", "-O2", "-o", str(exe), "prog.c", "asm_entry.S"], cwd=SRC,
                   check=True)  # fmt: skip
    data = bytearray(exe.read_bytes())
    got = assembly_lines(bytes(data), str(exe))
    assert set(got.paths) == {ASM} and len(got.starts) > 4
    # Every line program's version made one no reader knows: no lines at all.
    for at in _line_program_offsets(exe):
        data[at + 4 : at + 6] = (99).to_bytes(2, "little")
    damaged = assembly_lines(bytes(data), str(exe))
    assert len(damaged.starts) == 0


def _line_program_offsets(exe: Path) -> list[int]:
    """File offsets of each line program header in .debug_line."""
    out = subprocess.run(["readelf", "-SW", str(exe)], capture_output=True, text=True).stdout
    row = next(ln for ln in out.splitlines() if " .debug_line " in ln)
    fields = row.split("]", 1)[1].split()
    start, size = int(fields[3], 16), int(fields[4], 16)
    data = exe.read_bytes()[start : start + size]
    offsets, pos = [], 0
    while pos + 4 <= len(data):
        offsets.append(start + pos)
        pos += 4 + int.from_bytes(data[pos : pos + 4], "little")
    return offsets


def test_a_table_kept_before_the_assembly_lines_reads_back_without_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table written before the assembly's lines were kept (no ``lp_*``
    arrays in its header, nor the later ``ex_*``) reads back whole: the same
    frames, the assembly's without a line as they were."""
    exe = tmp_path / "exe"
    subprocess.run(["gcc", "-g", "-O2", "-o", str(exe), "prog.c", "asm_entry.S"], cwd=SRC,
                   check=True)  # fmt: skip
    table = build_line_table(exe)
    with monkeypatch.context() as m:
        m.setattr(lines, "_ARRAYS", tuple(k for k in lines._ARRAYS if k[:3] not in ("lp_", "ex_")))
        old = table.to_bytes()
    read = LineTable.from_bytes(old)
    assert len(read.lp_starts) == 0
    addresses = instructions(exe)[".text"]
    now, then = ours(table, addresses), ours(read, addresses)
    assert [t for t in then if not t or t[0][0] != "asm_entry"] == [
        n for n in now if not n or n[0][0] != "asm_entry"
    ]
    assert [t for t in then if t and t[0][0] == "asm_entry"] == [
        [("asm_entry", None, 0, False)]
    ] * len(ENTRY_LINES)
