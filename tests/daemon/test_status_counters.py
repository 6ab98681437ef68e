"""Status counts how often each of the daemon's workers turned over: what an
operator reads to see them alive, and what tests wait on to prove that
something did not happen."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.faketree import FakeTree
from support.run import start
from support.wait import counters, quick_heartbeat, wait_for_turns, wait_until

MOD = 0xFFFFFFFFC0400000


def test_status_counters_show_the_tracker_and_the_symbol_worker_turning_over(
    tree: FakeTree, sockdir: Path, tmp_path: Path, daemon_factory: Any
) -> None:
    sock = str(sockdir / "kreld.sock")
    beat = quick_heartbeat(tmp_path / "kreld.toml")
    d = start(daemon_factory, tree, tmp_path / "state", Path(sock), *beat)
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


def test_a_reloaded_heartbeat_interval_paces_the_idle_checks_at_once(
    tree: FakeTree, sockdir: Path, tmp_path: Path, daemon_factory: Any
) -> None:
    """At rest the tracker wakes only for its heartbeat.  With an hour between
    two, no idle check comes; SIGHUP with one second between two brings them
    without waiting out the hour."""
    sock = str(sockdir / "kreld.sock")
    cfg = tmp_path / "kreld.toml"
    cfg.write_text("[modules]\nheartbeat_interval = 3600\n")
    d = start(daemon_factory, tree, tmp_path / "state", Path(sock), "--config", str(cfg))
    d.wait_for("modules_startup")
    before = counters(sock)["tracker_idle_checks"]
    quick_heartbeat(cfg, 1.0)
    d.proc.send_signal(1)
    assert d.wait_for("config_reloaded")["changed"] == ["heartbeat_interval"]
    wait_for_turns(sock, "tracker_idle_checks", 2, timeout=30)
    assert counters(sock)["tracker_idle_checks"] >= before + 2
    assert d.stop() == 0
