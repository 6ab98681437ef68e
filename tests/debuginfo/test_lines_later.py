"""The lines of gcc's merged functions, read when first asked
(kreld.debuginfo.lines_later).

merged.c and merged_more.c (gcc -O2 -g, one executable) each have copies gcc
merged, whose lines only their unit's line program gives.  A table just built
holds both units as still to be read; a lookup reads only the units its own
addresses lie in; keeping the table reads the rest.  At every step, and
whoever reads first, every ``.text`` instruction is named as
``llvm-symbolizer --inlines`` names it."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import numpy as np

from kreld.debuginfo.lines import LineTable
from kreld.debuginfo.lines_build import build_line_table

from support.linerefs import NEEDS_REFERENCES, Frames, comparable, instructions, llvm, ours

SRC = Path(__file__).parent / "lines_src"
# Each merged copy's line (its declaration's) and its unit's file.
COPIES = {
    "noop_b": ("merged.c", 13), "noop_c": ("merged.c", 14),
    "more_b": ("merged_more.c", 10), "more_c": ("merged_more.c", 11),
}  # fmt: skip

pytestmark = NEEDS_REFERENCES


def _exe(tmp_path: Path) -> Path:
    exe = tmp_path / "exe"
    subprocess.run(["gcc", "-g", "-O2", "-o", str(exe), "merged.c", "merged_more.c"], cwd=SRC,
                   check=True)  # fmt: skip
    return exe


def _symbol(exe: Path, name: str) -> int:
    out = subprocess.run(["nm", str(exe)], capture_output=True, text=True, check=True).stdout
    return next(int(f.split()[0], 16) for f in out.splitlines() if f.endswith(f" {name}"))


def _equal_to_llvm(got: list[Frames], refs: list[Frames], keys: list[int]) -> None:
    named = set()
    for key, frames, ref in zip(keys, got, refs, strict=True):
        if comparable(ref):
            assert frames == ref, hex(key)
        if frames and frames[0][0] in COPIES:
            file, line = COPIES[frames[0][0]]
            assert (frames[0][1], frames[0][2]) == (str(SRC / file), line), (hex(key), frames)
            named.add(frames[0][0])
    assert named == set(COPIES)


def test_a_lookup_reads_only_its_own_units_and_keeping_reads_the_rest(tmp_path: Path) -> None:
    exe = _exe(tmp_path)
    addresses = instructions(exe)[".text"]
    refs = llvm(exe, addresses)
    table = build_line_table(exe)
    assert table.later is not None and len(table.later) == 2
    # A merged copy of merged_more.c: its unit is read, merged.c's is not.
    at = _symbol(exe, "more_b")
    assert ours(table, [at]) == [[("more_b", str(SRC / "merged_more.c"), 10, False)]]
    assert len(table.later) == 1
    # An address of no merged copy reads nothing.
    ours(table, [_symbol(exe, "main")])
    assert len(table.later) == 1
    # Every address, the other unit read now, named as llvm-symbolizer names it.
    _equal_to_llvm(ours(table, addresses), refs, addresses)
    assert table.later is not None and len(table.later) == 0
    # Kept: complete, and let go of the debug file.
    kept = LineTable.from_bytes(table.to_bytes())
    assert table.later is None and kept.later is None
    _equal_to_llvm(ours(kept, addresses), refs, addresses)


def test_a_table_kept_before_any_lookup_answers_the_same(tmp_path: Path) -> None:
    exe = _exe(tmp_path)
    addresses = instructions(exe)[".text"]
    first = build_line_table(exe)
    ours(first, [_symbol(exe, "noop_c")])  # merged.c's unit read first, then the rest
    kept_late = first.to_bytes()
    kept_at_once = LineTable.from_bytes(build_line_table(exe).to_bytes())
    assert ours(LineTable.from_bytes(kept_late), addresses) == ours(kept_at_once, addresses)
    _equal_to_llvm(ours(kept_at_once, addresses), llvm(exe, addresses), addresses)


def test_lookups_while_the_rest_is_read_each_see_a_whole_table(tmp_path: Path) -> None:
    """Calls look up while the builder completes the table: each answer is
    the complete table's (rows and file names are swapped in whole)."""
    exe = _exe(tmp_path)
    addresses = instructions(exe)[".text"]
    want = ours(LineTable.from_bytes(build_line_table(exe).to_bytes()), addresses)
    batch = np.array(addresses, dtype=np.uint64)
    for _ in range(5):
        table = build_line_table(exe)
        got: list[list[Frames]] = []
        go = threading.Barrier(3)

        def look(
            table: LineTable = table, got: list[list[Frames]] = got, go: threading.Barrier = go
        ) -> None:
            go.wait()
            for _ in range(20):
                chains = table.frames_at(batch)
                got.append([[(f.function, f.file, f.line, f.inlined) for f in c] for c in chains])

        threads = [threading.Thread(target=look) for _ in range(2)]
        for t in threads:
            t.start()
        go.wait()
        table.complete()
        for t in threads:
            t.join()
        assert table.later is None
        assert got and all(g == want for g in got)
