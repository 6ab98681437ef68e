"""``kreldctl export kallsyms --for perf.data`` and ``kreldctl symbolize --for perf.data``.

Both find the recording's boot in the store (:mod:`kreld.perf.match`), with
no ``--boot``.  The export gives perf a kallsyms with the kernel at that boot's
addresses and each module at the load the recording saw.  perf writes module
maps only when recording starts, so ``perf script`` shows a sample in a module
loaded later as ``[unknown]``; the symbolizer names it from the load kreld
recorded live at the sample's own time, and leaves every other line as it was.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TextIO

from kreld.core.errors import SymbolsUnavailable
from kreld.core.record import record, replace
from kreld.core.symtab import SymbolTables
from kreld.core.textin import Line
from kreld.perf.match import BootMatch, SampleClock, match_boot
from kreld.perf.reader import KERNEL_MAP_PREFIX, PerfHeader
from kreld.store.bootsource import BootSource
from kreld.symbols.export import module_key, render_kallsyms
from kreld.symbols.kernel_code import CodeIndex, code_history, kallsyms_lines
from kreld.symbols.late_loads import possibly_held, shadows
from kreld.symbols.queries import Region, init_live_at, is_init_section, module_regions

__all__ = [
    "INIT_WINDOW_NS",
    "Frame",
    "LinesHook",
    "ScriptNamer",
    "Symbolizer",
    "export_for",
    "find_boot",
    "symbolize_for",
    "symbolize_lines",
]

# Module maps without a recorded load named one by one; the rest are counted.
WARNINGS_SHOWN = 10


def find_boot(store: BootSource, h: PerfHeader, err: TextIO) -> BootMatch:
    """The recording's boot, said on *err* with what did not match."""
    if h.scan_limit is not None:
        print(
            f"kreldctl: warning: {h.path}: stopped reading its synthesized records at the "
            f"{h.scan_limit} limit, before their end",
            file=err,
        )
    m = match_boot(h, store.list_boots(), store.incarnations, store.hostname)
    print(
        f"kreldctl: {h.path}: boot {m.boot.boot_id} (release {m.boot.release}); "
        f"{len(m.modules) - len(m.missing)} of {len(m.modules)} module maps matched a "
        "recorded load",
        file=err,
    )
    missing = m.missing
    for mm in missing[:WARNINGS_SHOWN]:
        print(
            f"kreldctl: warning: no recorded load of {mm.name} at {mm.start:#x}: "
            "its symbols are left out",
            file=err,
        )
    if len(missing) > WARNINGS_SHOWN:
        print(
            f"kreldctl: warning: and {len(missing) - WARNINGS_SHOWN:,} more module maps "
            "with no recorded load: their symbols are left out",
            file=err,
        )
    return m


def export_for(store: BootSource, h: PerfHeader, err: TextIO) -> str:
    """A kallsyms for *h*: its boot's kernel, and the module loads it recorded."""
    m = find_boot(store, h, err)
    boot = m.boot
    rec = store.boot_symbols(boot.boot_id)
    if rec is None or boot.anchors.text is None:
        raise SymbolsUnavailable(boot.boot_id, "kallsyms was not captured for it")
    # The kernel lists modules newest first (each load goes to the list head).
    incs = sorted(m.chosen, key=lambda i: (i.loaded.monotonic, i.seq), reverse=True)
    kernel_key = rec.kernel
    keys = {kernel_key} | {k for i in incs if (k := module_key(i)) is not None}
    absolutes = store.absolutes(boot.boot_id)
    clock = m.clock
    extras = kallsyms_lines(code_history(store, boot.boot_id), rec.extras, clock.clock, clock.start)
    return store.with_tables(
        keys,
        lambda tables: render_kallsyms(
            boot.anchors.text or 0,
            tables,
            kernel_key,
            incs,
            extras,
            clock.clock,
            clock.start,
            absolutes,
        ),
    )


# A frame perf could not name: "<address> [unknown] (<dso>)", on a sample's
# own line (no call chains) or on a line of its call chain.
# The DSO ends at the next "(" and is bounded (a path: PATH_MAX), so that a line
# of unclosed "(" costs each candidate frame a few bytes, not the rest of the line
# (a kernel image's DSO, "[kernel.kallsyms]" or "[brd]", has no parenthesis).
_UNKNOWN_FRAME = re.compile(r"\b([0-9a-f]{16}) \[unknown\] \(([^()\n]{0,4096})\)")
# A sample's time on its first line: "comm pid [cpu] 5291.345926: ..."; seconds
# are bounded (2^64 ns is 20 digits of nanoseconds) so that int() is too.
_SAMPLE_TIME = re.compile(r"\s(\d{1,20})\.(\d{1,9}):(?=\s|$)")
_KERNEL_HALF = 0xFFFF800000000000


def _base(r: Region) -> int:
    return r.base


