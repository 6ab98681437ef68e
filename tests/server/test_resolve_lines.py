"""Resolve with ``lines`` over the daemon's real socket.

The daemon runs as a subprocess on a fake tree whose kernel is a small
program gcc built (``_text`` defined at its hot function: the "vmlinux") and
whose one module is a relocatable object linked with ``ld -r`` and a build-id,
its sections placed at the bases the tree's sysfs gives.  Their debug files
lie under ``/usr/lib/debug`` in the tree, in Debian's layout.  Each address's
frames, innermost first, must be those ``llvm-symbolizer --inlines`` gives
for the executable (the address moved back by the KASLR offset) and
``eu-addr2line -i -f -j SECTION`` for the object.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kreld.client import Client

from support.debuginfo_elves import build_id_of
from support.faketree import FakeTree
from support.linerefs import Frames, comparable, eu, instructions, llvm
from support.run import start
from support.wait import wait_until

SRC = Path(__file__).parents[1] / "debuginfo" / "lines_src"
R = "6.1.0-lines"
TEXT = 0xFFFFFFFF9D000000
BASES = {".text": 0xFFFFFFFFC0200000, ".text.unlikely": 0xFFFFFFFFC0201000,
         ".data": 0xFFFFFFFFC0203000}  # fmt: skip

pytestmark = [
    pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed"),
    pytest.mark.skipif(
        shutil.which("llvm-symbolizer") is None or shutil.which("eu-addr2line") is None,
        reason="llvm-symbolizer or eu-addr2line missing (scripts/setup installs llvm, elfutils)",
    ),
]


def _image(out: Path) -> int:
    """The "vmlinux": prog.c linked with ``_text`` at ``hot``; its ``_text``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-g", "-O2", "-gdwarf-5", "-Wl,--build-id", "-Wl,--defsym=_text=hot",
                    "-o", str(out), "prog.c"], cwd=SRC, check=True)  # fmt: skip
    nm = subprocess.run(["nm", str(out)], capture_output=True, text=True, check=True).stdout
    return next(
        int(v, 16)
        for v, _, n in (ln.split() for ln in nm.splitlines() if ln.count(" ") == 2)
        if n == "_text"
    )


def _module(out: Path) -> None:
    """The module: prog.c compiled, then ``ld -r`` with a build-id, as a .ko is."""
    out.parent.mkdir(parents=True, exist_ok=True)
    obj = out.with_suffix(".o")
    subprocess.run(["gcc", "-c", "-g", "-O2", "-gdwarf-4", "-gz", "-o", str(obj), "prog.c"],
                   cwd=SRC, check=True)  # fmt: skip
    subprocess.run(["ld", "-r", "--build-id=sha1", "-o", str(out), str(obj)], check=True)
    obj.unlink()


def _frames(r: dict[str, Any]) -> Frames:
    return [(f["function"], f["file"], f["line"], f["inlined"]) for f in r["frames"]]


def _tree(tmp_path: Path, with_debuginfo: bool) -> tuple[FakeTree, Path, Path, int]:
    built = tmp_path / "built"
    exe, ko = built / "vmlinux", built / "prog.ko"
    link_text = _image(exe)
    _module(ko)
    tree = FakeTree(tmp_path / "root", text=TEXT, build_id=build_id_of(exe), release=R)
    tree.add_module("prog", BASES[".text"], build_id=build_id_of(ko), sections=BASES)
    if with_debuginfo:
        debug = tree.root / "usr/lib/debug"
        (debug / "boot").mkdir(parents=True)
        shutil.copy(exe, debug / "boot" / f"vmlinux-{R}")
        (debug / "lib/modules" / R / "kernel/drivers").mkdir(parents=True)
        shutil.copy(ko, debug / "lib/modules" / R / "kernel/drivers/prog.ko")
    return tree, exe, ko, link_text


