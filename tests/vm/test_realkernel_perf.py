"""kreld on a real kernel (tests/vm/conftest.py boots it twice; the guest records
with perf): a perf.data finds its own boot on the host, and ``export
kallsyms --for``, ``symbolize --for`` and ``inject`` name what perf could not."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from support import harness
from support.realboot import Boot
from support.realkernel import CTL, host_ctl

pytestmark = [pytest.mark.realkernel, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", autouse=True)
def _selected(request: pytest.FixtureRequest) -> None:
    harness.skip_unless_selected(request.config.getoption("markexpr"))


# -- 9. perf: a perf.data finds its own boot ------------------------------------------------

PERF_KERNEL_ROW = re.compile(r"^\s*([0-9.]+)%\s+\[k\]\s+(\S+)\s*$")
PERF_UNKNOWN = re.compile(r"\b([0-9a-f]{16}) \[unknown\] \(")


def perf_kernel_rows(report: str) -> list[tuple[str, str]]:
    """(overhead, symbol) of each kernel row of ``perf report --sort sym``."""
    return [(m[1], m[2]) for ln in report.splitlines() if (m := PERF_KERNEL_ROW.match(ln))]


def host_perf(command: str, data: Path, kallsyms: Path, scratch: Path, *args: str) -> str:
    """``perf report`` or ``perf script`` on the host as a user would run it with
    kreld's export: an empty --symfs (or perf takes the host's own brd.ko and
    vmlinux) and a HOME with no build-id cache."""
    perf = shutil.which("perf")
    if perf is None:
        pytest.skip("perf is not installed on the host (Debian package linux-perf)")
    (scratch / "empty").mkdir(parents=True, exist_ok=True)
    (scratch / "home").mkdir(exist_ok=True)
    argv = [perf, command, "-i", str(data), f"--kallsyms={kallsyms}", f"--symfs={scratch}/empty"]
    cp = subprocess.run(
        [*argv, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HOME": str(scratch / "home")},
        check=False,
    )
    assert cp.returncode == 0, cp.stderr
    return cp.stdout


def test_export_for_a_perf_data_reports_as_its_own_boot_did_live(
    first: Boot, second: Boot, state: Path, tmp_path: Path
) -> None:
    """For the perf.data of each boot, ``export kallsyms --for`` (no --boot, on
    the host) gives a ``perf report --sort sym`` equal, row for row, to the one
    the guest made live from its own /proc/kallsyms, brd's functions included;
    brd lay at another base in each boot, and each recording's map says so."""
    from kreld.perf.reader import read_perf_header

    starts = []
    for b in (first, second):
        data = b.facts.dir / "perf-brd.data"
        brd = next(m for m in read_perf_header(data).modules if m.name == "brd")
        assert brd.start == b.facts.module("brd").core_base
        starts.append(brd.start)
        ks = tmp_path / f"kallsyms-{b.facts.boot_id}"
        cp = host_ctl(state, "export", "kallsyms", "--for", str(data), "-o", str(ks), timeout=120)
        assert cp.returncode == 0, cp.stderr
        assert f"boot {b.facts.boot_id}" in cp.stderr
        live = perf_kernel_rows((b.facts.dir / "perf-brd.report").read_text())
        assert any(sym.startswith("brd_") for _, sym in live), live[:20]
        ours = perf_kernel_rows(
            host_perf("report", data, ks, tmp_path / b.facts.boot_id, "--stdio", "--sort", "sym")
        )
        assert ours == live
    assert starts[0] != starts[1], "brd loaded at one base in both boots: nothing was shown"


def test_export_for_a_perf_data_of_another_boot_build_fails_with_exit_3(
    first: Boot, state: Path, tmp_path: Path
) -> None:
    """A recording whose _text no boot had is refused with exit code 3 and the
    nearest boots (same build, another _text) listed."""
    data = (first.facts.dir / "perf-brd.data").read_bytes()
    text = first.facts.anchors["_text"]
    head = 1 << 16  # the kernel map's start and pgoff (_text) are in the synthesized prefix
    moved = data[:head].replace(struct.pack("<Q", text), struct.pack("<Q", text + 0x200000))
    moved += data[head:]
    assert moved != data
    (tmp_path / "moved.data").write_bytes(moved)
    cp = host_ctl(state, "export", "kallsyms", "--for", str(tmp_path / "moved.data"), timeout=60)
    assert cp.returncode == 3, cp.stderr
    assert first.facts.boot_id in cp.stderr and f"{text:x}" in cp.stderr


