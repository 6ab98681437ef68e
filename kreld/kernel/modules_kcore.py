"""The kernel's list of modules, walked in its memory (``/proc/kcore``).

``modules`` (kernel/module/main.c) is a ``struct list_head`` linking every
``struct module`` through its ``list`` member, newest first
(``add_unformed_module()`` adds with ``list_add_rcu``, ``free_module()``
removes with ``list_del_rcu``).  Each module's section attributes
(``mod->sect_attrs``, set once they are all filled in, by ``add_sect_attrs()``)
hold the very names and addresses ``/sys/module/<m>/sections/`` shows, which
``kptr_restrict=2`` zeroes there but not here.

kreld reads the list without the kernel's lock, so a load or unload may change
it mid-walk.  Every step checks the link it followed (``next->prev`` is where
it came from) and, once a walk is done, the list is read again (each entry's
links, state and name): only a walk that both reads agree on is an answer.
Otherwise it is walked again, :data:`TRIES` times at most, then
:class:`ModuleListChanged`.  A pointer outside every kcore segment is
:class:`AddressNotMapped`; a chain longer than :data:`MAX_MODULES` (a cycle) or
a name without its NUL is :class:`KernelMemoryError`.  No answer is ever torn.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Set

from kreld.core.errors import KernelMemoryError, ModuleListChanged, NoteError
from kreld.core.record import record
from kreld.kernel.kcore import MAX_READ, Kcore
from kreld.kernel.module_struct import KallsymsLayout, ModuleLayout
from kreld.kernel.notes import find_build_id

__all__ = [
    "MAX_MODULES",
    "MAX_SECTIONS",
    "MAX_SYMBOLS",
    "TRIES",
    "KernelModule",
    "module_symbols",
    "walk_modules",
]

MAX_MODULES = 8192  # a machine has a few hundred; more is a cycle in a corrupt chain
MAX_SECTIONS = 4096  # section attributes of one module (a module has 20-60)
MAX_SECTION_NAME = 256
MAX_SYMBOLS = 1 << 18  # symbols of one module (the largest have some 60,000)
MAX_STRTAB = 16 << 20  # bytes of its string table
TRIES = 3
BUILD_ID_SECTION = ".note.gnu.build-id"
_NOTE_READ = 64  # a GNU build-id note: 12-byte header, "GNU\0", a 20-byte SHA-1 (or so)
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_SYM = struct.Struct("<I4xQ8x")  # Elf64_Sym: st_name, (info, other, shndx), st_value, (size)


@record
class KernelModule:
    """One ``struct module`` as its memory showed it."""

    name: str
    address: int  # of the struct module
    state: str  # "live", "coming", "going", "unformed"
    sections: Mapping[str, int]
    coresize: int
    initsize: int
    core_base: int | None
    build_id: str | None  # from the note its .note.gnu.build-id section holds
    faults: tuple[str, ...] = ()


class _Torn(Exception):
    """The list changed under this walk (internal: the walk is tried again)."""


def walk_modules(
    kcore: Kcore, layout: ModuleLayout, head: int, wanted: Set[str] | None = None
) -> list[KernelModule]:
    """Every module on the list at *head* (the ``modules`` symbol's runtime
    address), oldest first as ``/proc/modules`` lists them last; with *wanted*,
    only those, and the list is walked only as far as they are (a new load is
    at its head)."""
    for _ in range(TRIES):
        try:
            mods, seen = _walk(kcore, layout, head, wanted)
            if _identity(kcore, layout, head, len(seen)) == seen:
                return mods[::-1]
        except _Torn:
            continue
    raise ModuleListChanged(kcore.path, TRIES)


def _links(kcore: Kcore, head: int) -> Iterator[int]:
    """The list's entries (addresses of ``mod->list``), newest first, each link
    checked (:class:`_Torn` where ``next->prev`` is not where it came from)."""
    prev, entry = head, kcore.pointer(head, "modules.next", 16)
    count = 0
    while entry != head:
        if count >= MAX_MODULES:
            raise KernelMemoryError(
                kcore.path,
                f"more than {MAX_MODULES} modules on the list: a cycle or a corrupt chain",
            )
        if kcore.u64(entry + 8) != prev:
            raise _Torn()
        yield entry
        count += 1
        prev, entry = entry, kcore.pointer(entry, f"the list link at {entry:#x}", 16)
    if kcore.u64(head + 8) != prev:
        raise _Torn()


def _ident(kcore: Kcore, layout: ModuleLayout, entry: int) -> tuple[int, str, str]:
    """An entry's struct module: its address, state and name (one small read)."""
    start, length = layout.window()
    mod = entry - layout.list_next
    raw = kcore.read(mod + start, length)
    return mod, _state(layout, raw, -start), _name(kcore, layout, raw, -start)


