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
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kreld.core.errors import InvalidArgument, LineTableError, StoreCorrupt
from kreld.core.model import (
    Anchors,
    BootSnapshot,
    Clock,
    Incarnation,
    ModuleState,
    SeenBy,
    Timestamp,
)
from kreld.debuginfo.lines import LineTable, normalize_path
from kreld.debuginfo.lines_build import build_line_table
from kreld.debuginfo.lines_reloc import place_sections
from kreld.store import Store
from kreld.store.linetabs import CHUNK
from kreld.symbols.linequery import lines_at
from kreld.symbols.queries import AddressMap

from support.linerefs import Frames, eu, instructions, llvm

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


def _gcc(tmp: Path, variant: str, relocatable: bool) -> Path:
    out = tmp / (f"prog-{variant}" + (".o" if relocatable else ""))
    cmd = ["gcc", "-g", "-O2", *VARIANTS[variant], "-o", str(out), "prog.c"]
    if relocatable:
        cmd.insert(1, "-c")
    subprocess.run(cmd, cwd=SRC, check=True)
    return out


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
    addresses = sorted(a for sec in instructions(exe).values() for a in sec)
    refs = llvm(exe, addresses)
    assert len(refs) == len(addresses)
    compared = 0
    inlined = 0
    for address, ref in zip(addresses, refs, strict=True):
        if not _named(ref):
            continue
        assert _ours(table, address) == ref, hex(address)
        compared += 1
        inlined += len(ref) > 1
    assert compared > 50 and inlined > 20  # the fixture has inlined code to check
    files = {f.file for a in addresses for f in table.frames(a)}
    assert str(SRC / "helpers.h") in files  # "./sub/../helpers.h" normalized


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_instruction_of_a_relocatable_object_is_named_by_section_as_eu_addr2line_does(
    tmp_path: Path, variant: str
) -> None:
    obj = _gcc(tmp_path, variant, relocatable=True)
    table = LineTable.from_bytes(build_line_table(obj).to_bytes())
    sections = instructions(obj)
    assert {".text", ".text.unlikely", ".init.text"} <= set(sections)
    inlined = 0
    for section, offsets in sections.items():
        refs = eu(obj, section, offsets)
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


# -- kept in the store, answered for a recorded boot -------------------------

KERNEL_BUILD = "ab" * 20
MODULE_BUILD = "cd" * 20
RUNTIME_TEXT = 0xFFFFFFFF9A000000
MODULE_BASES = {".text": 0xFFFFFFFFC0101000, ".text.unlikely": 0xFFFFFFFFC0100400,
                ".init.text": 0xFFFFFFFFC0900000, ".text.startup": 0xFFFFFFFFC0100800}  # fmt: skip


def _recorded(link_text: int, image_size: int) -> tuple[AddressMap, int]:
    t0 = Timestamp(1_000, 1_000, 1_000)
    boot = BootSnapshot(
        boot_id="00000000-0000-0000-0000-000000000001", release="6.1.0", version="#1",
        build_id=KERNEL_BUILD,
        anchors=Anchors(RUNTIME_TEXT, RUNTIME_TEXT, RUNTIME_TEXT + image_size),
        kaslr=None, restricted=False, restricted_reason=None, kptr_restrict=0, first_seen=t0,
    )  # fmt: skip
    state = ModuleState(
        name="prog", build_id=MODULE_BUILD, sections=MODULE_BASES, coresize=0x2000,
        initsize=0x1000, initstate="coming", srcversion=None, taint=None,
        core_base=0xFFFFFFFFC0100000, restricted=False, inode=1,
    )  # fmt: skip
    inc = Incarnation(
        boot_id=boot.boot_id, seq=1, state=state, loaded=t0, seen_by=SeenBy.STARTUP,
        init_live=True, init_done=None, unloaded=None,
    )  # fmt: skip
    return AddressMap(boot, [inc], Clock.MONOTONIC, None), link_text


