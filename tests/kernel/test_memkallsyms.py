"""The kernel's kallsyms tables decoded from kernel memory (kreld/kernel/memkallsyms.py),
on kcore-shaped files holding tables encoded here (tests/support/kallsymsbuild.py) in each
address layout the kernel has had, and hostile ones."""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path

import pytest

from kreld.core.errors import KallsymsTableError, KernelReadError
from kreld.kernel.kcore import Kcore
from kreld.kernel.memkallsyms import (
    MAX_SYMBOLS,
    check_against,
    decode_kallsyms,
    read_kallsyms,
)

from support.kallsymsbuild import kallsyms_text, place
from support.kmembuild import KcoreImage

TEXT = 0xFFFFFFFFAB000000
TABLES = 0xFFFFFFFFAD000000  # the tables' own segment, as .rodata would be
BIG = "a_" + "".join(chr(ord("a") + i % 26) + chr(ord("A") + i * 7 % 26) for i in range(160))
LINES = [
    (TEXT, "T", "_text"),
    (TEXT, "T", "_stext"),
    (TEXT + 0x1000, "T", "start_kernel"),
    (TEXT + 0x2000, "t", "do_one_initcall"),
    (TEXT + 0x2040, "t", "do_one_initcall"),  # a name twice: both kept, in order
    (TEXT + 0x3000, "t", BIG),  # compressed to 0x80 bytes or more: a two-byte length
    (TEXT + 0x1000000, "T", "_etext"),
    (TEXT + 0x1800000, "D", "modules"),
    (TEXT + 0x3000000, "T", "_sinittext"),
    (TEXT + 0x3100000, "T", "_einittext"),
]
PERCPU = [(0, "A", "fixed_percpu_data"), (0x1000, "A", "irq_stack_backing_store"), *LINES]


def image(
    tmp_path: Path, lines: list[tuple[int, str, str]], layout: str, size: int = 0x100000
) -> tuple[KcoreImage, dict[str, str]]:
    img = KcoreImage()
    img.segment(TABLES, size)
    info = {"KERNELOFFSET": "2a000000", "SYMBOL(_stext)": f"{TEXT:x}"}
    info |= place(img, TABLES, lines, layout)
    img.save(tmp_path / "kcore", info)
    return img, info


def want(lines: list[tuple[int, str, str]]) -> bytes:
    return kallsyms_text(lines, zero=False).encode()


@pytest.mark.parametrize(
    ("layout", "lines", "named"),
    [
        ("percpu", PERCPU, "per-cpu absolute"),
        ("relative", LINES, "relative to kallsyms_relative_base"),
        ("absolute", PERCPU, "absolute"),
        ("place", LINES, "place-relative"),
    ],
)
def test_each_address_layout_decodes_to_the_lines_kallsyms_prints(
    tmp_path: Path, layout: str, lines: list[tuple[int, str, str]], named: str
) -> None:
    image(tmp_path, lines, layout)
    with Kcore.open(tmp_path / "kcore") as k:
        table = read_kallsyms(k, kallsyms_text(lines, zero=True).encode())
    assert table.text == want(lines)
    assert table.count == len(lines) and named in table.layout
    assert table.address("modules", b"dDbB") == TEXT + 0x1800000
    assert table.address("do_one_initcall") == TEXT + 0x2000
    assert table.address("modules", b"tT") is None and table.address("nothing") is None


def test_a_big_name_takes_two_length_bytes_and_decodes_whole(tmp_path: Path) -> None:
    _img, info = image(tmp_path, LINES, "relative")
    names = int(info["SYMBOL(kallsyms_names)"], 16)
    with Kcore.open(tmp_path / "kcore") as k:
        raw = k.read(names, 0x1000)
        table = decode_kallsyms(k)
    # Walk to the big name's length: it has the high bit set.
    p = 0
    for _i in range(5):
        p += 1 + raw[p] if raw[p] < 0x80 else 2 + ((raw[p] & 0x7F) | raw[p + 1] << 7)
    assert raw[p] & 0x80
    assert f" t {BIG}\n".encode() in table.text


def test_a_table_checked_against_kallsyms_with_modules_lines_after_it(tmp_path: Path) -> None:
    image(tmp_path, PERCPU, "percpu")
    listed = kallsyms_text(PERCPU, zero=True) + "0000000000000000 t dummy_init\t[dummy]\n"
    with Kcore.open(tmp_path / "kcore") as k:
        assert read_kallsyms(k, listed.encode()).text == want(PERCPU)


