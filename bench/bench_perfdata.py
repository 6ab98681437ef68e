"""``kreldctl export kallsyms --for perf.data`` on a recording of 100 MB
or more costs what a small recording costs: the header read stops at the end
of perf's synthesized records and never scans the samples.

The recording is real when perf can record here (root, ``perf record -e
cpu-clock -g -a`` at a high rate while dd runs, repeated with a longer
workload until the file passes 100 MB); otherwise a file of the same size is
written (tests/support/perffile.py: a header, the synthesized records, then samples).
The store holds this boot (``kreldctl snapshot``), so the export matches it.

Figures (medians over interleaved runs, the file in the page cache):

* ``kreldctl export kallsyms --for BIG`` (subprocess) against ``cat BIG``
  (reading the whole file once) and against ``kreldctl export kallsyms``
  of the same boot named by ``--boot`` (the export without a perf.data);
* ``read_perf_header(BIG)`` in-process against reading the whole file
  in-process;
* bytes the header read took from the file, against the file's size.

Run alone: ``.venv/bin/python bench/bench_perfdata.py [--quick]``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from common import (
    REPO,
    Result,
    bench_main,
    interleaved,
    log,
    median,
    record_perf_data,
    run_quiet,
    snapshot_store,
    venv_tool,
)

from kreld.kernel.info import Root, read_boot_id
from kreld.perf.reader import read_perf_header

MIN_SIZE = 100 << 20


def written(d: Path, text: int, build_id: str | None, release: str) -> Path:
    """A file of MIN_SIZE bytes written here, for a machine where perf cannot record."""
    sys.path.insert(0, str(REPO / "tests"))
    from support.perffile import PerfFile, sample

    samples = b"".join(sample(text + 0x1000 + i, i) for i in range(10_000))
    f = PerfFile(text=text, kernel_build_id=build_id, osrelease=release)
    return f.write(d / "big.data", tail=samples * (MIN_SIZE // len(samples) + 1))


def run(quick: bool) -> list[Result]:
    """--for on a 100 MB perf.data against reading the file."""
    n = 5 if quick else 15
    d = Path(tempfile.mkdtemp(prefix="kreld-bench-perf-"))
    try:
        state = snapshot_store(d)
        ctl = venv_tool("kreldctl")
        boot = read_boot_id(Root(Path("/")))
        log("recording a perf.data of 100 MB or more")
        big = record_perf_data(d, MIN_SIZE)
        kind = "perf record -g -a"
        if big is None:
            from kreld.store import Store

            with Store(state, readonly=True) as store:
                b = store.get_boot(boot)
            if b.anchors.text is None:
                raise RuntimeError("this boot's _text is unknown (kallsyms restricted)")
            big = written(d, b.anchors.text, b.build_id, b.release)
            kind = "written (perf cannot record here)"
        size = big.stat().st_size
        h = read_perf_header(big)
        log(f"{big}: {size / 2**20:.0f} MiB ({kind}); header read {h.bytes_read} bytes")

        def whole() -> None:
            with open(big, "rb") as f:
                while f.read(1 << 20):
                    pass

        out = str(d / "out.kallsyms")
        export = [ctl, "--state-dir", str(state), "export", "kallsyms", "-o", out]
        cat = ["sh", "-c", 'cat "$1" >/dev/null', "sh", str(big)]
        sub = interleaved(
            {
                "for": lambda: run_quiet([*export, "--for", str(big)]),
                "boot": lambda: run_quiet([*export, "--boot", boot]),
                "cat": lambda: run_quiet(cat),
            },
            n,
        )
        inproc = interleaved({"header": lambda: read_perf_header(big), "whole": whole}, n * 2)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    mib = f"{size / 2**20:.0f} MiB"
    cat_desc = f"cat of the whole {mib} perf.data to /dev/null, page-cached (subprocess)"
    notes = [
        f"export --for: the perf.data is {mib} ({kind}); {n} runs per figure, interleaved. "
        "Goals: export --for costs about what export --boot does (rendering the kallsyms "
        "dominates both); the header read costs a small share of reading the file, and takes "
        "under 1 MiB of it whatever its size."
    ]
    results = [
        Result(
            f"export kallsyms --for a {mib} perf.data (subprocess) p50",
            median(sub["for"]),
            "ns",
            median(sub["cat"]),
            "cat-file",
            cat_desc,
            notes=notes,
        ),
        Result(
            "export kallsyms --for, against export --boot of the same boot, p50",
            median(sub["for"]),
            "ns",
            median(sub["boot"]),
            "export-boot",
            "kreldctl export kallsyms --boot (no perf.data read), subprocess",
            goal="< 1.5x",
            met=median(sub["for"]) < 1.5 * median(sub["boot"]),
        ),
        Result(
            "read_perf_header of it (in-process) p50",
            median(inproc["header"]),
            "ns",
            median(inproc["whole"]),
            "read-whole",
            "reading the whole perf.data in 1 MiB chunks, in-process",
            goal="< 0.1x",
            met=median(inproc["header"]) < 0.1 * median(inproc["whole"]),
        ),
        Result(
            "bytes of it the header read took",
            float(h.bytes_read),
            "",
            float(size),
            "file-size",
            "the perf.data's size in bytes",
            goal="< 1 MiB",
            met=h.bytes_read < 1 << 20,
        ),
    ]
    for r in results:
        r.bench = "perfdata"
    return results


if __name__ == "__main__":
    sys.exit(bench_main("perfdata", run))
