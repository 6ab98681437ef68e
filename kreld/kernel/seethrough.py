"""Seeing through ``kernel.kptr_restrict=2``: addresses from kernel memory.

Where kallsyms and ``/sys/module/*/sections`` show zeros even to root, kreld
reads what it needs where the kernel does not zero it:

* the KASLR offset: ``KERNELOFFSET=`` in VMCOREINFO (``/proc/kcore``);
* the kernel's anchors: a ``System.map`` (link-time addresses) moved by it,
  once that map is proven to be this kernel's: the kernel's own notes
  (``/sys/kernel/notes``, its build-id) lie in kernel memory at the map's
  ``__start_notes`` moved by the offset; VMCOREINFO's ``SYMBOL(_stext)`` is
  the map's ``_stext`` moved by it; and the names kallsyms still lists, in the
  kernel's order, come in the map's order;
* where no System.map is this kernel's (a stock host: Debian's is a one-line
  placeholder), the kernel's own kallsyms tables decoded in its memory
  (:mod:`kreld.kernel.memkallsyms`), checked against kallsyms' names: the
  anchors, ``modules`` and the kernel's whole table;
* every module's sections: its ``struct module`` walked in kernel memory
  (:mod:`kreld.kernel.modules_kcore`) from the map's ``modules``, laid out as BTF
  says, cross-checked with ``/sys/module`` (name, build-id note, core size);
  and its symbols, from its own table there (``mod->kallsyms``).

Where it cannot (no CAP_SYS_RAWIO, lockdown, no BTF, no matching System.map)
:func:`open_kernel_memory` says which, and nothing is guessed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from itertools import pairwise
from pathlib import Path, PurePosixPath

from kreld.core import consts
from kreld.core.errors import BtfError, KernelReadError
from kreld.core.model import AddressSource, Anchors, ModuleState
from kreld.core.record import replace
from kreld.kernel.btf import Btf
from kreld.kernel.files import hex_u64, moved
from kreld.kernel.info import Root
from kreld.kernel.kallsyms import KallsymsText
from kreld.kernel.kaslr import read_system_map, system_map_symbols
from kreld.kernel.kcore import Kcore
from kreld.kernel.memkallsyms import MemoryKallsyms, read_kallsyms
from kreld.kernel.module_struct import ModuleLayout, module_layout
from kreld.kernel.modules_kcore import KernelModule, module_symbols, walk_modules

__all__ = [
    "KERNEL_BTF",
    "KernelMemory",
    "kallsyms_from_map",
    "kernel_lines",
    "lockdown",
    "not_yet",
    "open_kernel_memory",
    "see_through",
    "system_map_order",
]

KERNEL_BTF = PurePosixPath("sys/kernel/btf/vmlinux")
LOCKDOWN = PurePosixPath("sys/kernel/security/lockdown")
MAP_SYMBOLS = (*consts.ANCHOR_SYMBOLS, "modules", "__start_notes", "__stop_notes")
MAX_NOTES = 1 << 16  # the kernel's .notes section (some 500 bytes)
MIN_ORDER = 0.99  # share of kallsyms' neighbouring names the map must order alike


class KernelMemory:
    """An open ``/proc/kcore`` with what reading it needs: the offset, the
    kernel's symbols (link-time: from the checked System.map, or from the
    kernel's own kallsyms *table* decoded in its memory, moved back by the
    offset), and ``struct module``'s layout."""

    __slots__ = ("kcore", "layout", "link", "offset", "system_map", "table")

    def __init__(
        self,
        kcore: Kcore,
        layout: ModuleLayout,
        offset: int,
        link: dict[str, int],
        system_map: str | None,
        table: MemoryKallsyms | None = None,
    ) -> None:
        self.kcore = kcore
        self.layout = layout
        self.offset = offset
        self.link = link
        self.system_map = system_map
        self.table = table

    @property
    def symbols_from(self) -> str:
        """Where the kernel's symbols came from, for the log."""
        if self.system_map is not None:
            return self.system_map
        return f"the kernel's kallsyms tables in {self.kcore.path}"

    def anchors(self) -> Anchors:
        return Anchors.from_symbols(
            moved({k: v for k, v in self.link.items() if k in consts.ANCHOR_SYMBOLS}, self.offset)
        )

    def modules(self, wanted: Set[str] | None = None) -> dict[str, KernelModule]:
        """The loaded modules by name, all or those *wanted*
        (:class:`KernelReadError` when the list cannot be read whole)."""
        mods = walk_modules(self.kcore, self.layout, self.modules_head(), wanted)
        return {m.name: m for m in mods}

    def symbols(self, state: ModuleState) -> list[tuple[int, bytes, bytes]] | None:
        """The kallsyms lines of the load *state* read (its build-id and
        ``.text`` the same in kernel memory), or ``None`` where they cannot be
        read (the module gone, another load, this kernel's BTF silent)."""
        try:
            found = walk_modules(self.kcore, self.layout, self.modules_head(), {state.name})
            if not found or found[0].build_id != state.build_id:
                return None
            if found[0].sections.get(".text") != state.sections.get(".text"):
                return None
            return module_symbols(self.kcore, self.layout, found[0].address)
        except KernelReadError:
            return None

    def modules_head(self) -> int:
        return self.link["modules"] + self.offset

    def close(self) -> None:
        self.kcore.close()


