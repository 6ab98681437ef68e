"""Kernel memory through a kcore-shaped ELF core (kreld/kernel/kcore.py) and the
module list walked in it (kreld/kernel/modules_kcore.py), on files built in
tests/support/kmembuild.py and tests/support/kmodimage.py in both layouts of struct module."""

from __future__ import annotations

import os
import struct
import threading
import time
from pathlib import Path

import pytest

from kreld.core.errors import (
    AddressNotMapped,
    KernelMemoryError,
    KernelReadError,
    ModuleListChanged,
)
from kreld.kernel.btf import Btf
from kreld.kernel.elf import ElfFileError
from kreld.kernel.kcore import MAX_READ, Kcore
from kreld.kernel.module_struct import module_layout
from kreld.kernel.modules_kcore import walk_modules

from support.kmembuild import KcoreImage
from support.kmodimage import MODAREA, MODULES_HEAD, NEW, ModuleImage, new_btf, old_btf

BTF = {"old": old_btf, "new": new_btf}
DUMMY = {
    ".text": MODAREA + 0x100000,
    ".init.text": MODAREA + 0x180000,
    ".data": MODAREA + 0x102000,
    ".note.gnu.build-id": MODAREA + 0x101000,
    ".gnu.linkonce.this_module": MODAREA + 0x10000,
}
BRD = {".text": MODAREA + 0x200000, ".exit.text": MODAREA + 0x200800, "__param": MODAREA + 0x201000}
DUMMY_ID = "4bd0a1f1c9c4f23a0011223344556677889900aa"


def test_reads_map_addresses_through_pt_load_segments_and_vmcoreinfo(tmp_path: Path) -> None:
    img = KcoreImage()
    img.segment(0xFFFFFFFF81000000, 0x2000)
    img.segment(0xFFFF888000000000, 0x1000)
    img.write(0xFFFFFFFF81001FF8, b"12345678")
    img.write(0xFFFF888000000010, b"hello\0world")
    path = img.save(
        tmp_path / "kcore", {"KERNELOFFSET": "2a000000", "SYMBOL(_stext)": "ffffffffab000000"}
    )
    with Kcore.open(path) as k:
        assert k.read(0xFFFFFFFF81001FF8, 8) == b"12345678"
        assert k.string(0xFFFF888000000010) == "hello"
        assert k.kernel_offset() == 0x2A000000
        assert k.symbol("_stext") == 0xFFFFFFFFAB000000
        assert k.symbol("modules") is None
        # The file offset is the segment's: not the address, not another segment's.
        with open(path, "rb") as f:
            f.seek(img.offset_of(0xFFFF888000000010))
            assert f.read(5) == b"hello"


def test_a_pointer_outside_every_segment_is_a_named_error(tmp_path: Path) -> None:
    img = KcoreImage()
    img.segment(0xFFFFFFFF81000000, 0x1000)
    img.u64(0xFFFFFFFF81000000, 0xFFFFFFFF81000800)  # points inside
    img.u64(0xFFFFFFFF81000008, 0xDEAD000000000100)  # LIST_POISON1: points nowhere
    img.u64(0xFFFFFFFF81000010, 0xFFFFFFFF81000FFC)  # 4 bytes left: not 16
    img.write(0xFFFFFFFF81000F00, b"x" * 16)
    with Kcore.open(img.save(tmp_path / "kcore")) as k:
        assert k.pointer(0xFFFFFFFF81000000, "ok", 16) == 0xFFFFFFFF81000800
        with pytest.raises(
            AddressNotMapped, match="poisoned points to 16 bytes at 0xdead000000000100"
        ):
            k.pointer(0xFFFFFFFF81000008, "poisoned", 16)
        with pytest.raises(AddressNotMapped):
            k.pointer(0xFFFFFFFF81000010, "at the edge", 16)
        with pytest.raises(AddressNotMapped):  # a read across the segment's end
            k.read(0xFFFFFFFF81000FF0, 32)
        with pytest.raises(KernelMemoryError, match="limit"):
            k.read(0xFFFFFFFF81000000, MAX_READ + 1)
        with pytest.raises(KernelMemoryError, match="no NUL"):
            k.string(0xFFFFFFFF81000F00, 8)


def test_a_file_that_is_not_a_core_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "text").write_bytes(b"not an ELF file at all, just words" * 4)
    with pytest.raises(ElfFileError, match="not an ELF file"):
        Kcore.open(tmp_path / "text")
    (tmp_path / "elf32").write_bytes(b"\x7fELF\x01\x01\x01" + bytes(45))
    with pytest.raises(KernelMemoryError, match="not an ELF64"):
        Kcore.open(tmp_path / "elf32")
    with pytest.raises(KernelReadError, match="No such file"):
        Kcore.open(tmp_path / "absent")


