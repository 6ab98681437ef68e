"""The host side of the QEMU tests: kreldctl on the guest's state dir, anchors of a record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from support import harness

CTL = next(
    (
        p
        for p in (Path(sys.executable).parent / "kreldctl", harness.REPO / ".venv/bin/kreldctl")
        if p.exists()
    ),
    Path("kreldctl"),
)


def reader_root(state: Path, boot_id: str) -> Path:
    """A --root whose boot-id is *boot_id*, for reading the store as that boot."""
    root = state.parent / f"reader-root-{boot_id}"
    f = root / "proc/sys/kernel/random/boot_id"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(boot_id + "\n")
    return root


def host_ctl(state: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``kreldctl --config <checkout's> --state-dir STATE ARGS`` run on the host."""
    argv = [str(CTL), "--config", str(harness.REPO / "etc/kreld/kreld.toml")]
    return subprocess.run(
        [*argv, "--state-dir", str(state), *args], capture_output=True, text=True, timeout=timeout
    )


def ctl(state: Path, *args: str, as_boot: str | None = None, check: bool = True) -> Any:
    """kreldctl on the host against the guest's store (no daemon: read-only LMDB).

    With *as_boot*, kreldctl runs with a --root that says that boot-id, as if
    on that boot (what is current); without, it reads as the host, whose own
    boot is not in the store (test_host_reads_a_store_recorded_elsewhere).
    """
    root = ["--root", str(reader_root(state, as_boot))] if as_boot else []
    cp = host_ctl(state, *root, *args, "--json", timeout=60)
    if check and cp.returncode != 0:
        raise AssertionError(f"kreldctl {' '.join(args)} -> {cp.returncode}\n{cp.stderr}")
    return json.loads(cp.stdout)


def addr(v: str | None) -> int | None:
    return None if v is None else int(v, 16)


def anchors_of(rec: dict[str, Any]) -> dict[str, int | None]:
    """A boot record's anchors by kernel symbol name: the wire names them without
    the leading underscore ("text" is _text)."""
    return {f"_{k}": addr(v) for k, v in rec["anchors"].items()}
