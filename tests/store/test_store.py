"""The LMDB store on real files: one record per boot, durability, refusal, growth, readers."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import lmdb
import pytest

from kreld.core import consts
from kreld.core.errors import StoreCorrupt, StoreError, StoreTooNew
from kreld.core.model import Anchors, BootSnapshot, KaslrOffset, OffsetSource, Timestamp
from kreld.core.symtab import kernel_table
from kreld.store import Store
from kreld.store.lock import LOCK_NAME

from support.faketree import FakeTree
from support.records import BUILD_ID, TEXT, snap
from support.run import kreldctl
from support.smaps import file_rss

LINK = 0xFFFFFFFF81000000


# -- one record per boot -----------------------------------------------------------------


def test_same_boot_recorded_twice_is_one_record(tmp_path: Path) -> None:
    first = snap()
    with Store(tmp_path / "st") as store:
        stored, new, changed = store.boots.record_boot(first)
        assert (stored, new, changed) == (first, True, False)
        # A second scan of the same boot, a moment later: nothing new.
        again = snap(first.boot_id, n=5)
        stored, new, changed = store.boots.record_boot(again)
        assert (new, changed) == (False, False)
        assert stored == first  # first_seen is the first scan's
    with Store(tmp_path / "st") as store:  # and after reopening
        _, new, changed = store.boots.record_boot(snap(first.boot_id, n=9))
        assert (new, changed) == (False, False)
        assert store.boots.counts()["boots"] == 1
        assert [b.boot_id for b in store.list_boots()] == [first.boot_id]
        assert store.get_boot(first.boot_id) == first


def test_later_snapshot_fills_unknowns_and_keeps_what_was_known(tmp_path: Path) -> None:
    """Restricted first, then with pointers and an offset: filled in; a third, different
    scan of the same boot changes nothing already known."""
    boot = str(uuid.uuid4())
    restricted = snap(boot, text=None, restricted=True, build_id=None, kptr_restrict=2)
    offset = KaslrOffset(TEXT - LINK, OffsetSource.VMLINUX, "/boot/vmlinux-6.1.0-fake")
    full = snap(boot, n=1, kaslr=offset, kptr_restrict=0)
    with Store(tmp_path / "st") as store:
        store.boots.record_boot(restricted)
        stored, new, changed = store.boots.record_boot(full)
        assert (new, changed) == (False, True)
        assert stored.anchors == full.anchors
        assert stored.kaslr == offset
        assert stored.build_id == BUILD_ID
        assert stored.restricted is False and stored.restricted_reason is None
        assert stored.first_seen == restricted.first_seen
        assert stored.kptr_restrict == 2  # known before: kept
        assert store.boots.get_build(BUILD_ID)["link_text"] == f"{LINK:#x}"

        other = KaslrOffset(0x1000000, OffsetSource.VMCOREINFO, "/proc/kcore")
        liar = snap(boot, n=2, text=TEXT + 0x200000, kaslr=other, build_id="ab" * 20)
        stored2, new, changed = store.boots.record_boot(liar)
        assert (new, changed) == (False, False)
        assert stored2 == stored == store.get_boot(boot)
        assert store.boots.counts()["boots"] == 1


def test_partial_anchor_knowledge_is_completed_field_by_field(tmp_path: Path) -> None:
    boot = str(uuid.uuid4())
    a = snap(boot, text=None)
    a = BootSnapshot(**{**_fields(a), "anchors": Anchors(text=TEXT)})
    b = snap(boot, n=1)
    with Store(tmp_path / "st") as store:
        store.boots.record_boot(a)
        stored, _, changed = store.boots.record_boot(b)
    assert changed is True
    assert stored.anchors == Anchors(TEXT, TEXT, TEXT + 0x1000000)


# A boot record as stores have held it since schema 1 (anchors under the kernel's symbol
# names), written out by hand so that a change to the writer cannot move it too.
OLD_BOOT_RECORD = (
    '{"boot_id":"%s","release":"6.1.0-fake","version":"#1 SMP","build_id":null,'
    '"anchors":{"_text":"0xffffffff9d000000","_stext":"0xffffffff9d000000",'
    '"_etext":"0xffffffff9e000000","_sinittext":null,"_einittext":null},'
    '"kaslr_offset":null,"kaslr_source":null,"kaslr_path":null,"restricted":false,'
    '"restricted_reason":null,"kptr_restrict":0,'
    '"first_seen":{"monotonic":1,"boottime":2,"realtime":3},"faults":[]}'
)


def test_stored_anchors_keep_the_kernel_symbol_names_the_wire_drops(tmp_path: Path) -> None:
    """The varlink fields are text, stext, ... (no leading underscore); the store keeps
    _text, ... as before, so an older store reads and an older kreld reads a newer one."""
    old_id, new_id = str(uuid.uuid4()), str(uuid.uuid4())
    with Store(tmp_path / "st") as store:
        store.boots.record_boot(snap(new_id))
    env = lmdb.open(str(tmp_path / "st"), max_dbs=16)
    boots = env.open_db(b"boots", create=False)
    with env.begin(write=True) as txn:
        written = json.loads(txn.get(new_id.encode(), db=boots))
        txn.put(old_id.encode(), (OLD_BOOT_RECORD % old_id).encode(), db=boots)
    env.close()
    assert written["anchors"] == {
        "_text": f"{TEXT:#x}",
        "_stext": f"{TEXT:#x}",
        "_etext": f"{TEXT + 0x1000000:#x}",
        "_sinittext": None,
        "_einittext": None,
    }
    with Store(tmp_path / "st", readonly=True) as store:
        old, new = store.get_boot(old_id), store.get_boot(new_id)
    assert old.anchors == new.anchors == Anchors(TEXT, TEXT, TEXT + 0x1000000)
    assert old.to_json()["anchors"] == {
        "text": f"{TEXT:#x}",
        "stext": f"{TEXT:#x}",
        "etext": f"{TEXT + 0x1000000:#x}",
        "sinittext": None,
        "einittext": None,
    }


def test_restriction_learnt_later_keeps_its_reason(tmp_path: Path) -> None:
    """kallsyms unreadable at first (no anchors, not restricted), zeros later: the record
    becomes restricted *with* the later scan's reason, never a reason of None."""
    boot = str(uuid.uuid4())
    unreadable = snap(boot, text=None)
    zeros = snap(boot, n=1, text=None, restricted=True, kptr_restrict=2)
    with Store(tmp_path / "st") as store:
        store.boots.record_boot(unreadable)
        stored, _, changed = store.boots.record_boot(zeros)
    assert changed is True
    assert stored.restricted is True
    assert stored.restricted_reason == zeros.restricted_reason


