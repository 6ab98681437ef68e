"""kreld.kernel.elf.elf_symbols: named symbols of an ELF's ``.symtab``, found
without decoding the others, exactly as reading the table in order finds
them (pyelftools is the reference), on gcc-built executables whose string
table ld tail-merged; and nothing from a table the file cannot hold."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from kreld.kernel.elf import elf_symbols

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

# Two units, each with a static "_text" (two symbols of one name: the first
# in table order counts), whose names ld keeps as the ends of other names.
A = """static void __attribute__((used, noinline)) _text(void) { __asm__ volatile(""); }
void sys_text(void) { __asm__ volatile(""); }
int main(void) { return 0; }
"""
B = """static void __attribute__((used, noinline)) _text(void) { __asm__ volatile("nop"); }
void x_text(void) { __asm__ volatile(""); }
"""
NAMES = {"_text", "sys_text", "x_text", "main", "ext", "absent"}


def _first_in_order(path: Path, names: set[str]) -> dict[str, int]:
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    out: dict[str, int] = {}
    with open(path, "rb") as f:
        symtab = ELFFile(f).get_section_by_name(".symtab")
        assert isinstance(symtab, SymbolTableSection)
        for sym in symtab.iter_symbols():
            if sym.name in names and sym.name not in out:
                out[sym.name] = int(sym["st_value"])
    return out


@pytest.fixture(scope="module")
def exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("elfsyms")
    (d / "a.c").write_text(A)
    (d / "b.c").write_text(B)
    subprocess.run(["gcc", "-O1", "-o", "e", "a.c", "b.c"], cwd=d, check=True)
    return d / "e"


def test_each_name_is_the_first_symbol_of_that_name_in_table_order(exe: Path) -> None:
    want = _first_in_order(exe, NAMES)
    assert {"_text", "sys_text", "x_text", "main"} <= set(want)  # "ext" too, if ld kept one
    assert elf_symbols(exe, NAMES) == want
    dump = subprocess.run(["readelf", "-sW", str(exe)], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip
    texts = [int(ln.split()[1], 16) for ln in dump.splitlines() if ln.split()[-1:] == ["_text"]]
    assert len(texts) == 2 and want["_text"] == texts[0] != texts[1]


def test_a_symbol_table_past_the_end_of_the_file_gives_nothing(exe: Path, tmp_path: Path) -> None:
    """The .symtab's size grown past the file (its section header rewritten)."""
    data = bytearray(exe.read_bytes())
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    for i in range(shnum):
        at = shoff + i * shentsize
        if struct.unpack_from("<I", data, at + 4)[0] == 2:  # SHT_SYMTAB
            struct.pack_into("<Q", data, at + 32, len(data) * 24)
    bad = tmp_path / "bad"
    bad.write_bytes(bytes(data))
    assert elf_symbols(bad, NAMES) == {}
    assert elf_symbols(tmp_path / "missing", NAMES) == {}
