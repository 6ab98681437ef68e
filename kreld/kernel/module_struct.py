"""Where ``struct module`` keeps what kreld reads, on this kernel, from its BTF.

The layout differs from release to release, so nothing here is an offset
written down: every one is asked of BTF (:mod:`kreld.kernel.btf`), and a
kernel difference is handled by trying one shape, then the other.

* Memory regions.  Before 6.4 a module had two ``struct module_layout``
  (``core_layout``, ``init_layout``: ``base``, ``size``); since 6.4 (commit
  ac3b43283923 "module: replace module_layout with module_memory") it has
  ``mem[MOD_MEM_NUM_TYPES]`` of ``struct module_memory``, indexed by
  ``enum mod_mem_type`` (``MOD_TEXT``, ..., ``MOD_INIT_TEXT``, ...).
* Section attributes (``mod->sect_attrs``, kernel/module/sysfs.c; before 5.19,
  kernel/module.c).  Up to 6.13 each is a ``struct module_sect_attr`` holding a
  ``struct bin_attribute battr`` (its ``attr.name`` the section's name) and an
  ``unsigned long address``; since 6.14 ("module: sysfs: Drop member
  'module_sect_attr::address'", Thomas Weißschuh) the array holds bare
  ``struct bin_attribute``s whose ``private`` is the address.
"""

from __future__ import annotations

from kreld.core.errors import BtfError
from kreld.core.record import record
from kreld.kernel.btf import Btf, Kind

__all__ = ["KallsymsLayout", "ModuleLayout", "Region", "SectAttrsLayout", "module_layout"]

MODULE_STATE_PREFIX = "MODULE_STATE_"


@record
class Region:
    """One memory region of a module: where its base and size are kept."""

    name: str  # "core_layout", "MOD_TEXT", ...
    init: bool
    base: int  # offset of the base pointer in struct module
    size: int  # offset of the unsigned int size


@record
class SectAttrsLayout:
    """``struct module_sect_attrs`` and the element of its ``attrs[]``."""

    nsections: int
    attrs: int
    stride: int
    name: int  # offset of the name pointer in an element
    address: int  # offset of the address (or ``private``) in an element


@record
class KallsymsLayout:
    """A module's own symbol table, as /proc/kallsyms prints it: ``mod->kallsyms``
    (``struct mod_kallsyms``: ``symtab``, ``num_symtab``, ``strtab``, ``typetab``;
    the type array since 5.2, commit 1c7651f43777 "kallsyms: store type
    information in its own array"), and the exported symbols ``mod->syms``
    (``struct kernel_symbol``: a relative ``name_offset`` where the arch has
    PREL32 relocations, x86-64 among them, else a ``name`` pointer)."""

    pointer: int  # offset of mod->kallsyms in struct module
    size: int  # of struct mod_kallsyms
    symtab: int
    num_symtab: int
    strtab: int
    typetab: int
    syms: int  # offsets of mod->syms and mod->num_syms in struct module
    num_syms: int
    ksym_size: int  # of struct kernel_symbol
    ksym_name: int  # offset of its name_offset (or name)
    relative: bool  # name_offset, relative to itself (PREL32)


@record
class ModuleLayout:
    """What the walk reads of ``struct module``, as offsets into it."""

    size: int
    state: int
    list_next: int
    list_prev: int
    name: int
    name_len: int
    sect_attrs: int
    regions: tuple[Region, ...]
    core_base: int  # offset of the base /proc/modules shows
    states: dict[int, str]  # enum module_state: value -> "live", "coming", ...
    sections: SectAttrsLayout | None  # None: this kernel's BTF has no section attributes
    symbols: KallsymsLayout | None = None  # None: this kernel's BTF does not say

    def window(self) -> tuple[int, int]:
        """The part of the struct a re-check reads: state, links and name."""
        start = min(self.state, self.list_next, self.list_prev, self.name)
        end = max(self.state + 4, self.list_next + 8, self.list_prev + 8, self.name + self.name_len)
        return start, end - start


