"""``kreldctl inject -i IN.data -o OUT.data``: a perf.data that names what perf
could not, for every reader of perf.data.

``perf record`` maps only the modules of ``/proc/modules`` when it starts.  A
module loaded later leaves its samples ``[unknown]`` in every tool that reads
the perf.data (perf report, hotspot, pprof's converter).  OUT is IN with, for
each module incarnation kreld recorded on IN's boot (:mod:`kreld.perf.match`)
loaded while IN was recording:

* one kernel ``PERF_RECORD_MMAP`` of its ``.text`` (and the code sections the
  kernel lays after it, up to its first data section), named as perf names a
  module (``[brd]``), timed at the load on the recording's sample clock and
  placed in time order among the samples (:mod:`kreld.perf.rewrite`);
* its build-id in the build-id table (feature ``HEADER_BUILD_ID``);
* once per module name, a map of no size at the same base among perf's own
  records of the recording's start.  It claims no address; it is there because
  ``perf report --kallsyms`` gives a kallsyms file's module lines to the module
  maps that exist when it first reads the kernel's symbols (at the first kernel
  sample, ``maps__split_kallsyms`` in tools/perf/util/symbol.c) and drops the
  rest, so a module mapped only later would get no symbols from the file.  It
  also lets ``kreldctl export kallsyms --for OUT`` include the module.

A recording perf made while kallsyms was restricted (``kptr_restrict``) has no
kernel map at all: perf read zeros, so it wrote neither its
``[kernel.kallsyms]_text`` map nor a map per module, and no tool can name a
kernel sample of it.  Its boot is found by time (:mod:`kreld.perf.match`), and
OUT gets, among perf's own records of the start, the maps perf writes at
``kptr_restrict=0`` (:func:`start_records`): the kernel's, over ``_text`` to
``_etext`` with ``_text`` as its reference symbol, and one per module loaded
when the recording started.

:func:`ksymbol_records` is the seam for BPF programs, trampolines and other
out-of-line code: each becomes a ``PERF_RECORD_KSYMBOL`` registered at its load
and unregistered at its unload.  :func:`code_ksyms` gives it what kreld recorded
of the boot's kernel code: every record live at some time of the
recording whose length is known, from the first to the last time it was
certainly there, on the sample clock (only an exact sample clock places them;
a program only kallsyms showed has no length and is left out: perf would have
to guess its end).
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import TextIO

from kreld.core.errors import InvalidArgument
from kreld.core.kernel_code import OWNER_BPF
from kreld.core.model import Clock, Incarnation, hexaddr
from kreld.core.record import record
from kreld.core.safeout import safe_output
from kreld.core.symtab import SymbolTables
from kreld.perf.commands import find_boot
from kreld.perf.match import BootMatch, SampleClock
from kreld.perf.reader import read_perf_header
from kreld.perf.rewrite import Added, Recording, write_with
from kreld.perf.synth import AttrLayout, KsymType, build_id_entry, kernel_mmap, ksymbol
from kreld.store.bootsource import BootSource
from kreld.symbols.kernel_code import code_history
from kreld.symbols.queries import Region, is_init_section, module_regions

__all__ = [
    "KSYM_KINDS",
    "Ksym",
    "ModuleMapPlan",
    "Unloads",
    "code_ksyms",
    "inject",
    "ksymbol_records",
    "module_records",
    "plan_modules",
    "start_records",
    "text_range",
]

# kreld's kinds of out-of-line kernel code, as perf's ksym types.
KSYM_KINDS = {
    "bpf": KsymType.BPF,
    "bpf_prog": KsymType.BPF,
    "trampoline": KsymType.OOL,
    "ftrace_trampoline": KsymType.OOL,
    "kprobe_insn_page": KsymType.OOL,
    "ool": KsymType.OOL,
}
# (addr, len, kind, name, load_ns, unload_ns): one symbol of out-of-line code,
# times on the recording's sample clock (unload None: still live).
Ksym = tuple[int, int, str, str, int, int | None]


def _is_code(section: str) -> bool:
    return (
        section == ".text"
        or section.startswith(".text.")
        or section.endswith(".text")
        or section in (".altinstr_replacement", ".fixup")
    )


def text_range(inc: Incarnation) -> tuple[int, int] | None:
    """[start, end) of a load's ``.text`` and the code sections laid right after
    it, up to the first other section (sysfs gives bases, not sizes)."""
    text = inc.state.sections.get(".text")
    if not text or inc.state.restricted:
        return None
    by_base: dict[int, list[tuple[str, int]]] = {}
    for r in module_regions(inc, False):
        if r.base >= text:
            by_base.setdefault(r.base, []).append((r.section, r.limit))
    end = text
    for base in sorted(by_base):
        code = [limit for name, limit in by_base[base] if _is_code(name)]
        if base > end or not code:
            break
        end = max(end, *code)
    return (text, end) if end > text else None


@record
class ModuleMapPlan:
    inc: Incarnation
    start: int
    end: int
    time: int  # when the map begins, on the sample clock
    loaded: int  # when kreld saw the load (it was certainly there from then)

    @property
    def possible(self) -> bool:
        """Whether the map begins before the load was certain: a sample between
        is named from a load possibly there then (seen late by kreld)."""
        return self.time < self.loaded

    @property
    def name(self) -> str:
        return f"[{self.inc.name}]"


def plan_modules(m: BootMatch, span: tuple[int, int] | None, err: TextIO) -> list[ModuleMapPlan]:
    """The loads to map: those recorded after the recording's start, at or before
    its end, each mapped from the earliest moment its code may have run
    (:meth:`Unloads.map_time`); one whose map begins before kreld saw the load
    names the samples between as possible (:attr:`ModuleMapPlan.possible`)."""
    clock: SampleClock = m.clock
    if span is None:
        return []
    first, last = span
    start = clock.start if clock.start is not None else first
    start = min(start, first)
    seen = {c.inc.seq for c in m.modules if c.inc is not None}
    unloads = Unloads(m.incarnations, clock)
    plans: list[ModuleMapPlan] = []
    for inc in m.incarnations:
        t = inc.loaded.on(clock.clock)
        if inc.seq in seen or not start < t <= last:
            continue
        r = text_range(inc)
        if r is None:
            print(f"kreldctl: warning: {inc.name} (seq {inc.seq}): no .text address", file=err)
            continue
        plans.append(ModuleMapPlan(inc, r[0], r[1], max(start, unloads.map_time(inc, r)), t))
    return sorted(plans, key=lambda p: (p.time, p.inc.seq))


class Unloads:
    """The boot's unloads in time order, to find when a load's map may begin.

    kreld finds a load when the module's directory is up, often after its init
    ran and the uevent came, and later still on a busy host, while the recorded
    task may already run the module's code (``modprobe``, then I/O at once).
    The module was absent at ``loaded_after``, so its code ran no earlier; but
    an earlier occupant of the same range seen gone only after that time may
    have run there too, and the map then begins when it was seen gone: never a
    sample named after the wrong module."""

    def __init__(self, incarnations: Sequence[Incarnation], clock: SampleClock) -> None:
        self.clock = clock.clock
        gone = sorted(
            (i.unloaded.on(self.clock), i.seq, i) for i in incarnations if i.unloaded is not None
        )
        self.times = [g[0] for g in gone]
        self.gone = [g[2] for g in gone]

    def map_time(self, inc: Incarnation, text: tuple[int, int]) -> int:
        t = inc.loaded.on(self.clock)
        lo = t if inc.loaded_after is None else min(inc.loaded_after.on(self.clock), t)
        # Only unloads seen inside (lo, t] can move lo: a bisect, not a scan of the boot.
        for k in range(bisect_right(self.times, lo), bisect_right(self.times, t)):
            other = text_range(self.gone[k])
            overlaps = other is not None and other[0] < text[1] and text[0] < other[1]
            if overlaps and self.gone[k].seq != inc.seq:
                lo = max(lo, self.times[k])
        return lo


def module_records(
    plans: Sequence[ModuleMapPlan], rec: Recording, mapped: Sequence[str]
) -> tuple[list[Added], list[bytes]]:
    """The records and build-id entries for *plans*; *mapped* are the module
    names IN already maps (and so need no early map of no size)."""
    lay, e = rec.layout, rec.e
    added: list[Added] = []
    named = set(mapped)
    ids: dict[tuple[str, str], bytes] = {}
    for p in plans:
        if p.inc.name not in named:
            named.add(p.inc.name)
            added.append(Added(kernel_mmap(p.name, p.start, 0, lay.sample_id(0, e), e), None))
        mmap = kernel_mmap(p.name, p.start, p.end - p.start, lay.sample_id(p.time, e), e)
        added.append(Added(mmap, p.time))
        bid = p.inc.state.build_id
        if bid:
            ids.setdefault((p.name, bid), build_id_entry(p.name, bid, e))
    return added, list(ids.values())


KERNEL_MAP = "[kernel.kallsyms]_text"  # perf's kernel map, relative to _text


def start_records(
    m: BootMatch, rec: Recording, start: int, kernel_id: bool, err: TextIO
) -> tuple[list[Added], list[str], list[bytes]]:
    """For a recording with no kernel map: the kernel map and a map of each module
    loaded at *start* (on the sample clock), the modules' names, and build-id
    entries for those modules and (*kernel_id*: IN has none) the kernel."""
    boot, lay, e, clock = m.boot, rec.layout, rec.e, m.clock.clock
    text, etext = boot.anchors.text, boot.anchors.etext
    if text is None:  # match_boot takes no such boot for a recording without _text
        return [], [], []
    size = etext - text if etext is not None and etext > text else 0  # 0: perf takes the rest
    added = [Added(kernel_mmap(KERNEL_MAP, text, size, lay.sample_id(0, e), e, pgoff=text), None)]
    names: list[str] = []
    ids: list[bytes] = []
    if kernel_id and boot.build_id:
        ids.append(build_id_entry("[kernel.kallsyms]", boot.build_id, e))
    for inc in m.incarnations:
        gone = inc.unloaded is not None and inc.unloaded.on(clock) <= start
        if inc.loaded.on(clock) > start or gone:
            continue
        r = text_range(inc)
        if r is None:
            print(f"kreldctl: warning: {inc.name} (seq {inc.seq}): no .text address", file=err)
            continue
        name = f"[{inc.name}]"
        added.append(Added(kernel_mmap(name, r[0], r[1] - r[0], lay.sample_id(0, e), e), None))
        names.append(inc.name)
        if inc.state.build_id:
            ids.append(build_id_entry(name, inc.state.build_id, e))
    return added, names, ids


def ksymbol_records(symbols: Sequence[Ksym], layout: AttrLayout, endian: str = "<") -> list[Added]:
    """A ``PERF_RECORD_KSYMBOL`` registering each symbol at its load and, when
    it was unloaded, one unregistering it then (kinds: :data:`KSYM_KINDS`)."""
    out = []
    for addr, length, kind, name, load_ns, unload_ns in symbols:
        ktype = KSYM_KINDS.get(kind, KsymType.UNKNOWN)
        trailer = layout.sample_id(load_ns, endian)
        out.append(Added(ksymbol(addr, length, ktype, name, trailer, endian=endian), load_ns))
        if unload_ns is not None:
            trailer = layout.sample_id(unload_ns, endian)
            rec = ksymbol(addr, length, ktype, name, trailer, unregister=True, endian=endian)
            out.append(Added(rec, unload_ns))
    return out


def code_ksyms(store: BootSource, err: TextIO) -> Callable[[BootMatch], list[Ksym]]:
    """The kernel code of the matched boot as :data:`Ksym` (see the module's docstring)."""

    def ksyms(m: BootMatch) -> list[Ksym]:
        clock = m.clock
        if not clock.exact:
            print("kreldctl: warning: BPF programs need an exact sample clock", file=err)
            return []
        out: list[Ksym] = []
        for c in code_history(store, m.boot.boot_id).codes:
            if c.length is None:
                continue
            load = c.loaded.on(clock.clock)
            # Where the unload fell in a window, the code is claimed only up to
            # the last time it was certainly there.
            end = c.unloaded_after or c.unloaded
            unload = None if end is None else end.on(clock.clock)
            kind = "bpf" if c.owner == OWNER_BPF else "ool"
            out.append((c.addr, c.length, kind, c.name, load, unload))
        return out

    return ksyms


def init_text_ksyms(store: BootSource, plans: Sequence[ModuleMapPlan], clock: Clock) -> list[Ksym]:
    """The functions of each mapped load's init text, while its init ran.

    perf maps a module by one range and names its symbols relative to that
    range's start, and the init text is allocated apart from the core: it
    cannot be a second map of the module.  Each function there becomes
    out-of-line code of its own instead (``PERF_RECORD_KSYMBOL``), registered
    from the module's map and unregistered once kreld saw its init done (or
    the module gone), since the kernel frees init text then."""
    wanted: list[tuple[ModuleMapPlan, list[Region]]] = []
    for p in plans:
        regions = [r for r in module_regions(p.inc, True)
                   if is_init_section(r.section) and _is_code(r.section) and r.table]  # fmt: skip
        if regions and p.inc.init_live:
            wanted.append((p, regions))
    keys = {r.table for _, regions in wanted for r in regions if r.table is not None}
    if not keys:
        return []

    def named(tables: SymbolTables) -> list[Ksym]:
        out: list[Ksym] = []
        for p, regions in wanted:
            end = p.inc.init_done or p.inc.unloaded
            unload = None if end is None else end.on(clock)
            for r in regions:
                table = tables.get(r.table) if r.table is not None else None
                sec = None if table is None else table.section_index(r.section)
                if table is None or sec is None:
                    continue
                starts = sorted(
                    {r.rel_base + e.value for e in table if e.section == sec and e.type in "tT"}
                )
                for a, b in zip(starts, [*starts[1:], r.limit], strict=True):
                    if r.base <= a < min(b, r.limit):
                        name = table.lookup(sec, a - r.rel_base)
                        if name is not None:
                            out.append((a, min(b, r.limit) - a, "ool", name[0], p.time, unload))
        return out

    return store.with_tables(keys, named)


def inject(
    store: BootSource,
    in_path: str,
    out_path: str,
    err: TextIO,
    ksyms: Callable[[BootMatch], Sequence[Ksym]] | None = None,
) -> dict[str, object]:
    """Write OUT from IN (see the module's docstring); nothing is written when
    no recorded boot matches (:class:`~kreld.core.errors.NoBootForRecording`)."""
    if in_path == "-":
        raise InvalidArgument("-i", "inject reads a regular file: give the perf.data's path")
    if out_path != "-" and os.path.exists(out_path) and os.path.samefile(in_path, out_path):
        raise InvalidArgument("-o", "the output is the input: IN is never modified")
    h = read_perf_header(in_path)
    rec = Recording(in_path)
    try:
        if out_path == "-" and not rec.pipe:
            raise InvalidArgument(
                "-o", "a file-mode perf.data is written to a file (only pipe mode streams)"
            )
        m = find_boot(store, h, err)
        if not m.clock.exact:
            print(
                f"kreldctl: warning: {in_path} was not recorded with perf record -k "
                "monotonic|boottime|realtime: modules are mapped at approximate times",
                file=err,
            )
        span = rec.span()
        early: list[Added] = []
        mapped = [mm.name for mm in h.modules]
        ids0: list[bytes] = []
        if h.text is None and span is not None:  # perf could read no kernel address
            start = m.clock.start if m.clock.start is not None else span[0]
            kernel_id = h.kernel_build_id is None
            early, names, ids0 = start_records(m, rec, min(start, span[0]), kernel_id, err)
            mapped += names
        plans = plan_modules(m, span, err)
        added, ids = module_records(plans, rec, mapped)
        added, ids = [*early, *added], [*ids0, *ids]
        code = [*(ksyms(m) if ksyms is not None else []),
                *init_text_ksyms(store, plans, m.clock.clock)]  # fmt: skip
        extra = ksymbol_records(code, rec.layout, rec.e)
        with safe_output(out_path, 0o600) as sink:  # perf writes its files 0600
            size = write_with(rec, sink, [*added, *extra], ids)
    finally:
        rec.close()
    _summary(out_path, plans, len(ids), len(extra), len(early), err)
    return {
        "output": out_path,
        "bytes": size,
        "boot_id": m.boot.boot_id,
        "modules": [_plan_json(p) for p in plans],
        "build_ids": len(ids),
        "ksymbols": len(extra),
        "start_maps": len(early),
    }


def _summary(
    out_path: str, plans: Sequence[ModuleMapPlan], ids: int, ksyms: int, early: int, err: TextIO
) -> None:
    """The one line inject says of what it added."""
    print(
        f"kreldctl: {out_path}: {_mapped(plans)}, {ids} build-ids added, {ksyms} ksymbol records"
        + (f", the kernel and {early - 1} modules mapped from its start" if early else ""),
        file=err,
    )


def _mapped(plans: Sequence[ModuleMapPlan]) -> str:
    possible = sum(p.possible for p in plans)
    said = f"{len(plans)} module loads mapped"
    return said + (f" ({possible} from before kreld saw them: possible there)" if possible else "")


def _plan_json(p: ModuleMapPlan) -> dict[str, object]:
    return {
        "name": p.inc.name,
        "seq": p.inc.seq,
        "start": hexaddr(p.start),
        "end": hexaddr(p.end),
        "time": p.time,
        "loaded": p.loaded,
        "possible": p.possible,
    }
