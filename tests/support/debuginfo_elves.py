"""Small ELF files with DWARF and a GNU build-id, built with gcc, for the
debuginfo tests: a linked program (as the kernel image stands) and a
relocatable object linked with ``-r`` (as a module is), each a distinct build."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

import pytest

from kreld.kernel.elf import fd_build_id

SOURCE = """
static int twice(int a) { return a * 2 + SALT; }
int work(int a) { return twice(a) ^ (a >> 3); }
int more(int a, int b) { return work(a) + work(b) * SALT; }
"""
MAIN = "int main(void) { return more(1, 2) & 1; }\n"


def build_id_of(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        found = fd_build_id(fd)
    finally:
        os.close(fd)
    assert found, path
    return found


@functools.cache
def _zstd_linker() -> bool:
    """Whether ld here compresses debug sections with zstd (binutils 2.40)."""
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"kreld-zstd-probe-{os.getpid()}"
    cp = subprocess.run(
        ["gcc", "-g", "-x", "c", "-", "-o", str(probe), "-Wl,--compress-debug-sections=zstd"],
        input=MAIN.replace("more(1, 2)", "0"),
        capture_output=True,
        text=True,
        check=False,
    )
    probe.unlink(missing_ok=True)
    return cp.returncode == 0


def build(out: Path, salt: int, kind: str = "image", compress: str = "none") -> str:
    """Build *out* (``kind`` image: a program; module: ``ld -r``), its debug
    sections compressed as *compress* says; returns its build-id."""
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_name(out.name + ".c")
    src.write_text(SOURCE.replace("SALT", str(salt)) + (MAIN if kind == "image" else ""))
    flags = ["-g", "-O2", "-Wl,--build-id"]
    if compress == "zlib":
        flags.append("-gz=zlib")
    elif compress == "zstd":
        if not _zstd_linker():
            pytest.skip("this ld cannot compress debug sections with zstd")
        flags.append("-Wl,--compress-debug-sections=zstd")
    if kind == "module":
        obj = out.with_name(out.name + ".o")
        subprocess.run(["gcc", "-g", "-O2", "-c", str(src), "-o", str(obj)], check=True)
        cmd = ["gcc", "-r", "-nostdlib", *flags, str(obj), "-o", str(out)]
    else:
        cmd = ["gcc", *flags, str(src), "-o", str(out)]
    subprocess.run(cmd, check=True)
    src.unlink()
    return build_id_of(out)


def section_flags(path: Path) -> str:
    """``readelf -S`` of *path*, to see which sections are compressed."""
    return subprocess.run(
        ["readelf", "-SW", str(path)], capture_output=True, text=True, check=True
    ).stdout
