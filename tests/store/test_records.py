"""The stored form of an incarnation round-trips every field, is compact, refuses
damage by name, and the records of older stores stay readable."""

from __future__ import annotations

import json
from pathlib import Path

import lmdb
import pytest

from kreld.core import consts, record
from kreld.core.errors import RecordRefused, StoreCorrupt
from kreld.core.model import Incarnation, KaslrOffset, ModuleState, OffsetSource, SeenBy, Timestamp
from kreld.core.record import replace
from kreld.store import Store, encoding, inc_key

from support.records import incarnation


def roundtrip(inc: Incarnation) -> Incarnation:
    raw, key, names = encoding.encode(inc)
    layouts = {key: names}
    return encoding.decode(raw, inc.boot_id, inc.seq, layouts.__getitem__)


def test_every_field_survives() -> None:
    loaded = incarnation()
    assert roundtrip(loaded) == loaded
    gone = incarnation(
        unloaded=Timestamp(40_121_514_158, 40_121_514_200, 1_796_214_903_491_333_905),
        unloaded_after=Timestamp(40_000_000_000, 40_000_000_042, 1_796_214_903_370_000_000),
        unload_seen_by=SeenBy.POLL,
        loaded_after=Timestamp(32_000_000_000, 32_000_000_100, 1_796_214_895_370_000_000),
    )
    assert roundtrip(gone) == gone


def test_restricted_and_sectionless_records_survive() -> None:
    inc = incarnation()
    bare = Incarnation(
        inc.boot_id, 3, ModuleState("m", None, {}, None, None, None, None, None, None, True, None),
        inc.loaded, SeenBy.STARTUP, False,
    )  # fmt: skip
    assert roundtrip(bare) == bare


def test_odd_values_survive() -> None:
    """A build-id that is not lower-case hex, a realtime before 1970, a section below
    the core base, and every way a module can be seen."""
    inc = incarnation()
    for seen in SeenBy:
        odd = record.replace(
            inc,
            seen_by=seen,
            unload_seen_by=seen,
            loaded=Timestamp(5, 5, -1_000),
            unloaded=Timestamp(4, 9, 2**63),
            state=record.replace(
                inc.state, build_id="ABC", core_base=inc.state.core_base + 0x800, faults=()
            ),
        )
        assert roundtrip(odd) == odd


def test_same_names_share_one_layout_and_the_record_is_a_sixth_of_the_wire_form() -> None:
    a, b = incarnation(), incarnation()
    assert encoding.encode(a)[1] == encoding.encode(b)[1]
    raw = encoding.encode(a)[0]
    assert len(raw) * 6 < len(json.dumps(a.to_json()))


def test_damaged_records_raise_value_or_index_errors() -> None:
    """Every truncation, trailing bytes, unknown flags and a bad seen-by index fail
    with the errors the store turns into StoreCorrupt, never a wrong incarnation."""
    inc = incarnation(
        unloaded=Timestamp(40_121_514_158, 40_121_514_200, 1_796_214_903_491),
        unload_seen_by=SeenBy.POLL,  # the last byte: an index into SeenBy
    )
    raw, key, names = encoding.encode(inc)
    layouts = {key: names}
    bad = [raw[:n] for n in range(1, len(raw))]
    bad += [raw + b"\0", raw[:1] + b"\xff\xff\x0f" + raw[4:], raw[:-1] + b"\x09"]
    for b in bad:
        with pytest.raises((ValueError, IndexError, KeyError)):
            encoding.decode(b, inc.boot_id, inc.seq, layouts.__getitem__)


def test_schema_1_records_are_still_read() -> None:
    inc = incarnation()
    old = json.dumps(inc.to_json()).encode()
    assert encoding.decode(old, inc.boot_id, inc.seq, {}.__getitem__) == inc


SCHEMA_2_RECORD = {
    "v": 2, "n": "dummy", "b0": 0xFFFFFFFFC03BB000, "o": [0, 1024],
    "l": [32652141668, 32652141700, 1796214896021961415], "by": "uevent",
    "B": "4bd0a1f1c9c4f23a4bd0a1f1c9c4f23aabcd0123", "cs": 16384, "st": "live",
    "u": [100, 100, 100], "uby": "poll",
}  # fmt: skip


