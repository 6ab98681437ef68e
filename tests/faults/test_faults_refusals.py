"""What kreld refuses to start on: a store that is not a whole kreld store, a state or
socket directory someone else controls, a socket path planted by someone else.

Each is refused with a clear message and the documented exit code (``kreld --help``:
5 the store is unusable, 1 any other startup error such as the socket), and nothing
is written, replaced or followed.  (tests/store/test_store.py covers the same files through
the Store class and kreldctl; here it is the daemon.)
"""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import pytest

from kreld.core.model import Anchors, BootSnapshot, Timestamp
from kreld.store import Store

from support.faketree import FakeTree
from support.faultlib import NOBODY, sha256, sha256_tree
from support.run import bin_path
from support.wait import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant another uid's files")


def boot(i: int) -> BootSnapshot:
    text = 0xFFFFFFFF81000000 + (i << 21)
    return BootSnapshot(
        boot_id=str(uuid.UUID(int=i + 1)), release="6.1.0-fake", version="#1",
        build_id=f"{i:040x}", anchors=Anchors(text, text, text + 0x1000000), kaslr=None,
        restricted=False, restricted_reason=None, kptr_restrict=0, first_seen=Timestamp.now(),
    )  # fmt: skip


def make_store(d: Path, boots: int = 20) -> None:
    """A real kreld store of a few hundred KiB (few commits: each one is an fsync)."""
    with Store(d) as store:
        for i in range(boots):
            store.boots.record_boot(boot(i))
        store.symbols.put_table("x:pad", os.urandom(256 << 10))


def run_refused(
    daemon_factory: Any, tree: FakeTree, state: Path, sock: Path
) -> tuple[int, dict[str, Any], str]:
    """Start kreld, expect it to exit by itself; its code, its startup_failed event, its log."""
    d = daemon_factory(
        "--root", str(tree.root), "--state-dir", str(state), "--socket", str(sock),
        log_name=f"refused-{uuid.uuid4().hex[:8]}.log",
    )  # fmt: skip
    d.start(wait_ready=False)
    rc = d.proc.wait(timeout=30)
    text = d.log_path.read_text()
    failed = [e for e in d.events() if e.get("event") == "startup_failed"]
    assert len(failed) == 1, text
    assert "Traceback" not in text, text
    assert not [e for e in d.events() if e.get("event") == "ready"]
    return rc, failed[0], text


def test_exit_codes_are_documented() -> None:
    """kreld --help lists every exit code it can end with, each with its meaning
    from the one table (core.errors.EXIT_STATUS)."""
    from kreld.core.errors import EXIT_STATUS, ExitCode

    out = subprocess.run([bin_path("kreld"), "--help"], capture_output=True, text=True).stdout
    flat = " ".join(out.split())
    for code, (_short, sentence) in EXIT_STATUS["kreld"].items():
        assert f"{int(code)} {sentence}" in flat, code
    for code in (ExitCode.ERROR, ExitCode.STORE, ExitCode.STORE_LOCKED):
        assert code in EXIT_STATUS["kreld"]


# -- data.mdb that is not a whole kreld store ------------------------------------------------


def truncated(keep: int | float) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        make_store(d)
        data = d / "data.mdb"
        size = data.stat().st_size
        os.truncate(data, int(size * keep) if isinstance(keep, float) else keep)

    return make


def garbage(d: Path) -> None:
    d.mkdir()
    (d / "data.mdb").write_bytes(os.urandom(64 << 10))


def foreign_named(d: Path) -> None:
    env = lmdb.open(str(d), max_dbs=4)
    users = env.open_db(b"users")
    with env.begin(write=True) as txn:
        txn.put(b"alice", b"1", db=users)
    env.close()


def foreign_plain(d: Path) -> None:
    env = lmdb.open(str(d))
    with env.begin(write=True) as txn:
        txn.put(b"meta", b"not ours")
        txn.put(b"other", b"x" * 5000)
    env.close()


def schema_99(d: Path) -> None:
    make_store(d, boots=3)
    env = lmdb.open(str(d), max_dbs=16)
    meta = env.open_db(b"meta", create=False)
    with env.begin(write=True) as txn:
        txn.put(b"schema", b"99", db=meta)
    env.close()