def _swap(lines: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    out = list(lines)
    out[4], out[5] = out[5], out[4]
    return out


@pytest.mark.parametrize(
    ("listed", "why"),
    [
        (
            _swap(PERCPU),
            "disagree with it at line 5: 'T start_kernel', kallsyms lists 't do_one_initcall'",
        ),
        (PERCPU[:-1], "disagree with it at line 12"),
        ([*PERCPU, (0, "t", "more")], "disagree with it at line 13: '(end)'"),
        ([(a, "t" if n == "_etext" else t, n) for a, t, n in PERCPU], "'T _etext'"),
    ],
)
def test_a_table_disagreeing_with_kallsyms_is_refused(
    tmp_path: Path, listed: list[tuple[int, str, str]], why: str
) -> None:
    image(tmp_path, PERCPU, "percpu")
    with Kcore.open(tmp_path / "kcore") as k:
        table = decode_kallsyms(k)
        with pytest.raises(KallsymsTableError, match="kallsyms") as e:
            check_against(table, kallsyms_text(listed, zero=True).encode())
    assert why in str(e.value)


def _hostile(tmp_path: Path, label: str, data: bytes, at: int = 0) -> None:
    img, info = image(tmp_path, PERCPU, "percpu")
    img.write(int(info[f"SYMBOL({label})"], 16) + at, data)
    img.save(tmp_path / "kcore", info)


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda p: _hostile(p, "kallsyms_num_syms", struct.pack("<I", 0xFFFFFFF0)), "limit"),
        (lambda p: _hostile(p, "kallsyms_num_syms", struct.pack("<I", 0)), "is 0"),
        (
            lambda p: _hostile(p, "kallsyms_num_syms", struct.pack("<I", MAX_SYMBOLS)),
            "of 4194304",
        ),
        (
            lambda p: _hostile(p, "kallsyms_token_index", b"\xff\xff", 2 * 7),
            "token 0x07 at offset 65535",
        ),
        (lambda p: _hostile(p, "kallsyms_names", b"\x00"), "name 0 of 12 is empty"),
        (lambda p: _hostile(p, "kallsyms_offsets", struct.pack("<i", -99), 12), "_stext decodes"),
    ],
)
def test_hostile_tables_are_refused_with_a_named_error_in_bounded_memory(
    tmp_path: Path, damage: object, why: str
) -> None:
    damage(tmp_path)  # type: ignore[operator]
    tracemalloc.start()
    try:
        with Kcore.open(tmp_path / "kcore") as k, pytest.raises(KallsymsTableError) as e:
            decode_kallsyms(k)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert why in str(e.value)
    assert isinstance(e.value, KernelReadError)
    assert peak < 16 << 20, f"{peak} bytes to refuse a table of {len(PERCPU)} symbols"


def test_a_name_running_past_the_end_of_memory_is_refused(tmp_path: Path) -> None:
    """The names are the last thing in the segment, cut mid-name."""
    img = KcoreImage()
    img.segment(TABLES, 0x10000)
    info = {"SYMBOL(_stext)": f"{TEXT:x}"} | place(img, TABLES, PERCPU, "percpu")
    names = int(info["SYMBOL(kallsyms_names)"], 16)
    # A second segment holding only the start of the names: the first name's
    # length says 0x40 bytes, the segment ends after 8.
    img.segment(TABLES + 0x100000, 9)
    img.write(TABLES + 0x100000, bytes([0x40]) + b"\x01" * 8)
    info["SYMBOL(kallsyms_names)"] = f"{TABLES + 0x100000:x}"
    img.save(tmp_path / "kcore", info)
    with Kcore.open(tmp_path / "kcore") as k, pytest.raises(KallsymsTableError) as e:
        decode_kallsyms(k)
    assert "name 0 of 12 (64 bytes) runs past the names" in str(e.value)
    assert names != TABLES + 0x100000


def test_tables_vmcoreinfo_does_not_name_are_refused_saying_which(tmp_path: Path) -> None:
    img = KcoreImage()
    img.segment(TABLES, 0x1000)
    img.save(tmp_path / "kcore", {"KERNELOFFSET": "0"})
    with Kcore.open(tmp_path / "kcore") as k, pytest.raises(KallsymsTableError) as e:
        decode_kallsyms(k)
    assert "does not name kallsyms_names" in str(e.value)
    assert "kallsyms_offsets or kallsyms_addresses" in str(e.value)


def test_a_real_size_table_decodes_whole(tmp_path: Path) -> None:
    lines = [*PERCPU]
    lines += [(TEXT + 0x4000000 + 16 * i, "t", f"filler_fn_{i}") for i in range(150_000)]
    image(tmp_path, lines, "percpu", size=0x800000)
    with Kcore.open(tmp_path / "kcore") as k:
        table = read_kallsyms(k, kallsyms_text(lines, zero=True).encode())
    assert table.count == len(lines) and table.text == want(lines)