def test_a_schema_2_store_is_upgraded_and_its_records_still_read(tmp_path: Path) -> None:
    """A store written by the previous release (schema 2, JSON records): read-only
    openers leave it as it is; a writer raises it to the current schema, after which old and
    new records are read side by side, and a damaged record is a named StoreCorrupt."""
    boot = "4e5fd6e0-ca47-4d0d-9917-575640bbb1aa"
    state = tmp_path / "st"
    with Store(state):
        pass
    env = lmdb.open(str(state), max_dbs=16)
    meta, incs, lays = (env.open_db(n) for n in (b"meta", b"incarnations", b"layouts"))
    names = [".text", ".data"]
    lkey = encoding.layout_key(names)
    with env.begin(write=True) as txn:
        txn.put(b"schema", b"2", db=meta)
        txn.put(lkey, json.dumps(names).encode(), db=lays)
        old = dict(SCHEMA_2_RECORD, L=lkey.hex())
        txn.put(inc_key(boot, 0), json.dumps(old).encode(), db=incs)
    env.close()

    def schema() -> bytes:
        e = lmdb.open(str(state), max_dbs=16, readonly=True, lock=False)
        with e.begin(db=e.open_db(b"meta", create=False)) as txn:
            v = bytes(txn.get(b"schema"))
        e.close()
        return v

    with Store(state, readonly=True) as ro:
        (first,) = ro.incarnations(boot)
    assert schema() == b"2"
    assert first.state.sections == {".text": 0xFFFFFFFFC03BB000, ".data": 0xFFFFFFFFC03BB400}
    assert first.unloaded == Timestamp(32652141768, 32652141800, 1796214896021961515)
    assert first.unload_seen_by is SeenBy.POLL
    with Store(state) as st:
        (second,) = st.modules.apply_module_changes(boot, [incarnation()], [], [], None)
        assert st.incarnations(boot) == [first, second]
    assert schema() == str(consts.STORE_SCHEMA_VERSION).encode() == b"4"
    env = lmdb.open(str(state), max_dbs=16)
    with env.begin(write=True, db=env.open_db(b"incarnations")) as txn:
        txn.put(inc_key(boot, 1), encoding.encode(second)[0][:-3])
    env.close()
    with Store(state, readonly=True) as ro, pytest.raises(StoreCorrupt, match="unreadable"):
        ro.incarnations(boot)


@pytest.mark.parametrize(
    "change",
    [
        {"sections": {".text": 1 << 68, ".data": 0xFFFFFFFFC03BB000}},
        {"sections": {".text": int("f" * 60_000, 16)}},
        {"sections": {".text": -16}},
        {"coresize": -1},
    ],
    ids=["section-2^68", "section-60000-hex-digits", "section-negative", "coresize--1"],
)
def test_a_record_its_readers_would_refuse_is_refused_and_the_store_left_readable(
    tmp_path: Path, change: dict[str, object]
) -> None:
    good = incarnation()
    bad = replace(good, state=replace(good.state, name="bad", **change))
    with Store(tmp_path / "state") as store:
        store.modules.apply_module_changes(good.boot_id, [good], [], [], None)
        with pytest.raises(RecordRefused, match="bad would not read back"):
            store.modules.apply_module_changes(good.boot_id, [bad], [], [], None)
    with Store(tmp_path / "state", readonly=True) as store:
        assert [i.name for i in store.incarnations(good.boot_id)] == ["dummy"]


@pytest.mark.parametrize("offset", [-1, 1 << 80])
def test_a_boot_its_readers_would_refuse_is_refused(tmp_path: Path, offset: int) -> None:
    from support.records import snap

    bad = snap(kaslr=KaslrOffset(offset, OffsetSource.VMCOREINFO, "/proc/kcore"))
    with Store(tmp_path / "state") as store:
        with pytest.raises(RecordRefused, match="would not read back"):
            store.boots.record_boot(bad)
        assert store.boots.counts()["boots"] == 0
