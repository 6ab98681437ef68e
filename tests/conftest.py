"""Fixtures shared by every test: fake trees, the daemon as a real subprocess, the collection
rule of the fault suite.  Helpers live in the support package (tests/support)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from support.faketree import FakeTree
from support.run import Daemon


@pytest.fixture
def tree(tmp_path: Path) -> FakeTree:
    return FakeTree(tmp_path / "root")


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[Daemon] = []

    def make(*args: str, log_name: str = "kreld.log") -> Daemon:
        d = Daemon(list(args), tmp_path / log_name)
        started.append(d)
        return d

    yield make
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


if TYPE_CHECKING:
    pass


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fault suite (tests/faults, marked ``faults``) is opt-in like tests/vm: its
    tests are skipped unless selected with ``-m faults``."""
    expr = config.getoption("markexpr") or ""
    if "faults" in expr and "not faults" not in expr:
        return
    skip = pytest.mark.skip(reason="the fault suite (minutes): select with -m faults")
    for item in items:
        if item.get_closest_marker("faults") is not None:
            item.add_marker(skip)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A short, world-traversable directory (sun_path is 108 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="kreld-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)