def _parse_time(m: re.Match[str]) -> int:
    return int(m.group(1)) * 1_000_000_000 + int(m.group(2).ljust(9, "0"))


# How long before a load's recorded time a sample may still be in its init
# (brd allocating its ram disks under emulation takes a good part of a second).
INIT_WINDOW_NS = 10_000_000_000


@record
class Frame:
    symbol: str  # "func+0x1f", or "[unknown]" when no symbol covers it
    dso: str  # perf's name of the image: "[kernel.kallsyms]", "[brd]"
    possible: bool = False  # a module possibly loaded then (its load seen late)


class Symbolizer:
    """Names addresses of one boot at sample times, from its recorded loads.

    With an exact sample clock the load live at the sample's time holds the
    address (or, where none was, the load recorded there next, whose init was
    running: see :meth:`_initializing`); otherwise (perf's ``local_clock()``)
    the loads the recording saw come first, then the load whose lifetime lies
    nearest the sample's time read as monotonic.
    """

    def __init__(
        self,
        match: BootMatch,
        tables: SymbolTables,
        kernel_key: str | None,
        code: CodeIndex | None = None,
    ) -> None:
        self.clock: SampleClock = match.clock
        self.code = code
        self.tables = tables
        self.seen = {c.inc.seq for c in match.modules if c.inc is not None}
        b = match.boot.anchors
        regions: list[Region] = []
        if b.text is not None and b.etext is not None:
            regions.append(Region(b.text, b.etext, "kernel", ".text", None, kernel_key, b.text))
        if b.text is not None and b.sinittext is not None and b.einittext is not None:
            regions.append(
                Region(b.sinittext, b.einittext, "kernel", ".init.text", None, kernel_key, b.text)
            )
        for inc in match.incarnations:
            regions.extend(module_regions(inc, inc.init_live))
        self.regions = regions
        self._holders: dict[int, list[Region]] = {}
        self._marked: dict[int, Region] = {}  # id of a region -> it marked possible

    def _live(self, r: Region, t: int) -> bool:
        inc, clock = r.inc, self.clock.clock
        if inc is None:
            return True
        if not inc.loaded_at(clock, t):
            return False
        return not is_init_section(r.section) or init_live_at(inc, clock, t)

    def _rank(self, r: Region, t: int) -> tuple[int, int, int, int]:
        inc = r.inc
        if inc is None:
            return (0, 0, 0, 0)
        lo = inc.loaded.monotonic
        hi = None if inc.unloaded is None else inc.unloaded.monotonic
        gap = lo - t if t < lo else (t - hi if hi is not None and t >= hi else 0)
        return (0 if inc.seq in self.seen else 1, gap, -r.base, -inc.seq)

    def region(self, address: int, t: int | None) -> Region | None:
        holders = self._holders.get(address)
        if holders is None:
            holders = [r for r in self.regions if r.base <= address < r.limit]
            self._holders[address] = holders
        if not holders:
            return None
        if t is None:
            return holders[0] if len(holders) == 1 else None
        if self.clock.exact:
            return self._held_at(holders, t)
        return min(holders, key=lambda r: self._rank(r, t))

    def _held_at(self, holders: list[Region], t: int) -> Region | None:
        """Of the regions whose extent holds an address, the one that held it
        at *t* (an exact sample time).  Extents are bounds, bases exact, and
        regions resident at once never overlap: of those certainly there, the
        nearest base below the address; a load possibly there then and higher
        (see :func:`shadows`) comes before it, marked."""
        clock = self.clock.clock
        live = max((r for r in holders if self._live(r, t)), key=_base, default=None)
        maybe = [
            r
            for r in holders
            if possibly_held(r, clock, t) and (live is None or not shadows(live, r, clock))
        ]
        if len(maybe) > 1:  # two loads possibly there: neither, never a guess
            return live
        if maybe and (live is None or maybe[0].base > live.base):
            return self._possible(maybe[0])
        if live is not None:
            return live
        return self._initializing(holders, t)

    def _possible(self, r: Region) -> Region:
        """*r* marked possible: its load is known only as an interval (seen by
        the poll, a uevent or kreld's start) and the sample lies in it, so it is
        named as Resolve names it then, marked; two loads possibly there name
        neither (never a guess between them)."""
        marked = self._marked.get(id(r))
        if marked is None:
            marked = self._marked[id(r)] = replace(r, possible=True)
        return marked

    def _initializing(self, holders: list[Region], t: int) -> Region | None:
        """A sample in module memory that no recorded load held at *t*: the module
        was still running its init, which comes before the ``add`` uevent (on
        current kernels) and so before the time kreld records the load at.  The
        load recorded next at that address, if it came within INIT_WINDOW_NS."""
        clock = self.clock.clock
        later = [
            (r.inc.loaded.on(clock), r)
            for r in holders
            if r.inc is not None and 0 < r.inc.loaded.on(clock) - t <= INIT_WINDOW_NS
        ]
        return min(later, key=lambda x: x[0])[1] if later else None

    def frame(self, address: int, t: int | None) -> Frame | None:
        r = self.region(address, t)
        if r is None:
            return self._code_frame(address, t)
        dso = KERNEL_MAP_PREFIX if r.inc is None else f"[{r.image}]"
        table = self.tables.get(r.table) if r.table else None
        sec = None if table is None else (0 if r.inc is None else table.section_index(r.section))
        hit = None if table is None or sec is None else table.lookup(sec, address - r.rel_base)
        if hit is None:
            return Frame("[unknown]", dso)
        return Frame(f"{hit[0]}+{hit[1]:#x}", dso, r.possible)

    def _code_frame(self, address: int, t: int | None) -> Frame | None:
        """A BPF program, trampoline, ftrace or kprobe page certainly at *address*
        at the sample's time (kreld/symbols/kernel_code.py): never a guess."""
        if self.code is None:
            return None
        c = self.code.at(address, self.clock.clock, t if self.clock.exact else None)
        return None if c is None else Frame(f"{c.name}+{address - c.addr:#x}", f"[{c.owner}]")


