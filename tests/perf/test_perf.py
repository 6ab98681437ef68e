"""The perf round trip: a kallsyms exported by kreld names the kernel frames of a perf.data.

Where perf can record system-wide (Debian: linux-perf; root, unrestricted kallsyms):
record a moment of a syscall-heavy workload, then report it with a HOME that has no
perf build-id cache (so perf has no copy of kallsyms of its own) against kreld's
export, against /proc/kallsyms, and against an empty kallsyms.  The first two must
name the same kernel symbols with the same overheads; the last must name none.
"""

from __future__ import annotations

import bisect
import json
import re
import subprocess
from pathlib import Path

from kreld.client import resolutions
from kreld.core.model import Anchors, BootSnapshot, Clock, Timestamp
from kreld.core.symtab import SymbolTable, kernel_table
from kreld.kernel.kallsyms import parse_kallsyms
from kreld.symbols.queries import AddressMap

from support.perftool import perf as perf
from support.perftool import perf_env, record
from support.run import kreldctl

KERNEL_LINE = re.compile(r"^\s*([0-9.]+)%\s+\[k\]\s+(\S+)\s*$")


def kernel_frames(perf: str, data: Path, kallsyms: Path, home: Path) -> list[tuple[str, str]]:
    """(overhead, symbol) of each kernel line of ``perf report --sort sym``."""
    cp = subprocess.run(
        [perf, "report", "-i", str(data), f"--kallsyms={kallsyms}", "--stdio", "--sort", "sym"],
        capture_output=True,
        text=True,
        timeout=120,
        env=perf_env(home),
        check=False,
    )
    assert cp.returncode == 0, cp.stderr
    return [
        (m.group(1), m.group(2)) for ln in cp.stdout.splitlines() if (m := KERNEL_LINE.match(ln))
    ]


def named(frames: list[tuple[str, str]]) -> set[str]:
    return {s for _, s in frames if not s.startswith("0x")}


def test_perf_report_with_exported_kallsyms_names_the_kernel_frames(
    perf: str, tmp_path: Path
) -> None:
    data = tmp_path / "perf.data"
    home = tmp_path / "home"  # empty: no ~/.debug build-id cache
    rec = subprocess.run(
        [*record(perf, data), "dd", "if=/dev/zero", "of=/dev/null", "bs=512", "count=300000"],
        capture_output=True,
        text=True,
        timeout=120,
        env=perf_env(home),
        check=False,
    )
    assert rec.returncode == 0, rec.stderr

    state = str(tmp_path / "state")
    exported = tmp_path / "kallsyms"
    kreldctl("--state-dir", state, "snapshot")
    kreldctl("--state-dir", state, "export", "kallsyms", "-o", str(exported))
    empty = tmp_path / "empty-kallsyms"
    empty.write_text("")

    live = kernel_frames(perf, data, Path("/proc/kallsyms"), home)
    ours = kernel_frames(perf, data, exported, home)
    none = kernel_frames(perf, data, empty, home)
    assert not any(home.iterdir()), "perf wrote a build-id cache: the reports could use it"

    # The workload lives in read/write syscalls: the live report names kernel code.
    assert len(named(live)) >= 3, live
    assert ours == live
    # Without symbols perf shows raw addresses: the comparison above can fail.
    assert none, "the kernel samples vanished without kallsyms"
    assert named(none) == set(), named(none)


# Symbols set at one address just before a sampled instruction, in kallsyms order
# ({} is a number that keeps each group's names apart): the cases where perf must
# choose.  Of each group perf names one; kreld must name the same.
TIES = [
    [("T", "startup_64_{}"), ("T", "_stext_{}"), ("T", "_text_{}")],  # as at the real _text
    [("t", "__pfx_f{}"), ("T", "f{}")],  # a padding symbol with its function
    [("T", "f{}"), ("t", "__pfx_g{}")],
    [("t", "local{}"), ("T", "global{}")],
    [("T", "global{}"), ("t", "local{}")],
    [("W", "weak{}"), ("T", "strong{}")],
    [("T", "strong{}"), ("W", "weak{}")],
    [("T", "__under{}"), ("T", "plain{}")],
    [("T", "plain{}"), ("T", "__under{}")],
    [("t", "code{}"), ("r", "rodata{}")],
    [("r", "rodata{}"), ("t", "code{}")],
    [("T", "fn{}"), ("t", "fn{}.cold"), ("D", "data{}")],
]


