"""What kreld holds in memory once it runs, on this machine's real root.

``kreld --root /`` is started on a new state directory (it captures the
kernel's symbol table, some 122,000 symbols here), stopped, and started
again: the table is then cached.  After it is ready and idle, its memory is
read from ``/proc/PID/status``; then after Resolve calls of 10,000 random
kernel-text addresses (the first loads orjson and Resolve's modules, and
reads the table's pages in the LMDB map): at once after the last call, and
again once the daemon has been quiet past ``TRIM_QUIET`` (it then gives freed
heap back, and drops the map's pages from its resident set:
kreld.server.heapback.QuietTrim).  Baselines, measured in the same run: a
bare Python (the same interpreter) importing what the daemon has loaded at
each point (``kreld.daemon``; then also orjson and Resolve's modules) and
nothing else.

Goals: steady state after the restart, table cached, <= 40 MiB;
the same bound after 20 Resolve calls.  Resolve names a batch with the
standard library (kreld.symbols.batch): numpy, whose import alone costs
some 17 MiB here, is never loaded for it.  Two more figures say what the
trim and that choice cost:

* Resolve's time after a pause past ``TRIM_QUIET`` (the heap given back
  before the call, its pages faulted in again) against after a pause a second
  short of it, interleaved: what the trim costs a call that follows it, in
  time and in kreld's minor page faults during the call (steadier than the
  time on a shared machine).
* naming the same 10,000 addresses in the daemon's cached kernel table with
  the standard library (the page index of a batch:
  kreld.symbols.batch.SectionKeys) against numpy (``searchsorted``, what
  Resolve of many addresses did before): what leaving numpy out of the daemon
  costs the search.

The peak of the first capture is measured by bench_startup.

Run alone: ``.venv/bin/python bench/bench_memory.py [--quick]``.
"""

from __future__ import annotations

import bisect
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import Kreld, Result, bench_main, log, median, now_ns, proc_memory, venv_python

from kreld.client import Client
from kreld.core.symtab import KEY_SPAN
from kreld.server.heapback import TRIM_QUIET
from kreld.store import Store
from kreld.symbols.batch import section_keys

GOAL_MIB = 40
# What the daemon imports to answer a Resolve, beyond what it starts with.
RESOLVE_MODULES = ("orjson", "kreld.symbols.queries")
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


def capture_first(args: list[str], log_path: Path) -> tuple[int, dict[str, int], int]:
    """A first start on the state dir: the kernel table captured and stored."""
    first = Kreld(args, log_path)
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
        rc = first.stop()
    return int(symbols or 0), captured, rc


def resolve_calls(sock: Path, pid: int, calls: int, pauses: int) -> dict[str, Any]:
    """*calls* Resolve of 10,000 random kernel-text addresses back to back,
    memory at once and once quiet; then *pauses* calls each after a pause a
    second short of ``TRIM_QUIET`` (no trim) and as many after a pause half a
    second past it (the heap given back before each), interleaved."""
    out: dict[str, Any] = {"back": [], "kept": [], "trimmed": [], "faults": {}}
    with Client(str(sock), timeout=120) as c:
        boot = c.call("GetBoot")["boot"]
        text, etext = int(boot["anchors"]["text"], 16), int(boot["anchors"]["etext"], 16)
        rng = random.Random(13)

        def timed(into: str, pause: float) -> dict[str, Any]:
            b = [hex(text + rng.randrange(etext - text)) for _ in range(BATCH)]
            time.sleep(pause)
            f0, t0 = minor_faults(pid), now_ns()
            reply: dict[str, Any] = c.call("Resolve", addresses=b)
            out[into].append(now_ns() - t0)
            out["faults"].setdefault(into, []).append(minor_faults(pid) - f0)
            return reply

        named = 0
        for _ in range(calls):
            named += sum(1 for s in timed("back", 0)["symbol"] if s >= 0)
        out["burst"] = proc_memory(pid)
        out["steady"] = settle(pid, TRIM_QUIET + 1)
        for _ in range(pauses):
            timed("kept", TRIM_QUIET - 1)
            timed("trimmed", TRIM_QUIET + 0.5)
    out.update(named=named, boot_id=boot["boot_id"], text=text, etext=etext)
    return out