@pytest.mark.parametrize("layout", ["old", "new"])
def test_the_walk_gives_every_module_with_sections_sizes_and_build_id(
    tmp_path: Path, layout: str
) -> None:
    m = ModuleImage(layout)
    m.add(
        "dummy",
        DUMMY,
        core=(MODAREA + 0x100000, 0x3000),
        init=(MODAREA + 0x180000, 0x1000),
        build_id=DUMMY_ID,
    )
    m.add("brd", BRD, state="coming", core=(MODAREA + 0x200000, 0x5000))
    m.add("loading", {}, state="unformed")
    lay = module_layout(Btf.parse(BTF[layout]()))
    with Kcore.open(m.save(tmp_path / "kcore")) as k:
        mods = walk_modules(k, lay, MODULES_HEAD)
    assert [x.name for x in mods] == ["dummy", "brd", "loading"]  # oldest first
    dummy, brd, loading = mods
    assert dict(dummy.sections) == DUMMY
    assert (dummy.coresize, dummy.initsize, dummy.core_base) == (0x3000, 0x1000, MODAREA + 0x100000)
    assert dummy.build_id == DUMMY_ID and dummy.state == "live" and not dummy.faults
    assert dict(brd.sections) == BRD and brd.state == "coming" and brd.build_id is None
    assert loading.state == "unformed" and not loading.sections and loading.core_base is None


@pytest.mark.parametrize("layout", ["old", "new"])
def test_an_empty_list_is_no_module(tmp_path: Path, layout: str) -> None:
    lay = module_layout(Btf.parse(BTF[layout]()))
    with Kcore.open(ModuleImage(layout).save(tmp_path / "kcore")) as k:
        assert walk_modules(k, lay, MODULES_HEAD) == []


def test_a_torn_list_is_retried_then_a_named_error_never_an_answer(tmp_path: Path) -> None:
    m = ModuleImage("old")
    a = m.add("a", {".text": MODAREA + 0x300000})
    m.add("b", {".text": MODAREA + 0x301000})
    m.img.u64(m.entry(a) + 8, MODULES_HEAD)  # a's prev no longer b: b was unlinked half-way
    lay = module_layout(Btf.parse(old_btf()))
    with Kcore.open(m.save(tmp_path / "kcore")) as k, pytest.raises(ModuleListChanged):
        walk_modules(k, lay, MODULES_HEAD)


def test_a_corrupt_chain_ends_with_a_named_error(tmp_path: Path) -> None:
    m = ModuleImage("new")
    a = m.add("a", {".text": MODAREA + 0x300000})
    lay = module_layout(Btf.parse(new_btf()))
    m.img.u64(m.entry(a), 0xDEAD000000000100)  # LIST_POISON1
    with Kcore.open(m.save(tmp_path / "kcore")) as k, pytest.raises(AddressNotMapped):
        walk_modules(k, lay, MODULES_HEAD)
    m.relink()
    bad = m._sect_attrs({".text": MODAREA + 0x300000})
    m.img.u32(bad + NEW["nsections"], 1 << 30)  # a section count no module has
    m.img.u64(a + NEW["sect_attrs"], bad)
    with (
        Kcore.open(m.save(tmp_path / "kcore")) as k,
        pytest.raises(KernelMemoryError, match="section attributes"),
    ):
        walk_modules(k, lay, MODULES_HEAD)
    m.img.u32(bad + NEW["nsections"], 1)
    m.img.u64(bad + NEW["attrs"] + NEW["attr_name"], 0x1234)  # a name pointer into nothing
    with Kcore.open(m.save(tmp_path / "kcore")) as k, pytest.raises(AddressNotMapped):
        walk_modules(k, lay, MODULES_HEAD)