def open_kernel_memory(
    root: Root,
    release: str,
    kallsyms: Iterable[bytes] | None = None,
    kallsyms_text: bytes | None = None,
) -> tuple[KernelMemory | None, str | None]:
    """Kernel memory ready to read, or ``None`` and why not.

    *kallsyms*: the core names kallsyms lists (zeroed or not), in its order,
    against which a System.map's order is checked.  *kallsyms_text*: a read of
    kallsyms, against which the kernel's own tables are checked where no
    System.map is this kernel's (without it, only a System.map will do).
    """
    try:
        kcore = Kcore.open(root / consts.KCORE)
    except KernelReadError as e:
        mode = lockdown(root)
        held = (
            f" (the kernel is locked down: lockdown={mode})" if mode not in (None, "none") else ""
        )
        return None, f"cannot read kernel memory: {e}{held}"
    try:
        offset = kcore.kernel_offset()
        if offset is None:
            raise KernelReadError(kcore.path, "VMCOREINFO has no KERNELOFFSET")
        try:
            layout = module_layout(Btf.load(root / KERNEL_BTF))
        except BtfError as e:
            raise KernelReadError(str(root / KERNEL_BTF), f"no usable BTF: {e}") from e
        notes = root.read_bytes(consts.KERNEL_NOTES, consts.MAX_KERNEL_NOTES)
        try:
            link, path = _matching_map(root, release, kcore, offset, notes, kallsyms)
        except KernelReadError as e:
            if kallsyms_text is None:
                raise
            return _from_tables(kcore, layout, offset, kallsyms_text, str(e)), None
    except KernelReadError as e:
        kcore.close()
        return None, str(e)
    return KernelMemory(kcore, layout, offset, link, path), None


def _from_tables(
    kcore: Kcore, layout: ModuleLayout, offset: int, kallsyms: bytes, no_map: str
) -> KernelMemory:
    """Kernel memory whose symbols are the kernel's own kallsyms tables, checked
    against *kallsyms* (:class:`KernelReadError` with both reasons if not)."""
    try:
        table = read_kallsyms(kcore, kallsyms)
        link = {n: a - offset for n in consts.ANCHOR_SYMBOLS if (a := table.address(n, b"tT"))}
        head = table.address("modules", b"dDbB")
        if head is None or "_text" not in link:
            raise KernelReadError(kcore.path, "the kernel's kallsyms tables lack _text or modules")
        link["modules"] = head - offset
    except KernelReadError as e:
        raise KernelReadError(kcore.path, f"{no_map}; its kallsyms tables: {e}") from e
    return KernelMemory(kcore, layout, offset, link, None, table)


def lockdown(root: Root) -> str | None:
    """The kernel's lockdown mode (``none``, ``integrity``, ``confidentiality``:
    the last refuses /proc/kcore), or ``None`` where securityfs does not say."""
    try:
        text = root.read_text(LOCKDOWN)
    except KernelReadError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def _matching_map(
    root: Root,
    release: str,
    kcore: Kcore,
    offset: int,
    notes: bytes,
    kallsyms: Iterable[bytes] | None,
) -> tuple[dict[str, int], str]:
    names = list(kallsyms) if kallsyms is not None else None
    why: list[str] = []
    for template in consts.SYSTEM_MAP_CANDIDATES:
        path = root / template.format(release=release)
        if not path.is_file():
            continue
        try:
            text = read_system_map(path)
        except KernelReadError as e:
            why.append(str(e))
            continue
        link = system_map_symbols(text, MAP_SYMBOLS)
        problem = _check_map(link, kcore, offset, notes)
        if problem is None and names is not None:
            order = system_map_order(text, names)
            if order < MIN_ORDER:
                problem = f"orders only {order:.1%} of kallsyms' neighbouring names alike"
        if problem is None:
            return link, str(path)
        why.append(f"{path}: {problem}")
    tried = "; ".join(why) or "none found"
    raise KernelReadError(f"System.map-{release}", f"no System.map of this kernel ({tried})")


def _check_map(link: Mapping[str, int], kcore: Kcore, offset: int, notes: bytes) -> str | None:
    """Why the map is not this kernel's, or ``None`` if its notes and _stext are."""
    missing = [n for n in MAP_SYMBOLS if n not in link]
    if missing:
        return f"lacks {', '.join(missing)}"
    size = link["__stop_notes"] - link["__start_notes"]
    if not notes or size != len(notes) or size > MAX_NOTES:
        return f"its notes ({size} bytes) are not /sys/kernel/notes' ({len(notes)} bytes)"
    try:
        if kcore.read(link["__start_notes"] + offset, size) != notes:
            return "kernel memory at its __start_notes does not hold the kernel's notes"
    except KernelReadError as e:
        return f"its __start_notes: {e}"
    stext = kcore.symbol("_stext")
    if stext is not None and stext != link["_stext"] + offset:
        return f"its _stext moved by the offset is not VMCOREINFO's {stext:#x}"
    return None


