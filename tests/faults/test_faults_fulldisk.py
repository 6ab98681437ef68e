"""A disk full to the brim, where kreld begins a store or takes its writer lock.

Before kreld writes one record it writes two files of its own: the pid in the writer
lock ``kreld.lock``, and LMDB's ``lock.mdb``, which LMDB writes through a shared
mapping (on a full disk, a page of a sparse file touched through a mapping is SIGBUS,
not an error).  On a full disk each is a StoreFull naming the file, exit status 5,
nothing half written left behind; a daemon that has a store goes on serving it, and
Status says why writes fail (``store_full``) until one succeeds again.

The disk is a real tmpfs (needs root) filled until it says ENOSPC; kreld and kreldctl
run as real subprocesses, each under faults/peak.py's limits.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from kreld.client import Client, RemoteError
from kreld.core.errors import ExitCode

from support.faketree import FakeTree
from support.faultlib import fill, history, proc_status, run_measured, tiny_tmpfs, write_config
from support.run import bin_path, kreldctl, start
from support.tmpdirs import fast_tmpdir
from support.wait import wait_until

pytestmark = [
    pytest.mark.faults,
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root"),
]

BASE = 0xFFFFFFFFC0000000
TIMEOUT = 10.0
AS_LIMIT = 1536 << 20
MEMORY_CEILING_KIB = 500 << 10


def small_tree(at: Path, modules: int = 3) -> FakeTree:
    tree = FakeTree(at)
    for i in range(modules):
        tree.add_module(f"m{i}", BASE + i * 0x100000)
    return tree


def measured(argv: list[str], tmp: Path) -> tuple[int, str]:
    """*argv*'s exit status and its stderr, checked for the limits every case keeps."""
    with tempfile.TemporaryFile(dir=tmp) as err:
        m = run_measured(argv, stdout=err, stderr=err, timeout=TIMEOUT, as_limit=AS_LIMIT)
        err.seek(0)
        out = err.read().decode(errors="replace")
    assert not m.timed_out, f"{argv[0]} still running after {TIMEOUT} s"
    assert m.maxrss_kib < MEMORY_CEILING_KIB, m.maxrss_kib
    assert "Traceback" not in out, out
    return m.rc, out


def program(which: str, tree: FakeTree, state: Path, tmp: Path) -> list[str]:
    common = ["--root", str(tree.root), "--state-dir", str(state), "--socket", str(tmp / "k.sock")]
    if which == "kreld":
        return [bin_path("kreld"), "--log-format", "json", *common]
    return [bin_path("kreldctl"), *common, "snapshot"]


@pytest.mark.parametrize("which", ["kreld", "kreldctl-snapshot"])
@pytest.mark.parametrize("before", ["nothing", "writer-lock"])
def test_a_store_begun_on_a_full_disk_is_a_named_error_with_nothing_left_half_written(
    tmp_path: Path, which: str, before: str
) -> None:
    """A new state directory (empty, or holding only a writer lock from an earlier try)
    on a full disk: exit 5 with StoreFull naming the file that could not be written,
    no traceback and no SIGBUS, no empty or partial LMDB file left, no stale pid."""
    tree = small_tree(tmp_path / "root")
    with tiny_tmpfs("1m") as mnt:
        state = mnt / "state"
        state.mkdir(mode=0o700)
        if before == "writer-lock":
            (state / "kreld.lock").write_text("12345\n")  # a pid of an earlier kreld
        fill(mnt)
        rc, out = measured(program(which, tree, state, tmp_path), tmp_path)
        assert rc == ExitCode.STORE, out
        assert "StoreFull" in out or "no room" in out, out
        assert str(state / "lock.mdb") in out, out
        assert sorted(os.listdir(state)) == ["kreld.lock"]
        # A refused second writer would name the pid in it: the earlier one's is gone,
        # replaced by ours where the file had room for it, or by nothing.
        held = (state / "kreld.lock").read_bytes()
        assert held == b"" or (held.strip().isdigit() and held != b"12345\n"), held


def test_status_says_the_disk_is_full_until_a_write_succeeds(
    daemon_factory: Any, sockdir: Path, tmp_path: Path
) -> None:
    """A daemon whose disk fills: the loads it cannot write make Status say so, naming
    the store, while it answers from what it has; once space returns and they are
    written, Status says nothing more of it."""
    with fast_tmpdir() as fast, tiny_tmpfs("2m") as mnt:
        tree = small_tree(fast / "root")
        state = mnt / "state"
        sock = sockdir / "kreld.sock"
        cfg = write_config(tmp_path / "kreld.toml", modules={"watch": "inotify"})
        d = start(daemon_factory, tree, state, sock, "--config", str(cfg))
        with Client(str(sock)) as c:
            assert c.call("Status")["store_full"] is None
        filler = fill(mnt)
        for i in range(60):
            tree.add_module(f"late{i:02d}", BASE + (10 + i) * 0x100000)

        def full() -> str | None:
            with Client(str(sock)) as c:
                return str(c.call("Status")["store_full"] or "")

        why = wait_until("Status saying the disk is full", full, timeout=30)
        assert "no space left on device" in why and str(state) in why, why
        with Client(str(sock)) as c:  # reads go on, from what the store holds
            assert c.call("GetBoot")["boot"]["boot_id"] == tree.boot_id
            try:
                c.call("Snapshot")
            except RemoteError as e:  # a snapshot that had to write: named, never a crash
                assert e.error == "io.kreld.StoreFull", e
        assert d.proc.poll() is None
        filler.unlink()
        wait_until("the writes after space returned", lambda: not full(), timeout=30)
        wait_until("every load", lambda: len(history(state, tree.boot_id)) == 63, timeout=30)
        assert proc_status(d.proc.pid, "VmHWM") < MEMORY_CEILING_KIB
        assert d.stop() == 0
        for argv in (["boots"], ["modules"], ["status"]):
            kreldctl(
                "--root", str(tree.root), "--state-dir", str(state), "--socket", "/none", *argv
            )


def test_a_restart_on_a_full_disk_serves_the_store_it_has(
    daemon_factory: Any, sockdir: Path, tmp_path: Path
) -> None:
    """kreld stopped, the disk filled, kreld started again on the same boot: it takes
    its lock and maps LMDB's without a byte of room, and serves what the store holds;
    a module loaded meanwhile is a StoreFull in Status, not the end of the daemon."""
    with fast_tmpdir() as fast, tiny_tmpfs("2m") as mnt:
        tree = small_tree(fast / "root")
        state = mnt / "state"
        sock = sockdir / "kreld.sock"
        cfg = write_config(tmp_path / "kreld.toml", modules={"watch": "inotify"})
        d = start(daemon_factory, tree, state, sock, "--config", str(cfg))
        before = history(state, tree.boot_id)
        assert d.stop() == 0
        filler = fill(mnt)
        d = start(daemon_factory, tree, state, sock, "--config", str(cfg))
        with Client(str(sock)) as c:
            assert len(c.call("GetModules")["modules"]) == len(before) == 3
        tree.add_module("late", BASE + 0x4000000)

        def full() -> Any:
            with Client(str(sock)) as c:
                return c.call("Status")["store_full"]

        assert "no space left on device" in wait_until("Status saying so", full, timeout=30)
        filler.unlink()
        wait_until("the late load", lambda: len(history(state, tree.boot_id)) == 4, timeout=30)
        assert d.proc.poll() is None
        assert d.stop() == 0
        cp = subprocess.run(
            [bin_path("kreldctl"), "--state-dir", str(state), "--socket", "/none", "boots"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cp.returncode == 0, cp.stderr
