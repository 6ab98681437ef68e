"""What a boot snapshot and ``kreldctl show --json`` cost, against a
profiler's plain full parse of ``/proc/kallsyms`` (the work kreld saves it).

Figures (medians and p99 over repeated runs, variants interleaved):

* ``kreldctl show --json`` for the current boot, as a real subprocess,
  against a store where ``kreldctl snapshot`` recorded this boot; compared
  with a subprocess of the same interpreter doing the plain parse (like for
  like: both pay for starting Python).
* the plain parse in-process (read, split every line into address, type and
  name, address as an int): the floor of a profiler's own work.
* the snapshot's own cost in-process: ``take_snapshot`` + ``record_boot``
  into a fresh store (a new boot record, synced), against the in-process parse.

Run alone: ``.venv/bin/python bench/bench_snapshot.py [--quick]``.
"""

from __future__ import annotations

import inspect
import json
import shutil
import sys
import tempfile
from pathlib import Path

from common import (
    Result,
    bench_main,
    interleaved,
    log,
    median,
    now_ns,
    percentile,
    run_quiet,
    venv_python,
    venv_tool,
)

from kreld.kernel.info import Root
from kreld.kernel.snapshot import take_snapshot
from kreld.store import Store

KALLSYMS = "/proc/kallsyms"


def parse_kallsyms(path: str) -> list[tuple[int, str, str]]:
    """The profiler's own work, as plain as Python gets (this same source also
    runs in a subprocess)."""
    syms = []
    with open(path) as f:
        for line in f.read().splitlines():
            addr, kind, name = line.split(maxsplit=2)
            syms.append((int(addr, 16), kind, name))
    return syms


def _text_of(syms: list[tuple[int, str, str]]) -> int | None:
    for addr, _kind, name in syms:
        if name == "_text":
            return addr
    return None


def run(quick: bool) -> list[Result]:
    """Boot snapshot and kreldctl show --json vs a plain /proc/kallsyms parse."""
    n = 8 if quick else 30
    tmp = Path(tempfile.mkdtemp(prefix="kreld-bench-snap-"))
    try:
        return _run(tmp, n)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(tmp: Path, n: int) -> list[Result]:
    results: list[Result] = []
    out_notes: list[str] = []
    cfg = tmp / "kreld.toml"
    cfg.write_text("")  # defaults, whatever /etc/kreld holds
    state = tmp / "state"
    common = ["--config", str(cfg), "--state-dir", str(state), "--root", "/"]
    kreldctl = venv_tool("kreldctl")

    syms = parse_kallsyms(KALLSYMS)
    out_notes.append(f"/proc/kallsyms here: {len(syms)} symbols")

    # A store where the current boot was recorded, as a user would do it.
    run_quiet([kreldctl, *common, "snapshot", "--json"])
    shown = json.loads(run_quiet([kreldctl, *common, "show", "--json"]).stdout)
    parsed_text = _text_of(syms)
    shown_text = shown["anchors"]["text"]
    if parsed_text and shown_text != f"{parsed_text:#x}":
        out_notes.append(
            f"MISMATCH: kreldctl show says _text={shown_text}, the plain parse {parsed_text:#x}"
        )
    if shown.get("restricted"):
        out_notes.append("kallsyms was restricted (zeros) for this run: not run as root?")

    # -- subprocesses: kreldctl show --json vs the same parse in a subprocess --------
    log(f"snapshot: {n} x kreldctl show --json, subprocess parse (interleaved)")
    py = venv_python()
    src = inspect.getsource(parse_kallsyms)
    parse_cmd = [py, "-c", f"{src}\nprint(len(parse_kallsyms({KALLSYMS!r})))\n"]
    sub = interleaved(
        {
            "show": lambda: run_quiet([kreldctl, *common, "show", "--json"]),
            "parse": lambda: run_quiet(parse_cmd),
        },
        n,
    )

    # -- in-process: the snapshot vs the plain parse -------------------------------
    log(f"snapshot: {n} x take_snapshot+record_boot (fresh store each), in-process parse")
    root = Root(Path("/"))
    take: list[int] = []
    record: list[int] = []
    total: list[int] = []
    inproc: list[int] = []
    rawread: list[int] = []
    parse_kallsyms(KALLSYMS)
    take_snapshot(root)  # warm caches and lazy imports alike
    for i in range(n):
        t0 = now_ns()
        parse_kallsyms(KALLSYMS)
        inproc.append(now_ns() - t0)
        t0 = now_ns()
        with open(KALLSYMS, "rb") as f:
            f.read()
        rawread.append(now_ns() - t0)
        with Store(tmp / f"s{i}") as store:
            t0 = now_ns()
            snap, _notes = take_snapshot(root)
            t1 = now_ns()
            _stored, added, _changed = store.boots.record_boot(snap)
            t2 = now_ns()
        if not added:
            raise RuntimeError("a fresh store did not record the boot as new")
        take.append(t1 - t0)
        record.append(t2 - t1)
        total.append(t2 - t0)
        shutil.rmtree(tmp / f"s{i}", ignore_errors=True)

    sub_tag, sub_desc = (
        "parse-subproc",
        "`python -c` (same venv interpreter) doing the plain full parse of /proc/kallsyms "
        "(read, split every line into address/type/name, int(address))",
    )
    in_tag, in_desc = "parse", "the same plain full parse of /proc/kallsyms, in-process"
    for label, p in (("p50", 50.0), ("p99", 99.0)):
        results.append(
            Result(
                f"kreldctl show --json (subprocess) {label}",
                percentile(sub["show"], p),
                "ns",
                percentile(sub["parse"], p),
                sub_tag,
                sub_desc,
            )
        )
    for label, p in (("p50", 50.0), ("p99", 99.0)):
        results.append(
            Result(
                f"parse in a subprocess {label} (baseline's own cost)",
                percentile(sub["parse"], p),
                "ns",
                percentile(inproc, p),
                in_tag,
                in_desc,
            )
        )
    for label, p in (("p50", 50.0), ("p99", 99.0)):
        results.append(
            Result(
                f"snapshot: take_snapshot+record_boot {label}",
                percentile(total, p),
                "ns",
                percentile(inproc, p),
                in_tag,
                in_desc,
            )
        )
    results.append(
        Result(
            "  of which take_snapshot p50",
            median(take),
            "ns",
            median(inproc),
            in_tag,
            in_desc,
        )
    )
    results.append(
        Result(
            "  of which record_boot (new boot, synced) p50",
            median(record),
            "ns",
            median(inproc),
            in_tag,
            in_desc,
        )
    )
    results.append(
        Result(
            "  read of /proc/kallsyms alone (kernel's share) p50",
            median(rawread),
            "ns",
            median(inproc),
            in_tag,
            in_desc,
        )
    )
    out_notes.append(
        f"snapshot: {n} runs per figure, variants interleaved; p99 of fewer than 100 runs "
        "is their maximum. No goal is set for these figures."
    )
    for r in results:
        r.bench = "snapshot"
    results[0].notes = out_notes
    return results


if __name__ == "__main__":
    sys.exit(bench_main("snapshot", run))
