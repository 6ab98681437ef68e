"""Fake ``proc/`` + ``sys/`` trees for running kreld under ``--root``.

Module directories are built aside and renamed into ``sys/module`` so that
a watcher never sees one half written (the real kernel does expose them
half-built; tests of that case write files in place on purpose).
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import uuid
from collections.abc import Mapping
from pathlib import Path


def note(name: bytes, ntype: int, desc: bytes) -> bytes:
    """One raw ELF note, padded as the kernel emits it."""

    def pad(b: bytes) -> bytes:
        return b + b"\0" * (-len(b) % 4)

    return struct.pack("=III", len(name) + 1, len(desc), ntype) + pad(name + b"\0") + pad(desc)


def link_vmlinux(gcc: str, asm: str, out: Path, link: int, build_id: str) -> Path:
    """Assemble *asm* into a static ELF like a vmlinux: .text linked at *link*,
    a GNU build-id note of *build_id*, entry startup_64."""
    src = out.with_suffix(".S")
    src.write_text(asm)
    subprocess.run(
        [
            gcc, "-nostdlib", "-static", "-no-pie", f"-Wl,-Ttext={link:#x}",
            f"-Wl,--build-id=0x{build_id}", "-Wl,-e,startup_64", "-o", str(out), str(src),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return out


def kcore(vmcoreinfo: bytes, load_at: int = 0xFFFFFFFF81000000) -> bytes:
    """An ELF64 core like /proc/kcore: a PT_LOAD (at *load_at*, where x86-64 links
    _text), then a PT_NOTE with CORE + VMCOREINFO."""
    notes = note(b"CORE", 1, b"\0" * 336) + note(b"VMCOREINFO", 0, vmcoreinfo)
    ehdr = struct.pack(
        "<4sBBBBB7sHHIQQQIHHHHHH",
        b"\x7fELF",
        2,  # ELFCLASS64
        1,  # ELFDATA2LSB
        1,  # EV_CURRENT
        0,
        0,
        b"\0" * 7,
        4,  # ET_CORE
        62,  # EM_X86_64
        1,
        0,
        64,  # e_phoff
        0,
        0,
        64,
        56,  # e_phentsize
        2,  # e_phnum
        0,
        0,
        0,
    )
    notes_at = 64 + 2 * 56
    load = struct.pack("<IIQQQQQQ", 1, 7, notes_at + len(notes), load_at, 0, 0, 0x1000, 0x1000)
    pnote = struct.pack("<IIQQQQQQ", 4, 0, notes_at, 0, 0, len(notes), 0, 4)
    return ehdr + load + pnote + notes


def build_id_note(build_id: str) -> bytes:
    return note(b"GNU", 3, bytes.fromhex(build_id))


class FakeTree:
    """A kernel's view under a directory: boot-id, release, kallsyms, notes, modules."""

    def __init__(
        self,
        root: Path,
        *,
        text: int = 0xFFFFFFFF9D000000,
        build_id: str | None = None,
        release: str = "6.1.0-fake",
        kptr_restrict: int = 0,
    ) -> None:
        self.root = root
        self.release = release
        self.build_id = build_id or uuid.uuid4().hex + "01234567"
        self.boot_id = str(uuid.uuid4())
        (root / "proc/sys/kernel/random").mkdir(parents=True, exist_ok=True)
        (root / "sys/kernel").mkdir(parents=True, exist_ok=True)
        (root / "sys/module").mkdir(parents=True, exist_ok=True)
        (root / "stage").mkdir(exist_ok=True)
        self.write("proc/sys/kernel/random/boot_id", self.boot_id + "\n")
        self.write("proc/sys/kernel/osrelease", release + "\n")
        self.write("proc/sys/kernel/version", "#1 SMP PREEMPT_DYNAMIC fake\n")
        self.write("proc/sys/kernel/kptr_restrict", f"{kptr_restrict}\n")
        self.write("proc/sys/kernel/perf_event_paranoid", "2\n")
        (root / "sys/kernel/notes").write_bytes(
            build_id_note(self.build_id) + note(b"Linux", 6, b"\x00\x01\x00\x00")
        )
        # Host identity, as fleet publishing reads it.
        self.machine_id = uuid.uuid4().hex
        self.hostname = f"host-{self.machine_id[:6]}"
        self.write("etc/machine-id", self.machine_id + "\n")
        self.write("proc/sys/kernel/hostname", self.hostname + "\n")
        self.modules: dict[str, tuple[int, int]] = {}
        self.set_text(text)

    def write(self, rel: str, content: str | bytes) -> None:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)

    def new_boot(self, text: int | None = None) -> str:
        """A reboot: another boot-id, and (optionally) another KASLR slide."""
        self.boot_id = str(uuid.uuid4())
        self.write("proc/sys/kernel/random/boot_id", self.boot_id + "\n")
        if text is not None:
            self.set_text(text)
        return self.boot_id

    def set_text(self, text: int, *, zero: bool = False) -> None:
        """Write a kallsyms whose image starts at *text* (all zeros if *zero*)."""
        self.text = text
        syms = [
            (0, "T", "_text"),
            (0, "T", "_stext"),
            (0x1000, "T", "start_kernel"),
            (0x2000, "t", "do_one_initcall"),
            (0x1000000, "T", "_etext"),
            (0x3000000, "T", "_sinittext"),
            (0x3100000, "T", "_einittext"),
        ]
        lines = [f"{0 if zero else text + off:016x} {t} {n}" for off, t, n in syms]
        lines.append(f"{0 if zero else 0xFFFFFFFFC0000000:016x} t dummy_init\t[dummy]")
        self.write("proc/kallsyms", "\n".join(lines) + "\n")

    def grow_kallsyms(self, lines: int) -> None:
        """Pad the kernel's part of kallsyms to *lines* lines, a real kernel's size
        (~120,000), with local symbols past the anchors' range."""
        data = (self.root / "proc/kallsyms").read_bytes()
        tab = data.find(b"\t[")
        split = len(data) if tab < 0 else data.rfind(b"\n", 0, tab) + 1
        have = data[:split].count(b"\n")
        filler = "".join(
            f"{self.text + 0x4000000 + i * 16:016x} t filler_{i}\n" for i in range(lines - have)
        )
        self.write("proc/kallsyms", data[:split] + filler.encode() + data[split:])

    def add_module(
        self,
        name: str,
        base: int,
        *,
        build_id: str | None = None,
        initstate: str = "live",
        coresize: int = 0x4000,
        initsize: int = 0x1000,
        sections: Mapping[str, int] | None = None,
        zero: bool = False,
        extra_files: Mapping[str, bytes] | None = None,
    ) -> None:
        """Load a module: its sysfs directory appears at once (rename), and /proc/modules."""
        stage = self.root / "stage" / name
        shutil.rmtree(stage, ignore_errors=True)
        (stage / "sections").mkdir(parents=True)
        (stage / "notes").mkdir()
        (stage / "parameters").mkdir()
        secs = (
            dict(sections)
            if sections is not None
            else {
                ".text": base,
                ".data": base + 0x2000,
                ".rodata": base + 0x3000,
                ".gnu.linkonce.this_module": base + 0x3800,
                ".init.text": base + 0x100000,
                ".exit.text": base + 0x1800,
            }
        )
        for s, addr in secs.items():
            (stage / "sections" / s).write_text(f"0x{0 if zero else addr:016x}\n")
        (stage / "notes" / ".note.gnu.build-id").write_bytes(
            build_id_note(build_id or uuid.uuid5(uuid.NAMESPACE_DNS, name).hex[:40].ljust(40, "0"))
        )
        for f, v in {
            "initstate": initstate,
            "coresize": str(coresize),
            "initsize": str(initsize),
            "srcversion": "0123456789ABCDEF0123456",
            "taint": "",
            "refcnt": "0",
        }.items():
            (stage / f).write_text(v + "\n")
        for f, b in (extra_files or {}).items():
            p = stage / f
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b)
        # The kernel lists a module in /proc/modules before its sysfs directory
        # appears (mod_sysfs_setup() runs late in load_module()).
        self.modules[name] = (0 if zero else base, coresize)
        self._write_proc_modules()
        os.rename(stage, self.root / "sys/module" / name)

    def remove_module(self, name: str) -> None:
        """Unload: the directory is deleted in place, as sysfs removes a kobject.

        (Renaming it out would be atomic, but watchdog's inotify observer holds
        an unpaired IN_MOVED_FROM for half a second, and every later event
        queues behind it.)
        """
        self.modules.pop(name, None)
        self._write_proc_modules()
        shutil.rmtree(self.root / "sys/module" / name)

    def add_builtin(self, name: str) -> None:
        (self.root / "sys/module" / name / "parameters").mkdir(parents=True, exist_ok=True)

    def _write_proc_modules(self) -> None:
        # Newest first, as the kernel lists them (each load goes to the list head).
        lines = [
            f"{n} {size} 0 - Live 0x{base:016x}"
            for n, (base, size) in reversed(self.modules.items())
        ]
        tmp = self.root / "proc/.modules.tmp"
        tmp.write_text("".join(line + "\n" for line in lines))
        os.rename(tmp, self.root / "proc/modules")