def test_symbolize_for_names_a_module_loaded_after_perf_record_started(
    second: Boot, state: Path, tmp_path: Path
) -> None:
    """brd, loaded by the workload of a ``perf record -k monotonic`` that had
    already started, has no map in the recording: on the host, ``perf script``
    with the ``export --for`` kallsyms prints its samples as ``[unknown]``.
    ``symbolize --for`` names each as the brd function the guest's own perf
    named from its live /proc/kallsyms, at the same offset, with ``[brd]`` as
    the image, and leaves every other line as it was."""
    from kreld.perf.reader import read_perf_header

    d = second.facts.dir
    data = d / "perf-late.data"
    h = read_perf_header(data)
    assert h.clockid == 1 and h.clock_data is not None  # CLOCK_MONOTONIC
    assert "brd" not in {m.name for m in h.modules}
    base, size = second.facts.module("brd").loaded["brd"]
    ks = tmp_path / "kallsyms"
    cp = host_ctl(state, "export", "kallsyms", "--for", str(data), "-o", str(ks), timeout=120)
    assert cp.returncode == 0, cp.stderr
    script = host_perf("script", data, ks, tmp_path)
    lines = script.splitlines(keepends=True)
    live = (d / "perf-late.script").read_text().splitlines(keepends=True)
    assert len(live) == len(lines)
    in_brd = {
        i
        for i, ln in enumerate(lines)
        if (m := PERF_UNKNOWN.search(ln)) and base <= int(m[1], 16) < base + size
    }
    assert len(in_brd) >= 5, "too few brd samples to show anything"
    cp = subprocess.run(
        [str(CTL), "--state-dir", str(state), "symbolize", "--for", str(data)],
        input=script,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cp.returncode == 0, cp.stderr
    assert "approximate" not in cp.stderr
    out = cp.stdout.splitlines(keepends=True)
    assert len(out) == len(lines)
    for i, (before, after) in enumerate(zip(lines, out, strict=True)):
        if i in in_brd:
            m = re.search(r" (brd_[\w.]+\+0x[0-9a-f]+) \(\[brd\]\)$", after)
            assert m, after
            assert f" {m[1]} (" in live[i], (after, live[i])
        elif "[unknown]" not in before:
            assert after == before


def test_inject_names_in_perf_report_the_samples_of_a_module_loaded_mid_recording(
    second: Boot, state: Path, tmp_path: Path
) -> None:
    """brd, unloaded, then loaded again and kept busy by the workload of a
    per-task ``perf record -k monotonic``: on the host, ``perf report
    --symfs=<empty> --kallsyms=<export --for OUT>`` of ``kreldctl inject``'s OUT
    names as brd functions the samples that IN's report leaves ``[unknown]``;
    sample by sample (``perf script``), OUT names those in brd's init text by
    its init function and agrees with IN on every sample outside brd; and
    ``perf script`` of OUT names each brd sample as the guest's own perf did
    from its live /proc/kallsyms, and prints no warning."""
    from kreld.perf.reader import read_perf_header

    d = second.facts.dir
    data = d / "perf-task.data"
    h = read_perf_header(data)
    assert h.clockid == 1 and "brd" not in {m.name for m in h.modules}
    brd = second.facts.module("brd2")
    base, size = brd.loaded["brd"]
    out = tmp_path / "out.data"
    cp = host_ctl(state, "inject", "-i", str(data), "-o", str(out), timeout=120)
    assert cp.returncode == 0, cp.stderr
    assert "approximate" not in cp.stderr
    ks = tmp_path / "kallsyms"
    cp = host_ctl(state, "export", "kallsyms", "--for", str(out), "-o", str(ks), timeout=120)
    assert cp.returncode == 0, cp.stderr
    rows = {}
    for name, f in (("in", data), ("out", out)):
        text = host_perf("report", f, ks, tmp_path, "--stdio", "--sort", "dso,sym")
        rows[name] = [ln.split() for ln in text.splitlines() if ln.strip() and ln[0] != "#"]
    unknown = [r for r in rows["in"] if r[1] == "[unknown]" and base <= int(r[3], 16) < base + size]
    assert len(unknown) >= 3, rows["in"][:30]
    named = [r for r in rows["out"] if r[1] == "[brd]"]
    assert named and all(r[3].startswith("brd_") for r in named), named
    total = sum(float(r[0].rstrip("%")) for r in unknown)
    assert abs(sum(float(r[0].rstrip("%")) for r in named) - total) < 0.02 * len(unknown) + 0.05
    # Sample by sample (perf script, one ip each): outside brd, OUT says what IN
    # says; in brd's init text while it ran (rare: init is short), OUT names the
    # init function's own symbol (a ksymbol), where IN leaves the address
    # [unknown] or, by the layout of the boot, gives it a neighbour's name.
    init = brd.sections.get(".init.text")
    samples = {}
    for name, f in (("in", data), ("out", out)):
        text = host_perf("script", f, ks, tmp_path, "-F", "ip,sym")
        rows_ = [ln.split(maxsplit=1) for ln in text.splitlines() if ln.strip()]
        samples[name] = [(r[0], r[1] if len(r) > 1 else "") for r in rows_]
    assert len(samples["in"]) == len(samples["out"]) > 0
    in_init = 0
    for (ip, theirs), (ip_out, mine) in zip(samples["in"], samples["out"], strict=True):
        a = int(ip, 16)
        assert ip_out == ip
        if base <= a < base + size:
            assert mine.startswith("brd_"), (ip, mine)
        elif init is not None and init <= a < init + brd.initsize:
            in_init += 1
            assert mine in ("init_module", "brd_init"), (ip, theirs, mine)
        else:
            assert mine == theirs, (ip, theirs, mine)
    print(f"[realkernel] inject: {in_init} samples in brd's init text named", file=sys.stderr)
    script = host_perf("script", out, ks, tmp_path)
    live = (d / "perf-task.script").read_text().splitlines()
    lines = script.splitlines()
    assert len(lines) == len(live)
    in_brd = 0
    for mine, theirs in zip(lines, live, strict=True):
        m = re.search(r" ([0-9a-f]{16}) (brd_[\w.]+\+0x[0-9a-f]+) \(\[brd\]\)$", mine)
        if m and base <= int(m[1], 16) < base + size:
            in_brd += 1
            assert f" {m[2]} (" in theirs, (mine, theirs)
    assert in_brd >= 5
