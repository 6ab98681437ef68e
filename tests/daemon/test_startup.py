"""What a start costs: one read of kallsyms per daemon start, and commands that
import only what they use."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import struct
from pathlib import Path
from typing import Any

from support.faketree import FakeTree
from support.run import kreldctl, start
from support.startup import HEAVY, imported_by, run_cli
from support.wait import quick_heartbeat, wait_for_symbols_done

MOD_A = 0xFFFFFFFFC0400000
MOD_B = 0xFFFFFFFFC0900000


class OpenCounter:
    """Counts the opens of one file, as the kernel reports them (inotify
    ``IN_OPEN``): how many times kreld read it, whoever in kreld did.

    inotify merges an event into an identical one still unread: closes are
    watched too, so that reads one after another (open, close, open, close)
    never merge."""

    IN_OPEN = 0x20
    IN_CLOSE = 0x08 | 0x10
    _EVENT = struct.Struct("iIII")

    def __init__(self, path: Path) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        mask = self.IN_OPEN | self.IN_CLOSE
        if self.fd < 0 or libc.inotify_add_watch(self.fd, os.fsencode(path), mask) < 0:
            raise OSError(ctypes.get_errno(), f"inotify on {path}")
        self.opens = 0

    def count(self) -> int:
        """Opens so far (reads the events the kernel queued)."""
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return self.opens
            pos = 0
            while pos < len(buf):
                _wd, mask, _cookie, length = self._EVENT.unpack_from(buf, pos)
                pos += self._EVENT.size + length
                self.opens += bool(mask & self.IN_OPEN)

    def close(self) -> None:
        os.close(self.fd)


def test_a_daemon_start_reads_kallsyms_once(
    tree: FakeTree, tmp_path: Path, daemon_factory: Any
) -> None:
    """The snapshot (anchors), the kernel's symbol table and the tables of the
    modules loaded at start all come from one read of ``/proc/kallsyms``."""
    tree.add_module("alpha", MOD_A)
    tree.add_module("beta", MOD_B)
    kallsyms = tree.root / "proc/kallsyms"
    with open(kallsyms, "ab") as f:
        f.write(f"{MOD_A + 0x10:016x} t alpha_fn\t[alpha]\n".encode())
        f.write(f"{MOD_B + 0x20:016x} T beta_fn\t[beta]\n".encode())
    opens = OpenCounter(kallsyms)
    try:
        beat = quick_heartbeat(tmp_path / "kreld.toml")
        d = start(daemon_factory, tree, tmp_path / "state", tmp_path / "kreld.sock", *beat)
        d.wait_for("kernel_symbols")
        d.wait_for("module_symbols", module="alpha", source="kallsyms")
        d.wait_for("module_symbols", module="beta", source="kallsyms")
        wait_for_symbols_done(str(tmp_path / "kreld.sock"))  # a second read would be made
        assert opens.count() == 1
        assert d.wait_for("kernel_symbol", symbol="_text")["address"] == f"{tree.text:#x}"
        assert d.stop() == 0
    finally:
        opens.close()


def test_a_load_after_the_start_reads_kallsyms_again(
    tree: FakeTree, tmp_path: Path, daemon_factory: Any
) -> None:
    """The start's read serves the start only: a module loaded later gets its
    table from a read of kallsyms made after it loaded."""
    kallsyms = tree.root / "proc/kallsyms"
    opens = OpenCounter(kallsyms)
    try:
        beat = quick_heartbeat(tmp_path / "kreld.toml")
        d = start(daemon_factory, tree, tmp_path / "state", tmp_path / "kreld.sock", *beat)
        d.wait_for("kernel_symbols")
        wait_for_symbols_done(str(tmp_path / "kreld.sock"))
        assert opens.count() == 1
        with open(kallsyms, "ab") as f:  # the test's own open: one more
            f.write(f"{MOD_A + 0x10:016x} t gamma_fn\t[gamma]\n".encode())
        assert opens.count() == 2
        tree.add_module("gamma", MOD_A)
        d.wait_for("module_symbols", module="gamma", source="kallsyms")
        assert opens.count() == 3
        assert d.stop() == 0
    finally:
        opens.close()


def test_kreldctl_help_imports_no_store_no_client_no_logging() -> None:
    mods = imported_by(run_cli(["--help"]))
    assert "kreld.cli" in mods
    assert {m.split(".")[0] for m in mods} & HEAVY == set()
    assert mods & {"lmdb", "kreld.store", "kreld.server.service", "kreld.client", "uuid"} == set()


def test_kreldctl_show_from_the_store_imports_only_the_store(
    tree: FakeTree, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    common = ["--root", str(tree.root), "--state-dir", str(state)]
    kreldctl("snapshot", *common)
    shown = json.loads(kreldctl("show", "--json", *common).stdout)
    assert shown["boot_id"] == tree.boot_id
    mods = imported_by(run_cli(["show", "--json", *common]))
    assert {"kreld.store", "lmdb"} <= mods  # it did read the store
    assert {m.split(".")[0] for m in mods} & HEAVY == set()
    assert (
        mods & {"kreld.client", "kreld.kernel.snapshot", "kreld.symbols.capture", "socket"} == set()
    )


def test_importing_the_daemon_loads_no_elf_reader_and_no_uevent_library() -> None:
    """pyelftools is for the rare start that opens a vmlinux or a .ko; pyudev
    only for uevents on the real root; each watchdog observer when chosen."""
    mods = imported_by("import kreld.daemon")
    assert "kreld.daemon" in mods
    unwanted = {"elftools", "pyudev", "watchdog.observers.inotify", "watchdog.observers.polling"}
    assert mods & unwanted == set()
    assert not any(m.startswith("elftools.") for m in mods)


def test_the_open_counter_counts_every_open(tree: FakeTree) -> None:
    """The counter the tests above rely on: each read is one open; a stat is none."""
    path = tree.root / "proc/kallsyms"
    opens = OpenCounter(path)
    try:
        path.stat()
        assert opens.count() == 0
        path.read_bytes()
        path.read_bytes()  # unread, the two would merge without the closes between
        assert opens.count() == 2
    finally:
        opens.close()
