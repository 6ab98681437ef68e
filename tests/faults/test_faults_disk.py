"""The disk under the store fills up, and the LMDB map fills up.

A full disk: every failed write is a named error (StoreFull, ENOSPC) in the log, nothing
half written, reads go on, and what was held back is recorded once space returns.  A full
map: it is doubled and the write goes on, in the daemon and in any reader.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from kreld.client import Client
from kreld.core import consts
from kreld.core.errors import StoreFull
from kreld.core.model import Incarnation, ModuleState, SeenBy, Timestamp
from kreld.store import Store

from support.faketree import FakeTree
from support.faultlib import (
    assert_history_sane,
    assert_kept,
    fill,
    history,
    tiny_tmpfs,
    write_config,
)
from support.run import start
from support.tmpdirs import fast_tmpdir
from support.wait import wait_for_turns, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

BASE = 0xFFFFFFFFC0000000


def loaded_events(d: Any, names: set[str]) -> set[str]:
    return {
        e["module"]
        for e in d.events()
        if e.get("event") == "module_loaded" and e["module"] in names
    }


def end_init_with_1000_sections(tree: FakeTree) -> None:
    """slowinit's init returns: 1,000 sections appear (a record that needs room) and
    initstate says live; files inside a module directory, so no event says so."""
    secs = tree.root / "sys/module/slowinit/sections"
    for k in range(1000):
        (secs / f".text.part{k}").write_text(f"{BASE + k * 0x100:#018x}\n")
    tree.write("sys/module/slowinit/initstate", "live\n")


def count(events: list[dict[str, Any]], name: str) -> int:
    return sum(e.get("event") == name for e in events)


def full_disk_errors(d: Any) -> list[dict[str, Any]]:
    return [e for e in d.events() if e.get("event") == "reconcile_failed"]


# -- a full disk ----------------------------------------------------------------------------


def test_state_dir_on_a_full_tmpfs_errors_by_name_keeps_serving_and_recovers(
    daemon_factory: Any, sockdir: Path, tmp_path: Path
) -> None:
    with fast_tmpdir() as fast, tiny_tmpfs("2m") as mnt:
        tree = FakeTree(fast / "root")
        for i in range(5):
            tree.add_module(f"early{i}", BASE + i * 0x100000)
        state = mnt / "state"
        sock = sockdir / "kreld.sock"
        cfg = write_config(tmp_path / "kreld.toml", modules={"watch": "inotify"})
        d = start(daemon_factory, tree, state, sock, "--config", str(cfg))
        wait_until(
            "kernel symbols", lambda: any(e["event"] == "kernel_symbols" for e in d.events())
        )
        earlier = history(state, tree.boot_id)
        assert [i["name"] for i in earlier] == [f"early{i}" for i in range(5)]
        with Client(str(sock)) as c:
            boot_before = c.call("GetBoot")
            kallsyms_before = c.call("ExportKallsyms")["kallsyms"]

        filler = fill(mnt)
        late = {f"late{i:03d}" for i in range(150)}
        for i, n in enumerate(sorted(late)):
            tree.add_module(n, BASE + (100 + i) * 0x100000)
        err = wait_until("a store error", lambda: full_disk_errors(d), timeout=30)[0]
        assert (err["level"], err["kind"]) == ("error", "StoreFull"), err
        assert "no space left on device" in err["error"] and str(state) in err["error"], err
        n = len(full_disk_errors(d))  # kreld keeps retrying meanwhile, and says so each time
        wait_until("two more retries", lambda: len(full_disk_errors(d)) >= n + 2, timeout=30)
        assert d.proc.poll() is None
        # LMDB may fit a first small batch into pages it freed; the rest is held back.
        got_in = loaded_events(d, late)
        assert len(got_in) < len(late) // 2, len(got_in)

        # No corruption: another opener sees what was committed, and what kreld said it was.
        mid = history(state, tree.boot_id)
        assert mid[:5] == earlier
        assert {i["name"] for i in mid[5:]} == got_in
        # Reads go on: the answers are what the store holds.
        with Client(str(sock)) as c:
            assert c.call("GetBoot") == boot_before
            mods = c.call("GetModules")["modules"]
            assert mods == [i for i in mid if i["unloaded"] is None]
            [r] = c.resolve([f"{BASE + 0x100010:#x}"])
            assert (r["image"], r["offset"]) == ("early1", "0x10")
            assert c.call("ExportKallsyms")["kallsyms"] == kallsyms_before
            assert c.call("Status")["incarnations"] == len(mid)

        filler.unlink()  # space returns
        wait_until("the held-back loads", lambda: loaded_events(d, late) == late, timeout=30)
        after = history(state, tree.boot_id)
        assert_kept(earlier, after, "after the disk was full")
        assert_history_sane(after)
        assert {i["name"] for i in after} == {i["name"] for i in earlier} | late
        with Client(str(sock)) as c:
            assert len(c.call("GetModules")["modules"]) == 5 + len(late)
        assert d.stop() == 0
        with Store(state) as store:  # reopens for writing: not corrupt
            assert store.boots.counts()["incarnations"] == 5 + len(late)


def test_disk_full_while_idle_does_not_stop_module_tracking(
    daemon_factory: Any, sockdir: Path, tmp_path: Path
) -> None:
    """A store error outside any event: the idle re-read of a module still loading fails
    to write (the path of the 30 s heartbeat too).  It is logged by name, and tracking
    goes on: the update and later loads are recorded once space returns."""
    with fast_tmpdir() as fast, tiny_tmpfs("2m") as mnt:
        tree = FakeTree(fast / "root")
        tree.add_module("slowinit", BASE, initstate="coming", sections={})
        state = mnt / "state"
        sock = sockdir / "kreld.sock"
        cfg = write_config(
            tmp_path / "kreld.toml", modules={"watch": "inotify", "poll_interval": 0.2}
        )
        d = start(daemon_factory, tree, state, sock, "--config", str(cfg))
        filler = fill(mnt)
        # Its init ends while the disk is full, no event says so (files inside a module
        # directory): kreld's idle re-read finds it, with sections enough to need room.
        end_init_with_1000_sections(tree)
        err = d.wait_for("idle_check_failed", timeout=10)
        assert (err["level"], err["kind"]) == ("error", "StoreFull"), err
        assert "no space left on device" in err["error"], err
        d.wait_until(lambda ev: count(ev, "idle_check_failed") >= 2, "a second idle check failing")
        filler.unlink()
        tree.add_module("after", BASE + 0x1000000)
        wait_until("the load after space returned", lambda: loaded_events(d, {"after"}), 15)
        incs = history(state, tree.boot_id)
        assert [i["name"] for i in incs] == ["slowinit", "after"]
        assert_history_sane(incs, unique_text=False)
        with Client(str(sock)) as c:
            status = c.call("Status")
        assert next(s for s in status["sources"] if s["name"] == "tracker")["healthy"]
        assert d.stop() == 0


def test_unloads_and_updates_seen_while_the_disk_is_full_are_written_when_space_returns(
    daemon_factory: Any, sockdir: Path, tmp_path: Path
) -> None:
    with fast_tmpdir() as fast, tiny_tmpfs("2m") as mnt:
        tree = FakeTree(fast / "root")
        tree.add_module("slowinit", BASE, initstate="coming", sections={})
        for i in range(3):
            tree.add_module(f"early{i}", BASE + (1 + i) * 0x100000)
        state = mnt / "state"
        sock = sockdir / "kreld.sock"
        modules = {"watch": "inotify", "poll_interval": 0.2, "heartbeat_interval": 1.0}
        cfg = write_config(tmp_path / "kreld.toml", modules=modules)
        d = start(daemon_factory, tree, state, sock, "--config", str(cfg))
        filler = fill(mnt)
        tree.remove_module("early1")  # an unload while the disk is full
        end_init_with_1000_sections(tree)  # an update while the disk is full
        d.wait_for("reconcile_failed", kind="StoreFull", timeout=10)
        d.wait_until(lambda ev: count(ev, "reconcile_failed") >= 2, "the batch tried again")
        filler.unlink()
        tree.add_module("after", BASE + 0x1000000)
        wait_until("the load after space returned", lambda: loaded_events(d, {"after"}), 15)
        wait_for_turns(str(sock), "tracker_idle_checks")  # all held back is written by then
        incs = {i["name"]: i for i in history(state, tree.boot_id)}
        with Client(str(sock)) as c:
            in_memory = c.call("GetModules")["modules"]
        assert sorted(m["name"] for m in in_memory) == ["after", "early0", "early2", "slowinit"]
        stored = {n: (i["unloaded"] is not None, i["initstate"]) for n, i in incs.items()}
        assert stored == {
            "slowinit": (False, "live"),
            "early0": (False, "live"),
            "early1": (True, "live"),  # the unload is recorded
            "early2": (False, "live"),
            "after": (False, "live"),
        }
        assert len(incs["slowinit"]["sections"]) == 1000
        assert in_memory == [i for i in incs.values() if i["unloaded"] is None]
        assert d.stop() == 0


# -- a full map -----------------------------------------------------------------------------


def test_a_symbol_table_held_back_by_a_full_disk_is_stored_when_space_returns(
    daemon_factory: Any, sockdir: Path, tmp_path: Path
) -> None:
    """The module's record fits in the space left, its 5,000-symbol table does not:
    the capture fails by name, is held, and is stored by a retry once space returns,
    with no new load to prompt it; Resolve then names the module's functions."""
    with fast_tmpdir() as fast, tiny_tmpfs("2m") as mnt:
        tree = FakeTree(fast / "root")
        state = mnt / "state"
        sock = sockdir / "kreld.sock"
        cfg = write_config(tmp_path / "kreld.toml", modules={"watch": "inotify"})
        d = start(daemon_factory, tree, state, sock, "--config", str(cfg))
        d.wait_for("kernel_symbols")
        base = BASE + 0x1000000
        syms = [
            f"{base + k * 0x80:016x} t late_function_with_a_rather_long_name_{k}\t[late]"
            for k in range(5000)
        ]
        kallsyms = tree.root / "proc/kallsyms"
        kallsyms.write_text(kallsyms.read_text() + "\n".join(syms) + "\n")
        filler = fill(mnt)
        os.truncate(filler, filler.stat().st_size - (64 << 10))  # room for a record
        tree.add_module(
            "late", base, coresize=0x200000,
            sections={".text": base, ".data": base + 0x100000},
        )  # fmt: skip
        d.wait_for("module_loaded", module="late")
        failed = d.wait_for("symbol_capture_failed", timeout=15)
        assert (failed["level"], failed["kind"]) == ("error", "StoreFull"), failed
        with Client(str(sock)) as c:
            src = next(s for s in c.call("Status")["sources"] if s["name"] == "symbols")
            assert not src["healthy"] and "no space left" in src["last_error"], src
            [r] = c.resolve([f"{base + 0x80 * 42 + 3:#x}"])
            assert (r["image"], r.get("symbol")) == ("late", None), r
        filler.unlink()
        d.wait_for("module_symbols", module="late", timeout=30)
        d.wait_for("symbol_capture_recovered")
        with Client(str(sock)) as c:
            [r] = c.resolve([f"{base + 0x80 * 42 + 3:#x}"])
            assert (r["symbol"], r["symbol_offset"]) == (
                "late_function_with_a_rather_long_name_42",
                "0x3",
            ), r
            src = next(s for s in c.call("Status")["sources"] if s["name"] == "symbols")
            assert src["healthy"], src
        assert d.stop() == 0


