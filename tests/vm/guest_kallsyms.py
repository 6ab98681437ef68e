"""Runs inside the VM (tests/vm/guest.sh, with the project's virtualenv python):
wait until kreld has captured this boot's symbol tables, then copy the
kernel's own ``/proc/kallsyms`` at a moment T.

    python guest_kallsyms.py LOG OUT [PREV_LOG]

Waits (at most ``--wait`` seconds, default 150) until kreld's JSON log LOG
says what became of the kernel's table (``kernel_symbols``, or
``kernel_symbols_unavailable``/``_differ_from_build``), and until every module
in ``/proc/modules`` whose build no earlier boot stored (PREV_LOG: that boot's
kreld log; kreld logs ``module_symbols`` only when it stores a new table) has
a ``module_symbols`` or ``module_symbols_unavailable`` line.  Then reads
CLOCK_MONOTONIC, ``/proc/kallsyms`` and CLOCK_MONOTONIC again, and writes
``OUT/kallsyms-at-T`` and ``OUT/kallsyms-T.json``: ``t0``/``t1`` (ns, the
read lies between them), ``waited_s``, ``kernel`` (kreld's log record),
``modules_pending`` (modules whose symbols kreld had not captured when the
wait ended, each with how long it was waited for) and ``modules_logged``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

KERNEL_EVENTS = (
    "kernel_symbols",
    "kernel_symbols_unavailable",
    "kernel_symbols_differ_from_build",
)
MODULE_EVENTS = ("module_symbols", "module_symbols_unavailable")


def records(path: Path) -> list[dict[str, Any]]:
    """kreld's JSON log lines (anything else, e.g. a traceback, is skipped)."""
    out = []
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def loaded_modules() -> list[str]:
    with open("/proc/modules") as f:
        return [line.split()[0] for line in f if line.strip()]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("log", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("prev_log", type=Path, nargs="?")
    p.add_argument("--wait", type=float, default=150.0)
    args = p.parse_args()
    stored_before = set()
    if args.prev_log is not None:
        stored_before = {
            r.get("module") for r in records(args.prev_log) if r.get("event") == "module_symbols"
        }
    modules = loaded_modules()
    wanted = [m for m in modules if m not in stored_before]
    start = time.monotonic()
    kernel: dict[str, Any] | None = None
    logged: dict[str, str] = {}
    while True:
        recs = records(args.log)
        kernel = next((r for r in recs if r.get("event") in KERNEL_EVENTS), None)
        logged = {
            str(r.get("module")): str(r["event"]) for r in recs if r.get("event") in MODULE_EVENTS
        }
        pending = [m for m in wanted if m not in logged]
        if (kernel is not None and not pending) or time.monotonic() - start > args.wait:
            break
        time.sleep(0.2)
    waited = time.monotonic() - start
    t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    with open("/proc/kallsyms", "rb") as f:
        data = f.read()
    t1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    after = loaded_modules()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kallsyms-at-T").write_bytes(data)
    (args.out / "kallsyms-T.json").write_text(
        json.dumps(
            {
                "t0": t0,
                "t1": t1,
                "waited_s": round(waited, 2),
                "kernel": kernel,
                "modules_wanted": wanted,
                "modules_logged": logged,
                "modules_pending": pending,
                "modules_changed": sorted(set(after) ^ set(modules)),
            },
            indent=1,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
