"""The symbol cache against the live machine (root, unrestricted kallsyms): the
exported kallsyms is /proc/kallsyms line for line, and Resolve agrees with a
plain lookup in it."""

from __future__ import annotations

import bisect
import os
import random
from pathlib import Path

import pytest

from support.run import Daemon, kreldctl
from support.symanswers import (
    assert_same_lines,
    call,
    ok,
    resolved,
    sym,
)
from support.symbols import daemons as daemons
from support.symbols import sock_dir as sock_dir

# -- the live machine ------------------------------------------------------------------


def _live_kallsyms() -> bytes:
    if os.geteuid() != 0:
        pytest.skip("not root: /proc/kallsyms shows zeros to this user")
    try:
        data = Path("/proc/kallsyms").read_bytes()
    except OSError as e:
        pytest.skip(f"/proc/kallsyms unreadable: {e}")
    first = data.split(b" ", 1)[0]
    if not first.strip(b"0"):
        pytest.skip("/proc/kallsyms shows zero addresses (kernel.kptr_restrict)")
    return data


def test_live_snapshot_then_export_equals_proc_kallsyms(tmp_path: Path) -> None:
    _live_kallsyms()
    state = str(tmp_path / "st")
    out = tmp_path / "kallsyms"
    kreldctl("--state-dir", state, "snapshot")
    kreldctl("--state-dir", state, "export", "kallsyms", "-o", str(out))
    live = Path("/proc/kallsyms").read_text()
    assert_same_lines(out.read_text(), live)


def test_live_daemon_exports_and_resolves_like_proc_kallsyms(
    tmp_path: Path, sock_dir: Path, daemons: list[Daemon]
) -> None:
    _live_kallsyms()
    sock = sock_dir / "live.sock"
    d = Daemon(
        ["--root", "/", "--state-dir", str(tmp_path / "st"), "--socket", str(sock)],
        tmp_path / "kreld.log",
    )
    daemons.append(d)
    d.start(timeout=30)
    d.wait_for("kernel_symbols", timeout=60)
    text = ok(call(sock, "ExportKallsyms"))["kallsyms"]
    live = Path("/proc/kallsyms").read_text()
    assert_same_lines(text, live)

    # The straightforward lookup: the greatest core address <= A; of several names
    # at one address, the one perf names: the last in file order of a type perf
    # keeps (T, W, D, B).
    first: dict[int, str] = {}
    kept: set[int] = set()
    named: dict[str, int] = {}
    for line in live.splitlines():
        addr, typ, name = line.split(" ", 2)
        if "\t" not in name:
            a = int(addr, 16)
            if typ.upper() in "TWDB":
                first[a] = name
                kept.add(a)
            elif a not in kept:
                first[a] = name
            named.setdefault(name, a)
    addrs = sorted(first)
    text_start, etext = named["_text"], named["_etext"]
    assert text_start < etext
    rng = random.Random(0x5EED)
    sample = [rng.randrange(text_start, etext) for _ in range(10_000)]
    results = resolved(sock, [f"{a:#x}" for a in sample])
    assert len(results) == len(sample)
    wrong = []
    for a, r in zip(sample, results, strict=True):
        at = addrs[bisect.bisect_right(addrs, a) - 1]
        want = ("kernel", first[at], f"{a - at:#x}")
        if sym(r) != want or r["address"] != f"{a:#x}":
            wrong.append((f"{a:#x}", sym(r), want))
    assert not wrong, f"{len(wrong)} of 10000 differ, e.g. {wrong[:5]}"
    assert d.stop() == 0