class ScriptNamer:
    """``perf script`` output a line at a time: the time of the sample line
    last read, and each kernel frame perf left ``[unknown]`` named at it.  A
    frame named from a load possibly there then (:meth:`Symbolizer._possible`)
    says so after its symbol: ``brd_init+0x4 (possible) ([brd])``, its DSO
    still perf's own spelling, last, as perf script's readers take it."""

    def __init__(self, sym: Symbolizer) -> None:
        self.sym = sym
        self.t: int | None = None
        self.named = self.seen = self.possible = 0

    def line(self, line: str) -> str:
        """A whole line as it is written out."""
        if not line.startswith("\t"):
            tm = _SAMPLE_TIME.search(line)
            if tm is not None:
                self.t = _parse_time(tm)
            elif line.strip():
                self.t = None  # a sample line without a time: its frames at no time
        if "[unknown]" in line:
            line = _UNKNOWN_FRAME.sub(self._replace, line)
        return line

    def _replace(self, m: re.Match[str]) -> str:
        address = int(m.group(1), 16)
        if address < _KERNEL_HALF:
            return m.group(0)
        self.seen += 1
        f = self.sym.frame(address, self.t)
        if f is None or (f.symbol == "[unknown]" and m.group(2) == f.dso):
            return m.group(0)
        named = f.symbol != "[unknown]"
        self.named += named
        self.possible += named and f.possible
        mark = " (possible)" if f.possible else ""
        return f"{m.group(1)} {f.symbol}{mark} ({f.dso})"

    def summary(self) -> str:
        said = f"named {self.named} of {self.seen} unknown kernel frames"
        if self.possible:
            said += f", {self.possible} of them possible (a module whose load kreld saw late)"
        return said


def symbolize_lines(lines: Iterable[Line], namer: ScriptNamer, out: TextIO) -> None:
    """Copy ``perf script`` output to *out*, naming the kernel frames perf left
    ``[unknown]`` (*namer* counts them).  Pieces of a line over the reader's
    limit (not whole) are copied unchanged."""
    for line, whole in lines:
        out.write(namer.line(line) if whole else line)


# symbolize --for --lines or --json: given the recording's boot, its symbolizer,
# the lines and the output, writes them with each kernel frame's source lines, or
# as JSON.
LinesHook = Callable[[BootMatch, ScriptNamer, Iterable[Line], TextIO], None]


def symbolize_for(
    store: BootSource,
    h: PerfHeader,
    lines: Iterable[Line],
    out: TextIO,
    err: TextIO,
    with_lines: LinesHook | None = None,
) -> int:
    """``perf script`` output of *h* from *lines* to *out*, unknown kernel frames
    named; with *with_lines*, written by it (source lines added, or JSON)."""
    m = find_boot(store, h, err)
    if not m.clock.exact:
        print(
            f"kreldctl: warning: {h.path} was not recorded with perf record -k "
            "monotonic|boottime|realtime: its sample times are on perf's local_clock(), "
            "not a clock kreld keeps, so modules loaded during the recording are placed "
            "at approximate times",
            file=err,
        )
    rec = store.boot_symbols(m.boot.boot_id)
    kernel_key = None if rec is None else rec.kernel
    keys: set[str] = {kernel_key} if kernel_key else set()
    keys |= {k for i in m.incarnations if (k := module_key(i)) is not None}

    code = CodeIndex(code_history(store, m.boot.boot_id))

    def run(tables: SymbolTables) -> ScriptNamer:
        namer = ScriptNamer(Symbolizer(m, tables, kernel_key, code))
        if with_lines is None:
            symbolize_lines(lines, namer, out)
        else:
            with_lines(m, namer, lines, out)
        return namer

    print(f"kreldctl: {store.with_tables(keys, run).summary()}", file=err)
    return 0
