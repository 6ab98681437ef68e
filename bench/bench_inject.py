"""Issue 23: ``kreldctl inject -i BIG -o OUT`` on a recording of 100 MB or more,
against ``perf inject -i BIG -o OUT`` (perf's own rewrite with nothing to add)
and a plain copy (``cp``) of the same file.

The recording is real (``perf record -e cpu-clock -g -a`` while dd runs, as in
bench_perfdata.py); the store holds this boot (``kreldctl snapshot``), so
inject matches it.  This machine has no loadable modules, so inject adds no
record here: the figure is what every run pays, indexing each record's time
and copying the file (the added records are a few hundred bytes).

Figures (medians over interleaved runs, the file in the page cache, each a
subprocess writing OUT beside BIG):

* ``kreldctl inject`` against ``perf inject`` (goal: within 2x);
* ``kreldctl inject`` against ``cp``.

Run alone: ``.venv/bin/python bench/bench_inject.py [--quick]``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench_perfdata import MIN_SIZE
from common import Result, bench_main, interleaved, log, median, run_quiet, venv_tool


def record_big(perf: str, d: Path) -> Path | None:
    """``perf record -g -a`` while dd runs, the workload doubled until the file
    passes MIN_SIZE (or None where perf cannot record)."""
    out = d / "big.data"
    count = 6_000_000
    for _ in range(5):
        rec = [perf, "record", "-q", "-N", "-e", "cpu-clock", "-c", "20000", "-g", "-a"]
        work = ["dd", "if=/dev/zero", "of=/dev/null", "bs=512", f"count={count}"]
        cp = subprocess.run(
            [*rec, "-o", str(out), "--", *work],
            capture_output=True,
            env={**os.environ, "HOME": str(d)},
            timeout=900,
            check=False,
        )
        if cp.returncode != 0:
            log(f"perf record failed: {cp.stderr.decode(errors='replace')[-300:]}")
            return None
        if out.stat().st_size >= MIN_SIZE:
            return out
        count *= 2
    return None


def run(quick: bool) -> list[Result]:
    """kreldctl inject on a 100 MB perf.data against perf inject and cp."""
    n = 3 if quick else 7
    perf = shutil.which("perf")
    d = Path(tempfile.mkdtemp(prefix="kreld-bench-inject-"))
    try:
        state = d / "state"
        ctl = venv_tool("kreldctl")
        run_quiet([ctl, "--state-dir", str(state), "snapshot"])
        log("recording a perf.data of 100 MB or more")
        big = record_big(perf, d) if perf is not None and os.geteuid() == 0 else None
        if big is None or perf is None:
            raise RuntimeError("perf cannot record here (needs root and linux-perf)")
        size = big.stat().st_size
        out = str(d / "out.data")
        inject = [ctl, "--state-dir", str(state), "inject", "-i", str(big), "-o", out]
        runs = interleaved(
            {
                "kreld": lambda: run_quiet(inject),
                "perf": lambda: run_quiet([perf, "inject", "-i", str(big), "-o", out]),
                "cp": lambda: run_quiet(["cp", str(big), out]),
            },
            n,
        )
    finally:
        shutil.rmtree(d, ignore_errors=True)
    mib = f"{size / 2**20:.0f} MiB"
    notes = [
        f"issue 23: the perf.data is {mib} (perf record -g -a); {n} runs per figure, "
        "interleaved. Goal: kreldctl inject within 2x of perf inject of the same file."
    ]
    kreld, perf_t, cp = median(runs["kreld"]), median(runs["perf"]), median(runs["cp"])
    return [
        Result(
            f"kreldctl inject of a {mib} perf.data (subprocess) p50",
            kreld,
            "ns",
            perf_t,
            "perf-inject",
            "perf inject -i IN -o OUT of the same file (nothing to add), subprocess",
            goal="< 2x",
            met=kreld < 2 * perf_t,
            notes=notes,
        ),
        Result(
            "kreldctl inject, against a plain copy, p50",
            kreld,
            "ns",
            cp,
            "cp",
            "cp IN OUT, page-cached, subprocess",
        ),
    ]


if __name__ == "__main__":
    raise SystemExit(bench_main("bench_inject", run))
