"""Kernel pointers that become restricted while kreld runs, or between two runs of one
boot (kptr_restrict raised, CAP_SYSLOG dropped): what kreld then reads are zeros.

A zero is never an address: new records made from zeros say *restricted* and claim no
address; what was recorded before, with real addresses, is left as it was.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from kreld.client import Client
from kreld.store import Store

from support.faketree import FakeTree
from support.faultlib import assert_history_sane, assert_no_zero_address, history, write_config
from support.tmpdirs import fast_tmpdir
from support.wait import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

A, B, C = 0xFFFFFFFFC0400000, 0xFFFFFFFFC0800000, 0xFFFFFFFFC0C00000
ZERO_LINE = "0000000000000000 "


class Machine:
    def __init__(self, fast: Path, tmp_path: Path, sockdir: Path, factory: Any) -> None:
        self.tree = FakeTree(fast / "root")
        self.state = fast / "state"
        self.sock = sockdir / "kreld.sock"
        self.cfg = write_config(
            tmp_path / "kreld.toml", modules={"watch": "inotify", "poll_interval": 0.2}
        )
        self.factory = factory
        self.runs = 0

    def start(self) -> Any:
        self.runs += 1
        d = self.factory(
            "--root", str(self.tree.root), "--state-dir", str(self.state),
            "--socket", str(self.sock), "--config", str(self.cfg),
            log_name=f"kreld-{self.runs}.log",
        )  # fmt: skip
        return d.start()

    def start_with_a_and_b(self) -> tuple[Any, list[dict[str, Any]], dict[str, Any], str]:
        """Modules a and b loaded, kreld started and its symbols captured: the daemon,
        the history, GetBoot and the exported kallsyms, before anything goes wrong."""
        self.tree.add_module("a", A)
        self.tree.add_module("b", B)
        d = self.start()
        wait_until("kernel symbols", lambda: symbols_done(d))
        before = history(self.state, self.tree.boot_id)
        return d, before, self.call("GetBoot"), self.call("ExportKallsyms")["kallsyms"]

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        with Client(str(self.sock)) as c:
            return c.call(method, **params)

    def resolve(self, *addresses: str) -> list[dict[str, Any]]:
        with Client(str(self.sock)) as c:
            return c.resolve(addresses)

    def restrict(self) -> None:
        """kptr_restrict goes up: every pointer kreld reads from now on is zero, also in
        the directories of modules already loaded (rewritten in place: same inode)."""
        t = self.tree
        t.write("proc/sys/kernel/kptr_restrict", "2\n")
        t.set_text(t.text, zero=True)
        for m in os.listdir(t.root / "sys/module"):
            secs = t.root / "sys/module" / m / "sections"
            for f in secs.iterdir() if secs.is_dir() else ():
                f.write_text("0x0000000000000000\n")
        t.modules = {n: (0, size) for n, (_, size) in t.modules.items()}
        t._write_proc_modules()


def symbols_done(d: Any) -> bool:
    return any(e["event"] in ("kernel_symbols", "kernel_symbols_unavailable") for e in d.events())


def test_restricted_pointers_appearing_mid_run(
    daemon_factory: Any, tmp_path: Path, sockdir: Path
) -> None:
    with fast_tmpdir() as fast:
        m = Machine(fast, tmp_path, sockdir, daemon_factory)
        d, before, boot_before, kallsyms_before = m.start_with_a_and_b()

        m.restrict()
        m.tree.remove_module("b")
        m.tree.add_module("c", C, zero=True)
        m.tree.add_module("b", B + 0x100000, zero=True)  # b again, now unreadable
        d.wait_for("module_loaded", module="b", count=1, restricted=True)
        d.wait_for("module_loaded", module="c", restricted=True)

        after = history(m.state, m.tree.boot_id)
        assert_history_sane(after)
        a0, b0, *new = after
        assert a0 == before[0]  # untouched
        assert {k: v for k, v in b0.items() if not k.startswith("unload")} == {
            k: v for k, v in before[1].items() if not k.startswith("unload")
        }
        assert b0["unloaded"] is not None
        assert sorted(i["name"] for i in new) == ["b", "c"]
        for i in new:
            assert i["restricted"] is True, i
            assert i["sections"] == {} and i["core_base"] is None, i  # no zero kept
        mods = m.call("GetModules")["modules"]
        assert [x["name"] for x in mods] == ["a", *(i["name"] for i in new)]
        assert_no_zero_address(mods)
        res = m.resolve(f"{A + 0x10:#x}", f"{C + 0x10:#x}")
        assert (res[0]["image"], res[0]["offset"]) == ("a", "0x10")  # the old record serves
        assert "image" not in res[1]  # nothing claimed for a module read as zeros
        [kernel] = m.resolve(f"{m.tree.text + 0x1234:#x}")
        assert (kernel["image"], kernel["offset"]) == ("kernel", "0x1234")
        assert m.call("GetBoot") == boot_before
        kallsyms = m.call("ExportKallsyms")["kallsyms"]
        assert kallsyms == kallsyms_before
        assert not [line for line in kallsyms.splitlines() if line.startswith(ZERO_LINE)]
        assert d.stop() == 0


def test_restart_in_the_same_boot_reading_zeros_keeps_the_records(
    daemon_factory: Any, tmp_path: Path, sockdir: Path
) -> None:
    with fast_tmpdir() as fast:
        m = Machine(fast, tmp_path, sockdir, daemon_factory)
        d, before, boot_before, kallsyms_before = m.start_with_a_and_b()
        assert d.stop() == 0

        m.restrict()
        d = m.start()
        startup = d.wait_for("modules_startup")
        assert (startup["continued"], startup["opened"], startup["closed_while_down"]) == (2, 0, 0)
        m.tree.add_module("c", C, zero=True)
        d.wait_for("module_loaded", module="c", restricted=True)

        after = history(m.state, m.tree.boot_id)
        assert after[:2] == before  # continued: the records with real addresses stay
        assert after[2]["name"] == "c" and after[2]["restricted"] is True
        assert after[2]["sections"] == {}
        assert_history_sane(after)
        boot = m.call("GetBoot")
        assert boot == boot_before  # the image does not move within a boot
        assert_no_zero_address(boot)
        kallsyms = m.call("ExportKallsyms")["kallsyms"]
        assert kallsyms == kallsyms_before
        [res] = m.resolve(f"{B + 0x20:#x}")
        assert (res["image"], res["offset"]) == ("b", "0x20")
        status = m.call("Status")  # what kreld reads now, not what the record knows
        assert status["restricted"] is True and status["restricted_reason"], status
        assert d.stop() == 0


def test_kernel_symbols_never_captured_from_zeros_after_a_crash(
    daemon_factory: Any, tmp_path: Path, sockdir: Path
) -> None:
    """kill -9 between kreld's boot commit and its symbol-table commit (two transactions,
    tens of ms apart), then a restart in the same boot that reads kallsyms as zeros."""
    with fast_tmpdir() as fast:
        m = Machine(fast, tmp_path, sockdir, daemon_factory)
        m.tree.add_module("a", A)
        for _attempt in range(10):
            d = m.factory(
                "--root", str(m.tree.root), "--state-dir", str(m.state), "--socket",
                str(m.sock), "--config", str(m.cfg), log_name="first.log",
            )  # fmt: skip
            d.start(wait_ready=False)
            d.wait_for("boot")
            assert d.stop(signal.SIGKILL) == -signal.SIGKILL
            with Store(m.state, readonly=True) as st:
                if st.boot_symbols(m.tree.boot_id) is None:
                    break
            for f in m.state.iterdir():  # the window was missed: again, afresh
                f.unlink()
        else:
            pytest.fail("never killed kreld between its boot and its symbol commits")
        print(f"killed between the two commits on attempt {_attempt + 1}")
        m.restrict()
        d = m.start()
        wait_until("kernel symbols", lambda: symbols_done(d))
        boot = m.call("GetBoot")["boot"]
        assert boot["anchors"]["text"] == f"{m.tree.text:#x}"  # kept from the first run
        [r] = m.resolve(f"{m.tree.text + 0x1008:#x}")
        print("Resolve _text+0x1008:", r)
        assert r["image"] == "kernel" and r["offset"] == "0x1008"
        assert r.get("symbol") in (None, "start_kernel"), r
        try:
            kallsyms = m.call("ExportKallsyms")["kallsyms"]
        except Exception as e:  # SymbolsUnavailable is a fine answer
            assert "SymbolsUnavailable" in type(e).__name__, e
        else:
            zeros = [line for line in kallsyms.splitlines() if line.startswith(ZERO_LINE)]
            assert not zeros, zeros[:3]
        assert any(e["event"] == "kernel_symbols_zeroed" for e in d.events())
        assert d.stop() == 0
