"""The ELF note parser (``kreld.kernel.notes``) on real and hand-built note streams."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from kreld.core.errors import KreldError, NoteError
from kreld.kernel.notes import Note, find_build_id, iter_notes, parse_vmcoreinfo

SYS_NOTES = Path("/sys/kernel/notes")


def raw_note(
    name: bytes,
    ntype: int,
    desc: bytes,
    *,
    namesz: int | None = None,
    descsz: int | None = None,
    endian: str = "<",
) -> bytes:
    """One note as the kernel lays it out; *namesz*/*descsz* may lie about the sizes."""
    nm = name + b"\0" if name else b""
    hdr = struct.pack(
        endian + "III",
        len(nm) if namesz is None else namesz,
        len(desc) if descsz is None else descsz,
        ntype,
    )
    return hdr + nm + b"\0" * (-len(nm) % 4) + desc + b"\0" * (-len(desc) % 4)


def independent_parse(data: bytes) -> list[tuple[bytes, int, bytes]]:
    """A second, separately written parser: (name without NUL, type, descriptor).

    A tail shorter than a header is the section's zero padding."""
    out = []
    pos = 0
    while pos + 12 <= len(data):
        namesz, descsz, ntype = struct.unpack_from("=III", data, pos)
        pos += 12
        name = data[pos : pos + namesz].rstrip(b"\0")
        pos += (namesz + 3) // 4 * 4
        desc = data[pos : pos + descsz]
        assert len(desc) == descsz, "the real note stream is itself truncated"
        pos += (descsz + 3) // 4 * 4
        out.append((name, ntype, desc))
    return out


def as_tuples(notes: list[Note]) -> list[tuple[bytes, int, bytes]]:
    return [(n.name, n.type, n.desc) for n in notes]


BUILD_ID = bytes.fromhex("a3e4cd60a8ec14f02aa41b41d5b5846d3d9f1dd8")
SEVERAL = [
    (b"GNU", 3, BUILD_ID),
    (b"Linux", 6, b"\x00\x01\x00\x00"),
    (b"Xen", 18, struct.pack("<Q", 0xFFFFFFFF80000000)),
    (b"VMCOREINFO", 0, b"OSRELEASE=6.1.0\nKERNELOFFSET=1e000000\n"),
]


def blob_of(notes: list[tuple[bytes, int, bytes]]) -> bytes:
    return b"".join(raw_note(*n) for n in notes)


# -- the machine's own /sys/kernel/notes ------------------------------------------------


@pytest.mark.live
def test_real_sys_kernel_notes_parse_like_an_independent_parser() -> None:
    """Every note in the running kernel's /sys/kernel/notes comes out as struct reads it."""
    if not SYS_NOTES.exists():
        pytest.skip(f"{SYS_NOTES} does not exist on this machine")
    data = SYS_NOTES.read_bytes()
    expected = independent_parse(data)
    assert expected, "no notes at all in /sys/kernel/notes"
    assert as_tuples(list(iter_notes(data))) == expected


@pytest.mark.live
def test_real_build_id_is_the_gnu_type_3_note() -> None:
    """find_build_id returns the descriptor of the GNU/NT_GNU_BUILD_ID note, as hex."""
    if not SYS_NOTES.exists():
        pytest.skip(f"{SYS_NOTES} does not exist on this machine")
    data = SYS_NOTES.read_bytes()
    gnu = [d for name, t, d in independent_parse(data) if name == b"GNU" and t == 3]
    if not gnu:
        pytest.skip("the running kernel carries no GNU build-id note")
    assert find_build_id(data) == gnu[0].hex()
    assert len(gnu[0]) >= 8


# -- hand-built streams -------------------------------------------------------------------


def test_several_notes_come_out_in_order_with_exact_descriptors() -> None:
    blob = blob_of(SEVERAL)
    assert as_tuples(list(iter_notes(blob))) == SEVERAL
    assert find_build_id(blob) == BUILD_ID.hex()


@pytest.mark.parametrize(
    "notes",
    [
        # namesz 3, 6, 2 and descsz 1, 5, 7: every one needs padding to 4
        [(b"ab", 1, b"\x01"), (b"abcde", 2, b"12345"), (b"x", 3, b"seven!!")],
        # namesz exactly 4 / 8 (no name padding), descsz 0
        [(b"Xen", 7, b""), (b"Linux12", 8, b"abcd"), (b"GNU", 3, b"\xaa" * 20)],
        # a note without a name (namesz 0)
        [(b"", 9, b"nameless"), (b"GNU", 3, b"\x01\x02\x03")],
    ],
    ids=["odd-sizes", "aligned-and-empty-desc", "nameless"],
)
def test_odd_name_and_descriptor_sizes_are_padded_to_4(notes) -> None:
    """A note after an odd-sized one is found at the next 4-byte boundary."""
    blob = blob_of(notes)
    assert len(blob) % 4 == 0
    assert as_tuples(list(iter_notes(blob))) == notes


def test_unpadded_last_note_is_accepted() -> None:
    """A last descriptor cut right after its bytes (padding missing) still parses."""
    blob = blob_of([(b"GNU", 3, BUILD_ID), (b"odd", 5, b"12345")])
    cut = blob[:-3]  # drop the 3 padding bytes of the 5-byte descriptor
    assert as_tuples(list(iter_notes(cut)))[-1] == (b"odd", 5, b"12345")


@pytest.mark.parametrize("pad", [1, 4, 8, 11])
def test_trailing_zero_padding_is_not_a_note(pad: int) -> None:
    blob = blob_of(SEVERAL)
    assert as_tuples(list(iter_notes(blob + b"\0" * pad))) == SEVERAL


def test_trailing_nonzero_short_bytes_raise_with_their_offset() -> None:
    blob = blob_of(SEVERAL)
    with pytest.raises(NoteError) as ei:
        list(iter_notes(blob + b"\x04\0\0\0\x14"))
    assert ei.value.offset == len(blob)
    assert f"byte {len(blob)}" in str(ei.value)


def test_truncated_header_raises_note_error_at_the_header() -> None:
    first = raw_note(b"GNU", 3, BUILD_ID)
    second = raw_note(b"Linux", 6, b"\x00\x01\x00\x00")
    with pytest.raises(NoteError) as ei:
        list(iter_notes(first + second[:7]))
    assert ei.value.offset == len(first)
    assert isinstance(ei.value, KreldError)


def test_truncated_descriptor_raises_note_error_at_its_note() -> None:
    first = raw_note(b"Linux", 6, b"\x00\x01\x00\x00")
    second = raw_note(b"GNU", 3, BUILD_ID)
    data = first + second[: 12 + 4 + 10]  # header, name, 10 of 20 descriptor bytes
    with pytest.raises(NoteError) as ei:
        list(iter_notes(data))
    assert ei.value.offset == len(first)
    assert "descriptor 20" in str(ei.value)
    with pytest.raises(NoteError):
        find_build_id(data)


def test_descriptor_size_overrunning_the_blob_raises() -> None:
    """A header that lies (descsz far past the end) is refused, not read past."""
    data = raw_note(b"GNU", 3, BUILD_ID, descsz=0xFFFFFFF0)
    with pytest.raises(NoteError) as ei:
        list(iter_notes(data))
    assert ei.value.offset == 0


def test_name_size_overrunning_the_blob_raises() -> None:
    data = raw_note(b"GNU", 3, b"", namesz=64)
    with pytest.raises(NoteError) as ei:
        list(iter_notes(data))
    assert ei.value.offset == 0


def test_every_truncation_yields_a_prefix_or_a_named_error() -> None:
    """Cutting a valid stream anywhere never crashes or invents a note."""
    blob = blob_of(SEVERAL)
    boundaries = {0}
    pos = 0
    for n in SEVERAL:
        pos += len(raw_note(*n))
        boundaries.add(pos)
    for cut in range(len(blob)):
        try:
            got = as_tuples(list(iter_notes(blob[:cut])))
        except NoteError as e:
            assert cut not in boundaries
            assert e.offset in boundaries
            continue
        assert got == SEVERAL[: len(got)]
        if cut in boundaries:
            assert sum(len(raw_note(*n)) for n in got) == cut


def test_empty_build_id_is_an_error_not_an_empty_string() -> None:
    with pytest.raises(NoteError, match="empty GNU build-id"):
        find_build_id(raw_note(b"GNU", 3, b""))


def test_build_id_needs_both_the_gnu_name_and_type_3() -> None:
    """A GNU ABI-tag note (type 1) and a type-3 note of another owner are not build-ids."""
    abi_tag = raw_note(b"GNU", 1, b"\0" * 16)
    other = raw_note(b"Xen", 3, b"\x99" * 20)
    assert find_build_id(abi_tag + other) is None
    assert find_build_id(abi_tag + other + raw_note(b"GNU", 3, BUILD_ID)) == BUILD_ID.hex()
    assert find_build_id(b"") is None


def test_big_endian_notes_parse_with_byteorder_big() -> None:
    blob = b"".join(raw_note(*n, endian=">") for n in SEVERAL)
    assert as_tuples(list(iter_notes(blob, "big"))) == SEVERAL
    with pytest.raises(NoteError):  # read little-endian, namesz 4 becomes 0x04000000
        list(iter_notes(blob, "little"))


def test_vmcoreinfo_descriptor_lines_become_a_dict() -> None:
    desc = b"OSRELEASE=6.1.0\nPAGESIZE=4096\nKERNELOFFSET=1e000000\nno equals sign\n\0\0\0"
    assert parse_vmcoreinfo(desc) == {
        "OSRELEASE": "6.1.0",
        "PAGESIZE": "4096",
        "KERNELOFFSET": "1e000000",
    }
