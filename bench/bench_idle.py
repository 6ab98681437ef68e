"""What kreld costs at rest: the CPU of all its threads, from schedstat.

Two daemons run at once with a sleeping Python, all measured over the same
window once they are ready and settled: ``kreld`` on a fake tree
(``tests/support/faketree.py``) with 100 modules loaded (its sys/module seen
by inotify there), and ``kreld --root /`` (the real root: tracepoints or
uevents, the slow /sys/module poll, the kernel-code rings).  CPU is the run
time of every thread, summed from ``/proc/PID/task/*/schedstat`` (ns); the
wakes are the threads' voluntary context switches, per thread, so that what
still wakes at rest is named.  Baseline: ``python -c 'time.sleep(...)'``
started with them, measured over the same window.
Goal: <= 0.05 % of one core, each daemon.

The window is 10 minutes (``--quick``: 30 s).
Run alone: ``.venv/bin/python bench/bench_idle.py [--quick]``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from common import Kreld, Result, bench_main, load_faketree, log, venv_python

GOAL_PCT = 0.05
MODULES = 100
BASELINE = "an idle `python -c 'import time; time.sleep(...)'` measured over the same window"


def threads(pid: int) -> dict[str, tuple[str, int, int]]:
    """Per thread of *pid*: (name, run time ns, voluntary context switches)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            name = Path(f"{base}/comm").read_text().strip()
            run_ns = int(Path(f"{base}/schedstat").read_text().split()[0])
            status = Path(f"{base}/status").read_text()
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
        wakes = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        out[tid] = (name, run_ns, wakes)
    return out


def delta(
    before: dict[str, tuple[str, int, int]], after: dict[str, tuple[str, int, int]]
) -> dict[str, Any]:
    """Run time and wakes over the window, in all and per thread."""
    per = []
    total = 0
    for tid, (name, run_ns, wakes) in sorted(after.items()):
        _, run0, wakes0 = before.get(tid, (name, 0, 0))
        total += run_ns - run0
        per.append(f"{name}/{tid}: {wakes - wakes0} wakes, {(run_ns - run0) / 1e6:.1f} ms")
    return {"ns": total, "threads": per}


def start_fake(work: Path) -> Kreld:
    ft = load_faketree()
    tree = ft.FakeTree(work / "root")
    for i in range(MODULES):
        tree.add_module(f"bg{i:03d}", 0xFFFFFFFFC0000000 + i * 0x100000)
    args = ["--state-dir", str(work / "state"), "--root", str(work / "root")]
    return Kreld([*args, "--socket", str(work / "kreld.sock")], work / "kreld.log")


def start_real(work: Path) -> Kreld:
    args = ["--state-dir", str(work / "state"), "--root", "/"]
    return Kreld([*args, "--socket", str(work / "kreld.sock")], work / "kreld.log")


def run(quick: bool) -> list[Result]:
    """Idle CPU of kreld (fake tree of 100 modules, real root) against a sleeping Python."""
    window = 30.0 if quick else 600.0
    settle = 5.0 if quick else 20.0
    tmp = Path(tempfile.mkdtemp(prefix="kreld-bench-idle-", dir="/tmp"))
    (tmp / "fake").mkdir()
    (tmp / "real").mkdir()
    daemons = {"fake tree, 100 modules": start_fake(tmp / "fake")}
    daemons["--root /"] = start_real(tmp / "real")
    sleeper = subprocess.Popen(
        [venv_python(), "-c", f"import time; time.sleep({window + settle + 600})"],
        start_new_session=True,
    )
    try:
        for d in daemons.values():
            d.wait_ready()
        time.sleep(settle)
        log(f"idle: {window:.0f} s at rest")
        pids = {k: d.proc.pid for k, d in daemons.items()} | {"sleep": sleeper.pid}
        before = {k: threads(p) for k, p in pids.items()}
        t0 = time.monotonic()
        time.sleep(window)
        after = {k: threads(p) for k, p in pids.items()}
        elapsed = time.monotonic() - t0
    finally:
        sleeper.kill()
        sleeper.wait()
        rcs = {k: d.stop() for k, d in daemons.items()}
        shutil.rmtree(tmp, ignore_errors=True)
    got = {k: delta(before[k], after[k]) for k in pids}
    sleep_pct = got["sleep"]["ns"] / 1e9 / elapsed * 100
    results = []
    for k in daemons:
        pct = got[k]["ns"] / 1e9 / elapsed * 100
        notes = [f"{k}: over {elapsed:.0f} s: " + "; ".join(got[k]["threads"])]
        notes.append(f"sleeping python over the same window: {'; '.join(got['sleep']['threads'])}")
        if rcs[k] != 0:
            notes.append(f"{k}: kreld exited {rcs[k]} on SIGTERM (expected 0)")
        results.append(
            Result(
                f"idle kreld {k}: CPU of all threads, schedstat (% of one core)",
                pct,
                "%",
                sleep_pct,
                "sleep",
                BASELINE,
                f"<= {GOAL_PCT} %",
                pct <= GOAL_PCT,
                notes=notes,
            )
        )
    return results


if __name__ == "__main__":
    raise SystemExit(bench_main("idle", run))
