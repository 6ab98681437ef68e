"""A kernel image and a module built with gcc, and a store recording them, for
the tests of source lines through kreldctl (tests/debuginfo/test_lines_cli.py,
test_lines_for.py): the image a gcc-built executable, the module a relocatable
object linked ``-r`` with a build-id (as a ``.ko`` is) whose sections are
recorded at unrelated bases."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from kreld.core.model import Incarnation, ModuleState, SeenBy, Timestamp
from kreld.store import Store

from support.debuginfo_elves import build_id_of
from support.faketree import FakeTree
from support.linerefs import instructions
from support.run import ctl_json

SRC = Path(__file__).resolve().parents[1] / "debuginfo" / "lines_src"
R = "6.1.0-lines"
RUNTIME_TEXT = 0xFFFFFFFF9A000000
CORE = 0xFFFFFFFFC0100000
BASES = {".text": 0xFFFFFFFFC0101000, ".text.unlikely": 0xFFFFFFFFC0100400,
         ".init.text": 0xFFFFFFFFC0900000, ".text.startup": 0xFFFFFFFFC0100800}  # fmt: skip


class Built:
    """The image and the module, built once; a tree recording them."""

    def __init__(self, base: Path) -> None:
        self.exe = base / "vmlinux"
        subprocess.run(["gcc", "-g", "-O2", "-gdwarf-5", "-Wl,--build-id",
                        "-Wl,--defsym=_text=hot", "-o", str(self.exe), "prog.c"],
                       cwd=SRC, check=True)  # fmt: skip
        obj = base / "prog.o"
        subprocess.run(["gcc", "-c", "-g", "-O2", "-gdwarf-4", "-gz", "-o", str(obj), "prog.c"],
                       cwd=SRC, check=True)  # fmt: skip
        self.ko = base / "prog.ko"
        subprocess.run(["ld", "-r", "--build-id=sha1", "-o", str(self.ko), str(obj)], check=True)
        self.image_bid, self.module_bid = build_id_of(self.exe), build_id_of(self.ko)
        nm = subprocess.run(["nm", str(self.exe)], capture_output=True, text=True, check=True)
        self.link_text = next(
            int(w[0], 16) for w in map(str.split, nm.stdout.splitlines()) if w[-1] == "_text"
        )

    def debug_dir(self, d: Path) -> Path:
        """*d* in Debian's layout, holding both files."""
        (d / "boot").mkdir(parents=True, exist_ok=True)
        shutil.copy(self.exe, d / "boot" / f"vmlinux-{R}")
        mod = d / "lib" / "modules" / R / "kernel" / "drivers" / "misc"
        mod.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.ko, mod / "prog.ko")
        return d

    def recorded(self, base: Path) -> list[str]:
        """A store with the current boot recorded, the module loaded; kreldctl's options."""
        tree = FakeTree(base / "root", text=RUNTIME_TEXT, build_id=self.image_bid, release=R)
        opts = ["--root", str(tree.root), "--state-dir", str(base / "state")]
        ctl_json("snapshot", *opts)
        # The load as the daemon records it, written through the store's own method.
        state = ModuleState(
            name="prog", build_id=self.module_bid, sections=BASES, coresize=0x4000,
            initsize=0x1000, initstate="coming", srcversion=None, taint=None,
            core_base=CORE, restricted=False, inode=1,
        )  # fmt: skip
        t0 = Timestamp(1_000, 1_000, 1_000)
        inc = Incarnation(tree.boot_id, 1, state, t0, SeenBy.UEVENT, init_live=True)
        with Store(base / "state") as store:
            store.modules.apply_module_changes(tree.boot_id, [inc], [], [], None)
        self.boot_id = tree.boot_id
        return opts

    def addresses(self) -> tuple[list[int], list[tuple[str, int]]]:
        """The image's runtime instruction addresses, and the module's (section, offset)."""
        image = [RUNTIME_TEXT + a - self.link_text
                 for a in instructions(self.exe)[".text"] if a >= self.link_text]  # fmt: skip
        module = [(s, o) for s, offs in instructions(self.ko).items() if s in BASES for o in offs]
        return image, module


def json_frames(answer: dict[str, Any]) -> list[tuple[str, str | None, int, bool]]:
    """(function, file, line, inlined) of each frame of a ``--lines --json``
    answer, each frame checked to carry exactly the documented members."""
    for f in answer["frames"]:
        assert set(f) == {"function", "file", "line", "column", "inlined"}
    return [(f["function"], f["file"], f["line"], f["inlined"]) for f in answer["frames"]]
