"""Line tables of Debian's real kernel debug files against the references.

Sampled, on ``linux-image-6.1.0-57-cloud-amd64-dbg`` as scripts/setup-vm
extracts it under /var/cache/kreld-vm/dbg: 5,000 random addresses of
vmlinux's ``.text`` against ``llvm-symbolizer --inlines``, and offsets spread
over every code section of brd.ko and xfs.ko against ``eu-addr2line -i -f -j
SECTION``.  Every frame (function, normalized file, line), innermost first.
bench/bench_lines.py prints the same agreement with its timings.
"""

from __future__ import annotations

import mmap
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kreld.core.errors import LineTableError
from kreld.debuginfo.lines import LineTable
from kreld.debuginfo.lines_build import build_line_table
from kreld.debuginfo.lines_reloc import read_sections

from support.linerefs import Frames, eu_said, instructions, llvm

RELEASE = "6.1.0-57-cloud-amd64"
DBG = Path("/var/cache/kreld-vm/dbg/usr/lib/debug")
VMLINUX = DBG / f"boot/vmlinux-{RELEASE}"
MODULES = {
    "brd": DBG / f"lib/modules/{RELEASE}/kernel/drivers/block/brd.ko",
    "xfs": DBG / f"lib/modules/{RELEASE}/kernel/fs/xfs/xfs.ko",
}

pytestmark = [
    pytest.mark.skipif(
        not VMLINUX.is_file() or not all(p.is_file() for p in MODULES.values()),
        reason=f"no -dbg files under {DBG} (scripts/setup-vm extracts them)",
    ),
    pytest.mark.skipif(
        shutil.which("llvm-symbolizer") is None or shutil.which("eu-addr2line") is None,
        reason="llvm-symbolizer or eu-addr2line missing (scripts/setup installs llvm, elfutils)",
    ),
]


def _ours(table: LineTable, addresses: list[int]) -> list[list[tuple[str, str | None, int]]]:
    chains = table.frames_at(np.array(addresses, dtype=np.uint64))
    return [[(f.function, f.file, f.line) for f in fr] for fr in chains]


def _plain(ref: Frames) -> list[tuple[str, str | None, int]]:
    return [(f, p, n) for f, p, n, _ in ref]


def _named(ref: Frames) -> bool:
    return bool(ref) and ref[0][0] not in ("", "??")


