"""kreld.kernel.kallsyms: a module's lines out of the raw text, the kernel's streamed;
the same answers as parsing every line."""

from __future__ import annotations

from pathlib import Path

import pytest

from kreld.core.errors import KernelReadError
from kreld.core.symtab import SymbolTable, kernel_table
from kreld.kernel.info import Root
from kreld.kernel.kallsyms import KallsymsText, parse_kallsyms

TEXT = 0xFFFFFFFF81000000
RAW = b"".join(
    [
        b"ffffffff81000000 T _text\n",
        b"ffffffff81000000 T _stext\n",
        b"ffffffff81001000 t do_one_initcall\n",
        b"0000000000001000 A fixed_percpu_data\n",
        b"ffffffff82000000 T _etext\n",
        b"ffffffffc0100000 t kvm_a\t[kvm]\n",
        b"ffffffffc0100010 T kvm_b\t[kvm]\n",
        b"0000000000002000 a kvm_pcpu\t[kvm]\n",
        b"ffffffffc0200000 t vmx_a\t[kvm_intel]\n",
        b"ffffffffc0300000 t trampoline\t[__builtin__ftrace]\n",
        b"ffffffffc0400000 t bpf_prog_1\t[bpf]\n",
        b"ffffffffc0500000 T last_line_no_newline\t[tail]",
    ]
)


def test_module_lines_are_what_a_full_parse_gives_each_owner() -> None:
    """Every owner, a name that prefixes another (kvm, kvm_intel) and a last
    line without a newline included."""
    ks = KallsymsText.of(RAW)
    full = parse_kallsyms(RAW)
    assert full.order == ["kvm", "kvm_intel", "__builtin__ftrace", "bpf", "tail"]
    for owner in full.order:
        assert ks.module(owner) == full.modules[owner], owner
    assert ks.module("kvm_in") == []
    assert ks.module("absent") == []


def test_kernel_lines_stream_into_the_same_table_as_a_full_parse() -> None:
    ks = KallsymsText.of(RAW)
    assert list(ks.core()) == parse_kallsyms(RAW).core
    packed = kernel_table(ks.core(), TEXT)
    assert packed == kernel_table(parse_kallsyms(RAW).core, TEXT)
    assert SymbolTable(packed).count == 5


def test_owned_lines_are_the_kernels_lines_of_non_module_owners() -> None:
    ks = KallsymsText.of(RAW)
    assert ks.owned({"kvm", "kvm_intel", "tail"}) == [
        "ffffffffc0300000 t trampoline\t[__builtin__ftrace]",
        "ffffffffc0400000 t bpf_prog_1\t[bpf]",
    ]


@pytest.mark.parametrize(
    ("raw", "zeroed"),
    [
        (RAW, False),
        (b"0000000000000000 T _text\n0000000000000000 t x\t[m]\n", True),
        (b"", True),
    ],
)
def test_zeroed_means_restricted_addresses(raw: bytes, zeroed: bool) -> None:
    assert KallsymsText.of(raw).zeroed() is zeroed


def test_a_kallsyms_without_modules_has_an_empty_tail() -> None:
    raw = b"ffffffff81000000 T _text\nffffffff81000010 t x\n"
    ks = KallsymsText.of(raw)
    assert ks.tail == len(raw)
    assert ks.module("x") == []
    assert ks.owned(set()) == []
    assert len(list(ks.core())) == 2


@pytest.mark.parametrize("chunk", [1, 2, 7, 26, 64, 1 << 18])
def test_a_read_of_the_tail_keeps_every_owners_lines_and_no_core_line(
    tmp_path: Path, chunk: int
) -> None:
    """Whatever the chunks the core lines stream through (one byte, a chunk
    ending inside the first owned line, or all at once), the tail read gives
    each owner the lines a whole read gives, and keeps no core line."""
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/kallsyms").write_bytes(RAW)
    whole = KallsymsText.of(RAW)
    tail = KallsymsText.read_tail(Root(tmp_path), chunk)
    assert tail.data == RAW[whole.tail :]
    assert list(tail.core()) == []
    for owner in parse_kallsyms(RAW).order:
        assert tail.module(owner) == whole.module(owner), owner
    assert tail.owned(set()) == whole.owned(set())


def test_a_read_of_the_tail_of_a_kallsyms_without_owners_is_empty(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/kallsyms").write_bytes(b"ffffffff81000000 T _text\nffffffff81000010 t x\n")
    assert KallsymsText.read_tail(Root(tmp_path), 5).data == b""


def test_an_unreadable_kallsyms_is_a_kernel_read_error(tmp_path: Path) -> None:
    with pytest.raises(KernelReadError):
        KallsymsText.read_tail(Root(tmp_path))


def test_a_real_sized_kallsyms_is_read_whole_by_every_reader(tmp_path: Path) -> None:
    """120,000 lines (some 4 MB, a real kernel's): within the bound of the whole read,
    the tail's read and the snapshot's own read."""
    from kreld.kernel.snapshot import take_snapshot

    from support.faketree import FakeTree

    tree = FakeTree(tmp_path / "root")
    tree.grow_kallsyms(120_000)
    root = Root(tree.root)
    assert sum(1 for _ in KallsymsText.read(root).core()) == 120_000
    assert KallsymsText.read_tail(root).module("dummy")
    snap, _ = take_snapshot(root)
    assert snap.anchors.text == tree.text and not snap.faults


@pytest.mark.parametrize("tail", [False, True], ids=["whole", "tail"])
def test_a_kallsyms_past_its_bound_is_refused_by_name(tmp_path: Path, tail: bool) -> None:
    from kreld.core import consts

    path = tmp_path / "proc/kallsyms"
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.truncate(consts.MAX_KALLSYMS + 1)  # a hole: no disk
    read = KallsymsText.read_tail if tail else KallsymsText.read
    with pytest.raises(KernelReadError, match="larger than"):
        read(Root(tmp_path))


def test_an_address_of_more_than_16_hex_digits_is_no_line() -> None:
    ks = KallsymsText.of(
        b"ffffffff81000000 T _text\n1ffffffff81001000 T too_wide\nffffffff81002000 T ok\n"
    )
    assert [n for _v, _t, n in ks.core()] == [b"_text", b"ok"]
