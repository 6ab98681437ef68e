"""Building a line table from a debug file (vmlinux or a module).


Why this reader, measured when it was chosen (``bench/bench_lines.py``, one run
on this project's shared 2-core machine, Debian's 6.1.0-57-cloud-amd64 vmlinux:
590 MB, DWARF 5, 219 MB of .debug_* sections; 10,000 and 100,000 random .text
addresses; bench/RESULTS.md has the current figures, the reader in its own
process):

* ``llvm-symbolizer --inlines``, the reference: 2.9 s and 894 MiB for the
  10,000.  A process per use; no table to keep.
* drgn 0.3.0 (C, libdw): 17 s for the same 10,000, a Python call per address;
  nothing to keep either, so every use pays it again.
* pyelftools (pure Python): walking 164 MB of .debug_info DIE by DIE takes
  minutes; not a candidate for a kernel.
* Sentry's ``symbolic`` 13.9.0 (Rust, gimli) builds a *SymCache* of all of
  vmlinux: table built and the 10,000 named in a fresh process in 4.9 s
  (1.7x llvm-symbolizer's total; the build itself 4.4 s), 490 MiB peak.  A
  SymCache is the table wanted: sorted range starts, each with the innermost
  of a chain of deduplicated (function, file, line, caller) locations.  Its
  format (v9) is public and flat, so it is read here into numpy arrays and
  kept in kreld's own layout (:class:`LineTable`, 38 MB for vmlinux, 0.17 of
  its DWARF): a lookup is one ``searchsorted`` and a gather per inline depth,
  no DWARF walk, no per-address Python (13.7 million addresses/s to chains in
  process).
* ``symbolic`` does not apply a relocatable object's ``.rela.debug_*``, so a
  module's debug file is first linked in place by
  :func:`kreld.debuginfo.lines_reloc.place_sections` (each allocated section at
  its own base) and the table answers by (section, offset).

Which names, the one convention: each file is named as its reference names
it, so that kreld's answers can be checked against a tool everyone has.

* An executable (vmlinux, ``ET_EXEC``): as ``llvm-symbolizer --inlines``.
  The DWARF gives the chain; the outermost frame is renamed after the ELF
  symbol the address lies in, as llvm-symbolizer does when it reads DWARF
  and a symbol table (``intel_pmu_hw_config.part.0``, ``foo.isra.0``,
  ``foo.constprop.0``: GCC's clones, whose DWARF says ``foo``).
* A relocatable module (``ET_REL``): as ``eu-addr2line -i -f -j SECTION``,
  the DWARF's names throughout.
* Both: where no DWARF function covers an address but a symbol does
  (``.static_call.text`` trampolines, assembly), the symbol's name, no file,
  line 0, as both references print it.

So the table keeps, beside the SymCache's rows, the symbol table's code
symbols (functions, objects, indirect functions and untyped ones, as
llvm-symbolizer takes them; one per start address, the largest, the later
in table order among equals) and says in its header which use applies.

A line comes from elsewhere in two places, both where the SymCache has
none (:mod:`kreld.debuginfo.lines_program`): where no DWARF function covers
an address of an assembly unit (``entry_64.S``'s labels,
``irq_entries_start``), and C functions gcc gave no address in the DWARF
(its merged copies: ``noop_send_IPI_all``, ``iommu_shutdown_noop``,
``__bpf_trace_*``).  There, the unit's line program's file:line beside the
symbol's name, as both references give it.

How a build runs: the SymCache is built by ``symbolic`` in a process of its
own (:mod:`kreld.debuginfo.lines_spawn`), under an address-space bound, its
peak (about 265 MiB for vmlinux: the DWARF it has read is not kept mapped)
freed with it; an executable is read where it lies (no copy of its DWARF),
a module's relocated copy is handed over in memory.  A large
``.debug_info`` (vmlinux's: 164 MB) is read by two such processes at once,
each on half of its units (cut at a unit's start), their SymCaches merged
into the one a single reader gives (:mod:`kreld.debuginfo.symcache`; equal
at every range start of Debian's 6.1 vmlinux, 1.58 million): the reading is
most of a build's time and symbolic uses one core.  Meanwhile this process
reads the symbols and the assembly's line programs; then converts the
SymCache.  The line programs of the units where it
names a symbol without a line (which those are is known only then: for
vmlinux, 150 of its 2,800 units, most of a second to decode) are read when
first asked, each lookup reading those its addresses lie in, and all before
the table is kept (:mod:`kreld.debuginfo.lines_later`).

Where symbolic's SymCache has less than the DWARF: at the start of some
``.cold`` parts (45 of a 6.1 kernel's 2,413) no line-program row begins, the
row covering it having begun in the code before, and symbolic drops it with
the innermost inlined frame up to the next row.  The units of ``.cold``
parts are read when first asked too, and there the innermost inlined call is
named from the unit's DIEs (:mod:`kreld.debuginfo.lines_scopes`) and put
before the SymCache's chain, with the covering row's file and line.

Measured against the references on Debian's 6.1.0-57 -dbg files
(tests/debuginfo/test_lines_real.py, bench/bench_lines.py): equal wherever
they name a function, at 100,000 random addresses of vmlinux, the first
bytes of each of its ``.cold`` parts, and sampled offsets of every code
section of brd.ko and xfs.ko.  At some 0.2 % of xfs.ko's ``.text``
eu-addr2line's chain is not the DWARF's scopes (its first line and its
``-i`` lines name two chains, or it leaves out an inlined level); there the
table gives llvm-symbolizer's.  Not kept: the column (SymCache has none,
frames carry ``column`` None).

File names are spelled by :func:`kreld.debuginfo.lines.normalize_path`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import struct
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kreld.core.errors import KernelReadError, LineTableError
from kreld.debuginfo import lines_spawn
from kreld.debuginfo.lines import BUILDER, NONE, LineTable, normalize_path
from kreld.debuginfo.lines_dwarf import Buffer, ProgramLines, Within, dwarf_sections
from kreld.debuginfo.lines_later import LaterLines
from kreld.debuginfo.lines_program import assembly_lines, unit_cuts
from kreld.debuginfo.lines_reloc import (
    SymbolRows,
    place_sections,
    read_sections,
    read_symbols,
    symbol_value,
)
from kreld.debuginfo.symcache import SymCache, merge
from kreld.kernel.elf import PT_LOAD, ElfSource, elf_header, program_headers

if TYPE_CHECKING:
    from numpy.typing import NDArray

__all__ = ["build_line_table"]


def _uleb_strings(blob: bytes, offsets: NDArray[np.uint32]) -> list[str | None]:
    """The strings a SymCache string table holds at *offsets* (a LEB128
    length, then the bytes)."""
    out: list[str | None] = []
    n = len(blob)
    for off in offsets.tolist():
        if off == NONE or off >= n:
            out.append(None)
            continue
        length = shift = 0
        pos = off
        while pos < n:
            b = blob[pos]
            pos += 1
            length |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                break
        out.append(blob[pos : pos + length].decode("utf-8", "replace"))
    return out


def _strings_blob(strings: list[str]) -> tuple[bytes, NDArray[np.uint32]]:
    encoded = [s.encode() for s in strings]
    ends = np.cumsum([len(e) for e in encoded], dtype=np.uint64)
    if len(ends) and int(ends[-1]) >= NONE:
        raise LineTableError("<table>", "string data over 4 GiB")
    offs = np.zeros(len(encoded) + 1, dtype=np.uint32)
    offs[1:] = ends
    return b"".join(encoded), offs


Layer = tuple[dict[str, "NDArray[np.uint32]"], list[str]]
# Where a function of the SymCache has no line: the units whose line programs
# meet those addresses, to be read when asked (:mod:`kreld.debuginfo.lines_later`).
Later = Callable[[Within, Within], LaterLines]
# What the table keeps beside the SymCache, read while the reader runs: the
# symbols (:func:`_symbol_layer`) and the assembly's lines; and how to read
# the lines of C functions it names without one, once it is known where.
# and the first bytes of gcc's ``.cold`` parts (:func:`_cold_starts`).
Beside = tuple[Layer, ProgramLines, Later, Within]
# The bytes at the start of a ``.cold`` part whose first lookup reads its
# unit at once (:mod:`kreld.debuginfo.lines_scopes`: the windows where
# symbolic drops a frame are shorter, 26 bytes at most in a 6.1 kernel; a
# longer one has its frame once the table is complete).
COLD_WINDOW = 32
# A .debug_info larger than this is read by two readers, half of its units each.
SPLIT_OVER = 32 << 20
_SHF_COMPRESSED = 0x800
_SHT_NOBITS = 8
# gcc's name for the part of a function it moved out of line (``foo.cold``).
_COLD = re.compile(r"\.cold(\.\d+)?$")


def _lineless(
    starts: NDArray[np.uint32],
    locs: NDArray[np.uint32],
    symbols: dict[str, NDArray[np.uint32]],
    base: int,
) -> Within:
    """The symbols (sized, each up to the next one's start) that start where
    the SymCache gives no line: no function there, or one alone without a
    file (a function gcc gave no address: see lines_program); as absolute
    address ranges."""
    ranged = locs[len(locs) - len(starts) :]
    lineless = (ranged[:, 2] == NONE) | ((ranged[:, 0] == NONE) & (ranged[:, 3] == NONE))
    first = symbols["sym_starts"].astype(np.int64)
    end = first + symbols["sym_sizes"].astype(np.int64)
    end[:-1] = np.minimum(end[:-1], first[1:])
    i = np.searchsorted(starts, first, side="right").astype(np.int64) - 1
    keep = end > first
    if len(starts):
        keep &= (i < 0) | lineless[np.maximum(i, 0)]
    return (first[keep].astype(np.uint64) + np.uint64(base),
            end[keep].astype(np.uint64) + np.uint64(base))  # fmt: skip


def _cold_starts(rows: SymbolRows, addresses: NDArray[np.uint64]) -> Within:
    """The first bytes (:data:`COLD_WINDOW`, within the symbol) of gcc's
    ``.cold`` parts, at *addresses* (the rows' placed ones), sorted."""
    cold = [(a, a + max(1, min(int(n), COLD_WINDOW)))
            for a, n, name in zip(addresses.tolist(), rows.size.tolist(), rows.names, strict=True)
            if _COLD.search(name)]  # fmt: skip
    cold = sorted(dict(cold).items())
    return (np.array([a for a, _ in cold], dtype=np.uint64),
            np.array([b for _, b in cold], dtype=np.uint64))  # fmt: skip


def _symbol_layer(rows: SymbolRows, addresses: NDArray[np.uint64], base: int) -> Layer:
    """The symbols the table keeps, one per start address (*addresses*
    are the rows' placed addresses): at a shared address the one
    llvm-symbolizer keeps, the largest, the later in table order among
    equals.  Returns the arrays and the names, numbered from 0 (the table's
    function names come first: :func:`_from_symcache` shifts them)."""
    with np.errstate(over="ignore"):
        wrapped = addresses.astype(np.uint64) - np.uint64(base)  # below base: wraps past 4 GiB
    keep = np.flatnonzero(wrapped < np.uint64(1 << 32))
    rel = wrapped.astype(np.int64)[keep]
    size = rows.size[keep].astype(np.int64)
    order = np.lexsort((size, rel))  # stable: table order among equal (start, size)
    rel, size, keep = rel[order], size[order], keep[order]
    last = np.ones(len(rel), dtype=bool)
    last[:-1] = rel[1:] != rel[:-1]
    rel, size, keep = rel[last], size[last], keep[last]
    names: dict[str, int] = {}
    func = np.array([names.setdefault(rows.names[k], len(names))
                     for k in keep.tolist()], dtype=np.uint32)  # fmt: skip
    arrays = {
        "sym_starts": rel.astype(np.uint32),
        "sym_sizes": np.minimum(size, NONE).astype(np.uint32),
        "sym_func": func,
    }
    return arrays, list(names)


def _program_layer(
    program: ProgramLines, base: int, first_file: int
) -> dict[str, NDArray[np.uint32]]:
    """The assembly's line ranges the table keeps: those from *base* on
    (within 4 GiB), their files numbered from *first_file*."""
    with np.errstate(over="ignore"):
        rel = program.starts - np.uint64(base)  # below base: wraps past 4 GiB
    keep = rel < np.uint64(1 << 32)
    file = program.file[keep]
    return {
        "lp_starts": rel[keep].astype(np.uint32),
        "lp_file": np.where(file == NONE, NONE, file + np.uint32(first_file)).astype(np.uint32),
        "lp_line": program.line[keep],
    }


def _from_symcache(cache: SymCache, meta: dict[str, Any], beside: Beside) -> LineTable:
    files, funcs, locs, starts = cache.files, cache.funcs, cache.locs, cache.starts.copy()
    strings = cache.strings
    f_names = [s or "??" for s in _uleb_strings(strings, funcs[:, 0])]
    comp, dirs, names = (_uleb_strings(strings, files[:, k]) for k in range(3))
    f_paths = [
        normalize_path(c or "", d or "", n or "") for c, d, n in zip(comp, dirs, names, strict=True)
    ]
    (sym_arrays, sym_names), program, later, cold = beside
    sym_arrays = dict(sym_arrays, sym_func=sym_arrays["sym_func"] + np.uint32(len(f_names)))
    names_blob, func_offs = _strings_blob(f_names + sym_names)
    lp_arrays = _program_layer(program, int(meta["base"]), len(f_paths))
    files_blob, file_offs = _strings_blob(f_paths + program.paths)
    arrays = {
        "starts": starts, "loc_file": locs[:, 0].copy(), "loc_line": locs[:, 1].copy(),
        "loc_func": locs[:, 2].copy(), "loc_parent": locs[:, 3].copy(),
        "func_offs": func_offs, "file_offs": file_offs, **sym_arrays, **lp_arrays,
    }  # fmt: skip
    table = LineTable(meta, arrays, names_blob, files_blob)
    base = int(meta["base"])
    pending = later(_lineless(starts, locs, sym_arrays, base), cold)
    if len(pending):
        table.later = pending
    return table


def _load_address(path: Path) -> int:
    """Where symbolic counts a SymCache's addresses from: the first
    ``PT_LOAD``'s virtual address (0 where there is none, or the headers
    cannot be read within kreld.kernel.elf's bounds)."""
    try:
        with open(path, "rb") as f:
            src = ElfSource.of_fd(f.fileno(), str(path))
            phdrs = program_headers(src, elf_header(src))
    except (OSError, KernelReadError):
        return 0
    return next((p.vaddr for p in phdrs if p.type == PT_LOAD), 0)


def _text_address(path: Path) -> int | None:
    """A kernel image's link-time ``_text``, which a boot's recorded ``_text``
    is compared with to undo KASLR (None for a file without it)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return symbol_value(m, str(path), "_text")


def _image_fd(image: bytes, scratch: Path | None) -> int:
    """An anonymous file holding *image* (``memfd_create``, else an unlinked
    private file under *scratch*), for the reader's process to read."""
    try:
        fd = os.memfd_create("kreld-lines", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        with tempfile.TemporaryFile(prefix="kreld-lines-", dir=scratch) as unlinked:
            fd = os.dup(unlinked.fileno())
    try:
        with os.fdopen(fd, "wb", closefd=False) as out:
            out.write(image)
    except OSError:
        os.close(fd)
        raise
    return fd


def _module(path: Path, meta: dict[str, Any], bound: int, scratch: Path | None) -> tuple[
    SymCache, int, Beside
]:  # fmt: skip
    """A relocatable object's SymCache (its sections placed first, the copy
    handed to the reader as an anonymous file), the reader's peak and the
    symbols the table keeps (at their placed addresses), chosen while the
    reader runs."""
    what = str(path)
    buf = path.read_bytes()
    placed = place_sections(buf, what)
    rows = read_symbols(buf, what)
    del buf
    bases = [placed.bases.get(int(i), -1) for i in rows.shndx.tolist()]
    where = np.array(bases, dtype=np.int64)
    placed_at = np.where(where >= 0, rows.value.astype(np.int64) + where, -1)
    meta["sections"] = [[s.name, s.base, s.size] for s in placed.sections]
    meta["base"] = 0
    meta["symbol_names"] = "fill"
    fd = _image_fd(placed.image, scratch)
    try:
        reading = lines_spawn.start(fd, what, bound, scratch)
    finally:
        os.close(fd)
    raw, peak, beside = reading.meanwhile(
        lambda: (_symbol_layer(rows, placed_at.astype(np.uint64), 0),
                 assembly_lines(placed.image, what), partial(_later, placed.image, what),
                 _cold_starts(rows, placed_at.astype(np.uint64))))  # fmt: skip
    return SymCache.parse(raw, what), peak, beside


def _later(buf: Buffer, what: str, within: Within, colds: Within,
           close: Callable[[], None] = lambda: None) -> LaterLines:  # fmt: skip
    """The units of *buf* whose lines are read when asked: those the address
    ranges *within* lie in, and the spans *colds* where the SymCache may lack
    an innermost frame (:mod:`kreld.debuginfo.lines_later`)."""
    d = dwarf_sections(buf, what)
    return LaterLines(d, unit_cuts(d, within), unit_cuts(d, colds), close)


def _file_later(path: Path, within: Within, colds: Within) -> LaterLines:
    """:func:`_later` of the file at *path*, read where it lies (mapped until
    its last unit is read)."""
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def close() -> None:
        with contextlib.suppress(BufferError):  # a view still held: the collector's
            m.close()

    try:
        later = _later(m, str(path), within, colds, close)
    except BaseException:
        close()
        raise
    if not len(later):
        close()
    return later


def _executable(path: Path, meta: dict[str, Any], bound: int, scratch: Path | None) -> tuple[
    SymCache, int, Beside
]:  # fmt: skip
    """An executable's SymCache, read by the reader from the file itself (its
    symbol table too, which names nothing the table answers differently: the
    outermost frame is the ELF symbol's anyway), its peak, and its symbols,
    read here meanwhile.  A large ``.debug_info`` is read by two readers,
    each on half of its units (:func:`_halves`), where two cores are ours:
    the reading is most of a build's time, and one reader uses one core."""
    what = str(path)

    def beside() -> Beside:
        meta["base"] = _load_address(path)
        meta["text"] = _text_address(path)
        meta["symbol_names"] = "outer"
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            rows = read_symbols(m, what)
            program = assembly_lines(m, what)
        layer = _symbol_layer(rows, rows.value, meta["base"])
        cold = _cold_starts(rows, rows.value.astype(np.uint64))
        return layer, program, partial(_file_later, path), cold

    halves = _halves(path)
    if halves is None:
        raw, peak, done = lines_spawn.start(what, what, bound, scratch).meanwhile(beside)
        return SymCache.parse(raw, what), peak, done
    readings = lines_spawn.start_parts(what, bound, scratch, *halves)
    raws, peak, done = readings.meanwhile(beside)
    return merge(*(SymCache.parse(raw, what) for raw in raws)), peak, done


def _halves(path: Path, over: int | None = None) -> tuple[int, list[tuple[int, int]]] | None:
    """Where the file's ``.debug_info`` section header lies, and the section
    cut in two at the unit start nearest its middle (file offset and size of
    each); None where one reader reads it: not over *over* bytes (default
    :data:`SPLIT_OVER`), compressed, or fewer than two cores to run on."""
    over = SPLIT_OVER if over is None else over
    if len(os.sched_getaffinity(0)) < 2:
        return None
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            eh, secs, names = read_sections(m, str(path))
            if ".debug_info" not in names:
                return None
            i = names.index(".debug_info")
            s = secs[i]
            if s.size <= over or s.flags & _SHF_COMPRESSED or s.type == _SHT_NOBITS:
                return None
            cut = _unit_start_near(m, s.offset, s.size)
    except (OSError, ValueError, LineTableError):
        return None  # one reader, whose refusal names what is wrong
    if cut is None:
        return None
    return eh.shoff + i * eh.shentsize, [(s.offset, cut), (s.offset + cut, s.size - cut)]


def _unit_start_near(m: mmap.mmap, start: int, size: int) -> int | None:
    """The start of the unit of the section at *start* (*size* bytes) nearest
    its middle, past its first; None if its unit headers do not tile it."""
    pos, half = 0, size // 2
    while pos < size:
        if pos + 4 > size:
            return None
        (n,) = struct.unpack_from("<I", m, start + pos)
        head = 4
        if n == 0xFFFFFFFF and pos + 12 <= size:  # 64-bit DWARF
            (n,) = struct.unpack_from("<Q", m, start + pos + 4)
            head = 12
        elif n >= 0xFFFFFFF0:
            return None
        end = pos + head + n
        if end >= half:
            cut = end if end - half < half - pos or pos == 0 else pos
            return cut if 0 < cut < size else None
        pos = end
    return None


def build_line_table(
    path: Path,
    build_id: str | None = None,
    scratch: Path | None = None,
    bound: int = lines_spawn.DEFAULT_BOUND,
) -> LineTable:
    """The line table of the debug file at *path* (an executable such as
    vmlinux, or a relocatable module).  Run it off the record path: it reads
    all of the file's DWARF (seconds and a few hundred MiB for a kernel), in
    a process of its own whose address space is bounded by *bound*
    (:mod:`kreld.debuginfo.lines_spawn`); its peak RSS is the table's
    ``reader_peak_rss``.  A module's placed copy is handed to it in
    memory where it can be, else in a file under *scratch* (default:
    ``$TMPDIR``)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        raise LineTableError(str(path), e.strerror or str(e)) from None
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        raise LineTableError(str(path), "not a 64-bit little-endian ELF file")
    meta: dict[str, Any] = {"build_id": build_id, "sections": None, "builder": BUILDER}
    relocatable = struct.unpack_from("<H", head, 16)[0] == 1  # ET_REL
    cache, peak, beside = (_module if relocatable else _executable)(path, meta, bound, scratch)
    table = _from_symcache(cache, meta, beside)
    table.reader_peak_rss = peak
    return table