# A kreld store cut short after its meta pages, or empty (its creation cut
# short), is set aside instead (test_storelock.py).
UNUSABLE = [
    pytest.param(truncated(100), "StoreCorrupt", "not an LMDB file", id="truncated-100b"),
    pytest.param(garbage, "StoreCorrupt", "not an LMDB file", id="garbage"),
    pytest.param(foreign_named, "StoreCorrupt", "not a kreld store", id="foreign"),
    pytest.param(foreign_plain, "StoreCorrupt", "not a kreld store", id="foreign-plain"),
    pytest.param(schema_99, "StoreTooNew", "schema version 99", id="schema-99"),
]


@pytest.mark.parametrize(("make", "kind", "words"), UNUSABLE)
def test_unusable_data_mdb_exits_5_and_is_left_byte_for_byte(
    daemon_factory: Any, tree: FakeTree, tmp_path: Path, sockdir: Path, make: Any, kind: str,
    words: str,
) -> None:  # fmt: skip
    state = tmp_path / "state"
    make(state)
    digest = sha256(state / "data.mdb")
    sock = sockdir / "kreld.sock"
    # Twice for one case: a refused store stays refused, never "repaired" in between.
    for _ in range(2 if kind == "StoreCorrupt" and words == "not an LMDB file" else 1):
        rc, ev, _ = run_refused(daemon_factory, tree, state, sock)
        assert rc == 5
        assert ev["kind"] == kind
        assert words in ev["error"] and str(state) in ev["error"], ev
        assert sha256(state / "data.mdb") == digest
        assert not sock.exists() and not sock.is_symlink()


# -- a state directory someone else controls ---------------------------------------------------


def chown_tree(p: Path, uid: int) -> None:
    os.lchown(p, uid, uid)


@needs_root
@pytest.mark.parametrize(
    ("plant", "words"),
    [
        pytest.param("dir-owned", f"owned by uid {NOBODY}", id="state-dir-owned-by-nobody"),
        pytest.param("dir-0777", "writable by every user", id="state-dir-world-writable"),
        pytest.param("dir-symlink", "is a symlink", id="state-dir-a-symlink-by-nobody"),
        pytest.param("dangling", "", id="state-dir-a-dangling-symlink-by-nobody"),
        pytest.param("data-symlink", "a symlink or another user's file", id="data.mdb-a-symlink"),
        pytest.param("data-owned", "a symlink or another user's file", id="data.mdb-by-nobody"),
        pytest.param("lock-symlink", "a symlink or another user's file", id="lock.mdb-a-symlink"),
    ],
)
def test_state_dir_controlled_by_another_user_exits_5_and_nothing_is_followed(
    daemon_factory: Any, tree: FakeTree, tmp_path: Path, sockdir: Path, plant: str, words: str
) -> None:
    state = tmp_path / "state"
    elsewhere = tmp_path / "elsewhere"  # what a planted link points at: must stay untouched
    elsewhere.mkdir()
    (elsewhere / "victim").write_text("precious\n")
    if plant in ("dir-owned", "dir-0777", "data-symlink", "data-owned", "lock-symlink"):
        make_store(state, boots=5)
    if plant == "dir-owned":
        chown_tree(state, NOBODY)
    elif plant == "dir-0777":
        state.chmod(0o777)
    elif plant == "dir-symlink":
        make_store(elsewhere / "store", boots=5)
        (elsewhere / "store" / "lock.mdb").unlink()  # so that an open would show
        state.symlink_to(elsewhere / "store")
        chown_tree(state, NOBODY)
    elif plant == "dangling":
        state.symlink_to(elsewhere / "not-yet")
        chown_tree(state, NOBODY)
    elif plant in ("data-symlink", "lock-symlink"):
        name = "data.mdb" if plant == "data-symlink" else "lock.mdb"
        (state / name).unlink()
        (state / name).symlink_to(elsewhere / "victim")
        chown_tree(state / name, NOBODY)
    elif plant == "data-owned":
        chown_tree(state / "data.mdb", NOBODY)
    before_state = sha256_tree(state) if state.is_dir() and not state.is_symlink() else None
    before_elsewhere = sha256_tree(elsewhere)
    sock = sockdir / "kreld.sock"
    rc, ev, _ = run_refused(daemon_factory, tree, state, sock)
    assert rc == 5
    assert ev["kind"] == "StoreError", ev
    assert words in ev["error"] and str(state) in ev["error"], ev
    assert sha256_tree(elsewhere) == before_elsewhere  # nothing followed, nothing created
    if before_state is not None:
        assert sha256_tree(state) == before_state
    assert not sock.exists()


