"""``kreldctl inject -i BIG -o OUT`` on a recording of 100 MB or more,
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

Peak memory (``ru_maxrss`` of the child, from ``wait4``) of ``kreldctl inject`` on
written recordings of 80 MB and 800 MB of small records (40-byte samples, made in
a temporary directory against a fake tree kreld took a snapshot of, so inject
matches a boot and writes its output; deleted after), against a Python process
that only reads the same file in 1 MiB chunks (goal: the same for both sizes, at
most 128 MiB).  This part needs no perf.

Run alone: ``.venv/bin/python bench/bench_inject.py [--quick]``.
"""

from __future__ import annotations

import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_perfdata import MIN_SIZE
from common import (
    Result,
    bench_main,
    interleaved,
    load_faketree,
    log,
    median,
    record_perf_data,
    run_quiet,
    snapshot_store,
    venv_tool,
)

MIB = 1 << 20
MEMORY_SIZES = (80 * 1000 * 1000, 800 * 1000 * 1000)  # the 80 MB and 800 MB
READ_IN_CHUNKS = "import sys\nwith open(sys.argv[1], 'rb') as f:\n    while f.read(1 << 20): pass\n"


def peak_rss(argv: list[str]) -> int:
    """*argv*'s peak resident memory in bytes (wait4's ru_maxrss of the child,
    spawned without a copy of this process: posix_spawn), failing if it fails."""
    quiet = [(os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)]
    quiet.append((os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0))
    pid = os.posix_spawn(argv[0], argv, dict(os.environ), file_actions=quiet)
    _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {os.waitstatus_to_exitcode(status)}")
    return int(usage.ru_maxrss) * 1024


def write_small_records(path: Path, size: int, f: Any) -> None:
    """A file-mode perf.data of about *size* bytes: *f*'s header and synthesized
    records, then 40-byte samples written 4 MiB at a time (never held whole)."""
    from support.perffile import sample

    one = sample(0xFFFFFFFF81001000, 5_000_000_010)
    raw = f.write(path).read_bytes()  # header, attrs, data section, feature table, sections
    d_off, d_size = struct.unpack_from("<QQ", raw, 40)
    flags = struct.unpack_from("<4Q", raw, 72)
    n_features = sum(bin(x).count("1") for x in flags)
    n = (size - len(raw)) // len(one)
    grown = n * len(one)
    head = bytearray(raw[:d_off])
    struct.pack_into("<Q", head, 48, d_size + grown)
    table = bytearray(raw[d_off + d_size : d_off + d_size + 16 * n_features])
    for i in range(n_features):  # every section now lies *grown* bytes further on
        (off,) = struct.unpack_from("<Q", table, 16 * i)
        struct.pack_into("<Q", table, 16 * i, off + grown)
    per_block = (4 * MIB) // len(one)
    block = one * per_block
    with open(path, "wb") as out:
        out.write(head)
        out.write(raw[d_off : d_off + d_size])
        left = n
        while left:
            k = min(left, per_block)
            out.write(block if k == per_block else one * k)
            left -= k
        out.write(table)
        out.write(raw[d_off + d_size + 16 * n_features :])


def memory(quick: bool) -> list[Result]:
    """Peak RSS of kreldctl inject on 80 MB and 800 MB of small records."""
    del quick  # one run each: a peak does not vary as a time does
    faketree = load_faketree()
    from support.perffile import PerfFile

    d = Path(tempfile.mkdtemp(prefix="kreld-bench-injmem-"))
    figures: list[tuple[int, int, int]] = []
    try:
        text = 0xFFFFFFFF9D000000
        tree = faketree.FakeTree(d / "root", text=text)
        ctl = venv_tool("kreldctl")
        opts = ["--root", str(tree.root), "--state-dir", str(d / "state")]
        run_quiet([ctl, *opts, "snapshot"])
        f = PerfFile(text=text, kernel_build_id=tree.build_id, osrelease=tree.release)
        for size in MEMORY_SIZES:
            src = d / "in.data"
            write_small_records(src, size, f)
            log(f"{src}: {src.stat().st_size / 1e6:.0f} MB of 40-byte records")
            out = d / "out.data"
            kreld = peak_rss([ctl, "inject", "-i", str(src), "-o", str(out), *opts])
            base = peak_rss([sys.executable, "-c", READ_IN_CHUNKS, str(src)])
            figures.append((src.stat().st_size, kreld, base))
            src.unlink()
            out.unlink()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    same = figures[1][1] <= 1.25 * figures[0][1]
    out_rows = []
    for size, kreld, base in figures:
        out_rows.append(
            Result(
                f"kreldctl inject peak RSS, {size / 1e6:.0f} MB of small records",
                kreld / MIB,
                "",
                base / MIB,
                "read-chunks",
                "a Python process reading the same file in 1 MiB chunks (MiB, ru_maxrss)",
                goal="<= 128 MiB, same for 80 and 800 MB",
                met=kreld <= 128 * MIB and same,
                notes=[
                    "peak resident memory in MiB (wait4's ru_maxrss of the child); "
                    f"800 MB / 80 MB: {figures[1][1] / figures[0][1]:.2f}"
                ]
                if len(figures) == 2
                else [],
            )
        )
    return out_rows


def run(quick: bool) -> list[Result]:
    """kreldctl inject: peak memory on written recordings; on a 100 MB perf.data
    against perf inject and cp where perf records."""
    rows = memory(quick)
    try:
        rows += timing(quick)
    except RuntimeError as e:
        log(f"inject timing skipped: {e}")
    return rows


def timing(quick: bool) -> list[Result]:
    """kreldctl inject on a 100 MB perf.data against perf inject and cp."""
    n = 3 if quick else 7
    perf = shutil.which("perf")
    d = Path(tempfile.mkdtemp(prefix="kreld-bench-inject-"))
    try:
        state = snapshot_store(d)
        ctl = venv_tool("kreldctl")
        log("recording a perf.data of 100 MB or more")
        big = record_perf_data(d, MIN_SIZE)
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
        f"inject: the perf.data is {mib} (perf record -g -a); {n} runs per figure, "
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
