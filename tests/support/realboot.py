"""The QEMU tests of a real kernel (tests/vm/test_realkernel_*.py): what the guest
read itself (its facts), one boot run with guest.sh and what kreld recorded of
it read back on the host, shared by every file through tests/vm/conftest.py's
session-scoped boots."""

from __future__ import annotations

import contextlib
import gzip
import json
import lzma
import os
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from support import harness
from support.realkernel import ctl

GUEST_SCRIPT = harness.REPO / "tests/vm/guest.sh"
ANCHORS = ("_text", "_stext", "_etext", "_sinittext", "_einittext")
BOOT_TIMEOUT = 420.0


# -- what the guest read itself -------------------------------------------------------


def gnu_build_id(notes: bytes) -> str | None:
    """The NT_GNU_BUILD_ID of a raw ELF note stream (our own parser, not kreld's)."""
    off = 0
    while off + 12 <= len(notes):
        namesz, descsz, ntype = struct.unpack_from("<III", notes, off)
        name_off = off + 12
        desc_off = name_off + ((namesz + 3) & ~3)
        name = notes[name_off : name_off + namesz].rstrip(b"\0")
        if name == b"GNU" and ntype == 3:
            return notes[desc_off : desc_off + descsz].hex()
        off = desc_off + ((descsz + 3) & ~3)
    return None


def from_od(text: str) -> bytes:
    return bytes(int(b, 16) for b in text.split())


def symbols(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) == 3:
            out.setdefault(f[2], int(f[0], 16))
    return out


def proc_modules(text: str) -> dict[str, tuple[int, int]]:
    """/proc/modules as name -> (base, size)."""
    out = {}
    for line in text.splitlines():
        f = line.split()
        out[f[0]] = (int(f[5], 16), int(f[1]))
    return out


@dataclass
class ModFacts:
    sections: dict[str, int]
    build_id: str | None
    core_base: int
    coresize: int
    initsize: int
    loaded: dict[str, tuple[int, int]]  # all of /proc/modules at that moment


@dataclass
class Facts:
    """One boot, as the guest's own /proc and /sys showed it."""

    dir: Path
    boot_id: str = ""
    release: str = ""
    build_id: str | None = None
    anchors: dict[str, int] = field(default_factory=dict)
    kptr_restrict: int = -1
    modules_at_start: dict[str, tuple[int, int]] = field(default_factory=dict)
    # /proc/modules once kreld said READY=1: its start-up scan lay in between.
    modules_at_ready: dict[str, tuple[int, int]] = field(default_factory=dict)
    times: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def read(cls, d: Path) -> Facts:
        f = cls(d)
        f.boot_id = (d / "boot_id").read_text().strip()
        f.release = (d / "release").read_text().strip()
        f.build_id = gnu_build_id(from_od((d / "kernel_notes.hex").read_text()))
        f.anchors = symbols((d / "anchors").read_text())
        f.kptr_restrict = int((d / "kptr_restrict").read_text())
        f.modules_at_start = proc_modules((d / "modules.start").read_text())
        f.modules_at_ready = proc_modules((d / "modules.ready").read_text())
        for line in (d / "times").read_text().splitlines():
            label, mono, real = line.split()
            f.times[label] = (int(mono), int(real))
        return f

    def mono(self, label: str) -> int:
        return self.times[label][0]

    def module(self, label: str) -> ModFacts:
        d = self.dir / "mod" / label
        sections = {p.name: int(p.read_text().strip(), 16) for p in (d / "sections").iterdir()}
        loaded = proc_modules((d / "proc_modules").read_text())
        return ModFacts(
            sections=sections,
            build_id=gnu_build_id((d / ".note.gnu.build-id").read_bytes()),
            core_base=loaded[label.rstrip("0123456789")][0],
            coresize=int((d / "coresize").read_text()),
            initsize=int((d / "initsize").read_text()),
            loaded=loaded,
        )


