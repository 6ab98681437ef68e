"""kreld's BTF reader (kreld/kernel/btf.py) against BTF built byte by byte in
tests/support/kmembuild.py, and against this machine's own /sys/kernel/btf/vmlinux."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from kreld.core.errors import BtfError
from kreld.kernel.btf import MAX_DEPTH, Btf, Kind
from kreld.kernel.module_struct import module_layout

from support.kmembuild import BtfBuilder
from support.kmodimage import NEW, OLD, new_btf, old_btf


def test_members_offsets_sizes_through_typedefs_qualifiers_and_anonymous_unions() -> None:
    b = BtfBuilder()
    u32 = b.int("unsigned int", 4)
    u64 = b.int("long unsigned int", 8)
    typedef = b.qual("typedef", b.qual("volatile", b.qual("const", u64)), "u64_t")
    inner = b.struct("", 8, [("a", u32, 0), ("b", u32, 4)])
    anon = b.struct("", 8, [("", inner, 0), ("whole", u64, 0)], union=True)
    arr = b.array(b.array(u32, 3, u32), 2, u32)
    flags = b.struct("flags", 4, [("lo", u32, 0, 3), ("hi", u32, 3, 29)])
    outer = b.struct(
        "outer",
        64,
        [
            ("x", typedef, 0),
            ("", anon, 8),
            ("grid", arr, 16),
            ("f", flags, 40),
            ("p", b.ptr(0), 48),
        ],
    )
    btf = Btf.parse(b.build())
    assert btf.find("outer", Kind.STRUCT) == outer
    assert btf.member(outer, "x").size == 8
    assert btf.member(outer, "b").offset == 12  # found through the anonymous union and struct
    assert btf.member(outer, "whole").offset == 8
    assert btf.member(outer, "grid").size == 24
    assert btf.member(outer, "p").size == 8
    assert [(m.name, m.bit_offset, m.bitfield_size) for m in btf.members(flags)] == [
        ("lo", 0, 3),
        ("hi", 3, 29),
    ]
    with pytest.raises(BtfError, match="bitfield"):
        btf.member(outer, "f.hi")
    with pytest.raises(BtfError, match="has no 'nope'"):
        btf.member(outer, "nope")
    with pytest.raises(BtfError, match="no STRUCT named 'absent'"):
        btf.find("absent", Kind.STRUCT)


def test_a_forward_declaration_is_not_taken_for_the_struct() -> None:
    b = BtfBuilder()
    b.raw_type(struct.pack("<III", b.s("module"), 7 << 24, 0))  # BTF_KIND_FWD
    real = b.struct("module", 8, [("x", b.int("long", 8), 0)])
    assert Btf.parse(b.build()).find("module", Kind.STRUCT) == real


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: b"\xeb\x9f" + d[2:], "magic"),  # big-endian BTF
        (lambda d: d[:2] + b"\x02" + d[3:], "version 2"),
        (lambda d: d[:30], "runs past the end"),
        (lambda d: d[:12] + struct.pack("<I", 1 << 30) + d[16:], "section of"),
        (lambda d: d[:8], "too short"),
    ],
)
def test_a_damaged_header_is_a_named_error(damage: object, message: str) -> None:
    data = old_btf()
    with pytest.raises(BtfError, match=message):
        Btf.parse(damage(data))  # type: ignore[operator]


def test_a_type_that_runs_past_its_section_or_an_unknown_kind_is_refused() -> None:
    b = BtfBuilder()
    b.raw_type(struct.pack("<III", 0, 4 << 24 | 500, 8))  # a struct of 500 members, none there
    with pytest.raises(BtfError, match="runs past its section"):
        Btf.parse(b.build())
    b = BtfBuilder()
    b.raw_type(struct.pack("<III", 0, 31 << 24, 0))
    with pytest.raises(BtfError, match="unknown type kind 31"):
        Btf.parse(b.build())


def test_a_typedef_that_names_itself_ends_at_the_depth_limit() -> None:
    b = BtfBuilder()
    b.raw_type(struct.pack("<III", b.s("loop"), 8 << 24, 1))  # typedef loop loop;
    btf = Btf.parse(b.build())
    with pytest.raises(BtfError, match=f"more than {MAX_DEPTH}"):
        btf.size_of(1)


def test_a_type_id_out_of_range_is_refused_not_indexed() -> None:
    b = BtfBuilder()
    p = b.ptr(99)
    btf = Btf.parse(b.build())
    with pytest.raises(BtfError, match="type id 99 out of range"):
        btf.size_of(btf.pointee(p))


def test_both_struct_module_layouts_are_read_from_btf_not_assumed() -> None:
    old = module_layout(Btf.parse(old_btf()))
    assert [r.name for r in old.regions] == ["core_layout", "init_layout"]
    assert (old.state, old.list_next, old.list_prev, old.name) == (0, 8, 16, 24)
    assert old.core_base == OLD["core"] and old.sect_attrs == OLD["sect_attrs"]
    assert old.sections is not None
    assert (old.sections.stride, old.sections.address) == (48, 40)
    new = module_layout(Btf.parse(new_btf()))
    assert [r.name for r in new.regions if r.init] == [
        "MOD_INIT_TEXT",
        "MOD_INIT_DATA",
        "MOD_INIT_RODATA",
    ]
    assert new.regions[4].base == NEW["mem"] + 4 * NEW["mem_stride"]
    assert (new.state, new.list_next, new.name, new.size) == (4, 16, 40, 0x300)
    assert new.sections is not None
    assert (new.sections.stride, new.sections.address, new.sections.nsections) == (40, 24, 36)
    assert new.states == {0: "live", 1: "coming", 2: "going", 3: "unformed"}


VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")


@pytest.mark.live
@pytest.mark.skipif(not VMLINUX_BTF.exists(), reason="this kernel has no /sys/kernel/btf/vmlinux")
def test_this_machines_own_btf_parses_and_gives_struct_module() -> None:
    btf = Btf.load(VMLINUX_BTF)
    assert len(btf) > 10_000
    layout = module_layout(btf)
    assert layout.name_len == 56  # MODULE_NAME_LEN = 64 - sizeof(unsigned long)
    assert layout.list_prev == layout.list_next + 8


def test_anonymous_members_that_repeat_without_end_end_in_a_named_error() -> None:
    """struct module of 2,000 anonymous members of one struct, itself of 2,000 of the
    next, six deep: a search that looked into each would visit 2000**6 members."""
    b = BtfBuilder()
    u64 = b.int("unsigned long", 8)
    inner = b.struct("leaf", 8, [("x", u64, 0)])
    for i in range(6):
        inner = b.struct(f"level{i}", 8, [("", inner, 0)] * 2000)
    module = b.struct("module", 8, [("", inner, 0)] * 2000)
    btf = Btf.parse(b.build())
    with pytest.raises(BtfError, match="members looked at in search of 'name'"):
        btf.member(module, "name")
    assert btf.member(module, "x").offset == 0  # the first path down finds it


def test_a_member_that_lies_past_the_end_of_its_struct_is_refused() -> None:
    b = BtfBuilder()
    u64 = b.int("unsigned long", 8)
    inner = b.struct("inner", 16, [("a", u64, 0), ("b", u64, 4096)])
    outer = b.struct("module", 24, [("name", u64, 0), ("in", inner, 8)])
    btf = Btf.parse(b.build())
    assert btf.member(outer, "in.a").offset == 8
    with pytest.raises(BtfError, match="lies past the end of 'module'"):
        btf.member(outer, "in.b")
