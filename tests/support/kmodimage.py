"""A kernel's module list in a kcore-shaped file, with the BTF that describes it,
in two layouts of ``struct module``: before 6.4 (``core_layout``/``init_layout``,
``struct module_sect_attr`` with its ``address``) and after (``mem[MOD_*]``, bare
``struct bin_attribute`` section attributes with the address in ``private``).

The offsets are written down here, by hand and unlike each other, so a walk
that read them from anywhere but BTF would fail one layout or the other.
"""

from __future__ import annotations

import struct
from pathlib import Path

from support.kmembuild import BtfBuilder, KcoreImage

KTEXT = 0xFFFFFFFF81000000  # the kernel image
MODULES_HEAD = KTEXT + 0x80000
MODAREA = 0xFFFFFFFFC0000000  # where struct modules live
DIRECT = 0xFFFF888000000000  # kmalloc'd section attributes and names

STATES = {"live": 0, "coming": 1, "going": 2, "unformed": 3}
MEM_TYPES = ["MOD_TEXT", "MOD_DATA", "MOD_RODATA", "MOD_RO_AFTER_INIT"]
MEM_TYPES += ["MOD_INIT_TEXT", "MOD_INIT_DATA", "MOD_INIT_RODATA"]

# Offsets of each layout, in the struct module and in a section attribute.
OLD = {
    "size": 0x200, "state": 0, "list": 8, "name": 24, "sect_attrs": 0x1C8,
    "kallsyms": 0x1D0, "syms": 0x1D8, "num_syms": 0x1E0, "ksym": 12, "ksym_name": 4,
    "core": 0x140, "init": 0x180, "attr_stride": 48, "attr_name": 0, "attr_addr": 40,
    "nsections": 32, "attrs": 40,
}  # fmt: skip
NEW = {
    "size": 0x300, "state": 4, "list": 16, "name": 40, "sect_attrs": 0x2A0,
    "kallsyms": 0x2A8, "syms": 0x2B0, "num_syms": 0x2B8, "ksym": 24, "ksym_name": 8,
    "mem": 0x100, "mem_stride": 0x38, "attr_stride": 40, "attr_name": 0, "attr_addr": 24,
    "nsections": 36, "attrs": 40,
}  # fmt: skip


def _common(b: BtfBuilder) -> dict[str, int]:
    t = {
        "uint": b.int("unsigned int", 4),
        "ulong": b.int("long unsigned int", 8),
        "char": b.int("char", 1, signed=True),
        "ushort": b.int("short unsigned int", 2),
    }
    t["void*"] = b.ptr(0)
    t["const char"] = b.qual("const", t["char"])
    t["const char*"] = b.ptr(t["const char"])
    t["umode_t"] = b.qual("typedef", t["ushort"], "umode_t")
    t["size_t"] = b.qual("typedef", t["ulong"], "size_t")
    lh = b.declare()
    t["list_head"] = b.struct(
        "list_head", 16, [("next", b.ptr(lh), 0), ("prev", b.ptr(lh), 8)], into=lh
    )
    t["state"] = b.enum("module_state", {f"MODULE_STATE_{k.upper()}": v for k, v in STATES.items()})
    attr = b.struct("attribute", 16, [("name", t["const char*"], 0), ("mode", t["umode_t"], 8)])
    t["bin_attribute"] = b.struct(
        "bin_attribute",
        40,
        [
            ("attr", attr, 0),
            ("size", t["size_t"], 16),
            ("private", t["void*"], 24),
            ("read", t["void*"], 32),
        ],
    )
    t["grp"] = b.struct(
        "attribute_group", 32, [("name", t["const char*"], 0), ("bin_attrs", t["void*"], 24)]
    )
    t["char*"] = b.ptr(t["char"])
    mk = [("symtab", t["void*"], 0), ("num_symtab", t["uint"], 8), ("strtab", t["char*"], 16)]
    t["mod_kallsyms*"] = b.ptr(b.struct("mod_kallsyms", 32, [*mk, ("typetab", t["char*"], 24)]))
    return t


def _kernel_symbol(b: BtfBuilder, t: dict[str, int], relative: bool) -> int:
    """struct kernel_symbol: PREL32 offsets (x86-64's) or plain pointers."""
    if relative:
        i32 = b.int("int", 4, signed=True)
        fields = [("value_offset", i32, 0), ("name_offset", i32, 4), ("namespace_offset", i32, 8)]
        return b.ptr(b.struct("kernel_symbol", 12, fields))
    ptrs = [("value", t["ulong"], 0), ("name", t["const char*"], 8)]
    return b.ptr(b.struct("kernel_symbol", 24, [*ptrs, ("namespace", t["const char*"], 16)]))