def minor_faults(pid: int) -> int:
    """The minor page faults of process *pid* so far (all its threads)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[7])


def search_rates(state: Path, boot_id: str, text: int, etext: int, rounds: int) -> dict[str, Any]:
    """Naming 10,000 random kernel-text addresses in the cached kernel table:
    kreld's page index (the standard library) against numpy's searchsorted,
    interleaved, both on sorted keys and giving the same entries."""
    import numpy as np

    store = Store(state, readonly=True)
    try:
        rec = store.boot_symbols(boot_id)
        if rec is None:
            raise RuntimeError("the daemon did not cache the kernel table")
        key = rec.kernel
        rng = random.Random(29)

        def run(tables: Any) -> dict[str, Any]:
            keys = tables[key].keys
            section = keys[: bisect.bisect_left(keys, 1 << 40)]  # section 0: relocated
            paged = section_keys(key, 0, section, many=True)
            times: dict[str, list[int]] = {"stdlib": [], "numpy": []}
            for _ in range(rounds):
                want = [rng.randrange(etext - text) + KEY_SPAN for _ in range(BATCH)]
                t0 = now_ns()
                got = paged.search(sorted(w - paged.first for w in want))
                t1 = now_ns()
                a = np.sort(np.asarray(want, dtype=np.int64))
                j = np.searchsorted(np.asarray(keys), a, side="right") - 1
                t2 = now_ns()
                if got != j.tolist():
                    raise RuntimeError("the page index and searchsorted disagree")
                times["stdlib"].append(t1 - t0)
                times["numpy"].append(t2 - t1)
            return {"times": times, "keys": len(keys)}

        return store.with_tables([key], run)
    finally:
        store.close()


def run(quick: bool) -> list[Result]:
    """kreld's memory after a restart with the kernel table cached, idle and after Resolve."""
    tmp = Path(tempfile.mkdtemp(prefix="kreld-bench-mem-", dir="/tmp"))
    args = ["--root", "/", "--state-dir", str(tmp / "state"), "--socket", str(tmp / "s.sock")]
    calls, pauses = (5, 2) if quick else (20, 8)
    try:
        symbols, captured, rc1 = capture_first(args, tmp / "first.log")
        log(f"memory: first start captured {symbols} kernel symbols; restarting")
        again = Kreld(args, tmp / "again.log")
        try:
            again.wait_ready()
            idle = settle(again.proc.pid, 3 if quick else 5)
            got = resolve_calls(tmp / "s.sock", again.proc.pid, calls, pauses)
        finally:
            rc2 = again.stop()
        search = search_rates(
            tmp / "state", got["boot_id"], got["text"], got["etext"], 10 if quick else 30
        )
        base_idle = bare_python("kreld.daemon")
        base_steady = bare_python("kreld.daemon", *RESOLVE_MODULES)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = results(calls, idle, got, search, base_idle, base_steady)
    res[0].notes.append(
        f"memory (MiB; VmRSS/VmHWM/RssAnon/RssFile): first start once the table of {symbols} "
        f"kernel symbols was captured {_fmt(captured)}; after the restart, idle {_fmt(idle)}; "
        f"after {calls} Resolve calls, at once {_fmt(got['burst'])}, quiet "
        f"{_fmt(got['steady'])} ({got['named']} of {calls * BATCH} addresses named); bare "
        f"python importing kreld.daemon {_fmt(base_idle)}, and {', '.join(RESOLVE_MODULES)} "
        f"{_fmt(base_steady)}; daemon exits {rc1}, {rc2}; Resolve after a pause: "
        f"{len(got['kept'])} calls each way, minor faults of back-to-back calls p50 "
        f"{median(got['faults']['back']):.0f}; kernel table of {search['keys']} keys searched "
        f"{len(search['times']['numpy'])} times each way"
    )
    for r in res:
        r.bench = "memory"
    return res


def results(
    calls: int,
    idle: dict[str, int],
    got: dict[str, Any],
    search: dict[str, Any],
    base_idle: dict[str, int],
    base_steady: dict[str, int],
) -> list[Result]:
    steady, burst = got["steady"], got["burst"]
    tag_i, desc_i = "imports", "a bare python importing kreld.daemon (what kreld imports at start)"
    tag_s, desc_s = (
        "imports+resolve",
        f"a bare python importing kreld.daemon and {', '.join(RESOLVE_MODULES)} (what "
        "kreld has loaded once it has answered a Resolve)",
    )
    kept, trimmed = median(got["kept"]), median(got["trimmed"])
    std, npy = median(search["times"]["stdlib"]), median(search["times"]["numpy"])
    return [
        Result("kreld VmRSS after a restart, kernel table cached, idle (MiB)",
               idle["VmRSS"] / MIB, "", base_idle["VmRSS"] / MIB, tag_i, desc_i,
               f"<= {GOAL_MIB} MiB", idle["VmRSS"] <= GOAL_MIB * MIB),
        Result(f"kreld VmRSS after a restart, then {calls} Resolve of 10,000 addresses, "
               "quiet (MiB)",
               steady["VmRSS"] / MIB, "", base_steady["VmRSS"] / MIB, tag_s, desc_s,
               f"<= {GOAL_MIB} MiB", steady["VmRSS"] <= GOAL_MIB * MIB),
        Result("  of which RssAnon (heap) (MiB)", steady["RssAnon"] / MIB, "",
               base_steady["RssAnon"] / MIB, tag_s),
        Result("  of which RssFile (code, LMDB map pages) (MiB)", steady["RssFile"] / MIB, "",
               base_steady["RssFile"] / MIB, tag_s),
        Result("  RssAnon once quiet, against at once after the calls (MiB)",
               steady["RssAnon"] / MIB, "", burst["RssAnon"] / MIB, "burst",
               f"the same daemon's RssAnon read at once after its last call (before "
               f"{TRIM_QUIET:g} s quiet gave the heap back)"),
        Result(f"Resolve of 10,000 addresses after {TRIM_QUIET + 0.5:g} s quiet (heap given "
               "back before it), p50", trimmed, "ns", kept, "no-trim",
               f"the same daemon's Resolve of 10,000 addresses after {TRIM_QUIET - 1:g} s quiet "
               "(no trim before it), interleaved"),
        Result("Resolve of 10,000 addresses back to back, p50", median(got["back"]), "ns",
               kept, "no-trim"),
        Result(f"  minor page faults of kreld during that call after {TRIM_QUIET + 0.5:g} s "
               "quiet, p50", median(got["faults"]["trimmed"]), "",
               median(got["faults"]["kept"]), "no-trim",
               ),
        Result("naming 10,000 addresses in the kernel table, kreld's page index (stdlib), p50",
               std, "ns", npy, "searchsorted",
               "the same addresses, sorted, in the same keys of the daemon's cached kernel "
               "table with numpy.searchsorted (what Resolve of many addresses did before)"),
    ]  # fmt: skip


def _fmt(st: dict[str, int]) -> str:
    return "/".join(f"{st[k] / MIB:.1f}" for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"))


if __name__ == "__main__":
    sys.exit(bench_main("memory", run))
