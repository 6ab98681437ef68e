"""When the symbol cache captures tables: a boot recorded without them gets them
from a daemon started on it, and a module load gone before its batch costs no
read of kallsyms."""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path
from typing import Any

import structlog

from kreld.core.model import Incarnation, SeenBy, Timestamp
from kreld.kernel.info import Root
from kreld.kernel.modules_sysfs import read_module
from kreld.kernel.snapshot import take_snapshot
from kreld.store import Store
from kreld.tracker.modules_plan import new_incarnation

from support.faketree import FakeTree
from support.run import Daemon, kreldctl
from support.symanswers import (
    assert_same_lines,
    call,
    ok,
)
from support.symbols import (
    LINK,
    SLIDES,
    Machine,
    symbol_worker,
)
from support.symbols import daemons as daemons
from support.symbols import sock_dir as sock_dir


def test_export_of_a_boot_recorded_without_symbols_is_symbols_unavailable(
    tmp_path: Path, sock_dir: Path, daemons: list[Daemon]
) -> None:
    """A boot recorded before the symbol cache existed (or before its capture ran)."""
    m = Machine(tmp_path / "m", sock_dir / "nosym.sock", daemons)
    snap, _notes = take_snapshot(Root(m.tree.root))
    m.state.mkdir()
    with Store(m.state) as store:
        store.boots.record_boot(snap)
    cp = kreldctl("export", "kallsyms", *m.opts, check=False)
    assert cp.returncode == 1, cp.stderr
    assert "no kernel symbols recorded for boot" in cp.stderr and cp.stdout == ""
    # Resolve still places addresses, without symbols.
    [r] = m.resolve(None, LINK + SLIDES[0] + 0x2010)
    assert (r["image"], r["section"], r["offset"]) == ("kernel", ".text", "0x2010")
    assert "symbol" not in r
    # A daemon started on the boot captures the table; the export then works.
    d = m.start()
    d.wait_for("kernel_symbols", action="stored")
    reply = call(m.sock, "ExportKallsyms", boot_id=m.tree.boot_id)
    assert_same_lines(ok(reply)["kallsyms"], m.kallsyms())
    assert d.stop(signal.SIGTERM) == 0


def test_a_load_gone_before_its_batch_costs_no_read_of_kallsyms(
    tree: FakeTree, tmp_path: Path
) -> None:
    """The kernel drops an unloaded module's lines from kallsyms with its sysfs
    directory, so the worker reads kallsyms only for a load still there: with
    kallsyms unreadable after the start, a load gone before its batch is
    captured (from its .ko, here none) without a try, one still loaded tries."""
    root = Root(tree.root)
    buf = io.StringIO()
    log = structlog.wrap_logger(
        structlog.PrintLogger(buf),
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
    )

    def events(name: str) -> list[dict[str, Any]]:
        lines = [json.loads(ln) for ln in buf.getvalue().splitlines() if ln.strip()]
        return [e for e in lines if e["event"] == name]

    def load(name: str, base: int) -> Incarnation:
        tree.add_module(name, base)
        state = read_module(root, name)
        assert state is not None
        return new_incarnation(state, Timestamp.now(), SeenBy.INOTIFY)

    with symbol_worker(tree, tmp_path / "state", log) as (store, stored, capture):
        assert store.boot_symbols(stored.boot_id) is not None
        (tree.root / "proc/kallsyms").unlink()
        (tree.root / "proc/kallsyms").mkdir()  # a read now fails, and says so
        gone = load("gone", 0xFFFFFFFFC1000000)
        tree.remove_module("gone")
        capture.on_event("load", gone)
        assert capture.idle.wait(30)
        assert [e["module"] for e in events("module_symbols_unavailable")] == ["gone"]
        assert events("kallsyms_unreadable") == []
        capture.on_event("load", load("here", 0xFFFFFFFFC2000000))
        assert capture.idle.wait(30)
        assert [e["module"] for e in events("module_symbols_unavailable")] == ["gone", "here"]
        assert len(events("kallsyms_unreadable")) == 1