def _walk(
    kcore: Kcore, layout: ModuleLayout, head: int, wanted: Set[str] | None
) -> tuple[list[KernelModule], list[tuple[int, str, str]]]:
    """The modules read, and what identifies each entry walked past."""
    left = None if wanted is None else set(wanted)
    mods: list[KernelModule] = []
    seen: list[tuple[int, str, str]] = []
    for entry in _links(kcore, head):
        seen.append(_ident(kcore, layout, entry))
        mod, _, name = seen[-1]
        if left is None or name in left:
            mods.append(_module(kcore, layout, mod))
        if left is not None:
            left.discard(name)
            if not left:
                break
    return mods, seen


def _identity(
    kcore: Kcore, layout: ModuleLayout, head: int, count: int
) -> list[tuple[int, str, str]] | None:
    """The first *count* entries read again, cheaply (``None``: torn meanwhile)."""
    out: list[tuple[int, str, str]] = []
    try:
        for entry in _links(kcore, head):
            if len(out) == count:
                break
            out.append(_ident(kcore, layout, entry))
    except _Torn:
        return None
    return out


def _state(layout: ModuleLayout, raw: bytes, base: int) -> str:
    value = _U32.unpack_from(raw, base + layout.state)[0]
    return layout.states.get(value, f"unknown({value})")


def _name(kcore: Kcore, layout: ModuleLayout, raw: bytes, base: int) -> str:
    field = raw[base + layout.name : base + layout.name + layout.name_len]
    end = field.find(b"\0")
    if end <= 0:
        raise KernelMemoryError(
            kcore.path, f"module name at {base + layout.name:#x} not a C string"
        )
    return field[:end].decode("utf-8", "replace")


def _module(kcore: Kcore, layout: ModuleLayout, mod: int) -> KernelModule:
    raw = kcore.read(mod, layout.size)
    faults: list[str] = []
    state = _state(layout, raw, 0)
    sections: dict[str, int] = {}
    if layout.sections is None:
        faults.append("this kernel's BTF describes no module section attributes")
    elif state != "unformed":
        attrs = _U64.unpack_from(raw, layout.sect_attrs)[0]
        if attrs:
            sections = _sections(kcore, layout, attrs, faults)
        else:
            faults.append("section attributes not set up yet (still loading, or going)")
    core = [r for r in layout.regions if not r.init]
    init = [r for r in layout.regions if r.init]
    base = _U64.unpack_from(raw, layout.core_base)[0]
    return KernelModule(
        name=_name(kcore, layout, raw, 0),
        address=mod,
        state=state,
        sections=sections,
        coresize=sum(_U32.unpack_from(raw, r.size)[0] for r in core),
        initsize=sum(_U32.unpack_from(raw, r.size)[0] for r in init),
        core_base=base or None,
        build_id=_build_id(kcore, sections, faults),
        faults=tuple(faults),
    )


def _sections(kcore: Kcore, layout: ModuleLayout, attrs: int, faults: list[str]) -> dict[str, int]:
    """Names and addresses of a module's section attributes at *attrs*."""
    sa = layout.sections
    if sa is None:
        return {}
    count = kcore.u32(attrs + sa.nsections)
    if count > MAX_SECTIONS or count * sa.stride > MAX_READ:
        raise KernelMemoryError(kcore.path, f"{count} section attributes at {attrs:#x}")
    table = kcore.read(attrs + sa.attrs, count * sa.stride)
    out: dict[str, int] = {}
    for i in range(count):
        at = i * sa.stride
        name_ptr = _U64.unpack_from(table, at + sa.name)[0]
        address = _U64.unpack_from(table, at + sa.address)[0]
        name = kcore.string(name_ptr, MAX_SECTION_NAME)
        if not address:
            faults.append(f"section {name}: address 0 in kernel memory")
            continue
        out[name] = address
    return out