# -- a socket directory or path someone else controls ------------------------------------------


@needs_root
@pytest.mark.parametrize(
    ("plant", "words"),
    [
        pytest.param("dir-owned", f"owned by uid {NOBODY}", id="socket-dir-owned-by-nobody"),
        pytest.param("dir-0777", "writable by others", id="socket-dir-world-writable"),
        pytest.param("link-file", "not a socket", id="socket-a-symlink-to-a-file"),
        pytest.param("link-dangling", "not a socket", id="socket-a-dangling-symlink"),
        pytest.param("link-live", "not a socket", id="socket-a-symlink-to-a-live-socket"),
        pytest.param("link-stale", "not a socket", id="socket-a-symlink-to-a-dead-socket"),
    ],
)
def test_socket_path_controlled_by_another_user_exits_1_and_nothing_is_followed(
    daemon_factory: Any, tree: FakeTree, tmp_path: Path, sockdir: Path, plant: str, words: str
) -> None:
    sdir = sockdir / "run"
    sdir.mkdir()
    sock = sdir / "kreld.sock"
    elsewhere = sockdir / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "victim").write_text("precious\n")
    listener = None
    if plant == "dir-owned":
        os.chown(sdir, NOBODY, NOBODY)
    elif plant == "dir-0777":
        sdir.chmod(0o777)
    else:
        target = {
            "link-file": elsewhere / "victim",
            "link-dangling": elsewhere / "not-yet",
            "link-live": elsewhere / "theirs.sock",
            "link-stale": elsewhere / "dead.sock",
        }[plant]
        if plant in ("link-live", "link-stale"):
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(target))
            os.lchown(target, NOBODY, NOBODY)
            if plant == "link-live":
                listener.listen(8)
                listener.setblocking(False)
            else:
                listener.close()
                listener = None
        sock.symlink_to(target)
        os.lchown(sock, NOBODY, NOBODY)
    before = sha256_tree(sockdir)
    try:
        rc, ev, _ = run_refused(daemon_factory, tree, tmp_path / "state", sock)
        assert rc == 1
        assert ev["kind"] == "SocketError", ev
        assert words in ev["error"], ev
        assert sha256_tree(sockdir) == before  # no socket bound, no link replaced or followed
        if listener is not None:
            with pytest.raises(BlockingIOError):
                listener.accept()  # kreld never connected to the planted socket
    finally:
        if listener is not None:
            listener.close()


@needs_root
def test_socket_dir_a_symlink_planted_by_another_user_is_not_followed(
    daemon_factory: Any, tree: FakeTree, tmp_path: Path, sockdir: Path
) -> None:
    public = sockdir / "public"
    public.mkdir()
    public.chmod(0o1777)  # like /tmp
    target = sockdir / "target"  # root's, 0755: passes every check kreld makes on a dir
    target.mkdir()
    link = public / "kreld"
    link.symlink_to(target)
    os.lchown(link, NOBODY, NOBODY)  # nobody may replace it whenever they like
    d = daemon_factory(
        "--root", str(tree.root), "--state-dir", str(tmp_path / "state"),
        "--socket", str(link / "kreld.sock"),
    )  # fmt: skip
    d.start(wait_ready=False)
    try:
        wait_until(
            "kreld to refuse or to be ready",
            lambda: d.proc.poll() is not None or any(e["event"] == "ready" for e in d.events()),
        )
        bound_there = [p.name for p in target.iterdir()]
    finally:
        rc = d.proc.poll()
        if rc is None:
            d.stop()
    assert bound_there == []
    assert rc == 1
    [ev] = [e for e in d.events() if e.get("event") == "startup_failed"]
    assert ev["kind"] == "SocketError" and f"a symlink of uid {NOBODY}" in ev["error"], ev
