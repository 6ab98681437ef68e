"""What the CLI imports at start: the heavy modules it must not load, and a run of it."""

from __future__ import annotations

import json
import subprocess
import sys

# Loaded by no command below that does not need them.
HEAVY = {"structlog", "elftools", "watchdog", "pyudev", "systemd", "asyncio"}


def imported_by(code: str) -> set[str]:
    """The top-level names of the modules a fresh interpreter has after *code*."""
    probe = f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))\n"
    cp = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    return set(json.loads(cp.stdout.splitlines()[-1]))


def run_cli(argv: list[str]) -> str:
    return (
        "import contextlib, io, kreld.cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        f"    kreld.cli.main({argv!r})\n"
    )
