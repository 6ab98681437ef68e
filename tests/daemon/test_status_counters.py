"""Status counts how often each of the daemon's workers turned over: what an
operator reads to see them alive, and what tests wait on to prove that
something did not happen."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.faketree import FakeTree
from support.run import start
from support.wait import counters, wait_for_turns, wait_until

MOD = 0xFFFFFFFFC0400000


def test_status_counters_show_the_tracker_and_the_symbol_worker_turning_over(
    tree: FakeTree, sockdir: Path, tmp_path: Path, daemon_factory: Any
) -> None:
    sock = str(sockdir / "kreld.sock")
    d = start(daemon_factory, tree, tmp_path / "state", Path(sock))
    before = counters(sock)
    assert before["publish_rounds"] == 0  # no [publish]: no rounds
    tree.add_module("gamma", MOD)
    d.wait_for("module_loaded", module="gamma")
    wait_until("the symbol worker done", lambda: counters(sock)["symbol_loads_handled"] >= 1)
    after = counters(sock)
    assert after["symbol_loads_queued"] == after["symbol_loads_handled"] == 1
    assert after["tracker_passes"] > before["tracker_passes"]  # the load's pass at least
    wait_for_turns(sock, "tracker_idle_checks")  # idle once no event is left
    assert counters(sock)["symbol_loads_queued"] == 1  # and nothing new came meanwhile
    assert d.stop() == 0
