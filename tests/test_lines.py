"""Line tables against the references, on files gcc builds here.

Every instruction of a small program (functions inlined two deep, code in
``.text.unlikely`` and ``.init.text``, a header reached through ``sub/../``),
built with ``-g -O2`` in DWARF 4 and 5, plain and with compressed debug
sections, is named by kreld's line table exactly as ``llvm-symbolizer
--inlines`` names it in the executable, and as ``eu-addr2line -i -f -j
SECTION`` names it in the relocatable object, whose sections kreld places at
bases of its own: every frame's function, file (normalized both sides) and
line, innermost first, and which frames are inlined.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kreld.core.errors import LineTableError
from kreld.debuginfo.lines import LineTable, build_line_table, normalize_path
from kreld.debuginfo.lines_reloc import place_sections

SRC = Path(__file__).parent / "lines_src"
VARIANTS = {
    "dwarf4": ["-gdwarf-4"],
    "dwarf5": ["-gdwarf-5"],
    "dwarf5-gz": ["-gdwarf-5", "-gz"],
    "dwarf4-gz": ["-gdwarf-4", "-gz"],
}

pytestmark = [
    pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed"),
    pytest.mark.skipif(
        shutil.which("llvm-symbolizer") is None or shutil.which("eu-addr2line") is None,
        reason="llvm-symbolizer or eu-addr2line missing (scripts/setup installs llvm, elfutils)",
    ),
]

Frames = list[tuple[str, str | None, int, bool]]


def _norm(path: str) -> str | None:
    return normalize_path("", "", path) if path and path != "??" else None


def _gcc(tmp: Path, variant: str, relocatable: bool) -> Path:
    out = tmp / (f"prog-{variant}" + (".o" if relocatable else ""))
    cmd = ["gcc", "-g", "-O2", *VARIANTS[variant], "-o", str(out), "prog.c"]
    if relocatable:
        cmd.insert(1, "-c")
    subprocess.run(cmd, cwd=SRC, check=True)
    return out


def _instructions(obj: Path) -> dict[str, list[int]]:
    """Each code section's instruction addresses, as objdump -d lists them."""
    text = subprocess.run(["objdump", "-d", str(obj)], capture_output=True, text=True, check=True)
    out: dict[str, list[int]] = {}
    section = ""
    for line in text.stdout.splitlines():
        m = re.match(r"Disassembly of section (\S+):", line)
        if m:
            section = m.group(1)
            continue
        m = re.match(r"\s+([0-9a-f]+):\t", line)
        if m:
            out.setdefault(section, []).append(int(m.group(1), 16))
    return out


