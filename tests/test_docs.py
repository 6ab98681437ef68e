"""The docs made from code are up to date: scripts/gendocs would change nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_generated_parts_of_man_pages_and_readme_are_current() -> None:
    cp = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gendocs"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cp.returncode == 0, cp.stdout + cp.stderr