def test_daemon_grows_a_full_map_and_goes_on(
    daemon_factory: Any, sockdir: Path, tmp_path: Path
) -> None:
    """kreld opens its store with a 16 MiB map (consts.STORE_INITIAL_MAP_SIZE, not
    configurable); a store already filled to just under that makes the daemon's own
    writes hit MDB_MAP_FULL, during a burst, with a reader in another process."""
    with fast_tmpdir() as fast:
        tree = FakeTree(fast / "root")
        state = fast / "state"
        with Store(state, map_size=64 << 20) as store:
            # An unreferenced table nobody reads: only there to take up room.
            store.symbols.put_table(
                "x:ballast", b"\x5a" * (consts.STORE_INITIAL_MAP_SIZE - (96 << 10))
            )
        size0 = (state / "data.mdb").stat().st_size
        assert consts.STORE_INITIAL_MAP_SIZE - size0 < 128 << 10
        sock = sockdir / "kreld.sock"
        cfg = write_config(tmp_path / "kreld.toml", modules={"watch": "inotify"})
        common = ["--root", str(tree.root), "--state-dir", str(state), "--config", str(cfg)]
        d = daemon_factory(*common, "--socket", str(sock)).start()

        reader = Store(state, readonly=True)  # stays open across the growth
        seen: list[int] = []
        halt = threading.Event()

        def read_on() -> None:
            while not halt.is_set():
                seen.append(len(reader.incarnations(tree.boot_id)))
                time.sleep(0.01)

        t = threading.Thread(target=read_on)
        t.start()
        names = {f"m{i:03d}" for i in range(400)}
        try:
            for i, n in enumerate(sorted(names)):
                tree.add_module(n, BASE + i * 0x100000)
                if i % 100 == 99:
                    time.sleep(0.3)
            wait_until("all loads recorded", lambda: loaded_events(d, names) == names, 60)
        finally:
            halt.set()
            t.join()
        assert (state / "data.mdb").stat().st_size > consts.STORE_INITIAL_MAP_SIZE  # it grew
        assert not full_disk_errors(d)
        assert seen == sorted(seen) and seen[-1] == 400  # the reader followed the growth
        assert len(reader.incarnations(tree.boot_id)) == 400
        assert reader.env.lmdb.info()["map_size"] > consts.STORE_INITIAL_MAP_SIZE
        reader.close()
        with Client(str(sock)) as c:
            assert len(c.call("GetModules")["modules"]) == 400
        assert d.stop() == 0

        # A restart opens the grown store (its 16 MiB map is smaller than the file).
        before = history(state, tree.boot_id)
        d = daemon_factory(*common, "--socket", str(sock), log_name="again.log").start()
        tree.add_module("one_more", BASE + 1000 * 0x100000)
        d.wait_for("module_loaded", module="one_more")
        after = history(state, tree.boot_id)
        assert_kept(before, after, "after restart")
        assert len(after) == 401
        assert_history_sane(after)
        assert d.stop(signal.SIGTERM) == 0