def host_module_build_id(release: str, name: str) -> str:
    """``readelf -n`` of the host's .ko (decompressed to a temp file first)."""
    found = sorted(Path(f"/lib/modules/{release}/kernel").rglob(f"{name}.ko*"))
    assert found, f"no {name}.ko* under /lib/modules/{release}/kernel"
    ko = found[0]
    with tempfile.TemporaryDirectory() as tmp:
        if ko.suffix in (".xz", ".zst", ".gz"):
            plain = Path(tmp) / f"{name}.ko"
            raw = ko.read_bytes()
            if ko.suffix == ".xz":
                plain.write_bytes(lzma.decompress(raw))
            elif ko.suffix == ".gz":
                plain.write_bytes(gzip.decompress(raw))
            else:
                plain.write_bytes(
                    subprocess.run(["zstd", "-dc", str(ko)], capture_output=True, check=True).stdout
                )
            ko = plain
        out = subprocess.run(
            ["readelf", "-n", str(ko)], capture_output=True, text=True, check=True
        ).stdout
    m = re.search(r"Build ID: ([0-9a-f]+)", out)
    assert m, f"readelf -n {ko} shows no build-id:\n{out}"
    return m.group(1)


# -- what kreld recorded, read on the host ---------------------------------------------------


@dataclass
class Boot:
    facts: Facts
    run: harness.GuestRun
    show: dict[str, Any]
    modules: list[dict[str, Any]]
    boots: list[dict[str, Any]]

    def incs(self, name: str) -> list[dict[str, Any]]:
        return sorted((i for i in self.modules if i["name"] == name), key=lambda i: i["seq"])


def say(request: pytest.FixtureRequest, line: str) -> None:
    """A line on the terminal now, past output capturing (boot times, figures)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capman is None:
        return
    with capman.global_and_fixture_disabled():
        reporter.ensure_newline()
        reporter.write_line(line)


def boot(
    rw: Path, mode: str, state: Path, request: pytest.FixtureRequest, env: dict[str, str]
) -> Boot:
    out = rw / f"facts-{mode}"
    if os.environ.get("KRELD_VM_REUSE") and (out / "done").exists():
        run = harness.GuestRun(0, "", "", 0.0)
    else:
        shutil.rmtree(out, ignore_errors=True)
        run = harness.run_in_guest(
            f"sh {GUEST_SCRIPT} {mode}",
            rw,
            timeout=BOOT_TIMEOUT,
            env={"OUT": str(out), "STATE": str(state), **env},
            name=mode,
        )
    log = out / "kreld.log"
    tail = log.read_text()[-4000:] if log.exists() else "(no kreld.core.log)"
    assert run.status == 0, (
        f"guest.sh {mode} exited {run.status} after {run.elapsed:.1f}s\n"
        f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}\nkreld.log tail:\n{tail}"
    )
    assert (out / "kreld.rc").read_text().strip() == "0", f"kreld did not exit 0:\n{tail}"
    facts = Facts.read(out)
    mods = ", ".join(
        f"{d.name} .text {m.sections['.text']:#x} ({len(m.sections)} sections)"
        for d in sorted((out / "mod").iterdir())
        for m in [facts.module(d.name)]
    )
    say(
        request,
        f"[realkernel] boot {mode}: {run.elapsed:.1f}s, boot-id {facts.boot_id}, "
        f"_text {facts.anchors['_text']:#x}; {mods}",
    )
    with open(rw / "timings.txt", "a") as f:
        f.write(f"{mode} {run.elapsed:.1f}\n")
    return Boot(
        facts=facts,
        run=run,
        show=ctl(state, "show", facts.boot_id, as_boot=facts.boot_id),
        modules=ctl(state, "modules", "--boot", facts.boot_id, "--all", as_boot=facts.boot_id),
        boots=ctl(state, "boots", as_boot=facts.boot_id),
    )


def snapshot(first: Boot, label: str) -> dict[str, Any]:
    d = first.facts.dir
    rc = (d / f"snapshot-{label}.rc").read_text().strip()
    assert rc == "0", (d / f"snapshot-{label}.err").read_text()
    return dict(json.loads((d / f"snapshot-{label}.json").read_text())["boot"])


def seen_first_by_an_event(facts: Facts, by: str | None, action: str, module: str) -> bool:
    """Whether a kernel event saw this load (*action* ``add``) or unload
    (``remove``) first: the module tracepoint (exact, a load's before its init),
    or where none could be opened the uevent; or the poll did, in the moment
    before the kernel sent the uevent (a load's, after the module's init), and
    the uevent came as well."""
    if by in ("tracepoint", "uevent"):
        return True
    return by == "poll" and any(
        r.get("event") == "uevent" and r.get("action") == action and r.get("module") == module
        for r in kreld_log(facts)
    )


def kreld_log(facts: Facts) -> list[dict[str, Any]]:
    out = []
    for line in (facts.dir / "kreld.log").read_text().splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out
