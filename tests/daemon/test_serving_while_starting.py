"""The socket answers while the daemon's start does its heavy work (the boot's
record: kallsyms, a vmlinux to read, kernel memory), held here by the test hook
``KRELD_TEST_STALL_BOOT`` (a FIFO the start reads to its end) where a large
vmlinux would hold it: Status and Subscribe at once, the rest from what the
store holds, or the named NotReady."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kreld.client import Client
from kreld.core.errors import NotReady
from kreld.startup import STALL_ENV

from support.faketree import FakeTree

MOD = 0xFFFFFFFFC0400000


def _stalled(
    daemon_factory: Any, tree: FakeTree, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, Path, Path]:
    """kreld started with its boot record held at the FIFO; (daemon, fifo, socket)
    once it listens."""
    fifo = tmp_path / "stall"
    if not fifo.exists():
        os.mkfifo(fifo)
    monkeypatch.setenv(STALL_ENV, str(fifo))
    sock = tmp_path / "kreld.sock"
    d = daemon_factory(
        "--root", str(tree.root), "--state-dir", str(tmp_path / "state"), "--socket", str(sock)
    )
    d.start(wait_ready=False)
    d.wait_for("listening", timeout=60)
    return d, fifo, sock


def _release(fifo: Path) -> None:
    """Let the start go on: open the FIFO's writing end and close it (EOF)."""
    os.close(os.open(fifo, os.O_WRONLY))


def test_status_and_subscribe_answer_while_the_boot_record_is_held(
    tree: FakeTree, tmp_path: Path, daemon_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first start: Status says what is starting, Subscribe's first reply has
    no module yet and the start's first look then sends the module's load;
    the current boot is NotReady (no record of it yet), ListBoots answers."""
    tree.add_module("alpha", MOD)
    d, fifo, sock = _stalled(daemon_factory, tree, tmp_path, monkeypatch)
    with Client(str(sock), timeout=60) as c, Client(str(sock), timeout=60) as sub:
        st = c.call("Status")
        assert st["starting"] == ["boot", "modules"]
        assert st["boot_id"] == tree.boot_id
        assert st["loaded_modules"] == 0 and st["sources"] == []
        events = sub.stream("Subscribe")
        first = next(events)
        assert first["event"] == "snapshot" and first["modules"] == []
        assert c.call("ListBoots")["boots"] == []
        with pytest.raises(NotReady) as e:
            c.call("GetBoot")
        assert e.value.starting == ["boot", "modules"]
        with pytest.raises(NotReady):
            c.resolve([f"{MOD + 0x10:#x}"])
        assert c.call("Status")["starting"] == ["boot", "modules"]  # still held
        _release(fifo)
        load = next(events)
        assert load["event"] == "load" and load["module"]["name"] == "alpha"
        d.wait_for("ready", timeout=60)
        st = c.call("Status")
        assert st["starting"] == []
        assert st["loaded_modules"] == 1
        assert c.call("GetBoot")["boot"]["boot_id"] == tree.boot_id
    assert d.stop() == 0


def test_a_restart_held_at_the_boot_record_answers_from_the_store(
    tree: FakeTree, tmp_path: Path, daemon_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a first run recorded the boot and a module, a second start held at
    the boot record answers GetBoot, GetModules and Subscribe about the boot
    from what the store holds, before its own record is made."""
    tree.add_module("alpha", MOD)
    sock = tmp_path / "kreld.sock"
    first = daemon_factory(
        "--root", str(tree.root), "--state-dir", str(tmp_path / "state"), "--socket", str(sock)
    ).start(timeout=60)
    first.wait_for("modules_startup", opened=1, timeout=60)
    assert first.stop() == 0

    d, fifo, sock = _stalled(daemon_factory, tree, tmp_path, monkeypatch)
    try:
        with Client(str(sock), timeout=60) as c, Client(str(sock), timeout=60) as sub:
            assert c.call("Status")["starting"] == ["boot", "modules"]
            snap = next(sub.stream("Subscribe"))
            assert [m["name"] for m in snap["modules"]] == ["alpha"]
            assert c.call("GetBoot")["boot"]["boot_id"] == tree.boot_id
            assert [m["name"] for m in c.call("GetModules")["modules"]] == ["alpha"]
            with pytest.raises(NotReady):
                c.call("Snapshot")  # the start is making the record itself
            assert c.call("Status")["starting"] == ["boot", "modules"]
    finally:
        _release(fifo)
    d.wait_for("ready", timeout=60)
    assert d.stop() == 0
