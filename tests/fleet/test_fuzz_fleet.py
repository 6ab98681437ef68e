"""Fuzzing the fleet bucket's decoders: whatever an object holds, the
reader returns what the layout allows or raises FleetObjectInvalid, never
another exception, within its bounds.

Seeds are the publisher's own encodings of real records: a boot and module
incarnations a kreld recorded from a fake tree (a real store, read back), their
manifest and batch as kreld.fleet.objects writes them, a kernel symbol table
packed from that store, and index names.  hypothesis mutates them (bytes
flipped, cut, spliced; JSON values swapped for lists, objects, huge and
non-finite numbers, deep nesting) and draws JSON of its own.  In process, a few
hundred examples in some seconds.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kreld.core.errors import FleetObjectInvalid
from kreld.core.symtab import SymbolTable
from kreld.fleet import objects as fleet
from kreld.store import Store
from kreld.store.pubstate import table_bytes

from support.faketree import FakeTree
from support.run import kreldctl

SETTINGS = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


class Seeds:
    def __init__(self, boot_id: str, manifest: bytes, batch_json: bytes, table: bytes) -> None:
        self.boot_id, self.manifest, self.batch_json, self.table = (
            boot_id,
            manifest,
            batch_json,
            table,
        )


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> Seeds:
    d = tmp_path_factory.mktemp("fleetfuzz")
    tree = FakeTree(d / "root")
    state = d / "state"
    kreldctl("--root", str(tree.root), "--state-dir", str(state), "snapshot")
    with Store(state, readonly=True) as store:
        boot = store.get_boot(tree.boot_id)
        symbols = store.boot_symbols(tree.boot_id)
        assert symbols is not None
        packed = table_bytes(store, symbols.kernel)
        assert packed is not None
        table = fleet.encode_table(packed)
    host = fleet.Host("0" * 32, tree.hostname)
    manifest = fleet.encode_manifest(fleet.Manifest(host, boot, symbols, (fleet.batch_name(0),), 3))
    inc = {
        "boot_id": tree.boot_id, "seq": 1, "name": "brd", "build_id": "ab" * 20,
        "sections": {".text": "0xffffffffc0000000", ".data": "0xffffffffc0004000"},
        "coresize": 24576, "initsize": 0, "initstate": "live", "srcversion": None,
        "taint": "", "core_base": "0xffffffffc0000000", "restricted": False, "inode": 7,
        "faults": [], "loaded": {"monotonic": 5, "boottime": 6, "realtime": 7},
        "seen_by": "uevent", "init_live": False, "init_done": None, "unloaded": None,
        "unloaded_after": None, "unload_seen_by": None,
    }  # fmt: skip
    batch = {
        "format": fleet.FORMAT, "kind": "batch", "version": 1, "boot_id": tree.boot_id,
        "incarnations": [inc], "absolutes": {"1": [5, -3]},
    }  # fmt: skip
    return Seeds(tree.boot_id, manifest, json.dumps(batch).encode(), table)


def decoded_or_named(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except FleetObjectInvalid as e:
        assert str(e)
        return e


HOSTILE: list[Any] = [
    [], {}, [[["x"]]], None, True, -1, 10**30, -(10**30), 1e308, "", "x" * 5000,
    "0x" + "f" * 17, "../../etc/passwd",
]  # fmt: skip


def _paths(v: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at]
    if isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, (*at, k))
    elif isinstance(v, list):
        for i, x in enumerate(v[:4]):
            out += _paths(x, (*at, i))
    return out


@st.composite
def json_mutated(draw: st.DrawFn, seed: bytes) -> bytes:
    obj = json.loads(seed)
    for _ in range(draw(st.integers(1, 4))):
        paths = [p for p in _paths(obj) if p]
        p = draw(st.sampled_from(paths))
        node = obj
        for k in p[:-1]:
            node = node[k]
        kind = draw(st.sampled_from(["value", "drop", "deep"]))
        if kind == "value":
            node[p[-1]] = copy.deepcopy(draw(st.sampled_from(HOSTILE)))  # HOSTILE stays as is
        elif kind == "drop" and isinstance(node, dict):
            del node[p[-1]]
        else:
            n = draw(st.integers(10, 3000))
            node[p[-1]] = json.loads("[" * n + "]" * n) if n < 900 else None
    text = json.dumps(obj)
    if draw(st.booleans()):
        n = draw(st.integers(17, 200_000))
        text = text[:-1] + ', "z": ' + "[" * n + "]" * n + "}"
    if draw(st.booleans()):
        text = text.replace("5", "Infinity", 1) if draw(st.booleans()) else text.replace("5", "NaN")
    return text.encode()


@st.composite
def byte_mutated(draw: st.DrawFn, seed: bytes) -> bytes:
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        kind = draw(st.sampled_from(["flip", "cut", "splice"]))
        if kind == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=32))
    return bytes(data)


@SETTINGS
@given(st.data())
def test_mutated_manifests_decode_or_are_named(seeds: Seeds, data: st.DataObject) -> None:
    raw = data.draw(st.one_of(json_mutated(seeds.manifest), byte_mutated(seeds.manifest)))
    got = decoded_or_named(fleet.decode_manifest, "m", raw, seeds.boot_id)
    if isinstance(got, fleet.Manifest):
        assert got.boot.boot_id == seeds.boot_id
        assert fleet.machine_id_ok(got.host.machine_id)


@SETTINGS
@given(st.data())
def test_mutated_batches_decode_or_are_named(seeds: Seeds, data: st.DataObject) -> None:
    import zstandard

    raw = data.draw(st.one_of(json_mutated(seeds.batch_json), byte_mutated(seeds.batch_json)))
    blob = zstandard.ZstdCompressor().compress(raw)
    if data.draw(st.booleans()):
        blob = data.draw(byte_mutated(blob))
    got = decoded_or_named(fleet.decode_batch, "b", blob, seeds.boot_id)
    if isinstance(got, fleet.Batch):
        assert all(i.boot_id == seeds.boot_id for i in got.incarnations)
        assert all(0 <= v < 1 << 64 for i in got.incarnations for v in i.state.sections.values())


@SETTINGS
@given(st.data())
def test_mutated_tables_decode_or_are_named(seeds: Seeds, data: st.DataObject) -> None:
    import zstandard

    packed = zstandard.ZstdDecompressor().decompress(seeds.table[len(fleet.TABLE_MAGIC) :])
    raw = data.draw(byte_mutated(packed))
    blob = fleet.encode_table(raw)
    if data.draw(st.booleans()):
        blob = data.draw(byte_mutated(blob))

    def decode(name: str, b: bytes) -> SymbolTable:
        try:
            t = SymbolTable(fleet.decode_table(name, b))
            t.check()
        except (ValueError, TypeError) as e:  # as kreld.fleet.bucket names them
            raise FleetObjectInvalid(name, f"malformed symbol table: {e}") from e
        for i in range(min(t.count, 64)):
            t.name(i)
        return t

    decoded_or_named(decode, "t", blob)


@SETTINGS
@given(st.text(max_size=300) | st.sampled_from(["index/", "index/a.b.c.1.-", "index/" + "." * 9]))
def test_any_index_name_parses_or_is_named(name: str) -> None:
    decoded_or_named(fleet.parse_index, name if name.startswith("index/") else "index/" + name)


def test_the_seeds_decode_as_they_were_written(seeds: Seeds) -> None:
    """The corpus is worth mutating: each seed is a valid object of its kind."""
    import zstandard

    m = fleet.decode_manifest("m", seeds.manifest, seeds.boot_id)
    assert m.gen == 3 and m.batches == (fleet.batch_name(0),)
    blob = zstandard.ZstdCompressor().compress(seeds.batch_json)
    b = fleet.decode_batch("b", blob, seeds.boot_id)
    assert [i.state.name for i in b.incarnations] == ["brd"] and b.absolutes == {1: [5, -3]}
    t = SymbolTable(fleet.decode_table("t", seeds.table))
    t.check()
    assert t.count > 5