def _build_id(kcore: Kcore, sections: Mapping[str, int], faults: list[str]) -> str | None:
    """The build-id in the module's own note, read where its section lies."""
    at = sections.get(BUILD_ID_SECTION)
    if at is None:
        return None
    try:
        blob = kcore.read(at, _NOTE_READ)
        namesz, descsz, _type = struct.unpack_from("<III", blob)
        end = 12 + ((namesz + 3) & ~3) + descsz
        if end > len(blob):
            raise NoteError("longer than a build-id note", 0)
        return find_build_id(blob[:end])
    except (KernelMemoryError, NoteError) as e:
        faults.append(f"{BUILD_ID_SECTION} in kernel memory: {e}")
        return None


def module_symbols(kcore: Kcore, layout: ModuleLayout, mod: int) -> list[tuple[int, bytes, bytes]]:
    """The lines /proc/kallsyms prints for the module whose ``struct module`` is
    at *mod* (``module_get_kallsym()`` and ``s_show()``): each named symbol of
    ``mod->kallsyms`` in its order, with its ``typetab`` letter, upper case when
    the module exports it (``is_exported()``: listed in ``mod->syms``)."""
    ks = layout.symbols
    if ks is None:
        raise KernelMemoryError(kcore.path, "this kernel's BTF does not describe module symbols")
    raw = kcore.read(kcore.pointer(mod + ks.pointer, "mod->kallsyms", ks.size), ks.size)
    symtab, strtab, typetab = (
        _U64.unpack_from(raw, o)[0] for o in (ks.symtab, ks.strtab, ks.typetab)
    )
    count = _U32.unpack_from(raw, ks.num_symtab)[0]
    if count > MAX_SYMBOLS:
        raise KernelMemoryError(kcore.path, f"{count} symbols in the module at {mod:#x}")
    table = _read_long(kcore, symtab, count * _SYM.size)
    types = _read_long(kcore, typetab, count)
    syms = [_SYM.unpack_from(table, i * _SYM.size) for i in range(count)]
    names = _names(kcore, strtab, [s[0] for s in syms])
    exported = _exported(kcore, ks, kcore.read(mod, layout.size))
    out = []
    for (_name, value), typ, name in zip(syms, types, names, strict=True):
        if name:
            letter = chr(typ).upper() if name in exported else chr(typ).lower()
            out.append((value, letter.encode(), name))
    return out


def _read_long(kcore: Kcore, address: int, length: int) -> bytes:
    """*length* bytes at *address*, read :data:`MAX_READ` at a time."""
    return b"".join(
        kcore.read(address + at, min(MAX_READ, length - at)) for at in range(0, length, MAX_READ)
    )


def _names(kcore: Kcore, strtab: int, offsets: list[int]) -> list[bytes]:
    """The strings at *offsets* into the string table at *strtab* (read once)."""
    if not offsets:
        return []
    seg = kcore.segment_of(strtab)
    if seg is None:
        raise KernelMemoryError(kcore.path, f"string table at {strtab:#x} is not mapped")
    size = min(max(offsets) + MAX_SECTION_NAME, seg.end - strtab, MAX_STRTAB)
    blob = _read_long(kcore, strtab, size)
    out = []
    for off in offsets:
        end = blob.find(b"\0", off)
        if end < 0:
            raise KernelMemoryError(kcore.path, f"symbol name at {strtab + off:#x} has no end")
        out.append(blob[off:end])
    return out


def _exported(kcore: Kcore, ks: KallsymsLayout, raw: bytes) -> set[bytes]:
    """The names in ``mod->syms`` (its EXPORT_SYMBOL table; not the GPL one)."""
    syms = _U64.unpack_from(raw, ks.syms)[0]
    count = _U32.unpack_from(raw, ks.num_syms)[0]
    if not syms or not count:
        return set()
    if count > MAX_SYMBOLS:
        raise KernelMemoryError(kcore.path, f"{count} exported symbols at {syms:#x}")
    table = _read_long(kcore, syms, count * ks.ksym_size)
    out = set()
    for i in range(count):
        at = i * ks.ksym_size + ks.ksym_name
        if ks.relative:  # offset_to_ptr(&sym->name_offset)
            name = syms + at + struct.unpack_from("<i", table, at)[0]
        else:
            name = _U64.unpack_from(table, at)[0]
        out.add(kcore.string(name, MAX_SECTION_NAME).encode())
    return out