def _llvm(exe: Path, addresses: list[int]) -> list[Frames]:
    text = subprocess.run(
        ["llvm-symbolizer", "--inlines", "--output-style=JSON", "-e", str(exe)],
        input="\n".join(hex(a) for a in addresses),
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    out = []
    for entry in (json.loads(line) for line in text.splitlines() if line.strip()):
        syms = entry["Symbol"]
        # Where the DWARF has no line (code of crt files, assembly), llvm-symbolizer
        # takes a file name from the symbol table; kreld names the function alone.
        out.append([(s["FunctionName"], _norm(s["FileName"]) if s["Line"] else None, s["Line"],
                     k + 1 < len(syms)) for k, s in enumerate(syms)])  # fmt: skip
    return out


def _eu(obj: Path, section: str, offsets: list[int]) -> list[Frames]:
    text = subprocess.run(
        ["eu-addr2line", "-a", "-i", "-f", "-j", section, "-e", str(obj), *map(hex, offsets)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    out: list[Frames] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("0x"):
            out.append([])
            i += 1
            continue
        func = lines[i].split(" inlined at ")[0]
        m = re.fullmatch(r"(.*?):(\d+)(?::\d+)?", lines[i + 1])  # file:line[:column]
        file, line = (m.group(1), m.group(2)) if m else ("??", "0")
        out[-1].append((func, _norm(file), int(line), True))
        i += 2
    return [[(f, p, n, k + 1 < len(fr)) for k, (f, p, n, _) in enumerate(fr)] for fr in out]


def _ours(table: LineTable, address: int) -> Frames:
    return [(f.function, f.file, f.line, f.inlined) for f in table.frames(address)]


def _named(ref: Frames) -> bool:
    return bool(ref) and ref[0][0] not in ("", "??")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_instruction_of_an_executable_is_named_as_llvm_symbolizer_names_it(
    tmp_path: Path, variant: str
) -> None:
    exe = _gcc(tmp_path, variant, relocatable=False)
    table = LineTable.from_bytes(build_line_table(exe).to_bytes())
    addresses = sorted(a for sec in _instructions(exe).values() for a in sec)
    refs = _llvm(exe, addresses)
    assert len(refs) == len(addresses)
    compared = 0
    inlined = 0
    for address, ref in zip(addresses, refs, strict=True):
        if not _named(ref):
            continue
        assert _ours(table, address) == ref, hex(address)
        compared += 1
        inlined += len(ref) > 1
    assert compared > 100 and inlined > 20  # the fixture has inlined code to check
    files = {f.file for a in addresses for f in table.frames(a)}
    assert str(SRC / "helpers.h") in files  # "./sub/../helpers.h" normalized


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_instruction_of_a_relocatable_object_is_named_by_section_as_eu_addr2line_does(
    tmp_path: Path, variant: str
) -> None:
    obj = _gcc(tmp_path, variant, relocatable=True)
    table = LineTable.from_bytes(build_line_table(obj).to_bytes())
    sections = _instructions(obj)
    assert {".text", ".text.unlikely", ".init.text"} <= set(sections)
    inlined = 0
    for section, offsets in sections.items():
        refs = _eu(obj, section, offsets)
        assert len(refs) == len(offsets)
        for offset, ref in zip(offsets, refs, strict=True):
            address = table.section_address(section, offset)
            assert address is not None
            if _named(ref):
                assert _ours(table, address) == ref, (section, hex(offset))
                inlined += len(ref) > 1
    assert inlined > 20


def test_each_section_of_a_relocatable_object_gets_a_base_no_other_section_overlaps(
    tmp_path: Path,
) -> None:
    obj = _gcc(tmp_path, "dwarf5", relocatable=True)
    placed = place_sections(obj.read_bytes(), str(obj))
    spans = sorted((s.base, s.base + s.size) for s in placed.sections)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(spans))
    assert spans[0][0] > 0


def test_an_offset_past_its_section_or_an_unknown_section_finds_no_address(tmp_path: Path) -> None:
    table = build_line_table(_gcc(tmp_path, "dwarf5", relocatable=True))
    size = table.sections[".init.text"].size
    assert table.section_address(".init.text", size - 1) is not None
    assert table.section_address(".init.text", size) is None
    assert table.section_address(".no.such", 0) is None


def test_addresses_outside_every_function_get_no_frames_not_a_wrong_line(tmp_path: Path) -> None:
    table = build_line_table(_gcc(tmp_path, "dwarf5", relocatable=False))
    far = np.array([0, table.base + (1 << 33), (1 << 64) - 1], dtype=np.uint64)
    assert (table.locations(far) == 0xFFFFFFFF).all()
    assert table.frames(1 << 40) == []


def test_a_damaged_table_is_refused_with_a_named_error(tmp_path: Path) -> None:
    good = build_line_table(_gcc(tmp_path, "dwarf5", relocatable=False)).to_bytes()
    for bad in (good[:10], b"X" + good[1:], good[: len(good) // 2]):
        with pytest.raises(LineTableError):
            LineTable.from_bytes(bad)


def test_a_file_that_is_not_elf_is_refused_with_a_named_error(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.write_bytes(b"not an elf file at all" * 10)
    with pytest.raises(LineTableError, match="not a 64-bit"):
        build_line_table(junk)
    with pytest.raises(LineTableError, match="not an ELF"):
        place_sections(b"junk", "junk")


def test_normalized_names_drop_dot_and_dotdot_but_keep_a_relative_build_prefix() -> None:
    assert normalize_path("", "debian/build/x/./include", "../lib/a.c") == "debian/build/x/lib/a.c"
    assert normalize_path("/src", "./sub/../", "helpers.h") == "/src/helpers.h"
    assert normalize_path("/src", "/usr/include", "stdlib.h") == "/usr/include/stdlib.h"