def system_map_order(text: bytes, names: list[bytes]) -> float:
    """The share of neighbouring *names* (kallsyms' core names, in its order)
    that a System.map's *text* lists in the same order; names the map lists
    twice or not at all are left out.  Linear in both."""
    index: dict[bytes, int] = {}
    twice: set[bytes] = set()
    for i, line in enumerate(text.splitlines()):
        fields = line.split()
        if len(fields) >= 3:
            if fields[2] in index:
                twice.add(fields[2])
            index[fields[2]] = i
    positions = [index[n] for n in names if n in index and n not in twice]
    if len(positions) < 2 or len(positions) < len(names) // 2:
        return 0.0
    alike = sum(1 for a, b in pairwise(positions) if a < b)
    return alike / (len(positions) - 1)


def kallsyms_from_map(ks: KallsymsText, kmem: KernelMemory) -> tuple[KallsymsText, int]:
    """kallsyms' core lines (zeroed: names and types, in the kernel's order) with
    their addresses from *kmem*'s System.map, and how many names it lacked.

    The n-th line named N takes the n-th address the map gives N (both list
    by address); moved by the KASLR offset, but for per-cpu variables, which
    kallsyms prints absolute (type ``A``, CONFIG_KALLSYMS_ABSOLUTE_PERCPU) at
    their offset in the per-cpu area, as the map has it.  A name the map lacks
    is left out, never given an address.  Lines with an owner (``[bpf]``...)
    are left out: they are not the kernel image's.
    """
    by_name: dict[bytes, list[int]] = {}
    if kmem.system_map is None:
        raise KernelReadError(kmem.symbols_from, "no System.map to take addresses from")
    text = read_system_map(Path(kmem.system_map))
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3:
            try:
                by_name.setdefault(fields[2], []).append(hex_u64(fields[0]))
            except ValueError:
                continue
    taken: dict[bytes, int] = {}
    out: list[bytes] = []
    dropped = 0
    for _zero, typ, name in ks.core():
        i = taken.get(name, 0)
        addrs = by_name.get(name)
        if addrs is None or i >= len(addrs):
            dropped += 1
            continue
        taken[name] = i + 1
        value = addrs[i] if typ in (b"a", b"A") else addrs[i] + kmem.offset
        out.append(b"%016x %s %s\n" % (value & (1 << 64) - 1, typ, name))
    return KallsymsText.of(b"".join(out), ks.taken), dropped


def kernel_lines(
    ks: KallsymsText, kmem: KernelMemory, vmlinux_first: bool
) -> tuple[KallsymsText | None, dict[str, object]]:
    """The kernel's lines where kallsyms shows zeros (*ks*), with their
    addresses from kernel memory, and what to log: from the System.map it
    proved this kernel's, else its own kallsyms tables decoded there (unless
    *vmlinux_first*: a matching vmlinux gave the boot's anchors, and its table
    is read instead; ``None`` then)."""
    if kmem.system_map is not None:
        lines, dropped = kallsyms_from_map(ks, kmem)
        return lines, {"path": kmem.system_map, "dropped": dropped}
    if kmem.table is not None and not vmlinux_first:
        return KallsymsText.of(kmem.table.text, ks.taken), {"layout": kmem.table.layout}
    return None, {"path": None, "why": "the boot's anchors came from a matching vmlinux"}


def see_through(state: ModuleState, found: KernelModule | None) -> ModuleState:
    """A restricted sysfs read of a module, with its sections from kernel memory
    where that memory is the same load (its name, build-id note and core size).

    Otherwise the read as it was, the reason among its faults: still restricted
    where the kernel's memory shows another load or none, and with no sections
    but not restricted (incomplete: the tracker reads it again, as it does a
    sysfs directory still being filled) where its section attributes are not
    set up yet.
    """
    if not state.restricted:
        return state
    problem = None
    if found is None:
        problem = "not on the kernel's module list"
    elif state.build_id and found.build_id != state.build_id:
        problem = f"build-id in kernel memory {found.build_id} is not sysfs' {state.build_id}"
    elif state.coresize is not None and found.coresize != state.coresize:
        problem = f"core size in kernel memory {found.coresize} is not sysfs' {state.coresize}"
    elif not found.sections:
        return not_yet(state, "no section attributes in kernel memory yet")
    if problem is not None or found is None:
        return replace(state, faults=(*state.faults, f"kernel memory: {problem}"))
    return replace(
        state,
        sections=dict(found.sections),
        core_base=found.core_base,
        coresize=state.coresize if state.coresize is not None else found.coresize,
        initsize=state.initsize if state.initsize is not None else found.initsize,
        restricted=False,
        source=AddressSource.KCORE,
        faults=(*state.faults, *found.faults),
    )


def not_yet(state: ModuleState, why: str) -> ModuleState:
    """A restricted read that kernel memory may yet see through (a walk that
    failed, sections not set up): no address, to be read again."""
    return replace(
        state, sections={}, restricted=False, faults=(*state.faults, f"kernel memory: {why}")
    )
