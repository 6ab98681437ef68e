"""kill -9 of kreld at 50 random moments during a burst of module loads and unloads.

Each kill lands wherever it lands: during the startup scan, between two reconciliations,
inside an LMDB commit.  After each one the store must still hold everything a reader saw
just before the kill; at the end the daemon must answer for exactly what is loaded.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kreld.client import Client

from support.faketree import FakeTree
from support.faultlib import assert_history_sane, assert_kept, history, write_config
from support.tmpdirs import fast_tmpdir
from support.wait import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

KILLS = 50
POOL = [f"burst{i:02d}" for i in range(24)]
BASE = 0xFFFFFFFFC1000000


class Burst(threading.Thread):
    """Loads and unloads modules of a small pool without pause, each load at a base of
    its own (so a load recorded twice shows as two incarnations with one .text)."""

    def __init__(self, tree: FakeTree, seed: int) -> None:
        super().__init__(name="burst", daemon=True)
        self.tree = tree
        self.rng = random.Random(seed)
        self.halt = threading.Event()
        self.loads = 0
        self.unloads = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                name = self.rng.choice(POOL)
                if name in self.tree.modules:
                    self.tree.remove_module(name)
                    self.unloads += 1
                else:
                    self.tree.add_module(name, BASE + self.loads * 0x10000)
                    self.loads += 1
                time.sleep(self.rng.uniform(0, 0.012))
        except BaseException as e:
            self.error = e


def test_kill_9_at_50_random_moments_during_a_module_burst(
    daemon_factory: Any, sockdir: Path, tmp_path: Path
) -> None:
    seed = int(os.environ.get("KRELD_FAULTS_SEED", random.randrange(1 << 32)))
    print(f"seed {seed} (set KRELD_FAULTS_SEED to replay)")
    rng = random.Random(seed)
    with fast_tmpdir() as fast:
        tree = FakeTree(fast / "root")
        state = fast / "state"
        sock = sockdir / "kreld.sock"
        cfg = write_config(
            tmp_path / "kreld.toml", modules={"watch": "inotify", "poll_interval": 0.2}
        )
        common = ["--root", str(tree.root), "--state-dir", str(state), "--config", str(cfg)]
        for i in range(6):  # some modules that stay loaded throughout
            tree.add_module(f"steady{i}", 0xFFFFFFFFC0000000 + i * 0x100000)
        burst = Burst(tree, seed)
        burst.start()
        seen_before_kill: list[list[dict[str, Any]]] = []
        moments = {"before ready": 0, "after ready": 0}
        t0 = time.monotonic()
        try:
            for k in range(KILLS):
                d = daemon_factory(*common, "--socket", str(sock), log_name=f"kreld-{k:02d}.log")
                d.start(wait_ready=False)
                # kreld needs about 0.7 s to be ready here: some kills land in its
                # startup scan, most while it follows the burst.
                time.sleep(rng.uniform(0.15, 1.6))
                assert d.proc.poll() is None, d.log_path.read_text()[-3000:]
                ready = any(e.get("event") == "ready" for e in d.events())
                moments["after ready" if ready else "before ready"] += 1
                before = history(state, tree.boot_id)
                assert d.stop(signal.SIGKILL) == -signal.SIGKILL
                after = history(state, tree.boot_id)
                assert_kept(before, after, f"kill {k}")
                assert_history_sane(after)
                seen_before_kill.append(before)
                assert not [e for e in d.events() if e.get("event") == "reconcile_failed"]
                assert "Traceback" not in d.log_path.read_text(errors="replace")
        finally:
            burst.halt.set()
            burst.join(timeout=30)
        assert burst.error is None, burst.error
        print(
            f"{KILLS} kills in {time.monotonic() - t0:.0f}s ({moments}); burst: "
            f"{burst.loads} loads, {burst.unloads} unloads"
        )
        assert len(seen_before_kill[-1]) > 200  # the burst really was recorded

        # The last run: it must come to answer for exactly what is loaded.
        d = daemon_factory(*common, "--socket", str(sock), log_name="kreld-final.log")
        d.start(timeout=30)
        expected = {n: base for n, (base, _) in tree.modules.items()}

        def answered() -> list[dict[str, Any]] | None:
            with Client(str(sock)) as c:
                mods: list[dict[str, Any]] = c.call("GetModules")["modules"]
            got = {m["name"]: int(m["sections"][".text"], 16) for m in mods}
            return mods if got == expected else None

        mods = wait_until("GetModules to match what is loaded", answered, timeout=30)
        final = history(state, tree.boot_id)
        assert_history_sane(final)
        for k, before in enumerate(seen_before_kill):
            assert_kept(before, final, f"record seen before kill {k}")
        still_open = [i for i in final if i["unloaded"] is None]
        assert {i["name"]: int(i["sections"][".text"], 16) for i in still_open} == expected
        assert mods == still_open  # the daemon's answer is the store's, field for field
        with Client(str(sock)) as c:
            assert c.call("GetModules", all=True)["modules"] == final
            addrs = [f"{base + 0x10:#x}" for base in expected.values()]
            res = c.resolve(addrs)
            assert [(r["image"], r["section"], r["offset"]) for r in res] == [
                (n, ".text", "0x10") for n in expected
            ]
            assert c.call("GetBoot")["boot"]["boot_id"] == tree.boot_id
        assert d.stop() == 0
