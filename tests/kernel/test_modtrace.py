"""The module tracepoints' records read with their format files: real format
text as the kernel prints it, raw records built field by field, and every
offset of a record checked against its size."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from kreld.core.errors import KernelReadError
from kreld.kernel.info import Root
from kreld.kernel.modtrace import (
    MODULE_NAME_MAX,
    TraceEvent,
    decode,
    find_tracepoint,
    parse_format,
)
from kreld.kernel.sideband import HEADER, RawSample, RecordType, parse_records

LOAD_FORMAT = """name: module_load
ID: 357
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:unsigned int taints;\toffset:8;\tsize:4;\tsigned:0;
\tfield:__data_loc char[] name;\toffset:12;\tsize:4;\tsigned:0;

print fmt: "%s %s", __get_str(name), __print_flags(REC->taints, "", { (1UL << 0), "P" })
"""
FREE_FORMAT = """name: module_free
ID: 356
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:__data_loc char[] name;\toffset:8;\tsize:4;\tsigned:0;

print fmt: "%s", __get_str(name)
"""


def raw_load(name: bytes, tp_id: int = 357, taints: int = 0x1000) -> bytes:
    s = name + b"\0"
    return struct.pack("<HBBiII", tp_id, 0, 0, 42, taints, (len(s) << 16) | 16) + s


def formats() -> dict[int, tuple[TraceEvent, object]]:
    return {
        357: (TraceEvent.LOAD, parse_format(357, LOAD_FORMAT)),
        356: (TraceEvent.FREE, parse_format(356, FREE_FORMAT)),
    }


def test_a_load_record_gives_its_module_name_taints_and_time() -> None:
    t = decode(RawSample(123, 1, raw_load(b"slowinit")), formats())  # type: ignore[arg-type]
    assert t is not None
    assert (t.time, t.cpu, t.event, t.name, t.taints) == (
        123,
        1,
        TraceEvent.LOAD,
        "slowinit",
        0x1000,
    )


def test_a_free_record_is_read_with_its_own_format() -> None:
    s = b"brd\0"
    raw = struct.pack("<HBBiI", 356, 0, 0, 1, (len(s) << 16) | 12) + s
    t = decode(RawSample(5, 0, raw), formats())  # type: ignore[arg-type]
    assert t is not None and (t.event, t.name, t.taints) == (TraceEvent.FREE, "brd", None)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        raw_load(b"x", tp_id=999),  # another tracepoint
        raw_load(b"x")[:14],  # cut inside the name's location word
        struct.pack("<HBBiII", 357, 0, 0, 0, 0, (200 << 16) | 16) + b"x\0",  # length past the end
        struct.pack("<HBBiII", 357, 0, 0, 0, 0, (5000 << 16) | 16) + b"a" * 5000,  # over a name
        raw_load(b""),  # empty name
        raw_load(b"a/b"),  # not a module name
    ],
)
def test_a_record_that_does_not_hold_together_is_refused(raw: bytes) -> None:
    assert decode(RawSample(1, 0, raw), formats()) is None  # type: ignore[arg-type]


def test_the_longest_module_name_is_read_whole() -> None:
    name = b"m" * MODULE_NAME_MAX
    t = decode(RawSample(1, 0, raw_load(name)), formats())  # type: ignore[arg-type]
    assert t is not None and t.name == name.decode()


def test_a_format_without_a_data_loc_name_is_refused() -> None:
    with pytest.raises(ValueError, match="name"):
        parse_format(1, LOAD_FORMAT.replace("__data_loc char[] name", "char name[56]"))


def test_a_sample_record_in_a_ring_is_framed_with_its_time_and_raw_bytes() -> None:
    raw = raw_load(b"dummy")
    body = struct.pack("<QI", 777, len(raw)) + raw
    body += b"\0" * (-(HEADER.size + len(body)) % 8)
    data = HEADER.pack(RecordType.SAMPLE, 0, HEADER.size + len(body)) + body
    parsed = parse_records(data + data[:10], 3)
    assert parsed.records == [RawSample(777, 3, raw)] and parsed.rest == len(data)


def test_the_tracepoint_is_found_in_tracefs_or_debugfs_and_its_absence_said(tmp_path: Path) -> None:
    root = Root(tmp_path)
    with pytest.raises(KernelReadError, match="tracefs mounted"):
        find_tracepoint(root, TraceEvent.LOAD)
    d = tmp_path / "sys/kernel/debug/tracing/events/module/module_load"
    d.mkdir(parents=True)
    (d / "id").write_text("357\n")
    (d / "format").write_text(LOAD_FORMAT)
    fmt = find_tracepoint(root, TraceEvent.LOAD)
    assert fmt.id == 357 and fmt.fields["name"].data_loc and fmt.fields["taints"].offset == 8
    (d / "format").write_text("garbage")
    with pytest.raises(KernelReadError, match="not a module tracepoint"):
        find_tracepoint(root, TraceEvent.LOAD)