def _inc(name: str, i: int) -> Incarnation:
    state = ModuleState(
        name=name,
        build_id=f"{i:040x}",
        sections={".text": BASE + i * 0x10000, ".data": BASE + i * 0x10000 + 0x2000},
        coresize=0x4000,
        initsize=0,
        initstate="live",
        srcversion="0123456789ABCDEF0123456",
        taint="",
        core_base=BASE + i * 0x10000,
        restricted=False,
        inode=i + 1,
        faults=(),
    )
    return Incarnation(
        boot_id="", seq=-1, state=state, loaded=Timestamp.now(), seen_by=SeenBy.INOTIFY,
        init_live=False,
    )  # fmt: skip


def test_tiny_map_takes_thousands_of_incarnations_and_a_record_larger_than_it() -> None:
    """Store level (tests/store/test_store.py grows a tiny map with boots): here module
    incarnations, reader threads running through every growth, and one write bigger than
    several doublings of the map."""
    boot = str(uuid.uuid4())
    n = 5000
    with fast_tmpdir() as fast, Store(fast / "st", map_size=64 << 10) as store:
        halt = threading.Event()
        counts: list[int] = []
        errors: list[BaseException] = []

        def read_on() -> None:
            try:
                while not halt.is_set():
                    counts.append(store.boots.counts()["incarnations"])
                    time.sleep(0.001)
            except BaseException as e:
                errors.append(e)

        readers = [threading.Thread(target=read_on) for _ in range(2)]
        for t in readers:
            t.start()
        try:
            for b in range(0, n, 50):
                store.modules.apply_module_changes(
                    boot, [_inc(f"m{i}", i) for i in range(b, b + 50)], [], [], Timestamp.now()
                )
            big = b"\x33" * (3 << 20)  # 48 times the initial map, in one transaction
            assert store.symbols.put_table("x:big", big)
        finally:
            halt.set()
            for t in readers:
                t.join()
        assert not errors, errors
        assert counts and max(counts) == n and all(c % 50 == 0 for c in counts)
        assert store.env.lmdb.info()["map_size"] >= 4 << 20
        incs = store.incarnations(boot)
        assert [i.seq for i in incs] == list(range(n))
        assert len(store.modules.open_incarnations(boot)) == n
        got = store.env.read(lambda txn: txn.get(b"x:big", db=store.env.dbs[b"symtabs"]))
        assert got == big
        store.close()
        with Store(fast / "st", readonly=True, map_size=64 << 10) as ro:
            assert ro.boots.counts()["incarnations"] == n


def test_map_at_its_ceiling_is_a_named_error_and_nothing_partial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the map may grow no more (consts.STORE_MAX_MAP_SIZE), a write is refused as
    StoreFull, the transaction leaves nothing behind and the store stays usable."""
    monkeypatch.setattr(consts, "STORE_MAX_MAP_SIZE", 512 << 10)
    boot = str(uuid.uuid4())
    with Store(tmp_path / "st", map_size=64 << 10) as store:
        store.modules.apply_module_changes(boot, [_inc("first", 0)], [], [], Timestamp.now())
        with pytest.raises(StoreFull) as ei:
            store.modules.apply_module_changes(
                boot, [_inc(f"m{i}", i) for i in range(1, 8000)], [], [], Timestamp.now()
            )
        assert "map size limit" in str(ei.value) and str(tmp_path / "st") in str(ei.value)
        assert [i.name for i in store.incarnations(boot)] == ["first"]  # all or nothing
        store.modules.apply_module_changes(boot, [_inc("second", 1)], [], [], Timestamp.now())
        assert [(i.seq, i.name) for i in store.incarnations(boot)] == [(0, "first"), (1, "second")]