def _fields(s: BootSnapshot) -> dict[str, object]:
    return {f: getattr(s, f) for f in BootSnapshot.__slots__}


# -- kill -9 of a writer ------------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import sys, uuid
    from kreld.core.model import Anchors, BootSnapshot, Timestamp
    from kreld.store import Store

    store = Store(sys.argv[1])
    print("ready", flush=True)
    i = 0
    while True:
        boot = str(uuid.uuid4())
        store.boots.record_boot(BootSnapshot(
            boot_id=boot, release="6.1.0-fake", version="#1", build_id=uuid.uuid4().hex,
            anchors=Anchors(0xffffffff81000000 + (i << 21)), kaslr=None, restricted=False,
            restricted_reason=None, kptr_restrict=0, first_seen=Timestamp.now(),
        ))
        print(boot, flush=True)
        i += 1
    """
)


def test_kill_9_of_a_writer_mid_burst_loses_nothing_committed(tmp_path: Path) -> None:
    state = tmp_path / "st"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(state)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == "ready\n"
        printed = [proc.stdout.readline() for _ in range(300)]
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        printed += proc.stdout.readlines()  # committed before the kill, still in the pipe
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    committed = [line.strip() for line in printed if line.endswith("\n")]
    assert len(committed) >= 300

    with Store(state) as store:  # opens for writing: no corruption
        for boot in committed:
            assert store.get_boot(boot).boot_id == boot
        n = store.boots.counts()
        # At most one more than printed: committed, killed before printing.
        assert len(committed) <= n["boots"] <= len(committed) + 1
        # Every boot has its listing entry and its build record: no half transaction.
        assert len(store.list_boots()) == n["boots"] == n["builds"]
        _, new, _ = store.boots.record_boot(snap())
        assert new is True
    with Store(state, readonly=True) as ro:
        assert ro.boots.counts()["boots"] == n["boots"] + 1


# -- refusing what is not a kreld store -----------------------------------------------------


def make_garbage(d: Path) -> None:
    d.mkdir()
    (d / "data.mdb").write_bytes(hashlib.sha256(b"x").digest() * 2048)


def make_text_file(d: Path) -> None:
    d.mkdir()
    (d / "data.mdb").write_text("this is not a database\n")


def make_kreld_store(d: Path, boots: int = 200) -> None:
    with Store(d) as store:
        for i in range(boots):
            store.boots.record_boot(snap(n=i))


def make_truncated(keep: float | int):
    def make(d: Path) -> None:
        make_kreld_store(d)
        data = d / "data.mdb"
        size = data.stat().st_size
        assert size > 3 * 4096
        os.truncate(data, int(size * keep) if isinstance(keep, float) else keep)

    return make


def make_foreign_named(d: Path) -> None:
    """Another program's environment: named databases, none of them ours."""
    env = lmdb.open(str(d), max_dbs=4)
    users, blobs = env.open_db(b"users"), env.open_db(b"blobs")
    with env.begin(write=True) as txn:
        txn.put(b"alice", b"1", db=users)
        txn.put(b"k", b"v" * 100, db=blobs)
    env.close()