def _symbol_members(
    b: BtfBuilder, t: dict[str, int], o: dict[str, int], relative: bool
) -> list[tuple[str, int, int]]:
    return [
        ("kallsyms", t["mod_kallsyms*"], o["kallsyms"]),
        ("syms", _kernel_symbol(b, t, relative), o["syms"]),
        ("num_syms", t["uint"], o["num_syms"]),
    ]


def old_btf() -> bytes:
    """Before 6.4: core_layout/init_layout, struct module_sect_attr { battr; address; }."""
    b = BtfBuilder()
    t = _common(b)
    layout = b.struct(
        "module_layout",
        0x40,
        [("base", t["void*"], 0), ("size", t["uint"], 8), ("text_size", t["uint"], 12)],
    )
    sattr = b.struct(
        "module_sect_attr", 48, [("battr", t["bin_attribute"], 0), ("address", t["ulong"], 40)]
    )
    attrs = b.struct(
        "module_sect_attrs",
        40,
        [
            ("grp", t["grp"], 0),
            ("nsections", t["uint"], 32),
            ("attrs", b.array(sattr, 0, t["uint"]), 40),
        ],
    )
    o = OLD
    b.struct(
        "module",
        o["size"],
        [
            ("state", t["state"], o["state"]),
            ("list", t["list_head"], o["list"]),
            ("name", b.array(t["char"], 56, t["uint"]), o["name"]),
            ("core_layout", layout, o["core"]),
            ("init_layout", layout, o["init"]),
            ("sect_attrs", b.ptr(attrs), o["sect_attrs"]),
            *_symbol_members(b, t, o, relative=True),
        ],
    )
    return b.build()


def new_btf() -> bytes:
    """6.4+ (mem[MOD_*]) with the 6.14+ section attributes (bare bin_attribute)."""
    b = BtfBuilder()
    t = _common(b)
    mem = b.struct(
        "module_memory", NEW["mem_stride"], [("base", t["void*"], 0), ("size", t["uint"], 8)]
    )
    kinds = {n: i for i, n in enumerate(MEM_TYPES)} | {"MOD_MEM_NUM_TYPES": 7, "MOD_INVALID": -1}
    b.enum("mod_mem_type", kinds)
    attrs = b.struct(
        "module_sect_attrs",
        40,
        [
            ("grp", t["grp"], 0),
            ("nsections", t["uint"], NEW["nsections"]),
            ("attrs", b.array(t["bin_attribute"], 0, t["uint"]), NEW["attrs"]),
        ],
    )
    o = NEW
    mod = b.declare()
    b.struct(
        "module",
        o["size"],
        [
            ("state", t["state"], o["state"]),
            ("list", t["list_head"], o["list"]),
            ("name", b.array(t["const char"], 56, t["uint"]), o["name"]),
            ("mem", b.array(mem, 7, t["uint"]), o["mem"]),
            ("sect_attrs", b.ptr(attrs), o["sect_attrs"]),
            *_symbol_members(b, t, o, relative=False),
        ],
        into=mod,
    )
    return b.build()


def build_id_note(hexid: str) -> bytes:
    desc = bytes.fromhex(hexid)
    return struct.pack("<III", 4, len(desc), 3) + b"GNU\0" + desc