def test_a_recorded_boots_image_and_module_addresses_get_the_lines_of_their_stored_tables(
    tmp_path: Path,
) -> None:
    """The kernel image's addresses are moved back by the boot's KASLR offset;
    a module's are (section, offset) through its incarnation's recorded
    bases; the tables come back from a real store."""
    exe = tmp_path / "image"
    subprocess.run(["gcc", "-g", "-O2", "-gdwarf-5", "-Wl,--defsym=_text=hot", "-o", str(exe),
                    "prog.c"], cwd=SRC, check=True)  # fmt: skip
    obj = _gcc(tmp_path, "dwarf5-gz", relocatable=True)
    image, module = build_line_table(exe), build_line_table(obj)
    link_text = image.meta["text"]
    assert isinstance(link_text, int)
    with Store(tmp_path / "state") as store:
        store.line_tables.put(KERNEL_BUILD, image.to_bytes(), str(exe))
        store.line_tables.put(MODULE_BUILD, module.to_bytes(), str(obj))
    with Store(tmp_path / "state", readonly=True) as store:

        def tables(build: str) -> LineTable | str:
            got = store.line_tables.get(build)
            return (
                f"no line table for build {build}"
                if got is None
                else LineTable.from_bytes(got.data)
            )

        amap, _ = _recorded(link_text, 0x1000)
        code = instructions(exe)[".text"]
        image_addrs = [RUNTIME_TEXT + a - link_text for a in code if a >= link_text]
        mod_addrs = [
            (s, o) for s, offs in instructions(obj).items() for o in offs if s in MODULE_BASES
        ]
        addrs = image_addrs + [MODULE_BASES[s] + o for s, o in mod_addrs]
        answers = lines_at(amap, addrs, tables)
    refs = llvm(exe, [a - RUNTIME_TEXT + link_text for a in image_addrs])
    for sec in dict.fromkeys(s for s, _ in mod_addrs):
        refs += eu(obj, sec, [o for s, o in mod_addrs if s == sec])
    compared = 0
    for a, ans, ref in zip(addrs, answers, refs, strict=True):
        ours = [(f.function, f.file, f.line, f.inlined) for f in ans.frames]
        if _named(ref):
            assert ours == ref, hex(a)
            compared += 1
        elif not ours:
            assert ans.why_not
    assert compared > 80


def test_an_address_of_a_build_without_a_table_keeps_no_line_and_says_why(tmp_path: Path) -> None:
    amap, _ = _recorded(0xFFFFFFFF81000000, 0x1000)
    answers = lines_at(amap, [RUNTIME_TEXT + 0x10, MODULE_BASES[".text"] + 4, 0x1234],
                       lambda b: f"no debuginfo for build {b}, looked in /nowhere")  # fmt: skip
    assert [a.frames for a in answers] == [(), (), ()]
    assert answers[0].why_not == f"no debuginfo for build {KERNEL_BUILD}, looked in /nowhere"
    assert answers[1].why_not == f"no debuginfo for build {MODULE_BUILD}, looked in /nowhere"
    assert answers[2].why_not is not None and "not in the kernel image" in answers[2].why_not


def test_a_stored_line_table_comes_back_whole_across_chunks_and_a_damaged_one_is_refused(
    tmp_path: Path,
) -> None:
    data = np.random.default_rng(1).bytes(2 * CHUNK + 123)
    with Store(tmp_path / "state") as store:
        store.line_tables.put(MODULE_BUILD, data, "/x.ko")
        got = store.line_tables.get(MODULE_BUILD)
        assert got is not None and got.data == data and got.manifest["chunks"] == 3
        store.line_tables.put(MODULE_BUILD, b"short", "/y.ko")  # replaced: old chunks gone
        got = store.line_tables.get(MODULE_BUILD)
        assert got is not None and got.data == b"short"
        assert set(store.line_tables.listing()) == {MODULE_BUILD}
        assert store.line_tables.get(KERNEL_BUILD) is None
        with pytest.raises(InvalidArgument):
            store.line_tables.put("../etc", b"", "")
        db = store.env.dbs[b"linetabs"]
        with store.env.lmdb.begin(write=True) as txn:
            txn.put(MODULE_BUILD.encode() + b"/\0\0\0\0", b"shorx", db=db)
        with pytest.raises(StoreCorrupt):
            store.line_tables.get(MODULE_BUILD)


