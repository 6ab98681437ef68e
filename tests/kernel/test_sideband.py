"""The perf side-band record parser (kreld/kernel/sideband.py): records read
from their front and bounded by their size, LOST, and rings merged by time."""

from __future__ import annotations

import struct

from kreld.kernel.sideband import (
    HEADER,
    BpfEvent,
    BpfEventType,
    IdLayout,
    Ksymbol,
    KsymType,
    Lost,
    RecordType,
    merge_by_time,
    parse_records,
)

# Four records as this machine's kernel (6.18) wrote them into CPU 0's ring of a
# dummy event opened with ksymbol, bpf_event, sample_id_all and PERF_SAMPLE_TIME
# on CLOCK_MONOTONIC, while a socket filter named "kreldtest" was loaded and closed.
REAL_RING = bytes.fromhex(
    "1100000000004800183902c0ffffffff14000000010000006270665f70726f675f3539"
    "66346139333137343464636463365f6b72656c64746573740000000000ddbe587c43000000"
    "1200000000002000010000006100000059f4a931744dcdc613e9587c43000000"
    "1100000000004800183902c0ffffffff14000000010001006270665f70726f675f3539"
    "66346139333137343464636463365f6b72656c647465737400000000007c451c7f43000000"
    "1200000000002000020000006100000059f4a931744dcdc697731c7f43000000"
)


def ksymbol(t: int, addr: int, name: str, *, unregister: bool = False, trailing: int = 0) -> bytes:
    """A KSYMBOL record laid out as the kernel writes it, with *trailing* bytes
    after its sample_id (the size the shared header grew by)."""
    raw = name.encode() + b"\0"
    raw += b"\0" * (-len(raw) % 8)
    body = struct.pack("<QIHH", addr, 0x40, KsymType.BPF, int(unregister)) + raw
    body += struct.pack("<Q", t) + b"\xee" * trailing
    return HEADER.pack(RecordType.KSYMBOL, 0, HEADER.size + len(body)) + body


def bpf_event(t: int, typ: BpfEventType, prog_id: int, tag: bytes, trailing: int = 0) -> bytes:
    body = struct.pack("<HHI8s", typ, 0, prog_id, tag) + struct.pack("<Q", t)
    body += b"\xee" * trailing
    return HEADER.pack(RecordType.BPF_EVENT, 0, HEADER.size + len(body)) + body


def lost(t: int, n: int) -> bytes:
    body = struct.pack("<QQQ", 7, n, t)
    return HEADER.pack(RecordType.LOST, 0, HEADER.size + len(body)) + body


def test_records_written_by_the_real_kernel_parse_to_a_load_and_its_unload() -> None:
    p = parse_records(REAL_RING, cpu=0)
    assert p.skipped == 0 and p.rest == len(REAL_RING)
    reg, load, unreg, unload = p.records
    assert isinstance(reg, Ksymbol) and isinstance(unreg, Ksymbol)
    assert reg.name == unreg.name == "bpf_prog_59f4a931744dcdc6_kreldtest"
    assert reg.addr == unreg.addr == 0xFFFFFFFFC0023918 and reg.length == 20
    assert reg.ksym_type == KsymType.BPF and not reg.unregister and unreg.unregister
    assert isinstance(load, BpfEvent) and isinstance(unload, BpfEvent)
    assert (load.type, unload.type) == (BpfEventType.PROG_LOAD, BpfEventType.PROG_UNLOAD)
    assert load.prog_id == unload.prog_id == 0x61 and load.tag == "59f4a931744dcdc6"
    assert reg.time < load.time < unreg.time < unload.time


def test_trailing_bytes_after_the_sample_id_are_ignored_and_the_next_record_is_found() -> None:
    """Sizes grown by 24 and 32 bytes (seen on real kernels) change nothing read."""
    data = (
        ksymbol(100, 0xFFFFFFFFC0001000, "bpf_prog_0011223344556677_f", trailing=24)
        + bpf_event(101, BpfEventType.PROG_LOAD, 9, bytes(range(8)), trailing=32)
        + ksymbol(200, 0xFFFFFFFFC0001000, "bpf_prog_0011223344556677_f", unregister=True)
    )
    p = parse_records(data, cpu=1)
    assert [r.time for r in p.records] == [100, 101, 200] and p.skipped == 0
    first = p.records[0]
    assert isinstance(first, Ksymbol) and first.name == "bpf_prog_0011223344556677_f"
    ev = p.records[1]
    assert isinstance(ev, BpfEvent) and ev.prog_id == 9 and ev.tag == "0001020304050607"


def test_lost_records_are_read_with_their_count_and_time() -> None:
    p = parse_records(lost(555, 42) + ksymbol(556, 0xFFFFFFFFC0002000, "x"), cpu=3)
    assert p.records[0] == Lost(555, 3, 42)
    assert isinstance(p.records[1], Ksymbol) and p.records[1].cpu == 3


def test_unknown_types_and_malformed_records_are_stepped_over_by_their_size() -> None:
    other = HEADER.pack(9, 0, 16) + b"\0" * 8  # a COMM-sized record of another type
    no_nul = HEADER.pack(RecordType.KSYMBOL, 0, 40) + struct.pack("<QIHH", 1, 2, 1, 0) + b"a" * 16
    short = HEADER.pack(RecordType.BPF_EVENT, 0, 16) + b"\0" * 8  # no room for its fields
    data = other + no_nul + short + ksymbol(7, 0xFFFFFFFFC0003000, "ok")
    p = parse_records(data, cpu=0)
    assert p.skipped == 3 and [r.time for r in p.records] == [7]


def test_a_size_under_a_header_or_past_the_end_stops_the_parse_where_it_is() -> None:
    good = ksymbol(1, 0xFFFFFFFFC0001000, "a")
    zero = HEADER.pack(RecordType.KSYMBOL, 0, 0) + b"\0" * 64
    p = parse_records(good + zero, cpu=0)
    assert len(p.records) == 1 and p.rest == len(good)
    cut = ksymbol(2, 0xFFFFFFFFC0001000, "b")
    p = parse_records(good + cut[:-5], cpu=0)
    assert len(p.records) == 1 and p.rest == len(good)


def test_a_name_longer_than_ksym_name_len_is_malformed_not_read_on() -> None:
    p = parse_records(ksymbol(1, 0xFFFFFFFFC0001000, "n" * 600), cpu=0)
    assert p.records == [] and p.skipped == 1


def test_the_time_is_read_where_the_sample_type_puts_it() -> None:
    body = struct.pack("<HHI8s", 1, 0, 5, b"\1" * 8) + struct.pack("<IIQ", 10, 11, 999)
    rec = HEADER.pack(RecordType.BPF_EVENT, 0, HEADER.size + len(body)) + body
    (ev,) = parse_records(rec, cpu=0, layout=IdLayout(size=16, time_at=8)).records
    assert ev.time == 999


def test_merged_rings_give_an_unregister_on_another_cpu_after_its_register() -> None:
    """Loaded on CPU 0, unloaded on CPU 1: in time order whichever ring is read first."""
    name = "bpf_prog_aabbccddeeff0011_t"
    cpu0 = parse_records(ksymbol(10, 0xFFFFFFFFC0004000, name) + ksymbol(30, 0xA, "z"), cpu=0)
    cpu1 = parse_records(ksymbol(20, 0xFFFFFFFFC0004000, name, unregister=True), cpu=1)
    merged = list(merge_by_time([cpu1.records, cpu0.records]))
    assert [(r.time, r.cpu) for r in merged] == [(10, 0), (20, 1), (30, 0)]
    assert isinstance(merged[1], Ksymbol) and merged[1].unregister
