"""One writer per store, and a damaged kreld store set aside (kreld/store/lock.py).

Real daemons as subprocesses on a fake tree, real LMDB stores, real flock.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

from kreld.client import Client
from kreld.core.errors import ExitCode
from kreld.store import Store

from support.faketree import FakeTree
from support.records import snap
from support.run import bin_path, kreldctl, start
from support.wait import quick_heartbeat, wait_for_turns, wait_until


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def make_damaged_store(state: Path) -> None:
    """A kreld store with 20 boots whose last commit (a large symbol table on
    overflow pages) was cut short: LMDB cannot read it whole, a writer is refused."""
    with Store(state) as store:
        for i in range(20):
            store.boots.record_boot(snap(n=i))
        store.symbols.put_table("x:pad", os.urandom(256 << 10))
    data = state / "data.mdb"
    os.truncate(data, data.stat().st_size - (64 << 10))


def loads_of(state: Path, boot_id: str, name: str) -> int:
    with Store(state, readonly=True) as store:
        return sum(1 for i in store.incarnations(boot_id) if i.state.name == name)


def test_a_daemon_on_a_damaged_kreld_store_sets_it_aside_keeps_recording_and_says_so(
    daemon_factory: Any, tree: FakeTree, tmp_path: Path, sockdir: Path
) -> None:
    """The damaged data.mdb (and its lock.mdb) move, byte for byte, into
    damaged-<UTC time>/ in the state directory; the move is logged at error
    level; kreld starts a fresh store, records module loads into it, and shows
    the set-aside store in Status and `kreldctl status`.  The set-aside
    directory is a state directory kreldctl reads: the boots are still there."""
    state, sock = tmp_path / "state", sockdir / "kreld.sock"
    make_damaged_store(state)
    digest = sha256(state / "data.mdb")
    d = start(daemon_factory, tree, state, sock)
    moved = d.wait_for("store_set_aside")
    assert moved["level"] == "error" and "truncated" in moved["error"]
    aside = Path(moved["moved_to"])
    assert aside.parent == state and re.fullmatch(r"damaged-\d{8}T\d{6}Z", aside.name)
    assert sha256(aside / "data.mdb") == digest
    assert (aside / "lock.mdb").exists()
    with Client(str(sock)) as c:
        assert c.call("Status")["damaged_stores"] == [str(aside)]
    text = kreldctl("--socket", str(sock), "status").stdout
    assert re.search(rf"damaged_stores\s+{re.escape(str(aside))}", text), text

    tree.add_module("after", 0xFFFFFFFFC0500000)
    wait_until("the load recorded", lambda: loads_of(state, tree.boot_id, "after") == 1)
    assert d.stop() == 0
    assert sha256(aside / "data.mdb") == digest

    boots = json.loads(kreldctl("--state-dir", str(aside), "boots", "--json").stdout)
    assert len(boots) == 20
    st = json.loads(kreldctl("--state-dir", str(aside), "status", "--json").stdout)
    assert st["damaged_databases"] == ["symtabs"]

    # Started again on the fresh store: nothing more is set aside, Status still says it.
    d = start(daemon_factory, tree, state, sock)
    with Client(str(sock)) as c:
        assert c.call("Status")["damaged_stores"] == [str(aside)]
    assert not [e for e in d.events() if e.get("event") == "store_set_aside"]
    assert d.stop() == 0


def test_an_empty_data_mdb_left_by_a_creation_cut_short_is_set_aside_and_kreld_starts(
    daemon_factory: Any, tree: FakeTree, tmp_path: Path, sockdir: Path
) -> None:
    """A kreld killed inside LMDB's creation of its store leaves an empty
    data.mdb: the next kreld sets it aside, not refuses it for good."""
    state, sock = tmp_path / "state", sockdir / "kreld.sock"
    state.mkdir(mode=0o700)
    (state / "data.mdb").write_bytes(b"")
    d = start(daemon_factory, tree, state, sock)
    aside = Path(d.wait_for("store_set_aside")["moved_to"])
    assert (aside / "data.mdb").stat().st_size == 0
    with Client(str(sock)) as c:
        st = c.call("Status")
    assert st["damaged_stores"] == [str(aside)] and st["boots"] == 1
    assert d.stop() == 0


def test_a_second_daemon_on_the_same_store_exits_7_while_the_first_runs_and_records_once(
    daemon_factory: Any, tree: FakeTree, tmp_path: Path, sockdir: Path
) -> None:
    """A second kreld with the same --state-dir (another socket) is refused
    with StoreLocked, exit 7, naming the first one's pid; the first goes on
    serving, and a module load is recorded once, not once per daemon."""
    state = tmp_path / "state"
    beat = quick_heartbeat(tmp_path / "kreld.toml")
    first = start(daemon_factory, tree, state, sockdir / "one.sock", *beat)
    second = daemon_factory(
        "--root", str(tree.root), "--state-dir", str(state), "--socket", str(sockdir / "two.sock"),
        log_name="second.log",
    )  # fmt: skip
    second.start(wait_ready=False)
    assert second.proc.wait(timeout=30) == ExitCode.STORE_LOCKED == 7
    failed = [e for e in second.events() if e.get("event") == "startup_failed"]
    assert len(failed) == 1 and failed[0]["kind"] == "StoreLocked"
    assert f"pid {first.proc.pid}" in failed[0]["error"]
    assert not (sockdir / "two.sock").exists()

    assert first.proc.poll() is None
    tree.add_module("twice", 0xFFFFFFFFC0600000)
    wait_until("the load recorded", lambda: loads_of(state, tree.boot_id, "twice") >= 1)
    # The second daemon has exited; the first records the load once, and would
    # have recorded it again by its second idle check from now.
    wait_for_turns(str(sockdir / "one.sock"), "tracker_idle_checks")
    assert loads_of(state, tree.boot_id, "twice") == 1
    with Client(str(sockdir / "one.sock")) as c:
        assert c.call("Status")["loaded_modules"] == 1
    assert first.stop() == 0


def test_after_kill_9_of_the_daemon_a_new_one_starts_at_once(
    daemon_factory: Any, tree: FakeTree, tmp_path: Path, sockdir: Path
) -> None:
    """The lock is the kernel's (flock): it goes with the process, so SIGKILL
    leaves no stale lock and the next kreld starts without waiting."""
    state, sock = tmp_path / "state", sockdir / "kreld.sock"
    first = start(daemon_factory, tree, state, sock)
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    again = start(daemon_factory, tree, state, sock)
    assert not [e for e in again.events() if e.get("event") == "startup_failed"]
    assert again.stop() == 0


def test_kreldctl_reads_beside_a_daemon_and_its_writes_without_the_daemon_are_locked_out(
    daemon_factory: Any, tree: FakeTree, tmp_path: Path, sockdir: Path
) -> None:
    """Readers never take the lock: `kreldctl --state-dir` reads while kreld
    runs.  `kreldctl snapshot` goes through the daemon when it answers; told
    to write the store directly while a daemon holds it, it exits 7, and so
    does `kreldctl gc`."""
    state, sock = tmp_path / "state", sockdir / "kreld.sock"
    d = start(daemon_factory, tree, state, sock)
    boots = json.loads(kreldctl("--state-dir", str(state), "boots", "--json").stdout)
    assert [b["boot_id"] for b in boots] == [tree.boot_id]
    via = json.loads(kreldctl("--socket", str(sock), "snapshot", "--json").stdout)
    assert via["boot"]["boot_id"] == tree.boot_id
    cp = subprocess.run(
        [bin_path("kreldctl"), "--root", str(tree.root), "--state-dir", str(state), "snapshot"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cp.returncode == 7, cp.stderr
    assert "another kreld" in cp.stderr and str(d.proc.pid) in cp.stderr
    gc = subprocess.run(
        [bin_path("kreldctl"), "--state-dir", str(state), "gc", "--keep-boots", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert gc.returncode == 7, gc.stderr
    assert d.stop() == 0
    # With no daemon, kreldctl snapshot takes the lock itself and writes.
    kreldctl("--root", str(tree.root), "--state-dir", str(state), "snapshot")
