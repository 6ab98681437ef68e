"""Source lines with inline chains from DWARF: kreld's line tables against the references.

On Debian's 6.1.0-57-cloud-amd64 debug files (``linux-image-6.1.0-57-cloud-amd64-dbg``,
extracted once into /var/cache/kreld-vm/dbg under a flock, shared with other checkouts):

* vmlinux, 10,000 and 100,000 random addresses of its ``.text``, with inline frames.
  Baselines, same run, same addresses: ``llvm-symbolizer --inlines`` (a process per
  batch, its loaded rate = the 100,000 minus the 10,000; each batch run
  ``LLVM_RUNS`` times, in turn, and its median time taken: one run's swung
  up to 4x on a shared machine) and drgn 0.3.0
  (``Program.source_location``, the 10,000 only; installed into the virtualenv
  from pyproject's ``bench`` extra when missing).
  - cold: building the table from the file and naming the 10,000 (one call, as Resolve
    names them) in a fresh process,
    goal within 2x of llvm-symbolizer's total for the 10,000;
  - peak memory of the DWARF reader's process (goal <= 512 MiB), and of kreld's
    process beside it (the reader's own peak is said by it: its VmHWM);
  - warm: the table loaded from its bytes, the 100,000 looked up to their frames in
    columns (searchsorted, then a gather per inline depth), goal >= 5x llvm-symbolizer's
    loaded rate (in process: the socket is not part of this figure);
  - the table's bytes, goal <= 1/4 of the DWARF sections it came from;
  - answers: every frame's function, file (normalized both sides) and line equal to
    llvm-symbolizer's wherever it names a function; drgn's agreement on function and
    line is printed beside.
* brd.ko and xfs.ko, relocatable: random offsets in each code section, named by
  (section, offset); baseline ``eu-addr2line -i -f -j SECTION`` on the same offsets.

Why symbolic (the reader) and not the others: kreld/debuginfo/lines.py's docstring.

Run alone: ``.venv/bin/python bench/bench_lines.py [--quick]`` (as root, or with the
-dbg files already extracted).
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from common import Result, bench_main, log, venv_python

from kreld.debuginfo.lines import LineTable, normalize_path

RELEASE = "6.1.0-57-cloud-amd64"
CACHE = Path("/var/cache/kreld-vm/dbg")
LOCK = Path("/var/cache/kreld-vm/dbg.lock")
VMLINUX = CACHE / f"usr/lib/debug/boot/vmlinux-{RELEASE}"
MODULES = {
    "brd": CACHE / f"usr/lib/debug/lib/modules/{RELEASE}/kernel/drivers/block/brd.ko",
    "xfs": CACHE / f"usr/lib/debug/lib/modules/{RELEASE}/kernel/fs/xfs/xfs.ko",
}
MIB = 1 << 20
# Runs of llvm-symbolizer per batch (its median time is the baseline).
LLVM_RUNS = 3

Frames = list[tuple[str, str | None, int]]

_FETCH = f"""set -e
[ -f {VMLINUX} ] && [ -f {MODULES["brd"]} ] && [ -f {MODULES["xfs"]} ] && exit 0
mkdir -p {CACHE}
tmp=$(mktemp -d /var/cache/kreld-vm/dl.XXXXXX); chmod 0777 "$tmp"; cd "$tmp"
apt-get download -qq linux-image-{RELEASE}-dbg
dpkg-deb --fsys-tarfile ./*.deb | tar -x -C {CACHE} ./{VMLINUX.relative_to(CACHE)} \
    ./{MODULES["brd"].relative_to(CACHE)} ./{MODULES["xfs"].relative_to(CACHE)}
cd /; rm -rf "$tmp"
"""


def ensure_debug_files() -> bool:
    if VMLINUX.exists() and all(p.exists() for p in MODULES.values()):
        return True
    log(f"fetching linux-image-{RELEASE}-dbg into {CACHE}")
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    cp = subprocess.run(["flock", str(LOCK), "sh", "-c", _FETCH], capture_output=True, text=True)
    if cp.returncode != 0:
        log(f"cannot fetch the -dbg package: {cp.stderr[-500:]}")
    return VMLINUX.exists() and all(p.exists() for p in MODULES.values())


class _Child:
    """A child whose peak RSS is read from wait4 (Popen.wait would reap it
    first); input and output go through files, so neither side blocks."""

    @staticmethod
    def run(
        argv: list[str], stdin: bytes | None = None, ok: tuple[int, ...] = (0,)
    ) -> tuple[float, int, bytes]:
        with tempfile.TemporaryFile() as fin, tempfile.TemporaryFile() as fout:
            fin.write(stdin or b"")
            fin.seek(0)
            t0 = time.perf_counter()
            p = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=subprocess.PIPE)
            err = p.stderr.read()  # type: ignore[union-attr]
            _, status, usage = os.wait4(p.pid, 0)
            dt = time.perf_counter() - t0
            p.returncode = os.waitstatus_to_exitcode(status)
            if p.returncode not in ok:
                raise RuntimeError(
                    f"{argv[:3]} exited {p.returncode}: {err.decode(errors='replace')[-1500:]}"
                )
            fout.seek(0)
            return dt, usage.ru_maxrss * 1024, fout.read()


def text_range(path: Path, section: str) -> tuple[int, int]:
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        s = ELFFile(f).get_section_by_name(section)
        return int(s["sh_addr"]), int(s["sh_size"])


def code_sections(path: Path) -> dict[str, int]:
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        return {
            s.name: int(s["sh_size"])
            for s in ELFFile(f).iter_sections()
            if s["sh_flags"] & 0x4 and s["sh_size"] > 0  # SHF_EXECINSTR
        }


def dwarf_bytes(path: Path) -> int:
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        return sum(
            int(s["sh_size"]) for s in ELFFile(f).iter_sections() if s.name.startswith(".debug_")
        )


def _norm(path: str) -> str | None:
    return normalize_path("", "", path) if path and path != "??" else None


def llvm_frames(out: bytes) -> list[Frames]:
    res = []
    for line in out.decode().splitlines():
        if not line.strip():
            continue
        syms = json.loads(line)["Symbol"]
        res.append([(s["FunctionName"], _norm(s["FileName"]) if s["Line"] else None, s["Line"])
                    for s in syms])  # fmt: skip
    return res


def eu_frames(out: bytes) -> tuple[list[Frames], list[bool]]:
    """The frames of each address of an ``eu-addr2line -a -i -f`` run, and
    whether eu contradicts itself there (:func:`_eu_contradicts`)."""
    res: list[Frames] = []
    said: list[tuple[str, str | None, int] | None] = []
    lines = out.decode(errors="replace").splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("0x"):
            res.append([])
            said.append(None)
            i += 1
            continue
        func, _, inlined = lines[i].partition(" inlined at ")
        if inlined and not res[-1]:
            # "F inlined at FILE:LINE[:COL] in CALLER": the first frame's own
            # word on its caller.
            m = re.fullmatch(r"(.*?):(\d+)(?::\d+)? in (.*)", inlined)
            if m:
                said[-1] = (m.group(3), _norm(m.group(1)), int(m.group(2)))
        m = re.fullmatch(r"(.*?):(\d+)(?::\d+)?", lines[i + 1] if i + 1 < len(lines) else "")
        file, line = (m.group(1), int(m.group(2))) if m else ("??", 0)
        res[-1].append((func, _norm(file) if line else None, line))
        i += 2
    return res, [_eu_contradicts(fr, caller) for fr, caller in zip(res, said, strict=True)]


def _eu_contradicts(frames: Frames, caller: tuple[str, str | None, int] | None) -> bool:
    """Whether eu-addr2line's two answers at an address disagree: its first
    line names the innermost scope's function and, where that is inlined,
    its caller and call site (libdw's ``dwarf_getscopes`` of the address);
    the ``-i`` lines after it walk up from the innermost scope's DIE
    (``dwarf_getscopes_die``), which at a few addresses (a lexical block of an
    inlined instance, a range shared by two instances) gives another chain.
    There the DWARF's word is the first line's, and llvm-symbolizer's."""
    if not frames or frames[0][0] in ("", "??"):
        return False
    if caller is None:
        return len(frames) > 1
    return len(frames) < 2 or frames[1] != caller


@dataclass
class Sample:
    """A small and a big set of addresses (or of (section, offset) keys of a
    module), the reference's answers at each, and its times for each, in the
    same run: its loaded rate is the big set's minus the small set's."""

    small: list[Any]
    big: list[Any]
    refs_small: list[Frames]
    refs_big: list[Frames]
    t_small: float
    t_big: float
    rss_small: int = 0
    # A module's picks where eu-addr2line contradicts itself (_eu_contradicts).
    contradicts: set[Any] = field(default_factory=set)

    @property
    def loaded_rate(self) -> float:
        return (len(self.big) - len(self.small)) / max(self.t_big - self.t_small, 1e-9)


def _sets(
    draw: Callable[[int], list[Any]], quick: bool, sizes: tuple[int, int, int]
) -> tuple[list[Any], list[Any]]:
    """The big set (*sizes*: big, quick big, small) drawn sorted, and every
    so many of it as the small one."""
    big_n, quick_n, small_n = sizes
    big = sorted(draw(quick_n if quick else big_n))
    return big[:: len(big) // small_n][:small_n], big


def vmlinux_sample(quick: bool) -> Sample:
    """Random addresses of vmlinux's .text (10,000 and 100,000), named by
    ``llvm-symbolizer --inlines``, a process per set."""
    rng = random.Random(28)
    lo, size = text_range(VMLINUX, ".text")
    small, big = _sets(
        lambda n: [rng.randrange(lo, lo + size) for _ in range(n)], quick, (100_000, 20_000, 10_000)
    )
    llvm = ["llvm-symbolizer", "--inlines", "--output-style=JSON", "-e", str(VMLINUX)]
    runs = 1 if quick else LLVM_RUNS
    log(f"llvm-symbolizer, {len(small)} and {len(big)}, {runs} times each, in turn")
    small_in, big_in = ("\n".join(map(hex, s)).encode() for s in (small, big))
    t_small, rss, out_small = _Child.run(llvm, small_in)
    t_big, _, out_big = _Child.run(llvm, big_in)
    times_small, times_big = [t_small], [t_big]
    for _ in range(runs - 1):
        times_small.append(_Child.run(llvm, small_in)[0])
        times_big.append(_Child.run(llvm, big_in)[0])
    log(f"  its times (s): {[round(t, 2) for t in times_small]}, "
        f"{[round(t, 2) for t in times_big]}")  # fmt: skip
    return Sample(small, big, llvm_frames(out_small), llvm_frames(out_big),
                  statistics.median(times_small), statistics.median(times_big), rss)  # fmt: skip


def module_picks(path: Path, n: int, rng: random.Random) -> list[tuple[str, int]]:
    """*n* random (section, offset) of a module's code sections, each
    section's share by its size, but some of every section."""
    sections = code_sections(path)
    total = sum(sections.values())
    picks: list[tuple[str, int]] = []
    for sec, size in sections.items():
        k = max(n * size // total, min(50, size))
        picks += [(sec, rng.randrange(size)) for _ in range(k)]
    return picks


def eu_run(
    path: Path, picks: list[tuple[str, int]], contradicts: set[tuple[str, int]] | None = None
) -> tuple[float, list[Frames]]:
    """``eu-addr2line -i -f -j SECTION`` on *picks*, a run per section
    (offsets on its input), its time summed; the answers in *picks*' order.
    The picks where it contradicts itself are added to *contradicts*."""
    took = 0.0
    by_pick: dict[tuple[str, int], Frames] = {}
    for sec in dict.fromkeys(s for s, _ in picks):
        offs = sorted({o for s, o in picks if s == sec})
        # Exit 1 where some offset has no line.
        dt, _, out = _Child.run(["eu-addr2line", "-a", "-i", "-f", "-j", sec, "-e", str(path)],
                                "\n".join(map(hex, offs)).encode(), ok=(0, 1))  # fmt: skip
        took += dt
        frames, odd = eu_frames(out)
        by_pick.update(((sec, o), fr) for o, fr in zip(offs, frames, strict=True))
        if contradicts is not None:
            contradicts.update((sec, o) for o, c in zip(offs, odd, strict=True) if c)
    return took, [by_pick[p] for p in picks]


def llvm_on_text(path: Path, picks: list[tuple[str, int]]) -> dict[tuple[str, int], Frames]:
    """``llvm-symbolizer --inlines`` on a relocatable module, at the picks it
    can name without doubt: offsets of ``.text`` past the end of every other
    code section (it takes every section to start at 0, and mixes them
    where more than one holds an offset: llvm/llvm-project#71008)."""
    sections = code_sections(path)
    past = max((size for sec, size in sections.items() if sec != ".text"), default=0)
    sure = sorted({o for s, o in picks if s == ".text" and o >= past})
    if not sure:
        return {}
    _, _, out = _Child.run(["llvm-symbolizer", "--inlines", "--output-style=JSON", "-e",
                            str(path)], "\n".join(map(hex, sure)).encode())  # fmt: skip
    return {(".text", o): fr for o, fr in zip(sure, llvm_frames(out), strict=True)}


def module_sample(name: str, path: Path, quick: bool, with_big: bool = True) -> Sample:
    """Random (section, offset) of a module's code (1,000 and 10,000: elfutils
    takes seconds a thousand in a large module), named by eu-addr2line (the
    big set only *with_big*)."""
    rng = random.Random(name)
    small, big = _sets(lambda n: module_picks(path, n, rng), quick, (10_000, 3_000, 1_000))
    log(f"{name}.ko: eu-addr2line, {len(small)}" + (f" and {len(big)}" if with_big else ""))
    odd: set[tuple[str, int]] = set()
    t_small, refs_small = eu_run(path, small, odd)
    t_big, refs_big = eu_run(path, big, odd) if with_big else (float("nan"), [])
    return Sample(small, big, refs_small, refs_big, t_small, t_big, contradicts=odd)


def named(ref: Frames) -> bool:
    return bool(ref) and ref[0][0] not in ("", "??")


# The cold run: a fresh interpreter builds the table and names the addresses,
# then keeps the table (as the daemon does: the answer first, the lines of
# gcc's merged functions read meanwhile only where asked, the rest before the
# table is kept), printing its build seconds, the wall-clock time it answered
# at, the answers, then the table's bytes.
_COLD = r"""
import sys, json, time, numpy as np
from pathlib import Path
from kreld.debuginfo.lines_build import build_line_table
t0 = time.perf_counter()
table = build_line_table(Path(sys.argv[1]))
t1 = time.perf_counter()
addrs = [int(x, 16) for x in sys.stdin.read().split()]
sections = json.loads(Path(sys.argv[3]).read_text()) if len(sys.argv) > 3 else None
if sections:  # (section, offset) picks: no address where the section has none
    addrs = [table.section_address(*sections[k]) for k in addrs]
known = [a for a in addrs if a is not None]
chains = iter(table.frames_at(np.array(known, dtype=np.uint64)))  # all at once, as Resolve does
out = [[(f.function, f.file, f.line) for f in next(chains)] if a is not None else []
       for a in addrs]
answered = time.time()
Path(sys.argv[2]).write_bytes(table.to_bytes())
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(json.dumps({"build": t1 - t0, "answered": answered, "frames": out,
                  "hwm": int(hwm) * 1024, "reader": table.reader_peak_rss}))
"""


def cold_kreld(
    path: Path, table_path: Path, addrs: list[int]
) -> tuple[float, tuple[int, int], tuple[float, float], list[Frames]]:
    """The time from the start of a fresh process until it answered, its
    peaks (its own, the reader's), the build's seconds and the whole
    process's (the table kept after the answer), and the answers."""
    began = time.time()
    dt, rss, out = _Child.run(
        [venv_python(), "-c", _COLD, str(path), str(table_path)],
        "\n".join(hex(a) for a in addrs).encode(),
    )
    res = json.loads(out)
    del rss  # wait4's peak counts the forked bench before exec: the child's own VmHWM instead
    frames = [[tuple(f) for f in fr] for fr in res["frames"]]
    return (res["answered"] - began, (res["hwm"], res["reader"]), (res["build"], dt),
            frames)  # type: ignore[return-value]  # fmt: skip


def no_line_only(ours: list[Frames], refs: list[Frames]) -> int:
    """Where the answers differ only because the reference has a line from the
    DWARF line program alone (assembly, functions symbolic does not read) and
    kreld gives the same function without one."""
    return sum(
        1
        for o, r in zip(ours, refs, strict=True)
        if named(r)
        and len(r) == 1
        and r[0][2] > 0
        and [tuple(x) for x in o] == [(r[0][0], None, 0)]
    )


def inner_missing(ours: list[Frames], refs: list[Frames]) -> int:
    """Where kreld's chain is the reference's without its innermost frames
    (at the start of a ``.cold`` part: symbolic drops the line-program row
    begun before it, and the inlined frames with it; test_lines_real)."""
    return sum(
        1
        for o, r in zip(ours, refs, strict=True)
        if named(r)
        and 0 < len(o) < len(r)
        and [tuple(x) for x in o] == [tuple(x) for x in r[len(r) - len(o) :]]
    )


def compare(ours: list[Frames], refs: list[Frames], what: str, addrs: list[int]) -> tuple[int, int]:
    compared = equal = 0
    shown = 0
    for a, o, r in zip(addrs, ours, refs, strict=True):
        if not named(r):
            continue
        compared += 1
        if [tuple(x) for x in o] == [tuple(x) for x in r]:
            equal += 1
        elif shown < 5:
            shown += 1
            log(f"  {what} differs at {a:#x}: ours {o} ref {r}")
    return equal, compared


def same_chain(ours: Frames, llvm: Frames) -> bool:
    """*ours* is llvm-symbolizer's chain on a relocatable module, but for the
    outermost function's name: llvm takes that from the symbol table, where
    every section of such a file starts at 0 (a data symbol may be named),
    eu-addr2line and kreld from the DWARF."""
    a, b = [tuple(x) for x in ours], [tuple(x) for x in llvm]
    return len(a) == len(b) > 0 and a[:-1] == b[:-1] and a[-1][1:] == b[-1][1:]


def eu_settled(
    path: Path, ours: list[Frames], ref: Sample, refs: list[Frames], picks: list[Any]
) -> tuple[int, int, int]:
    """Where *ours* differs from eu-addr2line's *refs* at *picks* (of
    *ref*): how many, at how many of those eu contradicts itself, and at how
    many ours is llvm-symbolizer's chain (:func:`llvm_on_text`,
    :func:`same_chain`)."""
    differ = [k for k, (o, r) in enumerate(zip(ours, refs, strict=True))
              if named(r) and [tuple(x) for x in o] != [tuple(x) for x in r]]  # fmt: skip
    odd = sum(1 for k in differ if picks[k] in ref.contradicts)
    llvm = llvm_on_text(path, [picks[k] for k in differ])
    settled = sum(1 for k in differ if picks[k] in llvm and same_chain(ours[k], llvm[picks[k]]))
    return len(differ), odd, settled


def ensure_drgn() -> bool:
    """drgn importable: installed into the bench's virtualenv from the
    ``bench`` extra of pyproject.toml where it is not (a baseline of the
    benches only, never a dependency of the daemon)."""
    try:
        import drgn  # noqa: F401
    except ImportError:
        import tomllib

        meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
        wanted = meta["project"]["optional-dependencies"]["bench"]
        log(f"installing the bench extra: {' '.join(wanted)}")
        cp = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *wanted],
                            capture_output=True, text=True)  # fmt: skip
        if cp.returncode != 0:
            log(f"cannot install {wanted}: {cp.stderr[-500:]}")
            return False
    return True


def drgn_frames(path: Path, addrs: list[int], lo: int, hi: int) -> tuple[float, list[Frames]]:
    """drgn's answers (``Program.source_location`` on *path* loaded as an
    extra module spanning [*lo*, *hi*)), or NaN seconds where drgn cannot be
    installed."""
    if not ensure_drgn():
        return float("nan"), [[] for _ in addrs]
    import drgn

    t0 = time.perf_counter()
    prog = drgn.Program(drgn.host_platform)
    mod = prog.extra_module(str(path), create=True)
    mod.address_range = (lo, hi)
    mod.try_file(str(path), force=True)
    out: list[Frames] = []
    for a in addrs:
        try:
            out.append([(s.name() or "??", s.filename, s.line) for s in prog.source_location(a)])
        except LookupError:
            out.append([])
    return time.perf_counter() - t0, out


def vmlinux_results(quick: bool, work: Path) -> list[Result]:
    ref = vmlinux_sample(quick)
    small, big, refs_small, refs_big = ref.small, ref.big, ref.refs_small, ref.refs_big
    l10, lrss, loaded_rate = ref.t_small, ref.rss_small, ref.loaded_rate
    lo, size = text_range(VMLINUX, ".text")
    log("kreld cold: build the table and name the 10,000 in a fresh process")
    table_path = work / "vmlinux.lines"
    c_dt, (c_rss, c_reader), c_build, ours_small = cold_kreld(VMLINUX, table_path, small)
    blob = table_path.read_bytes()
    table = LineTable.from_bytes(blob)
    log("kreld warm: chains of the whole set from the loaded table")
    arr = np.array(big, dtype=np.uint64)
    table.frame_columns(arr)
    reps = []
    for _ in range(5):
        t0 = time.perf_counter()
        table.frame_columns(arr)
        reps.append(time.perf_counter() - t0)
    warm_rate = len(big) / sorted(reps)[len(reps) // 2]
    ours_big = [[(f.function, f.file, f.line) for f in fr] for fr in table.frames_at(arr)]
    eq_s, n_s = compare(ours_small, refs_small, "vmlinux", small)
    eq_b, n_b = compare(ours_big, refs_big, "vmlinux", big)
    nl_b = no_line_only(ours_big, refs_big)
    log("drgn, the 10,000")
    d_dt, d_frames = drgn_frames(VMLINUX, small, lo, lo + size)
    d_eq = sum(
        1
        for o, d, r in zip(ours_small, d_frames, refs_small, strict=True)
        if named(r) and [(f, n) for f, _, n in o] == [(f, n) for f, _, n in d]
    )
    dwarf = dwarf_bytes(VMLINUX)
    llvm_desc = "llvm-symbolizer --inlines on the same addresses, same run"
    return [
        Result("vmlinux cold: build + name 10,000 (a fresh process, until answered), vs "
               "llvm-symbolizer 10,000", c_dt * 1e9, "ns", l10 * 1e9, "llvm", llvm_desc, "<= 2x",
               c_dt <= 2 * l10,
               notes=[f"of which the table build {c_build[0]:.2f} s; the process with the table "
                      f"kept after the answer: {c_build[1]:.2f} s"]),
        Result("vmlinux cold: the DWARF reader's peak RSS (MiB, its own process), vs "
               "llvm-symbolizer's", c_reader / MIB, "", lrss / MIB, "llvm", llvm_desc,
               "<= 512 MiB", c_reader <= 512 * MIB),
        Result("vmlinux cold: kreld's own peak RSS (MiB) beside the reader", c_rss / MIB, "",
               goal="<= 512 MiB", met=c_rss <= 512 * MIB),
        Result("vmlinux warm: addresses/s (chains, in process), vs llvm loaded rate", warm_rate, "",
               loaded_rate, "llvm-loaded", "llvm-symbolizer: (N - 10,000) / (t(N) - t(10,000))",
               ">= 5x", warm_rate >= 5 * loaded_rate),
        Result("vmlinux table bytes, vs its DWARF sections", len(blob), "", dwarf, "dwarf",
               ".debug_* sections of vmlinux", "<= 1/4", len(blob) * 4 <= dwarf),
        Result(f"vmlinux answers equal to llvm-symbolizer, {n_s} named of 10,000", eq_s, "", n_s,
               "named", "addresses llvm-symbolizer names a function at", "all", eq_s == n_s),
        Result(f"vmlinux answers equal to llvm-symbolizer, {n_b} named of {len(big)}", eq_b, "",
               n_b, "named", "", "all", eq_b == n_b),
        Result("  of the rest: the reference's function, no line (line program only)", nl_b, "",
               n_b - eq_b, "differing", "addresses where the answers differ"),
        Result("  of the rest: the reference's chain without its innermost frames (a .cold start)",
               inner_missing(ours_big, refs_big), "", n_b - eq_b, "differing"),
        Result("drgn 10,000 (s), vs llvm-symbolizer 10,000", d_dt * 1e9, "ns", l10 * 1e9, "llvm",
               llvm_desc, notes=[f"drgn agrees with kreld on function, line at {d_eq} of {n_s}"]),
    ]  # fmt: skip


def module_results(name: str, path: Path, quick: bool, work: Path) -> list[Result]:
    ref = module_sample(name, path, quick, with_big=False)
    picks, refs, eu_t = ref.small, ref.refs_small, ref.t_small
    keys = list(range(len(picks)))
    picks_file = work / f"{name}.picks.json"
    picks_file.write_text(json.dumps(picks))
    argv = [venv_python(), "-c", _COLD, str(path), str(work / f"{name}.lines"), str(picks_file)]
    c_dt, _, out = _Child.run(argv, "\n".join(hex(k) for k in keys).encode())
    res = json.loads(out)
    c_rss, c_reader = res["hwm"], res["reader"]
    ours = [[tuple(f) for f in fr] for fr in res["frames"]]
    eq, n = compare(ours, refs, name, keys)  # type: ignore[arg-type]
    nl = no_line_only(ours, refs)  # type: ignore[arg-type]
    blob = (work / f"{name}.lines").stat().st_size
    dwarf = dwarf_bytes(path)
    desc = "eu-addr2line -i -f -j SECTION, one run per section, same offsets"
    return [
        Result(f"{name}.ko cold: build + name {len(picks)} (section, offset)", c_dt * 1e9, "ns",
               eu_t * 1e9, "eu", desc, notes=[f"table build {res['build']:.2f} s"]),
        Result(f"{name}.ko peak RSS building (MiB): the DWARF reader's process", c_reader / MIB,
               "", goal="<= 512 MiB", met=c_reader <= 512 * MIB),
        Result(f"{name}.ko peak RSS building (MiB): kreld's own beside it", c_rss / MIB, "",
               goal="<= 512 MiB", met=c_rss <= 512 * MIB),
        Result(f"{name}.ko table bytes, vs its DWARF sections", blob, "", dwarf, "dwarf",
               ".debug_* sections of the module", "<= 1/4", blob * 4 <= dwarf),
        Result(f"{name}.ko answers equal to eu-addr2line, {n} named", eq, "", n, "named",
               "offsets eu-addr2line names a function at", "all", eq == n,
               notes=[f"{name}: at {nl} of the {n - eq} others, the reference's function "
                      "without a line (only the line program covers it)"]),
    ]  # fmt: skip


def run(quick: bool) -> list[Result]:
    """Line tables of Debian's kernel debug files against llvm-symbolizer, drgn, eu-addr2line."""
    if not ensure_debug_files():
        log("no -dbg files: nothing measured")
        return []
    with tempfile.TemporaryDirectory(prefix="bench-lines-") as tmp:
        work = Path(tmp)
        results = vmlinux_results(quick, work)
        for name, path in MODULES.items():
            log(f"{name}.ko")
            results += module_results(name, path, quick, work)
    return results


if __name__ == "__main__":
    sys.exit(bench_main("lines", run))
