"""What starting costs, in time and in memory.

* ``kreldctl show --json`` (the store read directly) and ``kreldctl --help``,
  as real subprocesses, against ``python -c pass`` on the same interpreter
  (the floor of any Python CLI).  Goal: show <= 2.5x.
* ``python -c 'import kreld.daemon'`` (a subprocess, wall time, like a start
  pays it) and the import alone timed inside the interpreter.  Goal: <= 150 ms.
* startup to ``READY=1`` (received on a ``NOTIFY_SOCKET`` the bench holds,
  from spawn) on an empty store, on a fake tree whose kallsyms is a copy of
  this machine's (~120,000 lines).  Goal: <= 250 ms.
* the memory peak (VmHWM) of ``kreld --root /`` on an empty state directory,
  through the capture of the kernel's symbol table (the first start of a
  boot), against a bare interpreter that imports the same libraries.  Goal:
  <= 80 MiB.

Run alone: ``.venv/bin/python bench/bench_startup.py [--quick]``.
"""

from __future__ import annotations

import compileall
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench_scale import Notify, spawn_ns, start_daemon
from common import (
    REPO,
    Kreld,
    Result,
    bench_main,
    interleaved,
    load_faketree,
    log,
    percentile,
    real_kallsyms,
    run_quiet,
    venv_python,
    venv_tool,
)

# What the kreld entry point imports, in a process it made lean first.
LEAN_DAEMON_IMPORT = "import kreld.programs as p; p.lean_process(); import kreld.daemon"

SHOW_GOAL = 2.5
IMPORT_GOAL_NS = 150e6
READY_GOAL_NS = 250e6
PEAK_GOAL = 80 * 2**20
# What the daemon imports, for the memory baseline.
LIBRARIES = "import asyncio, json, lmdb, structlog, systemd.daemon, watchdog.observers"
# What the daemon cannot start without (its server is asyncio's; structlog,
# systemd-python and lmdb are DESIGN.md's), with ssl kept out of asyncio as the
# daemon's entry point keeps it (kreld.programs.lean_process): the floor under
# `import kreld.daemon`.
DAEMON_FLOOR = (
    "import kreld.programs as p; p.lean_process(); import asyncio, lmdb, structlog, systemd.daemon"
)
IMPORT_ALONE = (
    "import time; t = time.perf_counter_ns(); import kreld.programs as p; p.lean_process(); "
    "import kreld.daemon; "
    "print(time.perf_counter_ns() - t)"
)
PY_TAG, PY_DESC = "py-start", "`python -c pass` with the same venv interpreter"