# -- names from the ELF symbol table: GCC's clones and assembly --------------

CLONES = {"scale.constprop.0", "area.isra.0", "check.part.0"}


def test_gcc_clones_take_their_elf_symbol_name_in_an_executable_as_llvm_symbolizer_gives_it(
    tmp_path: Path,
) -> None:
    """llvm-symbolizer names the outermost frame after the ELF symbol
    (``scale.constprop.0``) where the DWARF says ``scale``; an assembly
    function assembled with -g, which has no DWARF subprogram, gets its
    symbol's name with the assembler's file and line."""
    exe = tmp_path / "clones"
    subprocess.run(["gcc", "-g", "-O2", "-nostartfiles", "-Wl,-e,use_clones", "-o", str(exe),
                    "clones.c", "asm_add.S"], cwd=SRC, check=True)  # fmt: skip
    table = LineTable.from_bytes(build_line_table(exe).to_bytes())
    addresses = sorted(a for sec in instructions(exe).values() for a in sec)
    refs = llvm(exe, addresses)
    outer_names, asm = set(), 0
    for address, ref in zip(addresses, refs, strict=True):
        if not _named(ref):  # padding between functions: no symbol covers it
            continue
        outer_names.add(ref[-1][0])
        assert _ours(table, address) == ref, hex(address)
        asm += ref[0][0] == "asm_add" and ref[0][1] is not None
    assert outer_names >= CLONES and asm == 3


def test_gcc_clones_keep_their_dwarf_name_in_a_relocatable_object_as_eu_addr2line_gives_it(
    tmp_path: Path,
) -> None:
    obj = tmp_path / "clones.o"
    subprocess.run(["gcc", "-g", "-O2", "-c", "-o", str(obj), "clones.c"], cwd=SRC, check=True)
    table = LineTable.from_bytes(build_line_table(obj).to_bytes())
    syms = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
    assert {line.split()[-1] for line in syms.splitlines()} >= CLONES
    compared = repeated = 0
    for section, offsets in instructions(obj).items():
        refs = eu(obj, section, offsets)
        for offset, ref in zip(offsets, refs, strict=True):
            address = table.section_address(section, offset)
            assert address is not None
            if not _named(ref):
                continue
            ours = _ours(table, address)
            assert not {f for f, *_ in ref} & CLONES
            compared += 1
            if ours != ref and _eu_dropped_a_repeated_call_site(ours, ref):
                repeated += 1
                continue
            assert ours == ref, (section, hex(offset))
    assert compared > 50 and repeated <= 2


def _eu_dropped_a_repeated_call_site(ours: Frames, ref: Frames) -> bool:
    """eu-addr2line leaves out the frames outside an inlined one whose call
    site is where the inlined code's own line is (file, line and column
    equal): the table keeps no columns, so kreld gives the whole chain."""
    k = len(ref)
    return (
        0 < k < len(ours)
        and [(f, p, n) for f, p, n, _ in ours[:k]] == [(f, p, n) for f, p, n, _ in ref]
        and ours[k][1:3] == ours[k - 1][1:3]
    )


def test_code_no_dwarf_covers_is_named_by_its_symbol_without_a_line(tmp_path: Path) -> None:
    """An assembly function assembled without -g, linked (``ld -r``) into an
    object whose C code has DWARF: both eu-addr2line and kreld give its
    symbol, with no file and line 0."""
    c_obj, s_obj, obj = tmp_path / "c.o", tmp_path / "s.o", tmp_path / "both.o"
    subprocess.run(["gcc", "-g", "-O2", "-c", "-o", str(c_obj), "clones.c"], cwd=SRC, check=True)
    subprocess.run(["gcc", "-c", "-o", str(s_obj), "asm_add.S"], cwd=SRC, check=True)
    subprocess.run(["ld", "-r", "-o", str(obj), str(c_obj), str(s_obj)], check=True)
    table = build_line_table(obj)
    offsets = instructions(obj)[".text"]
    refs = eu(obj, ".text", offsets)
    asm = 0
    for offset, ref in zip(offsets, refs, strict=True):
        address = table.section_address(".text", offset)
        assert address is not None
        if ref and ref[0][0] == "asm_add":
            assert _ours(table, address) == ref == [("asm_add", None, 0, False)]
            asm += 1
    assert asm == 3