def test_a_list_changing_during_walks_gives_one_whole_answer_or_a_retry(tmp_path: Path) -> None:
    """A writer flips the file between two lists, [a, b, c] and [a, c], one
    8-byte link at a time (so the file is often torn); every walk is one of the
    two lists, whole, or ModuleListChanged."""
    m = ModuleImage("old")
    mods = [m.add(n, {".text": MODAREA + 0x300000 + i * 0x1000}) for i, n in enumerate("cba")]
    path = m.save(tmp_path / "kcore")
    c, b, a = mods  # list order: a (newest), b, c
    ea, eb, ec = (m.entry(x) for x in (a, b, c))
    # (address, with b, without b) of the four links that change
    links = [(ea, eb, ec), (ec + 8, eb, ea), (eb, ec, ec), (eb + 8, ea, ea)]
    lay = module_layout(Btf.parse(old_btf()))
    stop = threading.Event()

    def flip() -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            with_b = False
            while not stop.is_set():
                for addr, yes, no in links:
                    os.pwrite(
                        fd, (yes if with_b else no).to_bytes(8, "little"), m.img.offset_of(addr)
                    )
                with_b = not with_b
        finally:
            os.close(fd)

    seen: dict[str, int] = {}
    writer = threading.Thread(target=flip)
    writer.start()
    try:
        with Kcore.open(path) as k:
            for _ in range(300):
                try:
                    names = "".join(x.name for x in walk_modules(k, lay, MODULES_HEAD))
                except ModuleListChanged:
                    names = "retry"
                seen[names] = seen.get(names, 0) + 1
    finally:
        stop.set()
        writer.join()
    assert set(seen) <= {"cba", "ca", "retry"}, seen


def test_threads_reading_one_kcore_while_it_closes_get_its_bytes_or_a_named_error(
    tmp_path: Path,
) -> None:
    """The tracepoint thread, the tracker and the symbol capture read one open
    kcore at once, and shutdown closes it under them: every read is the kcore's
    own bytes or KernelReadError, never bytes of a file that took the closed
    descriptor's number (opened here, again and again, to take it)."""
    img = KcoreImage()
    img.segment(0xFFFFFFFF81000000, 0x1000)
    img.write(0xFFFFFFFF81000100, b"K" * 64)
    path = img.save(tmp_path / "kcore")
    other = tmp_path / "other"
    other.write_bytes(b"O" * (1 << 16))
    k = Kcore.open(path)
    under_way = threading.Event()
    wrong: list[bytes] = []
    counts = {"read": 0, "refused": 0}

    def reader() -> None:
        deadline = time.monotonic() + 120
        refused = 0
        while refused < 100 and time.monotonic() < deadline:  # on, well past the close
            try:
                data = k.read(0xFFFFFFFF81000100, 64)
            except KernelReadError:
                refused += 1
                counts["refused"] += 1
                continue
            counts["read"] += 1
            if counts["read"] >= 100:
                under_way.set()
            if data != b"K" * 64:
                wrong.append(data)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    assert under_way.wait(120)
    k.close()
    fds = [os.open(other, os.O_RDONLY) for _ in range(8)]  # one of them takes the number
    try:
        for t in threads:
            t.join(timeout=150)
    finally:
        for fd in fds:
            os.close(fd)
    assert not any(t.is_alive() for t in threads)
    assert wrong == []
    assert counts["refused"] > 0  # the close did land among the reads
    with pytest.raises(KernelReadError, match="closed"):
        k.read(0xFFFFFFFF81000100, 8)


def test_a_walk_for_some_modules_stops_where_they_are_found(tmp_path: Path) -> None:
    """A new load is at the list's head: a walk for it reads no further, so a
    tail the walk never reaches (here torn, and with a poisoned link) costs
    nothing; a module not on the list makes the walk go to the end."""
    m = ModuleImage("new")
    old = m.add("old", {".text": MODAREA + 0x300000})
    m.add("middle", {".text": MODAREA + 0x301000})
    m.add("new", BRD)
    m.img.u64(m.entry(old), 0xDEAD000000000100)  # LIST_POISON1 at the tail
    lay = module_layout(Btf.parse(new_btf()))
    with Kcore.open(m.save(tmp_path / "kcore")) as k:
        assert [x.name for x in walk_modules(k, lay, MODULES_HEAD, {"new"})] == ["new"]
        assert [x.name for x in walk_modules(k, lay, MODULES_HEAD, {"new", "middle"})] == [
            "middle",
            "new",
        ]
        with pytest.raises(AddressNotMapped):
            walk_modules(k, lay, MODULES_HEAD, {"gone"})


@pytest.mark.parametrize("layout", ["old", "new"])
def test_a_modules_symbols_are_read_as_kallsyms_prints_them(tmp_path: Path, layout: str) -> None:
    """mod->kallsyms in its order, the empty symbol 0 left out, exported ones
    (in mod->syms: PREL32 offsets in one layout, pointers in the other) upper
    case, the rest lower, whatever case typetab holds."""
    from kreld.kernel.modules_kcore import module_symbols

    m = ModuleImage(layout)
    syms = [
        ("dummy_init", MODAREA + 0x180000, "t", False),
        ("dummy_setup", MODAREA + 0x100010, "T", False),
        ("dummy_exported", MODAREA + 0x100100, "t", True),
        ("__key.45", MODAREA + 0x103000, "b", False),
        ("per_cpu_var", 0x34000, "a", False),
    ]
    mod = m.add("dummy", DUMMY, symbols=syms)
    lay = module_layout(Btf.parse(BTF[layout]()))
    with Kcore.open(m.save(tmp_path / "kcore")) as k:
        got = module_symbols(k, lay, mod)
    assert got == [
        (MODAREA + 0x180000, b"t", b"dummy_init"),
        (MODAREA + 0x100010, b"t", b"dummy_setup"),
        (MODAREA + 0x100100, b"T", b"dummy_exported"),
        (MODAREA + 0x103000, b"b", b"__key.45"),
        (0x34000, b"a", b"per_cpu_var"),
    ]


