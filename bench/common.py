"""Shared helpers for kreld's benchmarks: timing, percentiles, results, tables.

Each ``bench/bench_*.py`` is a script: ``run(quick) -> list[Result]`` does the
work, and :func:`bench_main` gives it the command line every bench shares
(``--quick``, ``--json FILE``).  ``bench/run`` runs them all, one subprocess
each, and renders one table.

Every figure is compared with a baseline measured in the same run on the
same machine: the ratio is the result, never an absolute time (the machine
is shared and noisy).  Goals are reported as met or missed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
VENV_BIN = REPO / ".venv" / "bin"

now_ns = time.perf_counter_ns


def venv_python() -> str:
    p = VENV_BIN / "python"
    return str(p) if p.exists() else sys.executable


def venv_tool(name: str) -> str:
    """A console script installed in the checkout's virtualenv (kreld, kreldctl)."""
    p = VENV_BIN / name
    return str(p) if p.exists() else name


def _tests_on_path() -> None:
    """Make the helpers in ``tests/`` (not an installed package) importable."""
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)


def load_faketree() -> ModuleType:
    """``tests/support/faketree.py`` (FakeTree), which is not an installed module."""
    _tests_on_path()
    from support import faketree

    return faketree


def load_harness() -> ModuleType:
    """``tests/support/harness.py``: QEMU boots of the cloud kernel (the VM tests')."""
    _tests_on_path()
    from support import harness

    return harness


def real_kallsyms(tree: Any) -> int:
    """Give *tree* this machine's kallsyms (or one as long, if it is restricted)."""
    real = Path("/proc/kallsyms").read_bytes()
    first = real.split(b" ", 1)[0]
    if first and first.strip(b"0"):
        tree.write("proc/kallsyms", real)
    else:
        tree.grow_kallsyms(real.count(b"\n"))
    return int((tree.root / "proc/kallsyms").read_bytes().count(b"\n"))


_tests_on_path()
from support.kreldproc import KreldProcess  # noqa: E402 (tests/ is on the path only now)


def log(msg: str) -> None:
    """Progress goes to stderr; stdout is for the table."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- timing -----------------------------------------------------------------------


def time_ns(fn: Callable[[], object]) -> int:
    t0 = now_ns()
    fn()
    return now_ns() - t0


def interleaved(
    variants: dict[str, Callable[[], object]], n: int, warmup: int = 1
) -> dict[str, list[int]]:
    """Time each variant *n* times, round-robin, so that drift in the
    machine's load touches all of them alike.  Returns ns samples per variant."""
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    out: dict[str, list[int]] = {k: [] for k in variants}
    for _ in range(n):
        for k, fn in variants.items():
            out[k].append(time_ns(fn))
    return out


def snapshot_store(d: Path) -> Path:
    """A store under *d* holding this machine's boot (``kreldctl snapshot``): what
    the perf.data benches read a recording of this boot against."""
    state = d / "state"
    run_quiet([venv_tool("kreldctl"), "--state-dir", str(state), "snapshot"])
    return state


def record_perf_data(d: Path, min_size: int) -> Path | None:
    """A real recording of this machine (``perf record -g -a`` while dd runs) of
    at least *min_size* bytes, the workload doubled until it is; None where perf
    cannot record (no perf, not root, or perf fails)."""
    perf = shutil.which("perf")
    if perf is None or os.geteuid() != 0:
        return None
    out = d / "big.data"
    count = 3_000_000
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
        if out.stat().st_size >= min_size:
            return out
        count *= 2
    return None


def run_quiet(argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[bytes]:
    """Run a command the way a profiler would (stdout read through a pipe);
    fail loudly if it fails, since a failing command's time means nothing."""
    cp = subprocess.run(list(argv), capture_output=True, **kw)
    if cp.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} exited {cp.returncode}: {cp.stderr.decode(errors='replace')[-2000:]}"
        )
    return cp


def percentile(samples: Iterable[float], p: float) -> float:
    """Nearest-rank percentile: at least *p* % of the samples are <= the result.

    With fewer than 100 samples p99 is the maximum, which is what it should
    be: the tail is not hidden by interpolation.
    """
    xs = sorted(samples)
    if not xs:
        return math.nan
    rank = max(1, math.ceil(p / 100 * len(xs)))
    return xs[min(rank, len(xs)) - 1]


def median(samples: Iterable[float]) -> float:
    return percentile(samples, 50)


# -- results --------------------------------------------------------------------------


@dataclass
class Result:
    """One row of the table.

    *value* and *baseline* are in *unit* ("ns" for durations, "%" for shares
    of a core, "" for plain numbers).  *baseline_tag* names the baseline,
    explained once in *baseline_desc*.  *met* is None when no goal is set.
    """

    figure: str
    value: float
    unit: str
    baseline: float | None = None
    baseline_tag: str = ""
    baseline_desc: str = ""
    goal: str = ""
    met: bool | None = None
    bench: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or not self.baseline or math.isnan(self.value):
            return None
        return self.value / self.baseline

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Result:
        return cls(**d)