def status_kib(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def library_peak() -> int:
    """VmHWM of a bare interpreter once it imported what kreld imports."""
    code = f"{LIBRARIES}\nprint(open('/proc/self/status').read())"
    text = run_quiet([venv_python(), "-c", code]).stdout.decode()
    line = next(x for x in text.splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def first_capture_peak(tmp: Path) -> dict[str, int]:
    """kreld --root / on an empty store, until the kernel's table is stored."""
    cfg = tmp / "mem.toml"
    cfg.write_text("")
    args = ["--config", str(cfg), "--state-dir", str(tmp / "mem-state"), "--root", "/"]
    d = Kreld([*args, "--socket", str(tmp / "mem.sock")], tmp / "mem.log")
    try:
        d.wait_until(
            lambda evs: any(e.get("event") in ("kernel_symbols", "kernel_symbols_unavailable")
                            for e in evs),
            "kernel_symbols",
        )  # fmt: skip
        time.sleep(0.3)
        out = status_kib(d.proc.pid)
        ev = next(e for e in d.events() if str(e.get("event", "")).startswith("kernel_symbols"))
        out["symbols"] = int(ev.get("symbols") or 0)
    finally:
        d.stop()
    return out


def real_sized_tree(tmp: Path) -> tuple[Path, int]:
    """A fake tree whose kallsyms is this machine's (or as long, if unreadable)."""
    tree = load_faketree().FakeTree(tmp / "root")
    return tree.root, real_kallsyms(tree)


def run(quick: bool) -> list[Result]:
    """kreldctl and daemon start times, and the first capture's memory peak."""
    tmp = Path(tempfile.mkdtemp(prefix="kreld-bench-start-", dir="/dev/shm"))
    try:
        return _run(tmp, 7 if quick else 21)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(tmp: Path, n: int) -> list[Result]:
    results: list[Result] = []
    notes: list[str] = []
    # As installed: pip compiles a package's bytecode; a checkout run with
    # PYTHONDONTWRITEBYTECODE would compile every edited module at each start.
    compileall.compile_dir(str(REPO / "kreld"), quiet=1)
    py = venv_python()
    cfg = tmp / "kreld.toml"
    cfg.write_text("")
    state = tmp / "state"
    common = ["--config", str(cfg), "--state-dir", str(state), "--root", "/"]
    kreldctl = venv_tool("kreldctl")
    run_quiet([kreldctl, *common, "snapshot", "--json"])

    log(f"startup: {n} x kreldctl show --json, --help, import kreld.daemon, its floor, pass")
    sub = interleaved(
        {
            "pass": lambda: spawn_ns([py, "-c", "pass"]),
            "show": lambda: spawn_ns([kreldctl, *common, "show", "--json"]),
            "help": lambda: spawn_ns([kreldctl, "--help"]),
            "import": lambda: spawn_ns([py, "-c", LEAN_DAEMON_IMPORT]),
            "floor": lambda: spawn_ns([py, "-c", DAEMON_FLOOR]),
        },
        n,
    )
    alone = [int(run_quiet([py, "-c", IMPORT_ALONE]).stdout) for _ in range(n)]

    root, lines = real_sized_tree(tmp)
    log(f"startup: {n} x kreld to READY=1 on an empty store ({lines} kallsyms lines)")
    notify = Notify(tmp / "notify.sock")
    ready: list[int] = []
    try:
        for i in range(n):
            d = start_daemon(root, tmp / f"empty{i}", tmp / "s.sock", cfg, notify, tmp / "d.log")
            ready.append(d.startup_ns)
            if d.stop() != 0:
                raise RuntimeError(f"kreld exited non-zero: {(tmp / 'd.log').read_text()}")
            shutil.rmtree(tmp / f"empty{i}", ignore_errors=True)
    finally:
        notify.close()

    log("startup: memory of the first capture on the real root")
    base_peak = library_peak()
    mem = first_capture_peak(tmp)

    p50 = {k: percentile(v, 50) for k, v in sub.items()}
    results.append(
        Result(
            "kreldctl show --json (store, subprocess) p50",
            p50["show"],
            "ns",
            p50["pass"],
            PY_TAG,
            PY_DESC,
            f"<= {SHOW_GOAL}x",
            p50["show"] <= SHOW_GOAL * p50["pass"],
        )
    )
    results.append(Result("kreldctl --help p50", p50["help"], "ns", p50["pass"], PY_TAG, PY_DESC))
    results.append(
        Result(
            "python -c 'import kreld.daemon' p50",
            p50["import"],
            "ns",
            p50["pass"],
            PY_TAG,
            PY_DESC,
            "<= 150 ms",
            p50["import"] <= IMPORT_GOAL_NS,
        )
    )
    results.append(
        Result(
            "  its floor: python -c 'import asyncio, lmdb, structlog, systemd.daemon' p50",
            p50["floor"],
            "ns",
            p50["pass"],
            PY_TAG,
            PY_DESC,
        )
    )
    results.append(
        Result(
            "  of which the import alone (in-process) p50",
            percentile(alone, 50),
            "ns",
            p50["pass"],
            PY_TAG,
            PY_DESC,
            "<= 150 ms",
            percentile(alone, 50) <= IMPORT_GOAL_NS,
        )
    )
    for label, p in (("p50", 50.0), ("max", 100.0)):
        r = Result(
            f"kreld spawn -> READY=1, empty store, {lines} kallsyms lines, {label}",
            percentile(ready, p),
            "ns",
            p50["pass"],
            PY_TAG,
            PY_DESC,
        )
        if label == "p50":
            r.goal, r.met = "<= 250 ms", r.value <= READY_GOAL_NS
        results.append(r)
    results.append(
        Result(
            f"VmHWM of kreld --root / through its first capture ({mem['symbols']} symbols), MiB",
            mem["VmHWM"] / 2**20,
            "",
            base_peak / 2**20,
            "libs",
            f"VmHWM of `python -c '{LIBRARIES}'`",
            "<= 80 MiB",
            mem["VmHWM"] <= PEAK_GOAL,
        )
    )
    notes.append(
        f"startup: {n} runs per figure, interleaved; all samples (ms): "
        + "; ".join(
            f"{k} " + " ".join(f"{x / 1e6:.0f}" for x in v)
            for k, v in (*sub.items(), ("alone", alone), ("ready", ready))
        )
    )
    notes.append(
        f"first capture on /: after the table was stored VmRSS {mem['VmRSS'] / 2**20:.1f} MiB, "
        f"RssAnon {mem['RssAnon'] / 2**20:.1f} MiB; load average "
        + " ".join(Path("/proc/loadavg").read_text().split()[:3])
        + f" on {os.cpu_count()} cpus"
    )
    for r in results:
        r.bench = "startup"
    results[0].notes = notes
    return results


if __name__ == "__main__":
    sys.exit(bench_main("startup", run))