def _regions(btf: Btf, module: int) -> tuple[tuple[Region, ...], int]:
    """The memory regions and the offset of the core base, trying the 6.4+ shape first."""
    try:
        mem = btf.member(module, "mem")
    except BtfError:
        mem = None
    if mem is not None:
        elem, count = btf.array(mem.type_id)
        stride = btf.size_of(elem)
        base, size = btf.member(elem, "base").offset, btf.member(elem, "size").offset
        kinds = btf.enumerators(btf.find("mod_mem_type", Kind.ENUM, Kind.ENUM64))
        regions = tuple(
            Region(
                n,
                n.startswith("MOD_INIT_"),
                mem.offset + v * stride + base,
                mem.offset + v * stride + size,
            )
            for n, v in sorted(kinds.items(), key=lambda kv: kv[1])
            if 0 <= v < count and n != "MOD_MEM_NUM_TYPES"
        )
        text = kinds.get("MOD_TEXT", 0)
        return regions, mem.offset + text * stride + base
    out = []
    for name in ("core_layout", "init_layout"):
        layout = btf.member(module, name)
        base = layout.offset + btf.member(layout.type_id, "base").offset
        size = layout.offset + btf.member(layout.type_id, "size").offset
        out.append(Region(name, name == "init_layout", base, size))
    return tuple(out), out[0].base


def _sect_attrs(btf: Btf) -> SectAttrsLayout | None:
    """The section attributes' layout, or ``None`` where BTF has none (a kernel
    without CONFIG_KALLSYMS or CONFIG_SYSFS has no ``module_sect_attrs``)."""
    try:
        attrs_t = btf.find("module_sect_attrs", Kind.STRUCT)
    except BtfError:
        return None
    attrs = btf.member(attrs_t, "attrs")
    elem, _count = btf.array(attrs.type_id)
    stride = btf.size_of(elem)
    if btf.name(btf.resolve(elem)) == "module_sect_attr":
        name = btf.member(elem, "battr.attr.name").offset
        address = btf.member(elem, "address").offset
    else:  # 6.14+: a bare struct bin_attribute, the address in its private
        name = btf.member(elem, "attr.name").offset
        address = btf.member(elem, "private").offset
    return SectAttrsLayout(
        btf.member(attrs_t, "nsections").offset, attrs.offset, stride, name, address
    )


def _kallsyms(btf: Btf, module: int) -> KallsymsLayout | None:
    try:
        mk = btf.find("mod_kallsyms", Kind.STRUCT)
        ksym = btf.find("kernel_symbol", Kind.STRUCT)
        try:
            name, relative = btf.member(ksym, "name_offset").offset, True
        except BtfError:
            name, relative = btf.member(ksym, "name").offset, False
        return KallsymsLayout(
            pointer=btf.member(module, "kallsyms").offset,
            size=btf.size_of(mk),
            symtab=btf.member(mk, "symtab").offset,
            num_symtab=btf.member(mk, "num_symtab").offset,
            strtab=btf.member(mk, "strtab").offset,
            typetab=btf.member(mk, "typetab").offset,
            syms=btf.member(module, "syms").offset,
            num_syms=btf.member(module, "num_syms").offset,
            ksym_size=btf.size_of(ksym),
            ksym_name=name,
            relative=relative,
        )
    except BtfError:
        return None


def module_layout(btf: Btf) -> ModuleLayout:
    """Read the layout of ``struct module`` from *btf*; :class:`BtfError` names
    what is missing."""
    module = btf.find("module", Kind.STRUCT)
    name = btf.member(module, "name")
    regions, core_base = _regions(btf, module)
    states = btf.enumerators(btf.find("module_state", Kind.ENUM, Kind.ENUM64))
    return ModuleLayout(
        size=btf.size_of(module),
        state=btf.member(module, "state").offset,
        list_next=btf.member(module, "list.next").offset,
        list_prev=btf.member(module, "list.prev").offset,
        name=name.offset,
        name_len=name.size,
        sect_attrs=btf.member(module, "sect_attrs").offset,
        regions=regions,
        core_base=core_base,
        states={v: k.removeprefix(MODULE_STATE_PREFIX).lower() for k, v in states.items()},
        sections=_sect_attrs(btf),
        symbols=_kallsyms(btf, module),
    )