def test_resolve_with_lines_names_kernel_and_module_addresses_as_the_references_do(
    tmp_path: Path, daemon_factory: Any, sockdir: Path
) -> None:
    tree, exe, ko, link_text = _tree(tmp_path, with_debuginfo=True)
    sock = sockdir / "k.sock"
    start(daemon_factory, tree, tmp_path / "state", sock)
    image = [a for a in instructions(exe)[".text"] if a >= link_text]
    code = instructions(ko)
    module = [(s, o) for s in (".text", ".text.unlikely") for o in code[s]]
    asked = [TEXT + a - link_text for a in image] + [BASES[s] + o for s, o in module]
    with Client(str(sock)) as c:
        got = c.resolve([hex(a) for a in asked], lines=True)
        # The tables are built, answered, then kept: Status lists both, with
        # their sources.
        bids = {build_id_of(exe), build_id_of(ko)}
        kept = wait_until(
            "both tables kept",
            lambda: (
                (k := c.call("Status")["line_tables"]["kept"])
                and {t["build_id"] for t in k} == bids
                and k
            ),
            30,
        )
    assert all(t["size"] > 0 and "/usr/lib/debug/" in t["source"] for t in kept)
    refs = llvm(exe, image)
    for sec in (".text", ".text.unlikely"):
        refs += eu(ko, sec, [o for s, o in module if s == sec])
    compared = 0
    for a, r, ref in zip(asked, got, refs, strict=True):
        if comparable(ref):
            assert _frames(r) == ref, hex(a)
            compared += 1
        else:
            assert r["frames"] or r["no_lines"], hex(a)
    assert compared > 60
    assert any(len(_frames(r)) > 1 for r in got), "an inline chain was named"


def test_an_address_of_a_build_without_debuginfo_keeps_its_symbol_and_says_where_it_looked(
    tmp_path: Path, daemon_factory: Any, sockdir: Path
) -> None:
    tree, _, _, _ = _tree(tmp_path, with_debuginfo=False)
    sock = sockdir / "k.sock"
    start(daemon_factory, tree, tmp_path / "state", sock)
    with Client(str(sock)) as c:
        wait_until(  # the kernel's symbols are captured after the start
            "the kernel's symbols", lambda: "symbol" in c.resolve([hex(TEXT + 0x1000)])[0], 60
        )
        a, m, nowhere = c.resolve([hex(TEXT + 0x1000), hex(BASES[".text"] + 4), "0x10"], lines=True)
        assert a["symbol"] == "start_kernel" and a["frames"] == []
        assert f"build {tree.build_id}" in a["no_lines"]
        assert "usr/lib/debug" in a["no_lines"]
        assert m["image"] == "prog" and "module prog" in m["no_lines"]
        assert "not in the kernel image" in nowhere["no_lines"]
        # Remembered: Status says why, and the next call answers alike.
        missing = c.call("Status")["line_tables"]["missing"]
        assert tree.build_id in missing
        assert c.resolve([hex(TEXT + 0x1000)], lines=True)[0]["no_lines"] == a["no_lines"]
        # Without lines, nothing of them.
        assert "lines" not in c.call("Resolve", addresses=[hex(TEXT + 0x1000)])


def test_a_build_over_the_readers_memory_bound_is_named_and_the_daemon_goes_on(
    tmp_path: Path, daemon_factory: Any, sockdir: Path
) -> None:
    """``[kernel] line_build_memory`` bounds the DWARF reader's process: the
    kernel's debug file, padded past the bound, fails with the bound named
    (the reader dies, the daemon does not); the module's builds as before,
    and nothing is degraded."""
    tree, exe, _, link_text = _tree(tmp_path, with_debuginfo=True)
    debug_exe = tree.root / "usr/lib/debug/boot" / f"vmlinux-{R}"
    pad = tmp_path / "pad"
    with open(pad, "wb") as f:
        f.truncate(128 << 20)
    subprocess.run(["objcopy", f"--add-section=.kreld_pad={pad}", str(debug_exe)], check=True)
    cfg = tmp_path / "kreld.toml"
    cfg.write_text(f"[kernel]\nline_build_memory = {64 << 20}\n")
    sock = sockdir / "k.sock"
    start(daemon_factory, tree, tmp_path / "state", sock, "--config", str(cfg))
    image = [a for a in instructions(exe)[".text"] if a >= link_text][:5]
    with Client(str(sock)) as c:
        a, m = c.resolve([hex(TEXT + image[0] - link_text), hex(BASES[".text"] + 4)], lines=True)
        assert a["frames"] == []
        assert a["no_lines"].endswith(
            "the DWARF reader went over its memory bound of 64 MiB ([kernel] line_build_memory)"
        )
        assert m["frames"] and "no_lines" not in m
        st = c.call("Status")
        assert st["degraded"] == []
        assert tree.build_id in st["line_tables"]["missing"]
        kept = wait_until("the module's table kept", lambda: st["line_tables"]["kept"]
                          or c.call("Status")["line_tables"]["kept"], 30)  # fmt: skip
        assert [t["what"] for t in kept] == [f"module prog of {R}"]