def make_foreign_meta(d: Path) -> None:
    """A foreign environment that also has a named database called "meta"."""
    env = lmdb.open(str(d), max_dbs=4)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"version", b"3", db=meta)
        txn.put(b"magic", b"somebody-else", db=meta)
    env.close()


def make_foreign_plain(d: Path) -> None:
    """A foreign environment with plain keys, one of them b"meta", in its main database."""
    env = lmdb.open(str(d))
    with env.begin(write=True) as txn:
        txn.put(b"meta", b"not a database")
        txn.put(b"other", b"value")
    env.close()


def make_schema_99(d: Path) -> None:
    make_kreld_store(d, boots=3)
    env = lmdb.open(str(d), max_dbs=16)
    meta = env.open_db(b"meta", create=False)
    with env.begin(write=True) as txn:
        txn.put(b"schema", b"99", db=meta)
    env.close()


REFUSED = [
    pytest.param(make_garbage, StoreCorrupt, "not an LMDB file", id="garbage"),
    pytest.param(make_text_file, StoreCorrupt, "not an LMDB file", id="text-file"),
    pytest.param(make_truncated(0.5), StoreCorrupt, "truncated", id="truncated-half"),
    pytest.param(make_truncated(4096), StoreCorrupt, "truncated", id="truncated-one-page"),
    pytest.param(make_truncated(100), StoreCorrupt, "not an LMDB file", id="truncated-100b"),
    pytest.param(make_foreign_named, StoreCorrupt, "not a kreld store", id="foreign"),
    pytest.param(make_foreign_meta, StoreCorrupt, "not a kreld store", id="foreign-meta"),
    pytest.param(make_foreign_plain, StoreCorrupt, "not a kreld store", id="foreign-plain"),
    pytest.param(make_schema_99, StoreTooNew, "schema version 99", id="schema-99"),
]