def fmt_value(v: float | None, unit: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if unit == "ns":
        for div, u in ((1e9, "s"), (1e6, "ms"), (1e3, "us")):
            if abs(v) >= div:
                x = v / div
                return f"{x:.3g} {u}" if x < 100 else f"{x:.0f} {u}"
        return f"{v:.0f} ns"
    if unit == "%":
        return f"{v:.3f} %"
    return f"{v:.4g}{(' ' + unit) if unit else ''}"


def fmt_ratio(r: float | None, baseline: float | None) -> str:
    if r is None:
        return "n/a (baseline 0)" if baseline == 0 else "-"
    return f"{r:.3g}x" if r < 1000 else f"{r:.0f}x"


def fmt_met(met: bool | None) -> str:
    return "-" if met is None else ("yes" if met else "NO")


HEADERS = ("figure", "value", "baseline", "ratio", "goal", "met?")


def rows(results: Sequence[Result]) -> list[tuple[str, ...]]:
    out = []
    for r in results:
        base = fmt_value(r.baseline, r.unit)
        if r.baseline is not None and r.baseline_tag:
            base += f" [{r.baseline_tag}]"
        out.append(
            (
                r.figure,
                fmt_value(r.value, r.unit),
                base,
                fmt_ratio(r.ratio, r.baseline),
                r.goal or "-",
                fmt_met(r.met),
            )
        )
    return out


def legend(results: Sequence[Result]) -> list[str]:
    seen: dict[str, str] = {}
    for r in results:
        if r.baseline_tag and r.baseline_tag not in seen:
            seen[r.baseline_tag] = r.baseline_desc
    return [f"[{tag}] {desc}" for tag, desc in seen.items()]


def notes(results: Sequence[Result]) -> list[str]:
    out: list[str] = []
    for r in results:
        for n in r.notes:
            if n not in out:
                out.append(n)
    return out


def render_text(results: Sequence[Result]) -> str:
    body = rows(results)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(HEADERS)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEADERS, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for r in body:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    leg = legend(results)
    if leg:
        lines += ["", "Baselines (measured in the same run):", *(f"  {x}" for x in leg)]
    nts = notes(results)
    if nts:
        lines += ["", "Notes:", *(f"  - {x}" for x in nts)]
    return "\n".join(lines)


def render_markdown(results: Sequence[Result]) -> str:
    def cell(s: str) -> str:
        return s.replace("|", "\\|")

    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for r in rows(results):
        lines.append("| " + " | ".join(cell(c) for c in r) + " |")
    leg = legend(results)
    if leg:
        lines += ["", "Baselines, measured in the same run:", ""]
        lines += [f"- {cell(x)}" for x in leg]
    nts = notes(results)
    if nts:
        lines += ["", "Notes:", ""]
        lines += [f"- {x}" for x in nts]
    return "\n".join(lines)


# -- the command line every bench shares ---------------------------------------------


def bench_main(
    name: str, run: Callable[[bool], list[Result]], argv: list[str] | None = None
) -> int:
    p = argparse.ArgumentParser(prog=name, description=(run.__doc__ or "").strip() or None)
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    args = p.parse_args(argv)
    results = run(args.quick)
    for r in results:
        r.bench = r.bench or name
    print(render_text(results))
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_json() for r in results], indent=2) + "\n")
    return 0


def machine_description() -> list[tuple[str, str]]:
    """What the figures were measured on."""
    uname = os.uname()
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    py = subprocess.run(
        [venv_python(), "-c", "import sys; print(sys.version.split()[0])"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        load = ["?"]
    return [
        ("kernel", f"{uname.sysname} {uname.release} ({uname.machine})"),
        ("cpus", f"{os.cpu_count()} (nproc), {cpu}"),
        ("python", f"{py} ({venv_python()})"),
        ("date", time.strftime("%Y-%m-%d %H:%M:%S %Z")),
        ("load average at start", " ".join(load)),
    ]


# -- kreld as a subprocess ----------------------------------------------------------------


def proc_memory(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of process *pid* (bytes)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(rest.split()[0]) * 1024
    return out


class Kreld(KreldProcess):
    """``kreld`` as a real subprocess logging JSON lines to a file, started at once
    (the tests' harness, ``tests/support/kreldproc.py``)."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        super().__init__(args, log_path, venv_tool("kreld"))
        self.start(wait_ready=False)

    def wait_until(
        self, done: Callable[[list[dict[str, Any]]], bool], what: str, timeout: float = 90
    ) -> list[dict[str, Any]]:
        return super().wait_until(done, what, timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        return super().stop(sig, timeout)
