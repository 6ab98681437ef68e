"""Helpers of the fault suite (tests/faults): store reads, history invariants, process
figures.  (The opt-in, tests skipped unless ``-m faults`` selects them, is a hook in
tests/conftest.py keyed on the ``faults`` marker each module sets in its pytestmark.)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kreld.store import Store

NOBODY = 65534
Inc = dict[str, Any]


def sha256_tree(d: Path) -> dict[str, str]:
    """sha256 of every regular file under *d* (symlinks are recorded, not followed)."""
    out: dict[str, str] = {}
    for p in sorted(d.rglob("*")):
        rel = str(p.relative_to(d))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def history(state: Path, boot_id: str) -> list[Inc]:
    """Every incarnation of *boot_id* as the store holds it now (a read-only open)."""
    if not (state / "data.mdb").exists():
        return []
    with Store(state, readonly=True) as store:
        return [i.to_json() for i in store.incarnations(boot_id)]


def open_incarnations(state: Path, boot_id: str) -> list[Inc]:
    with Store(state, readonly=True) as store:
        return [i.to_json() for i in store.modules.open_incarnations(boot_id)]


IDENTITY = ("seq", "name", "build_id", "sections", "inode", "loaded", "seen_by", "core_base")


def assert_kept(before: list[Inc], after: list[Inc], what: str) -> None:
    """Every record of *before* is in *after*: same seq, same load; closed ones unchanged."""
    by_seq = {i["seq"]: i for i in after}
    for old in before:
        new = by_seq.get(old["seq"])
        assert new is not None, f"{what}: seq {old['seq']} ({old['name']}) lost"
        for k in IDENTITY:
            assert new[k] == old[k], f"{what}: seq {old['seq']} {k}: {old[k]!r} -> {new[k]!r}"
        if old["unloaded"] is not None:
            assert new == old, f"{what}: closed seq {old['seq']} changed"


def assert_history_sane(incs: list[Inc], *, unique_text: bool = True) -> None:
    """What holds whatever happened: seqs strictly increasing from 0 with no gap, one open
    incarnation per name at most, no zero address; with *unique_text* (every load at a base
    of its own), one incarnation per load."""
    seqs = [i["seq"] for i in incs]
    assert seqs == list(range(len(incs))), "seqs must be 0..n-1, in order, without duplicates"
    open_names = Counter(i["name"] for i in incs if i["unloaded"] is None)
    dupes = {n for n, c in open_names.items() if c > 1}
    assert not dupes, f"two open incarnations of {sorted(dupes)}"
    if unique_text:
        texts = Counter(i["sections"][".text"] for i in incs if ".text" in i["sections"])
        dup = sorted(t for t, c in texts.items() if c > 1)
        assert not dup, f"one load recorded twice: .text {dup[:5]}"
    for i in incs:
        assert_no_zero_address(i)
        if i["unloaded"] is not None:
            assert i["loaded"]["monotonic"] <= i["unloaded"]["monotonic"], i["seq"]


def assert_no_zero_address(obj: Any, where: str = "") -> None:
    """No address field holds zero: zero means *restricted*, never an address."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("sections", "anchors") and isinstance(v, dict):
                for s, a in v.items():
                    assert a is None or int(a, 16) != 0, f"{where}{k}.{s} is zero"
            elif k == "core_base":
                assert v is None or int(v, 16) != 0, f"{where}core_base is zero"
            else:
                assert_no_zero_address(v, f"{where}{k}.")
    elif isinstance(obj, list):
        for x in obj:
            assert_no_zero_address(x, where)


def proc_status(pid: int, key: str) -> int:
    """A ``kB`` figure (VmRSS, VmHWM, ...) of /proc/<pid>/status, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextlib.contextmanager
def tiny_tmpfs(size: str = "2m") -> Iterator[Path]:
    """A tmpfs of *size* mounted on a fresh directory (needs root), unmounted after."""
    d = Path(tempfile.mkdtemp(prefix="kreld-tmpfs-"))
    try:
        cp = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(d)],
            capture_output=True,
            text=True,
        )
        if cp.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {cp.stderr.strip()}")
        try:
            yield d
        finally:
            subprocess.run(["umount", "-l", str(d)], check=False)
    finally:
        with contextlib.suppress(OSError):
            d.rmdir()


def fill(d: Path, name: str = "filler") -> Path:
    """Write into *d* until its filesystem says ENOSPC; returns the filler file."""
    p = d / name
    chunk = b"\xa5" * 65536
    with open(p, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            assert e.errno == 28, e  # ENOSPC
        small = b"\xa5" * 512
        try:
            while True:
                f.write(small)
        except OSError as e:
            assert e.errno == 28, e
    return p


def write_config(path: Path, **sections: dict[str, Any]) -> Path:
    lines = []
    for sec, kv in sections.items():
        lines.append(f"[{sec}]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in kv.items())
    path.write_text("\n".join(lines) + "\n")
    return path


class Measured:
    """One command run through tests/support/peak.py: its exit status and the kernel's
    account of it alone (``wait4``), not of the pytest process it was started from."""

    def __init__(self, rc: int, maxrss_kib: int, cpu_s: float, wall_s: float, timed_out: bool):
        self.rc, self.maxrss_kib, self.cpu_s = rc, maxrss_kib, cpu_s
        self.wall_s, self.timed_out = wall_s, timed_out


PEAK = Path(__file__).with_name("peak.py")


def run_measured(
    argv: list[str],
    *,
    stdin: Any = subprocess.DEVNULL,
    stdout: Any = None,
    stderr: Any = None,
    timeout: float,
    as_limit: int,
) -> Measured:
    """*argv* under RLIMIT_AS *as_limit*, killed after *timeout* s, with its peak RSS
    and CPU.  A grandchild of the test on purpose (peak.py says why)."""
    import sys

    fd, result = tempfile.mkstemp(prefix="kreld-peak-", suffix=".json")
    os.close(fd)
    try:
        cp = subprocess.run(
            [sys.executable, str(PEAK), result, str(timeout), str(as_limit), "--", *argv],
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            timeout=timeout + 30,
        )
        assert cp.returncode == 0, f"peak.py failed ({cp.returncode}) for {argv}"
        with open(result, encoding="utf-8") as f:
            r = json.load(f)
    finally:
        os.unlink(result)
    return Measured(r["status"], r["maxrss_kib"], r["cpu_s"], r["wall_s"], r["timed_out"])