def digests(d: Path) -> dict[str, str]:
    """sha256 of every file but the lock files: LMDB's (which any opener may
    touch) and kreld's writer lock (which a writer takes before opening)."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.iterdir())
        if p.name not in ("lock.mdb", LOCK_NAME)
    }


@pytest.mark.parametrize(("make", "error", "words"), REFUSED)
def test_unusable_store_is_refused_and_left_untouched(
    tmp_path: Path, make, error: type[StoreError], words: str
) -> None:
    state = tmp_path / "st"
    make(state)
    before = digests(state)
    for readonly in (False, True):
        # A reader may open a store cut short only in named databases; any read
        # of one of those is refused by name (kreld.store.lmdbcheck), never mapped.
        with pytest.raises(error) as ei, Store(state, readonly=readonly) as store:
            store.list_boots()
        assert words in str(ei.value)
        assert str(state) in str(ei.value)
    if error is StoreTooNew:
        assert (ei.value.found, ei.value.supported) == (99, consts.STORE_SCHEMA_VERSION)
    assert digests(state) == before


# One of each kind for the CLI (a subprocess each); the Store test above covers all.
REFUSED_CLI = [
    p
    for p in REFUSED
    if p.id in ("garbage", "truncated-half", "foreign", "foreign-plain", "schema-99")
]


@pytest.mark.parametrize(("make", "error", "words"), REFUSED_CLI)
def test_kreldctl_on_unusable_store_exits_5(
    tmp_path: Path, tree: FakeTree, make, error: type[StoreError], words: str
) -> None:
    """`show` (a reader) refuses with exit 5 and a clear message, and writes nothing;
    so does `snapshot` (a writer) on a few representative cases."""
    state = tmp_path / "st"
    make(state)
    before = digests(state)
    writer_too = make in (make_garbage, make_foreign_plain, make_schema_99)
    for cmd in ("show", "snapshot") if writer_too else ("show",):
        cp = kreldctl(cmd, "--root", str(tree.root), "--state-dir", str(state), check=False)
        assert cp.returncode == 5, cp.stderr
        assert cp.stderr.startswith("kreldctl: store ")
        assert words in cp.stderr
        assert "Traceback" not in cp.stderr
        assert cp.stdout == ""
    assert digests(state) == before


# -- growth and readers ---------------------------------------------------------------------


def test_tiny_map_grows_to_take_thousands_of_records(tmp_path: Path) -> None:
    n = 2000
    ids = [str(uuid.UUID(int=i + 1)) for i in range(n)]
    with Store(tmp_path / "st", map_size=64 << 10) as store:
        for i, boot in enumerate(ids):
            store.boots.record_boot(snap(boot, n=i))
        assert store.env.lmdb.info()["map_size"] > 64 << 10
    with Store(tmp_path / "st", readonly=True, map_size=64 << 10) as ro:
        assert ro.boots.counts()["boots"] == n
        listed = [b.boot_id for b in ro.list_boots()]
        assert listed == ids[::-1]  # newest first


READER = textwrap.dedent(
    """
    import sys
    from kreld.core.errors import NoSuchBoot
    from kreld.store import Store

    store = Store(sys.argv[1], readonly=True, map_size=64 << 10)
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "count":
            print(store.boots.counts()["boots"], flush=True)
        elif cmd == "mapsize":
            print(store.env.lmdb.info()["map_size"], flush=True)
        elif cmd == "get":
            try:
                print(store.get_boot(arg).boot_id, flush=True)
            except NoSuchBoot:
                print("missing", flush=True)
    """
)


def test_reader_in_another_process_sees_commits_while_writer_stays_open(tmp_path: Path) -> None:
    """A long-lived read-only Store sees each commit, even after the writer grew the map."""
    state = tmp_path / "st"
    writer = Store(state, map_size=64 << 10)
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(state)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert reader.stdin is not None and reader.stdout is not None

    def ask(q: str) -> str:
        reader.stdin.write(q + "\n")
        reader.stdin.flush()
        return reader.stdout.readline().strip()

    try:
        first = snap(n=0)
        writer.boots.record_boot(first)
        assert reader.stdout.readline() == "ready\n"
        assert ask("count") == "1"
        later = snap(n=1)
        assert ask(f"get {later.boot_id}") == "missing"
        writer.boots.record_boot(later)
        assert ask(f"get {later.boot_id}") == later.boot_id
        # Grow the map well past the reader's 64 KiB while it stays open.
        for i in range(300):
            writer.boots.record_boot(snap(n=2 + i))
        assert writer.env.lmdb.info()["map_size"] > 64 << 10
        assert ask("count") == "302"
        assert int(ask("mapsize")) > 64 << 10  # the reader adopted the grown map
        last = snap(n=1000)
        writer.boots.record_boot(last)
        assert ask(f"get {last.boot_id}") == last.boot_id
    finally:
        reader.stdin.close()
        reader.wait(timeout=10)
        writer.close()
    assert reader.returncode == 0


HOLD_READ = """
import sys, time
from kreld.store import Store
Store(sys.argv[1], readonly=True).env.read(
    lambda txn: (print("reading", flush=True), time.sleep(60))
)
"""


def test_a_reader_killed_mid_read_is_cleared_and_its_pages_reused(tmp_path: Path) -> None:
    """kreldctl killed with SIGKILL inside a read leaves its reader slot behind, pinning
    that snapshot: the writer's check frees the slot, after which rewriting the same
    record reuses freed pages instead of growing the file."""
    state = tmp_path / "st"
    with Store(state) as writer:
        for i in range(50):
            writer.boots.record_boot(snap(n=i))
        reader = subprocess.Popen(
            [sys.executable, "-c", HOLD_READ, str(state)], stdout=subprocess.PIPE, text=True
        )
        assert reader.stdout is not None and reader.stdout.readline() == "reading\n"
        reader.kill()
        reader.wait(timeout=10)
        assert reader.pid in {r for r in _reader_pids(writer)}

        def churn() -> int:
            for k in range(300):  # each commit frees the pages of the one before
                writer.modules.heartbeat(snap(n=0).boot_id, Timestamp(k, k, k))
            return int(writer.env.lmdb.info()["last_pgno"])

        start = int(writer.env.lmdb.info()["last_pgno"])
        pinned = churn()
        assert writer.env.clear_stale_readers() == 1
        assert reader.pid not in _reader_pids(writer)
        assert writer.env.clear_stale_readers() == 0
        after = churn()
        assert after - pinned < (pinned - start) // 4, (start, pinned, after)


def _reader_pids(store: Store) -> set[int]:
    """Pids in LMDB's reader table (``mdb_reader_list``: "pid thread txnid" rows)."""
    rows = store.env.lmdb.readers().splitlines()[1:]
    return {int(r.split()[0]) for r in rows if r.split() and r.split()[0].isdigit()}