def _core(phoff: int, phentsize: int, phnum: int, phdrs: bytes = b"") -> bytes:
    fields = (b"\x7fELF", 2, 1, 1, 0, 0, b"\0" * 7, 4, 62, 1, 0, phoff, 0, 0, 64)
    return struct.pack("<4sBBBBB7sHHIQQQIHHHHHH", *fields, phentsize, phnum, 0, 0, 0) + phdrs


@pytest.mark.parametrize(
    "core,words",
    [
        (_core((1 << 64) - 64, 56, 2), "past any file"),
        (_core(64, 0xFFFF, 4096), "program headers of"),
        (_core(64, 56, 1, struct.pack("<IIQQQQQQ", 4, 0, 1 << 63, 0, 0, 1 << 40, 0, 0)),
         "a note segment of"),
        (_core(64, 56, 1, struct.pack("<IIQQQQQQ", 4, 0, (1 << 64) - 16, 0, 0, 4096, 0, 0)),
         "past any file"),
    ],
    ids=["phoff-2^64", "headers-of-256-mib", "note-of-a-tib", "note-at-2^64"],
)  # fmt: skip
def test_headers_that_point_anywhere_are_refused_before_anything_is_read(
    tmp_path: Path, core: bytes, words: str
) -> None:
    path = tmp_path / "kcore"
    path.write_bytes(core)
    with pytest.raises(KernelReadError, match=words):
        Kcore.open(path)


def test_a_segment_that_lies_past_2_63_in_the_file_is_left_out(tmp_path: Path) -> None:
    load = struct.pack("<IIQQQQQQ", 1, 0, 1 << 63, 0xFFFFFFFF81000000, 0, 4096, 4096, 0)
    path = tmp_path / "kcore"
    path.write_bytes(_core(64, 56, 1, load))
    with Kcore.open(path) as kcore:
        assert kcore.segments == []
        with pytest.raises(AddressNotMapped):
            kcore.read(0xFFFFFFFF81000000, 8)


@pytest.mark.parametrize("value", ["-1", f"{1 << 80:x}", "8000000000000000", "12x"])
def test_a_kerneloffset_the_kernel_cannot_have_is_a_named_error(tmp_path: Path, value: str) -> None:
    from support.faketree import kcore

    path = tmp_path / "kcore"
    path.write_bytes(kcore(f"KERNELOFFSET={value}\nSYMBOL(_stext)=-5\n".encode()))
    with Kcore.open(path) as k:
        with pytest.raises(KernelMemoryError, match="KERNELOFFSET"):
            k.kernel_offset()
        with pytest.raises(KernelMemoryError, match="_stext"):
            k.symbol("_stext")


def test_kcore_and_the_build_id_reader_share_one_elf_reader_and_its_bounds(
    tmp_path: Path,
) -> None:
    """A note segment one byte past the bound: refused by Kcore by name, and no
    build-id from fd_build_id, because both read it through kreld.kernel.elf."""
    from kreld.kernel.elf import MAX_NOTE_SEGMENT, fd_build_id

    build_id = bytes(range(20))
    note = struct.pack("<III", 4, len(build_id), 3) + b"GNU\0" + build_id
    size = MAX_NOTE_SEGMENT + 1
    phdr = struct.pack("<IIQQQQQQ", 4, 0, 64 + 56, 0, 0, size, 0, 0)
    path = tmp_path / "core"
    path.write_bytes(_core(64, 56, 1, phdr) + note + bytes(size - len(note)))
    with pytest.raises(KernelReadError, match="a note segment of"):
        Kcore.open(path)
    with open(path, "rb") as f:
        assert fd_build_id(f.fileno()) is None
    fitting = struct.pack("<IIQQQQQQ", 4, 0, 64 + 56, 0, 0, len(note), 0, 0)
    path.write_bytes(_core(64, 56, 1, fitting) + note)
    with open(path, "rb") as f:
        assert fd_build_id(f.fileno()) == build_id.hex()
    with Kcore.open(path) as kcore:
        assert kcore.segments == [] and kcore.vmcoreinfo == {}
