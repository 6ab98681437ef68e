"""What kreld holds in memory once it runs, on this machine's real root.

``kreld --root /`` is started on a new state directory (it captures the
kernel's symbol table, some 122,000 symbols here), stopped, and started
again: the table is then cached.  After it is ready and idle, its memory is
read from ``/proc/PID/status``; then after Resolve calls of 10,000 random
kernel-text addresses (the first loads numpy and orjson, and touches the
table's pages in the LMDB map).  Baselines, measured in the same run: a bare
Python (the same interpreter) importing what the daemon has loaded at each
point (``kreld.daemon``; then also numpy and orjson) and nothing else.
Goal: steady state after the restart, table cached, <= 40 MiB.
The same bound after Resolve calls is a stricter figure of our own: numpy
alone, loaded by the first large Resolve, holds some 11 MiB.  The peak of
the first capture is measured by bench_startup.

Run alone: ``.venv/bin/python bench/bench_memory.py [--quick]``.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Kreld, Result, bench_main, log, proc_memory, venv_python

from kreld.client import Client

GOAL_MIB = 40
MIB = 2**20
BATCH = 10_000
# A bare interpreter that imports *modules*, says so, and waits to be measured.
IMPORTER = "import sys, time\nfor m in sys.argv[1:]: __import__(m)\nprint('ready', flush=True)\n"
IMPORTER += "time.sleep(600)\n"


def bare_python(*modules: str) -> dict[str, int]:
    """The memory of a Python that imported *modules* and nothing else."""
    proc = subprocess.Popen(
        [venv_python(), "-c", IMPORTER, *modules], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"python importing {modules} failed")
        time.sleep(0.5)
        return proc_memory(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def settle(pid: int, seconds: float) -> dict[str, int]:
    """The daemon's memory once it has been idle a while."""
    time.sleep(seconds)
    return proc_memory(pid)


def run(quick: bool) -> list[Result]:
    """kreld's memory after a restart with the kernel table cached, idle and after Resolve."""
    tmp = Path(tempfile.mkdtemp(prefix="kreld-bench-mem-", dir="/tmp"))
    args = ["--root", "/", "--state-dir", str(tmp / "state"), "--socket", str(tmp / "s.sock")]
    calls = 5 if quick else 20
    try:
        first = Kreld(args, tmp / "first.log")
        try:
            first.wait_until(
                lambda ev: any(e.get("event") == "kernel_symbols" for e in ev),
                "kernel_symbols (the first start captures the table)",
            )
            symbols = next(
                e.get("symbols") for e in first.events() if e.get("event") == "kernel_symbols"
            )
            captured = proc_memory(first.proc.pid)
        finally:
            rc1 = first.stop()
        log(f"memory: first start captured {symbols} kernel symbols; restarting")
        again = Kreld(args, tmp / "again.log")
        try:
            again.wait_ready()
            idle = settle(again.proc.pid, 3 if quick else 5)
            with Client(str(tmp / "s.sock"), timeout=120) as c:
                anchors = c.call("GetBoot")["boot"]["anchors"]
                text, etext = int(anchors["text"], 16), int(anchors["etext"], 16)
                rng = random.Random(13)
                named = 0
                for _ in range(calls):
                    batch = [hex(text + rng.randrange(etext - text)) for _ in range(BATCH)]
                    reply = c.call("Resolve", addresses=batch)
                    named += sum(1 for s in reply["symbol"] if s >= 0)
            steady = settle(again.proc.pid, 2)
        finally:
            rc2 = again.stop()
        base_idle = bare_python("kreld.daemon")
        base_steady = bare_python("kreld.daemon", "numpy", "orjson")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    tag_i, desc_i = "imports", "a bare python importing kreld.daemon (what kreld imports at start)"
    tag_s, desc_s = (
        "imports+numpy",
        "a bare python importing kreld.daemon, numpy and orjson (what kreld has loaded "
        "once it has answered a Resolve)",
    )
    res = [
        Result("kreld VmRSS after a restart, kernel table cached, idle (MiB)",
               idle["VmRSS"] / MIB, "", base_idle["VmRSS"] / MIB, tag_i, desc_i,
               f"<= {GOAL_MIB} MiB", idle["VmRSS"] <= GOAL_MIB * MIB),
        Result(f"kreld VmRSS after a restart, then {calls} Resolve of 10,000 addresses (MiB)",
               steady["VmRSS"] / MIB, "", base_steady["VmRSS"] / MIB, tag_s, desc_s,
               f"<= {GOAL_MIB} MiB (ours, stricter)", steady["VmRSS"] <= GOAL_MIB * MIB),
        Result("  of which RssAnon (heap) (MiB)", steady["RssAnon"] / MIB, "",
               base_steady["RssAnon"] / MIB, tag_s),
        Result("  of which RssFile (code, LMDB map pages) (MiB)", steady["RssFile"] / MIB, "",
               base_steady["RssFile"] / MIB, tag_s),
    ]  # fmt: skip
    res[0].notes.append(
        f"memory (MiB; VmRSS/VmHWM/RssAnon/RssFile): first start once the table of {symbols} "
        f"kernel symbols was captured {_fmt(captured)}; after the restart, idle {_fmt(idle)}; "
        f"after {calls} Resolve calls {_fmt(steady)} ({named} of {calls * BATCH} addresses "
        f"named); bare python importing kreld.daemon {_fmt(base_idle)}, and numpy, orjson "
        f"{_fmt(base_steady)}; daemon exits {rc1}, {rc2}"
    )
    for r in res:
        r.bench = "memory"
    return res


def _fmt(st: dict[str, int]) -> str:
    return "/".join(f"{st[k] / MIB:.1f}" for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"))


if __name__ == "__main__":
    sys.exit(bench_main("memory", run))