# -- Resolve's columns -------------------------------------------------------


def test_resolves_columns_name_every_address_as_lines_at_does_with_regions_interleaved(
    tmp_path: Path,
) -> None:
    """The bulk columns Resolve sends (one walk per inline depth, names
    numbered per table) spell out, address by address, what ``lines_at``
    answers one by one: the image's clones under their ELF names, a module's
    assembly under its symbol alone, every reason; the addresses of the
    image, of two module sections and of nowhere mixed in any order."""
    import json
    import re

    from kreld.client import line_frames
    from kreld.symbols.linereply import line_columns

    exe, c_obj, s_obj, obj = (tmp_path / n for n in ("image", "c.o", "s.o", "both.o"))
    gcc = ["gcc", "-g", "-O2", "-nostartfiles", "-Wl,-e,use_clones", "-o", str(exe),
           "clones.c", "asm_add.S"]  # fmt: skip
    subprocess.run(gcc, cwd=SRC, check=True)
    # Linked again with _text at its first function, as a kernel's is.
    nm = subprocess.run(["nm", "-n", str(exe)], capture_output=True, text=True, check=True)
    first = next(ln.split()[0] for ln in nm.stdout.splitlines() if ln.split()[1] in "tT")
    subprocess.run([*gcc, f"-Wl,--defsym=_text=0x{first}"], cwd=SRC, check=True)
    subprocess.run(["gcc", "-g", "-O2", "-c", "-o", str(c_obj), "clones.c"], cwd=SRC, check=True)
    subprocess.run(["gcc", "-c", "-o", str(s_obj), "asm_add.S"], cwd=SRC, check=True)
    subprocess.run(["ld", "-r", "-o", str(obj), str(c_obj), str(s_obj)], check=True)
    tables = {KERNEL_BUILD: build_line_table(exe), MODULE_BUILD: build_line_table(obj)}
    link_text = tables[KERNEL_BUILD].meta["text"]
    assert isinstance(link_text, int)
    amap, _ = _recorded(link_text, 0x1000)
    image = [RUNTIME_TEXT + a - link_text for s in instructions(exe).values() for a in s]
    module = [MODULE_BASES[".text"] + o for o in instructions(obj)[".text"]]
    module += [MODULE_BASES[".init.text"] + k for k in range(0, 64, 7)]  # not in the file
    addrs = image + module + [0x1234, RUNTIME_TEXT - 1]
    np.random.default_rng(7).shuffle(addrs)

    def source(build: str) -> LineTable | str:
        return tables[build]

    spelt = line_frames(json.loads(line_columns(amap, addrs, source).to_json()))
    answers = lines_at(amap, addrs, source)
    named = alone = 0
    for a, got, ans in zip(addrs, spelt, answers, strict=True):
        if isinstance(got, str):
            # One reason for many addresses: without each one's offset.
            assert not ans.frames and ans.why_not is not None, hex(a)
            assert got == re.sub(r" at offset 0x[0-9a-f]+", "", ans.why_not), hex(a)
            continue
        frames = [(f["function"], f["file"], f["line"], f["inlined"]) for f in got]
        assert frames == [(f.function, f.file, f.line, f.inlined) for f in ans.frames], hex(a)
        named += 1
        alone += frames == [("asm_add", None, 0, False)]
    assert named > 50 and alone == 3
    assert any(isinstance(g, list) and g[-1]["function"] in CLONES for g in spelt)


@pytest.mark.parametrize("relocatable", [False, True])
def test_a_table_built_through_a_file_on_disk_equals_one_built_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, relocatable: bool
) -> None:
    """The reader's private copy is an anonymous file in memory where the
    kernel gives one; without memfd_create (another kernel or libc) it is a
    file under the scratch directory, removed after: the same table."""
    import os

    built = _gcc(tmp_path, "dwarf5-gz", relocatable)
    in_memory = build_line_table(built).to_bytes()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.delattr(os, "memfd_create")
    assert build_line_table(built, scratch=scratch).to_bytes() == in_memory
    assert list(scratch.iterdir()) == []
