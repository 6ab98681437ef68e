"""The sysfs module reader (kreld.kernel.modules_sysfs) on fake sys/module + proc/modules trees."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kreld.kernel.info import Root
from kreld.kernel.modules_sysfs import (
    ProcModule,
    list_modules,
    parse_proc_modules,
    read_module,
    read_proc_modules,
)

from support.faketree import FakeTree, build_id_note, note
from support.tmpdirs import fast_tmpdir

BASE = 0xFFFFFFFFC0A00000
BUILD_ID = "5f1e3d2c4b6a79881726354433221100ffeeddcc"

# What sysfs shows for a typical module: core, data, init and exit sections.
ALL_SECTIONS = {
    ".text": BASE,
    ".text.unlikely": BASE + 0x0E00,
    ".exit.text": BASE + 0x1800,
    ".init.text": 0xFFFFFFFFC0B10000,
    ".init.data": 0xFFFFFFFFC0B11000,
    ".exit.data": BASE + 0x2400,
    ".rodata": BASE + 0x3000,
    ".rodata.str1.1": BASE + 0x3100,
    ".data": BASE + 0x4000,
    ".data..read_mostly": BASE + 0x4200,
    ".bss": BASE + 0x5000,
    "__param": BASE + 0x3300,
    ".gnu.linkonce.this_module": BASE + 0x4800,
    ".note.gnu.build-id": BASE + 0x3400,
    ".note.Linux": BASE + 0x3424,
}


def root_of(tree: FakeTree) -> Root:
    return Root(tree.root)


def mod_dir(tree: FakeTree, name: str) -> Path:
    return tree.root / "sys/module" / name


def test_every_section_and_attribute_is_read(tree: FakeTree) -> None:
    tree.add_module(
        "e1000e",
        BASE,
        build_id=BUILD_ID,
        coresize=0x6000,
        initsize=0x2000,
        sections=ALL_SECTIONS,
        extra_files={"taint": b"OE\n"},
    )
    st = read_module(root_of(tree), "e1000e")
    assert st is not None
    assert st.name == "e1000e"
    assert dict(st.sections) == ALL_SECTIONS
    assert st.sections[".init.text"] == 0xFFFFFFFFC0B10000
    assert st.sections[".exit.text"] == BASE + 0x1800
    assert st.build_id == BUILD_ID
    assert st.coresize == 0x6000
    assert st.initsize == 0x2000
    assert st.initstate == "live"
    assert st.srcversion == "0123456789ABCDEF0123456"
    assert st.taint == "OE"
    assert st.core_base == BASE
    assert st.restricted is False
    assert st.inode == os.stat(mod_dir(tree, "e1000e")).st_ino
    assert st.faults == ()


def test_initstate_coming_and_going_are_reported_as_read(tree: FakeTree) -> None:
    tree.add_module("coming", BASE, initstate="coming")
    tree.add_module("going", BASE + 0x100000, initstate="going")
    r = root_of(tree)
    coming, going = read_module(r, "coming"), read_module(r, "going")
    assert coming is not None and going is not None
    assert coming.initstate == "coming"
    assert going.initstate == "going"
    # While init runs the init text is still mapped: its base is recorded.
    assert coming.sections[".init.text"] == BASE + 0x100000


def test_build_id_found_after_another_note(tree: FakeTree) -> None:
    stream = note(b"Linux", 0x100, b"\x01\x00\x00\x00") + build_id_note(BUILD_ID)
    tree.add_module("m", BASE, extra_files={"notes/.note.gnu.build-id": stream})
    st = read_module(root_of(tree), "m")
    assert st is not None
    assert st.build_id == BUILD_ID
    assert st.faults == ()


def test_build_id_of_odd_length_is_read_whole(tree: FakeTree) -> None:
    # A 20-byte SHA-1 is usual, but any length is legal (e.g. 16-byte md5/uuid ids).
    bid = "00112233445566778899aabbccddeeff"
    tree.add_module("m", BASE, build_id=bid)
    st = read_module(root_of(tree), "m")
    assert st is not None and st.build_id == bid


def test_builtin_modules_are_skipped(tree: FakeTree) -> None:
    tree.add_builtin("printk")
    tree.add_builtin("kernel")
    tree.add_module("loop", BASE)
    (tree.root / "sys/module/not-a-dir").write_text("x")
    r = root_of(tree)
    assert read_module(r, "printk") is None
    listed = list_modules(r)
    assert set(listed) == {"loop"}
    assert listed["loop"] == os.stat(mod_dir(tree, "loop")).st_ino


def test_module_with_initstate_but_no_sections_is_listed_with_a_fault(tree: FakeTree) -> None:
    # sysfs adds sections/ after the kobject: a module caught half set up.
    d = mod_dir(tree, "halfway")
    d.mkdir()
    (d / "initstate").write_text("coming\n")
    r = root_of(tree)
    assert "halfway" in list_modules(r)
    st = read_module(r, "halfway")
    assert st is not None
    assert st.sections == {}
    assert st.restricted is False
    assert st.initstate == "coming"
    assert st.build_id is None and st.coresize is None
    assert any("sections/" in f for f in st.faults)


def test_module_with_sections_but_no_initstate_is_listed(tree: FakeTree) -> None:
    tree.add_module("m", BASE)
    os.unlink(mod_dir(tree, "m") / "initstate")
    r = root_of(tree)
    assert "m" in list_modules(r)
    st = read_module(r, "m")
    assert st is not None
    assert st.initstate is None
    assert st.sections[".text"] == BASE


def test_gone_module_and_missing_tree(tree: FakeTree, tmp_path: Path) -> None:
    tree.add_module("m", BASE)
    tree.remove_module("m")
    r = root_of(tree)
    assert read_module(r, "m") is None
    assert list_modules(r) == {}
    empty = Root(tmp_path / "nothing")
    assert list_modules(empty) == {}
    assert read_proc_modules(empty) == {}
    assert read_module(empty, "m") is None


def test_zeros_mean_restricted_and_no_zero_address_is_kept(tree: FakeTree) -> None:
    tree.add_module("m", BASE, zero=True)
    text = (tree.root / "proc/modules").read_text()
    assert "0x0000000000000000" in text
    st = read_module(root_of(tree), "m")
    assert st is not None
    assert st.restricted is True
    assert st.sections == {}
    assert 0 not in st.sections.values()
    assert st.core_base is None
    # What is not a pointer is still read.
    assert st.build_id is not None
    assert st.coresize == 0x4000
    assert st.initstate == "live"
    assert st.faults == ()


def test_partly_zero_sections_keep_only_real_addresses(tree: FakeTree) -> None:
    tree.add_module("m", BASE)
    (mod_dir(tree, "m") / "sections/.bss").write_text("0x0000000000000000\n")
    st = read_module(root_of(tree), "m")
    assert st is not None
    assert st.restricted is True
    assert ".bss" not in st.sections
    assert st.sections[".text"] == BASE
    assert all(v != 0 for v in st.sections.values())


def test_zero_base_in_proc_modules_alone_means_restricted(tree: FakeTree) -> None:
    tree.add_module("m", BASE)
    (tree.root / "proc/modules").write_text("m 16384 0 - Live 0x0000000000000000\n")
    st = read_module(root_of(tree), "m")
    assert st is not None
    assert st.core_base is None
    assert st.restricted is True
    assert st.sections[".text"] == BASE


def test_truncated_note_is_a_fault_and_the_rest_is_read(tree: FakeTree) -> None:
    full = build_id_note(BUILD_ID)
    tree.add_module("m", BASE, extra_files={"notes/.note.gnu.build-id": full[:20]})
    st = read_module(root_of(tree), "m")
    assert st is not None
    assert st.build_id is None
    assert len(st.faults) == 1
    assert "notes/.note.gnu.build-id" in st.faults[0]
    assert st.sections[".text"] == BASE
    assert st.coresize == 0x4000 and st.initsize == 0x1000
    assert st.core_base == BASE


def test_note_cut_inside_its_header_is_a_fault(tree: FakeTree) -> None:
    tree.add_module(
        "m", BASE, extra_files={"notes/.note.gnu.build-id": build_id_note(BUILD_ID)[:7]}
    )
    st = read_module(root_of(tree), "m")
    assert st is not None
    assert st.build_id is None
    assert [f for f in st.faults if "build-id" in f]


def test_non_hex_section_is_skipped_with_a_fault(tree: FakeTree) -> None:
    tree.add_module("m", BASE, extra_files={"sections/.data": b"0xnot-hex-at-all\n"})
    st = read_module(root_of(tree), "m")
    assert st is not None
    assert ".data" not in st.sections
    assert st.sections[".text"] == BASE
    assert st.sections[".rodata"] == BASE + 0x3000
    assert len(st.faults) == 1
    assert "sections/.data" in st.faults[0]
    assert "0xnot-hex" in st.faults[0]
    assert st.restricted is False


def test_unreadable_section_is_skipped_with_a_fault(tree: FakeTree) -> None:
    tree.add_module("m", BASE)
    bad = mod_dir(tree, "m") / "sections/.bss"
    bad.mkdir()  # open() fails on it: EISDIR
    st = read_module(root_of(tree), "m")
    assert st is not None
    assert ".bss" not in st.sections
    assert st.sections[".text"] == BASE
    assert any("sections/.bss" in f for f in st.faults)


def test_non_numeric_sizes_are_faults(tree: FakeTree) -> None:
    tree.add_module("m", BASE, extra_files={"coresize": b"lots\n", "initsize": b"\xff\xfe\n"})
    st = read_module(root_of(tree), "m")
    assert st is not None
    assert st.coresize is None
    assert st.initsize is None
    assert any(f.startswith("coresize") for f in st.faults)
    assert any(f.startswith("initsize") for f in st.faults)
    assert st.sections[".text"] == BASE
    assert st.build_id is not None


def test_missing_files_are_unknown(tree: FakeTree) -> None:
    tree.add_module("m", BASE)
    d = mod_dir(tree, "m")
    for f in ("coresize", "srcversion", "taint", "notes/.note.gnu.build-id"):
        os.unlink(d / f)
    (tree.root / "proc/modules").unlink()
    st = read_module(root_of(tree), "m")
    assert st is not None
    assert st.coresize is None
    assert st.srcversion is None
    assert st.taint is None
    assert st.build_id is None
    assert st.core_base is None
    assert st.initsize == 0x1000
    assert st.sections[".text"] == BASE


def test_all_faults_of_one_module_are_listed(tree: FakeTree) -> None:
    tree.add_module(
        "m",
        BASE,
        extra_files={
            "notes/.note.gnu.build-id": build_id_note(BUILD_ID)[:-3],
            "sections/.rodata": b"garbage\n",
            "coresize": b"12k\n",
        },
    )
    st = read_module(root_of(tree), "m")
    assert st is not None
    joined = "\n".join(st.faults)
    assert len(st.faults) == 3, joined
    assert "sections/.rodata" in joined
    assert "build-id" in joined
    assert "coresize" in joined
    assert st.sections[".text"] == BASE
    assert ".rodata" not in st.sections
    assert st.initsize == 0x1000


def test_proc_modules_passed_in_is_used(tree: FakeTree) -> None:
    tree.add_module("m", BASE)
    proc = {"m": ProcModule(0x4000, "Live", BASE + 0x10)}
    st = read_module(root_of(tree), "m", proc)
    assert st is not None
    assert st.core_base == BASE + 0x10
    st2 = read_module(root_of(tree), "m", {})
    assert st2 is not None and st2.core_base is None


def test_parse_proc_modules_real_format() -> None:
    text = (
        "nft_chain_nat 12288 3 - Live 0xffffffffc0a9a000\n"
        "nf_nat 61440 2 nft_chain_nat,xt_MASQUERADE, Live 0xffffffffc0a75000\n"
        "vboxdrv 696320 2 vboxnetadp,vboxnetflt, Live 0xffffffffc1200000 (OE)\n"
        "loading 8192 0 - Loading 0xffffffffc0c00000\n"
        "hidden 16384 0 - Live 0x0000000000000000\n"
        "weird notanumber 0 - Live 0xzz\n"
        "short 1 2\n"
        "\n"
    )
    pm = parse_proc_modules(text)
    assert set(pm) == {"nft_chain_nat", "nf_nat", "vboxdrv", "loading", "hidden", "weird"}
    assert pm["nft_chain_nat"] == ProcModule(12288, "Live", 0xFFFFFFFFC0A9A000)
    assert pm["nf_nat"] == ProcModule(61440, "Live", 0xFFFFFFFFC0A75000)
    assert pm["vboxdrv"] == ProcModule(696320, "Live", 0xFFFFFFFFC1200000)
    assert pm["loading"].state == "Loading"
    assert pm["hidden"] == ProcModule(16384, "Live", None)
    assert pm["weird"] == ProcModule(None, "Live", None)


def test_read_proc_modules_follows_the_tree(tree: FakeTree) -> None:
    tree.add_module("a", BASE, coresize=0x3000)
    tree.add_module("b", BASE + 0x10000, coresize=0x5000)
    r = root_of(tree)
    assert read_proc_modules(r) == {
        "a": ProcModule(0x3000, "Live", BASE),
        "b": ProcModule(0x5000, "Live", BASE + 0x10000),
    }
    tree.remove_module("a")
    assert set(read_proc_modules(r)) == {"b"}


@pytest.mark.parametrize("count", [1, 40])
def test_list_modules_sees_every_loaded_module(tree: FakeTree, count: int) -> None:
    names = {f"mod{i:03d}" for i in range(count)}
    for i, n in enumerate(sorted(names)):
        tree.add_module(n, BASE + i * 0x10000)
    tree.add_builtin("builtin_one")
    listed = list_modules(root_of(tree))
    assert set(listed) == names
    assert len(set(listed.values())) == count  # one inode each


def test_empty_sections_directory_is_a_fault(tree: FakeTree) -> None:
    # The kernel removes a module's section attributes before its directory.
    tree.add_module("m", BASE)
    for f in (mod_dir(tree, "m") / "sections").iterdir():
        f.unlink()
    st = read_module(root_of(tree), "m")
    assert st is not None
    assert st.sections == {}
    assert any("sections/" in f for f in st.faults)
    # Without initstate either, the directory is being torn down: the module is gone.
    os.unlink(mod_dir(tree, "m") / "initstate")
    assert read_module(root_of(tree), "m") is None


# Where FakeTree.add_module puts each section, from the module's base.
LAYOUT = {
    ".text": 0,
    ".data": 0x2000,
    ".rodata": 0x3000,
    ".gnu.linkonce.this_module": 0x3800,
    ".init.text": 0x100000,
    ".exit.text": 0x1800,
}


@pytest.fixture
def fast_tree() -> Iterator[FakeTree]:
    """A fake tree on tmpfs when there is one (thousands of file operations stay quick)."""
    with fast_tmpdir() as d:
        yield FakeTree(d / "root")


def test_a_read_never_mixes_two_loads(fast_tree: FakeTree) -> None:
    """A module unloaded and loaded again while it is read: each read is of one load."""
    tree = fast_tree

    def base(k: int) -> int:
        return BASE + k * 0x10000

    inodes: dict[int, int] = {}
    held: list[int] = []  # removed directories kept open: their inode numbers are not reused
    done = threading.Event()

    def flap() -> None:
        try:
            for k in range(400):
                tree.add_module("m", base(k), build_id=f"{k + 1:040x}")
                held.append(os.open(mod_dir(tree, "m"), os.O_RDONLY))
                inodes[os.fstat(held[-1]).st_ino] = k
                tree.remove_module("m")
        finally:
            done.set()

    t = threading.Thread(target=flap)
    t.start()
    reads = 0
    try:
        while not done.is_set():
            st = read_module(root_of(tree), "m")
            if st is None:
                continue
            reads += 1
            if not st.sections:
                assert st.faults, st  # caught while going: says so
                continue
            # A read caught while the files go may miss some; what it has is of one load.
            ks = {(addr - LAYOUT[sec] - BASE) // 0x10000 for sec, addr in st.sections.items()}
            assert len(ks) == 1, st
            k = ks.pop()
            assert {sec: base(k) + LAYOUT[sec] for sec in st.sections} == st.sections
            if st.build_id is not None:
                assert st.build_id == f"{k + 1:040x}", st
            if st.inode in inodes:
                assert inodes[st.inode] == k, st
    finally:
        t.join()
        for fd in held:
            os.close(fd)
    assert reads > 0