class ModuleImage:
    """A kcore image holding a module list, in one of the two layouts."""

    def __init__(self, layout: str) -> None:
        self.o = OLD if layout == "old" else NEW
        self.layout = layout
        self.img = KcoreImage()
        self.img.segment(KTEXT, 0x100000)
        self.img.segment(MODAREA, 0x400000)
        self.img.segment(DIRECT, 0x100000)
        self._heap = DIRECT + 0x1000
        self._module_heap = MODAREA + 0x380000
        self.mods: list[int] = []  # struct module addresses, in list order (newest first)
        self.img.u64(MODULES_HEAD, MODULES_HEAD)
        self.img.u64(MODULES_HEAD + 8, MODULES_HEAD)

    def alloc_module(self, data: bytes) -> int:
        at = self._module_heap
        self.img.write(at, data)
        self._module_heap += (len(data) + 15) & ~15
        return at

    def alloc(self, data: bytes) -> int:
        at = self._heap
        self.img.write(at, data)
        self._heap += (len(data) + 15) & ~15
        return at

    def add(
        self,
        name: str,
        sections: dict[str, int],
        *,
        state: str = "live",
        core: tuple[int, int] = (0, 0),
        init: tuple[int, int] = (0, 0),
        build_id: str | None = None,
        symbols: list[tuple[str, int, str, bool]] | None = None,
    ) -> int:
        """Put a module at the head of the list (as the kernel adds it); its
        address.  *symbols*: (name, value, typetab letter, exported)."""
        o = self.o
        mod = MODAREA + 0x1000 * (len(self.mods) + 1)
        self.img.u32(mod + o["state"], STATES[state])
        self.img.write(mod + o["name"], name.encode() + b"\0")
        if self.layout == "old":
            self.img.u64(mod + o["core"], core[0])
            self.img.u32(mod + o["core"] + 8, core[1])
            self.img.u64(mod + o["init"], init[0])
            self.img.u32(mod + o["init"] + 8, init[1])
        else:
            for i, (base, size) in ((0, core), (4, init)):
                self.img.u64(mod + o["mem"] + i * o["mem_stride"], base)
                self.img.u32(mod + o["mem"] + i * o["mem_stride"] + 8, size)
        if sections:
            self.img.u64(mod + o["sect_attrs"], self._sect_attrs(sections))
        if build_id is not None and ".note.gnu.build-id" in sections:
            self.img.write(sections[".note.gnu.build-id"], build_id_note(build_id))
        if symbols is not None:
            self._symbols(mod, symbols)
        self.mods.insert(0, mod)
        self.relink()
        return mod

    def _symbols(self, mod: int, symbols: list[tuple[str, int, str, bool]]) -> None:
        """mod->kallsyms (symbol 0 the empty one, as the kernel's), mod->syms."""
        o = self.o
        strtab = b"\0" + b"".join(n.encode() + b"\0" for n, _v, _t, _e in symbols)
        names = [1 + sum(len(x[0]) + 1 for x in symbols[:i]) for i in range(len(symbols))]
        symtab = bytes(24) + b"".join(
            struct.pack("<I4xQ8x", at, v)
            for at, (_n, v, _t, _e) in zip(names, symbols, strict=True)
        )
        typetab = b"\0" + "".join(t for _n, _v, t, _e in symbols).encode()
        at = {
            k: self.alloc(v)
            for k, v in (("strtab", strtab), ("symtab", symtab), ("typetab", typetab))
        }
        mk = struct.pack("<QI4xQQ", at["symtab"], len(symbols) + 1, at["strtab"], at["typetab"])
        self.img.u64(mod + o["kallsyms"], self.alloc(mk))
        exported = [(n, v) for n, v, _t, e in symbols if e]
        if not exported:
            return
        # In the module's own memory, as the kernel has it: PREL32 reaches +-2 GiB.
        table = self.alloc_module(bytes(o["ksym"] * len(exported)))
        for i, (n, v) in enumerate(exported):
            entry = table + i * o["ksym"]
            name = self.alloc_module(n.encode() + b"\0")
            if self.layout == "old":  # PREL32: offsets from the field itself
                self.img.write(entry, struct.pack("<ii", v - entry, name - (entry + 4)))
            else:
                self.img.write(entry, struct.pack("<QQ", v, name))
        self.img.u64(mod + o["syms"], table)
        self.img.u32(mod + o["num_syms"], len(exported))

    def _sect_attrs(self, sections: dict[str, int]) -> int:
        o = self.o
        table = bytearray(o["attrs"] + o["attr_stride"] * len(sections))
        struct.pack_into("<I", table, o["nsections"], len(sections))
        for i, (name, addr) in enumerate(sections.items()):
            at = o["attrs"] + i * o["attr_stride"]
            struct.pack_into("<Q", table, at + o["attr_name"], self.alloc(name.encode() + b"\0"))
            struct.pack_into("<Q", table, at + o["attr_addr"], addr)
        return self.alloc(bytes(table))

    def entry(self, mod: int) -> int:
        return mod + self.o["list"]

    def relink(self) -> None:
        """Link self.mods in order, consistently."""
        chain = [MODULES_HEAD] + [self.entry(m) for m in self.mods]
        for i, node in enumerate(chain):
            self.img.u64(node, chain[(i + 1) % len(chain)])
            self.img.u64(node + 8, chain[i - 1])

    def save(self, path: Path, offset: int = 0x2A000000) -> Path:
        return self.img.save(path, {"OSRELEASE": "6.1.0-test", "KERNELOFFSET": f"{offset:x}"})

    def unlink(self, mod: int) -> None:
        """Take a module off the list, as free_module() does."""
        self.mods.remove(mod)
        self.relink()

    def rewrite(self, path: Path, vmcoreinfo: dict[str, str]) -> None:
        """Write the image over *path* in place (same inode, same size with the
        same *vmcoreinfo*: a reader holding it open sees the new memory, never
        an empty file)."""
        tmp = path.with_name(path.name + ".new")
        self.img.save(tmp, vmcoreinfo)
        with open(path, "r+b") as f:
            f.write(tmp.read_bytes())
        tmp.unlink()
