"""The daemon's line-table builder made to fail (``KRELD_TEST_FAULTS``): the
Resolve that woke it is answered, its addresses saying the builder is not
running; Status names the failure; the daemon goes on serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kreld.client import Client

from support.faketree import FakeTree
from support.run import start
from support.wait import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


def test_a_failed_line_table_builder_is_named_in_status_and_resolve_says_so(
    tree: FakeTree,
    tmp_path: Path,
    sockdir: Path,
    daemon_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KRELD_TEST_FAULTS", "line-tables")
    monkeypatch.setenv("KRELD_TEST", "1")  # the fault hook is honoured only beside it
    sock = sockdir / "k.sock"
    start(daemon_factory, tree, tmp_path / "state", sock)
    with Client(str(sock)) as c:
        (r,) = c.resolve([hex(tree.text + 0x1000)], lines=True)
        assert r["frames"] == []
        assert r["no_lines"] == "the line-table builder is not running (see Status degraded)"
        failed = wait_until(
            "Status naming line-tables",
            lambda: [f for f in c.call("Status")["degraded"] if f["name"] == "line-tables"],
            60,
        )
        assert "InjectedFault" in failed[0]["reason"]
        assert c.resolve([hex(tree.text + 0x1000)])[0]["image"] == "kernel"
