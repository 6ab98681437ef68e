"""kreld's own reading of the DIEs' scopes (kreld.debuginfo.lines_scopes):
the deepest inlined call at an address, as llvm-symbolizer names it.

prog.c (gcc -O2 -g, DWARF 4 and 5: ``.debug_ranges`` and ``.debug_rnglists``,
inlined chains two deep, code in three sections): at every ``.text``
instruction where llvm-symbolizer gives an inlined frame, its innermost
function; where it gives none, no name.  The real kernel's ``.cold`` parts,
where the table needs it, are in test_lines_real.py."""

from __future__ import annotations

import mmap
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kreld.debuginfo.lines_dwarf import dwarf_sections
from kreld.debuginfo.lines_program import unit_cuts
from kreld.debuginfo.lines_scopes import innermost_inlined

from support.linerefs import NEEDS_REFERENCES, instructions, llvm

SRC = Path(__file__).parent / "lines_src"

pytestmark = NEEDS_REFERENCES


@pytest.mark.parametrize("dwarf", ["-gdwarf-4", "-gdwarf-5"])
def test_the_innermost_inlined_call_is_llvm_symbolizers_innermost_inlined_frame(
    tmp_path: Path, dwarf: str
) -> None:
    exe = tmp_path / "exe"
    subprocess.run(["gcc", dwarf, "-O2", "-o", str(exe), "prog.c"], cwd=SRC, check=True)
    addresses = instructions(exe)[".text"]
    refs = llvm(exe, addresses)
    inlined = 0
    with open(exe, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        d = dwarf_sections(m, str(exe))
        for a, ref in zip(addresses, refs, strict=True):
            at = np.array([a], dtype=np.uint64)
            units = unit_cuts(d, (at, at + np.uint64(1)))
            got = innermost_inlined(d, units[0][0], a) if units else None
            want = ref[0][0] if len(ref) > 1 else None
            assert got == want, (hex(a), got, ref)
            inlined += want is not None
    assert inlined > 20


def test_a_unit_it_cannot_follow_gives_no_name(tmp_path: Path) -> None:
    """A unit offset that is not a unit, and an address no scope holds:
    None, never an exception nor a name."""
    exe = tmp_path / "exe"
    subprocess.run(["gcc", "-O2", "-g", "-o", str(exe), "prog.c"], cwd=SRC, check=True)
    with open(exe, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        d = dwarf_sections(m, str(exe))
        a = instructions(exe)[".text"][0]
        at = np.array([a], dtype=np.uint64)
        unit = unit_cuts(d, (at, at + np.uint64(1)))[0][0]
        assert innermost_inlined(d, unit + 3, a) is None
        assert innermost_inlined(d, 1 << 40, a) is None
        assert innermost_inlined(d, unit, 0) is None