def test_readonly_store_refuses_writes_and_missing_store(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no kreld store here"):
        Store(tmp_path / "nothing", readonly=True)
    assert not (tmp_path / "nothing").exists()
    make_kreld_store(tmp_path / "st", boots=1)
    with Store(tmp_path / "st", readonly=True) as ro, pytest.raises(StoreError, match="read-only"):
        ro.boots.record_boot(snap())


def test_dropping_the_maps_pages_leaves_the_resident_set_and_loses_no_byte(
    tmp_path: Path,
) -> None:
    """What reads of the store bring into the resident set leaves it on
    drop_pages (the pages stay in the page cache), and a read after it gets the
    same bytes."""
    store = Store(tmp_path / "state")
    core = [(TEXT + 0x10 * k, b"T", b"function_%06d" % k) for k in range(60_000)]
    assert store.symbols.put_table("k:big", kernel_table(core, TEXT))
    data = tmp_path / "state" / "data.mdb"

    def digest() -> str:
        def read(tables: Any) -> str:
            t = tables["k:big"]
            return hashlib.sha256(bytes(t.names) + bytes(t.keys) + bytes(t.values)).hexdigest()

        return store.with_tables(["k:big"], read)

    first = digest()
    held = file_rss(data)
    assert held > 1 << 20  # the table's pages, read
    assert store.drop_pages()
    assert file_rss(data) < held / 8
    assert digest() == first
    assert file_rss(data) > 1 << 20  # read again, from the page cache
    store.close()
