"""A fake tree and the kallsyms text address that the perf inject tests record against."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.faketree import FakeTree
from support.run import kreldctl

TEXT = 0xFFFFFFFF9D000000


@pytest.fixture
def store(tmp_path: Path) -> tuple[list[str], FakeTree]:
    tree = FakeTree(tmp_path / "root", text=TEXT)
    opts = ["--root", str(tree.root), "--state-dir", str(tmp_path / "state")]
    kreldctl(*opts, "snapshot")
    return opts, tree
