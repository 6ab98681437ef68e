"""The real perf tool: where it records system-wide, its environment, this machine's _text."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kreld.kernel.info import scan_kallsyms_anchors


def perf_env(home: Path) -> dict[str, str]:
    home.mkdir(exist_ok=True)
    return {**os.environ, "HOME": str(home)}


def record(perf: str, out: Path, *options: str) -> list[str]:
    """perf record, system-wide, on the cpu-clock; -N: no build-id cache written."""
    return [perf, "record", "-e", "cpu-clock", "-a", "-N", "-q", "-o", str(out), *options, "--"]


@pytest.fixture
def perf(tmp_path: Path) -> str:
    """perf, if it can record system-wide here; else skip saying why."""
    exe = shutil.which("perf")
    if exe is None:
        pytest.skip("perf is not installed (Debian package linux-perf)")
    if os.geteuid() != 0:
        pytest.skip("not root: /proc/kallsyms shows zeros and perf record -a needs privilege")
    first = Path("/proc/kallsyms").read_bytes().split(b" ", 1)[0]
    if not first.strip(b"0"):
        pytest.skip("/proc/kallsyms shows zero addresses (kernel.kptr_restrict)")
    probe = subprocess.run(
        [*record(exe, tmp_path / "probe.data"), "sleep", "0.5"],
        capture_output=True,
        text=True,
        timeout=60,
        env=perf_env(tmp_path / "probe-home"),
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"perf record -e cpu-clock -a fails here: {probe.stderr.strip()[-300:]}")
    return exe


def live_text() -> int:
    anchors = scan_kallsyms_anchors(Path("/proc/kallsyms").read_bytes())
    if not anchors.get("_text"):
        pytest.skip("/proc/kallsyms shows zero addresses (kernel.kptr_restrict)")
    return anchors["_text"]