def kernel_ips(perf: str, data: Path, kallsyms: Path, home: Path) -> dict[int, str]:
    """Each kernel instruction pointer of the recording (callchains included),
    with the symbol ``perf script`` names for it from *kallsyms* alone."""
    empty = home / "symfs"
    empty.mkdir(exist_ok=True)
    cp = subprocess.run(
        [perf, "script", "-i", str(data), "-F", "ip,sym", f"--kallsyms={kallsyms}",
         f"--symfs={empty}"],
        capture_output=True, text=True, timeout=120, env=perf_env(home), check=False,
    )  # fmt: skip
    assert cp.returncode == 0, cp.stderr
    out: dict[int, str] = {}
    for line in cp.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] != "[unknown]" and int(parts[0], 16) >= 1 << 63:
            out[int(parts[0], 16)] = parts[1]
    return out


def test_of_symbols_at_one_address_kreld_names_the_one_perf_script_names(
    perf: str, tmp_path: Path
) -> None:
    """A recording made here, symbolized by ``perf script --kallsyms`` from this
    machine's kallsyms with groups of symbols added at one address just before
    sampled instructions (the ``_text`` aliases, ``__pfx_`` padding, local vs
    global, weak, leading underscores, read-only data): kreld, given the same
    kallsyms, names what perf names for every kernel address of the recording."""
    data = tmp_path / "perf.data"
    home = tmp_path / "home"
    rec = subprocess.run(
        [*record(perf, data, "-g"), "dd", "if=/dev/zero", "of=/dev/null", "bs=512",
         "count=200000"],
        capture_output=True, text=True, timeout=120, env=perf_env(home), check=False,
    )  # fmt: skip
    assert rec.returncode == 0, rec.stderr
    live = Path("/proc/kallsyms").read_text()
    core = parse_kallsyms(live.encode()).core
    starts = sorted({v for v, _t, _n in core})
    ips = kernel_ips(perf, data, Path("/proc/kallsyms"), home)
    extra, used = [], set()
    for k, ip in enumerate(sorted(ips)):
        below = starts[bisect.bisect_right(starts, ip) - 1]
        if ip == below or below in used:
            continue
        used.add(below)
        at = below + 1 if ip - below > 1 else ip
        extra += [f"{at:016x} {t} {n.format(k)}" for t, n in TIES[len(used) % len(TIES)]]
    synth = tmp_path / "kallsyms"
    synth.write_text(live + "\n".join(extra) + "\n")
    named_by_perf = kernel_ips(perf, data, synth, home)
    assert len(used) >= 2 * len(TIES), f"too few kernel samples to test with ({len(used)})"

    ks = parse_kallsyms(synth.read_bytes())
    by_name = {n: v for v, _t, n in reversed(ks.core)}
    text, etext = by_name[b"_text"], by_name[b"_etext"]
    table = SymbolTable(kernel_table(ks.core, text))
    boot = BootSnapshot(
        "00000000-0000-0000-0000-000000000001", "6.1", "#1", None, Anchors(text, text, etext),
        None, False, None, 0, Timestamp(1, 1, 1),
    )  # fmt: skip
    amap = AddressMap(boot, [], Clock.MONOTONIC, None, "k:x")
    asked = [ip for ip in named_by_perf if text <= ip < etext]
    got = resolutions(asked, json.loads(amap.resolve(asked, {"k:x": table}).to_json()))
    differ = [
        (hex(ip), perf_name, r.get("symbol"))
        for ip, r in zip(asked, got, strict=True)
        if r.get("symbol") != (perf_name := named_by_perf[ip])
    ]
    assert not differ, f"{len(differ)} of {len(asked)} differ from perf, e.g. {differ[:8]}"
    # The added groups were in play: perf named a symbol of many of them.
    added = {n.split()[-1] for n in extra}
    assert len(added & set(named_by_perf.values())) >= len(TIES)