def test_vmlinux_agrees_with_llvm_symbolizer_wherever_it_names_a_function() -> None:
    """Equal wherever llvm-symbolizer names a function: assembly (its line
    programs' lines where no DWARF function covers it) and C functions gcc
    gave no address in the DWARF (the line program's line, as there) included."""
    table = build_line_table(VMLINUX)
    with open(VMLINUX, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        _, secs, names = read_sections(m, str(VMLINUX))
        text = secs[names.index(".text")]
    rng = random.Random(5000)
    addresses = sorted(rng.randrange(text.addr, text.addr + text.size) for _ in range(20000))
    refs = llvm(VMLINUX, addresses)
    compared = assembly = 0
    for a, ours, ref in zip(addresses, _ours(table, addresses), refs, strict=True):
        if not _named(ref):
            continue
        compared += 1
        assembly += ours == _plain(ref) and len(ref) == 1 and str(ref[0][1]).endswith(".S")
        assert ours == _plain(ref), (hex(a), ours, ref)
    assert compared > 18000 and assembly > 10


def test_the_start_of_every_cold_part_agrees_with_llvm_symbolizer() -> None:
    """The first 8 bytes of each of vmlinux's ``.cold`` parts (gcc's code
    moved out of line), looked up before the table is complete and after.
    Where such a part begins inside an inlined call but without a
    line-program row of its own (the row before it goes on: same line, so
    gcc wrote none), symbolic drops that row as another function's, and with
    it the innermost inlined frame up to the next row
    (``check_all_holdout_tasks.cold``: ``check_holdout_task`` at tasks.h:225);
    kreld reads the unit's scopes there (lines_scopes) and puts it back."""
    table = build_line_table(VMLINUX)
    out = subprocess.run(["nm", str(VMLINUX)], capture_output=True, text=True, check=True).stdout
    cold = sorted({int(f.split()[0], 16) for f in out.splitlines()
                   if f.split()[-1].endswith(".cold")})  # fmt: skip
    assert len(cold) > 1000
    addresses = [a + k for a in cold for k in range(8)]
    refs = llvm(VMLINUX, addresses)
    first = _ours(table, addresses)  # reads the units these lie in
    kept = _ours(LineTable.from_bytes(table.to_bytes()), addresses)
    for ours in (first, kept):
        differ = [(hex(a), o, r) for a, o, r in zip(addresses, ours, refs, strict=True)
                  if _named(r) and o != _plain(r)]  # fmt: skip
        assert differ == []
    at = 8 * cold.index(0xFFFFFFFF819D383A)  # check_all_holdout_tasks.cold, Debian's 6.1.0-57
    assert [f[0] for f in kept[at]] == ["check_holdout_task", "check_all_holdout_tasks.cold"]


def _llvm_sure(path: Path, picks: list[int]) -> dict[int, list[tuple[str, str | None, int]]]:
    """llvm-symbolizer's frames at the ``.text`` offsets of *picks* past the
    end of every other code section: it takes each section of a
    relocatable object to start at 0, so only there is it sure which one
    an offset is in (llvm/llvm-project#71008)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        _, secs, names = read_sections(m, str(path))
    others = max(
        s.size for s, n in zip(secs, names, strict=True) if s.flags & 0x4 and n != ".text"
    )  # SHF_EXECINSTR; fmt: skip
    sure = [o for o in picks if o >= others]
    return dict(zip(sure, (_plain(r) for r in llvm(path, sure)), strict=True))


def _agree(path: Path, table: LineTable, section: str, picks: list[int]) -> tuple[int, int, int]:
    """Every named offset of *picks* as eu-addr2line names it, or where the
    two differ, as llvm-symbolizer does (:func:`_llvm_sure`; its outermost
    name excepted, which it takes from a symbol table whose sections all
    start at 0: eu and kreld take it from the DWARF).  How many were
    compared, how many differ from eu, and at how many of those eu
    contradicts itself (:func:`support.linerefs.eu_said`)."""
    refs, odd = eu_said(path, section, picks)
    addresses = [table.section_address(section, o) for o in picks]
    assert None not in addresses, section
    ours = _ours(table, addresses)  # type: ignore[arg-type]
    differ = [k for k, (got, ref) in enumerate(zip(ours, refs, strict=True))
              if _named(ref) and got != _plain(ref)]  # fmt: skip
    sure = _llvm_sure(path, [picks[k] for k in differ]) if section == ".text" else {}
    for k in differ:
        llvm_chain = sure.get(picks[k])
        assert llvm_chain is not None, (section, hex(picks[k]), ours[k], refs[k])
        assert len(ours[k]) == len(llvm_chain), (hex(picks[k]), ours[k], llvm_chain)
        assert ours[k][:-1] == llvm_chain[:-1], (hex(picks[k]), ours[k], llvm_chain)
        assert ours[k][-1][1:] == llvm_chain[-1][1:], (hex(picks[k]), ours[k], llvm_chain)
    return sum(1 for r in refs if _named(r)), len(differ), sum(odd[k] for k in differ)


@pytest.mark.parametrize("name", list(MODULES))
def test_a_module_agrees_with_eu_addr2line_in_every_code_section(name: str) -> None:
    """Equal at every sampled offset, xfs's ``__bpf_trace_*`` functions (no
    address in the DWARF: the line program's line) included; where eu
    differs, as llvm-symbolizer names it (:func:`_agree`)."""
    path = MODULES[name]
    table = build_line_table(path)
    rng = random.Random(name)
    compared = 0
    for section, offsets in instructions(path).items():
        picks = sorted(rng.sample(offsets, min(len(offsets), 400)))
        compared += _agree(path, table, section, picks)[0]
    assert compared > (500 if name == "brd" else 1000)


def test_where_eu_addr2line_differs_in_xfs_the_chain_is_llvm_symbolizers() -> None:
    """At some 0.2 % of xfs.ko's ``.text`` eu-addr2line's chain is not the
    DWARF's scopes: mostly its first line and its ``-i`` lines name two
    chains (``do_trace_event_raw_event_*`` inlined at xfs_trace.h:196 in one,
    no caller in the other), or it leaves out an inlined level
    (``do_trace_event_raw_event_xfs_da_class``).  kreld's chain there is
    llvm-symbolizer's: 4,000 offsets."""
    path = MODULES["xfs"]
    table = build_line_table(path)
    offsets = instructions(path)[".text"]
    picks = sorted(random.Random("xfs-text").sample(offsets, 4000))
    compared, differ, contradicted = _agree(path, table, ".text", picks)
    assert compared > 3500 and 0 < contradicted <= differ


def test_a_kernel_build_over_its_memory_bound_is_named_and_the_reader_peak_said() -> None:
    """vmlinux mapped within 700 MiB of address space, but its reading not:
    the reader (native code) aborts on an allocation refused, which is named
    as the bound.  Within the default bound its peak is said, and is under
    320 MiB: the DWARF it has read (about 200 MiB of it) is not kept mapped
    (lines_child drops those pages as it goes)."""
    with pytest.raises(LineTableError) as e:
        build_line_table(VMLINUX, bound=700 << 20)
    assert e.value.reason == (
        "the DWARF reader went over its memory bound of 700 MiB ([kernel] line_build_memory)"
    )
    table = build_line_table(VMLINUX)
    assert 0 < table.reader_peak_rss < 320 << 20
