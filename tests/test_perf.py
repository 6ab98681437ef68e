"""The perf round trip: a kallsyms exported by kreld names the kernel frames of a perf.data.

Where perf can record system-wide (Debian: linux-perf; root, unrestricted kallsyms):
record a moment of a syscall-heavy workload, then report it with a HOME that has no
perf build-id cache (so perf has no copy of kallsyms of its own) against kreld's
export, against /proc/kallsyms, and against an empty kallsyms.  The first two must
name the same kernel symbols with the same overheads; the last must name none.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import kreldctl

KERNEL_LINE = re.compile(r"^\s*([0-9.]+)%\s+\[k\]\s+(\S+)\s*$")


def perf_env(home: Path) -> dict[str, str]:
    home.mkdir(exist_ok=True)
    return {**os.environ, "HOME": str(home)}


def record(perf: str, out: Path) -> list[str]:
    """perf record, system-wide, on the cpu-clock; -N: no build-id cache written."""
    return [perf, "record", "-e", "cpu-clock", "-a", "-N", "-q", "-o", str(out), "--"]


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


def kernel_frames(perf: str, data: Path, kallsyms: Path, home: Path) -> list[tuple[str, str]]:
    """(overhead, symbol) of each kernel line of ``perf report --sort sym``."""
    cp = subprocess.run(
        [perf, "report", "-i", str(data), f"--kallsyms={kallsyms}", "--stdio", "--sort", "sym"],
        capture_output=True,
        text=True,
        timeout=120,
        env=perf_env(home),
        check=False,
    )
    assert cp.returncode == 0, cp.stderr
    return [
        (m.group(1), m.group(2)) for ln in cp.stdout.splitlines() if (m := KERNEL_LINE.match(ln))
    ]


def named(frames: list[tuple[str, str]]) -> set[str]:
    return {s for _, s in frames if not s.startswith("0x")}


def test_perf_report_with_exported_kallsyms_names_the_kernel_frames(
    perf: str, tmp_path: Path
) -> None:
    data = tmp_path / "perf.data"
    home = tmp_path / "home"  # empty: no ~/.debug build-id cache
    rec = subprocess.run(
        [*record(perf, data), "dd", "if=/dev/zero", "of=/dev/null", "bs=512", "count=300000"],
        capture_output=True,
        text=True,
        timeout=120,
        env=perf_env(home),
        check=False,
    )
    assert rec.returncode == 0, rec.stderr

    state = str(tmp_path / "state")
    exported = tmp_path / "kallsyms"
    kreldctl("--state-dir", state, "snapshot")
    kreldctl("--state-dir", state, "export", "kallsyms", "-o", str(exported))
    empty = tmp_path / "empty-kallsyms"
    empty.write_text("")

    live = kernel_frames(perf, data, Path("/proc/kallsyms"), home)
    ours = kernel_frames(perf, data, exported, home)
    none = kernel_frames(perf, data, empty, home)
    assert not any(home.iterdir()), "perf wrote a build-id cache: the reports could use it"

    # The workload lives in read/write syscalls: the live report names kernel code.
    assert len(named(live)) >= 3, live
    assert ours == live
    # Without symbols perf shows raw addresses: the comparison above can fail.
    assert none, "the kernel samples vanished without kallsyms"
    assert named(none) == set(), named(none)
