"""The references source lines are checked against, run on files gcc built:
``llvm-symbolizer --inlines`` for an executable, ``eu-addr2line -i -f -j
SECTION`` for a relocatable object; and each code section's instruction
addresses as ``objdump -d`` lists them.  A frame is (function, normalized
file or None, line, inlined), innermost first."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kreld.debuginfo.lines import LineTable, normalize_path

Frames = list[tuple[str, str | None, int, bool]]

# A test module of gcc-built files checked against both references.
NEEDS_REFERENCES = [
    pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed"),
    pytest.mark.skipif(
        shutil.which("llvm-symbolizer") is None or shutil.which("eu-addr2line") is None,
        reason="llvm-symbolizer or eu-addr2line missing (scripts/setup installs llvm, elfutils)",
    ),
]


def ours(table: LineTable, addresses: list[int]) -> list[Frames]:
    """The table's frames at *addresses*, as the references' are given."""
    chains = table.frames_at(np.array(addresses, dtype=np.uint64))
    return [[(f.function, f.file, f.line, f.inlined) for f in fr] for fr in chains]


def norm(path: str) -> str | None:
    return normalize_path("", "", path) if path and path != "??" else None


def instructions(obj: Path) -> dict[str, list[int]]:
    text = subprocess.run(["objdump", "-d", str(obj)], capture_output=True, text=True, check=True)
    out: dict[str, list[int]] = {}
    section = ""
    for line in text.stdout.splitlines():
        m = re.match(r"Disassembly of section (\S+):", line)
        if m:
            section = m.group(1)
            continue
        m = re.match(r"\s+([0-9a-f]+):\t", line)
        if m:
            out.setdefault(section, []).append(int(m.group(1), 16))
    return out


def llvm(exe: Path, addresses: list[int]) -> list[Frames]:
    text = subprocess.run(
        ["llvm-symbolizer", "--inlines", "--output-style=JSON", "-e", str(exe)],
        input="\n".join(hex(a) for a in addresses),
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    out = []
    for entry in (json.loads(line) for line in text.splitlines() if line.strip()):
        syms = entry["Symbol"]
        out.append([(s["FunctionName"], norm(s["FileName"]) if s["Line"] else None, s["Line"],
                     k + 1 < len(syms)) for k, s in enumerate(syms)])  # fmt: skip
    return out


def eu(obj: Path, section: str, offsets: list[int]) -> list[Frames]:
    return eu_said(obj, section, offsets)[0]


def eu_said(obj: Path, section: str, offsets: list[int]) -> tuple[list[Frames], list[bool]]:
    """eu-addr2line's frames at *offsets*, and at each whether it contradicts
    itself: its first line names the innermost scope's function and, where
    that is inlined, the caller and call site (libdw's ``dwarf_getscopes``
    of the address), while its ``-i`` lines walk up from the innermost
    scope's DIE (``dwarf_getscopes_die``), which at a few addresses of a
    large module (a lexical block of an inlined instance, an address two
    instances' ranges share) is another chain."""
    text = "".join(
        subprocess.run(
            ["eu-addr2line", "-a", "-i", "-f", "-j", section, "-e", str(obj),
             *map(hex, offsets[i : i + 10_000])],
            capture_output=True, text=True,  # exits 1 where some address has no line
        ).stdout
        for i in range(0, len(offsets), 10_000)  # argv is bounded
    )  # fmt: skip
    out: list[Frames] = []
    said: list[tuple[str, str | None, int] | None] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("0x"):
            out.append([])
            said.append(None)
            i += 1
            continue
        func, _, inlined = lines[i].partition(" inlined at ")
        m = re.fullmatch(r"(.*?):(\d+)(?::\d+)? in (.*)", inlined)
        if m and not out[-1]:  # "F inlined at FILE:LINE[:COL] in CALLER"
            said[-1] = (m.group(3), norm(m.group(1)), int(m.group(2)))
        m = re.fullmatch(r"(.*?):(\d+)(?::\d+)?", lines[i + 1])
        file, line = (m.group(1), m.group(2)) if m else ("??", "0")
        out[-1].append((func, norm(file), int(line), True))
        i += 2
    frames = [[(f, p, n, k + 1 < len(fr)) for k, (f, p, n, _) in enumerate(fr)] for fr in out]
    odd = [
        bool(fr) and fr[0][0] not in ("", "??")
        and (len(fr) > 1 if caller is None else len(fr) < 2 or fr[1][:3] != caller)
        for fr, caller in zip(frames, said, strict=True)
    ]  # fmt: skip
    return frames, odd


def comparable(ref: Frames) -> bool:
    """The reference named a function from the DWARF (not from the symbol
    table alone, where kreld gives no frames and Resolve names the symbol)."""
    return bool(ref) and ref[0][0] not in ("", "??") and not (len(ref) == 1 and ref[0][2] == 0)
