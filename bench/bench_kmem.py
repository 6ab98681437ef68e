"""What reading modules in kernel memory costs, against today's sysfs reads.

Where kptr_restrict=2 zeroes ``/sys/module/*/sections``, the tracker still reads
each module's sysfs directory (build-id, sizes, state; the sections read as
zeros) and then walks the kernel's module list in ``/proc/kcore`` for the
addresses.  Both sides run in process on files built like the real ones
(tests/support/faketree.py for sysfs, tests/support/kmodimage.py for a kcore image in the pre-6.4
layout with its BTF), 100 modules of 24 sections each:

* at start: all 100 read; baseline: the same 100 read in a sysfs tree that
  shows the addresses (what kreld does today);
* per load: the newest module (at the list's head) read; baseline: that one
  module read in sysfs.

Goal: within 2x of the sysfs reads.  Both sides' files are on the
same file system (page cache); on a real kernel each sysfs read and each kcore
read costs more (the VM figures are in tests/vm/test_seethrough_vm.py's notes).

And the kernel's own symbol table on a stock host: decoding its kallsyms tables
(150,000 symbols, encoded as scripts/kallsyms.c does, tests/support/kallsymsbuild.py)
from a kcore image and checking them against kallsyms' names, against reading
``/proc/kallsyms`` itself (this host's, every line formatted by its kernel).

Run alone: ``.venv/bin/python bench/bench_kmem.py [--quick]``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from common import Result, bench_main, interleaved, load_faketree, log, median

from kreld.kernel.btf import Btf
from kreld.kernel.info import Root
from kreld.kernel.kallsyms import KallsymsText
from kreld.kernel.kcore import Kcore
from kreld.kernel.memkallsyms import read_kallsyms
from kreld.kernel.module_struct import module_layout
from kreld.kernel.modules_sysfs import read_module, read_proc_modules
from kreld.kernel.seethrough import KernelMemory, see_through

OFFSET = 0x2A000000
MODULES = 100
SECTIONS = [".text", ".data", ".rodata", ".bss", ".init.text", ".init.data", ".exit.text"]
SECTIONS += [".gnu.linkonce.this_module", ".note.gnu.build-id", ".note.Linux", "__param"]
SECTIONS += [".orc_unwind", ".orc_unwind_ip", "__mcount_loc", ".rodata.str1.1", ".strtab"]
SECTIONS += [".symtab", ".text.unlikely", "__bug_table", "__jump_table", ".return_sites"]
SECTIONS += [".static_call_sites", ".exit.data", ".init.rodata"]


def _build(tmp: Path) -> tuple[Root, Root, KernelMemory, list[str]]:
    faketree = load_faketree()
    from support import kmodimage

    visible = faketree.FakeTree(tmp / "visible")
    zeroed = faketree.FakeTree(tmp / "zeroed", kptr_restrict=2)
    image = kmodimage.ModuleImage("old")
    names = [f"mod{i:03d}" for i in range(MODULES)]
    for i, name in enumerate(names):
        base = kmodimage.MODAREA + 0x100000 + i * 0x2000
        secs = {s: base + j * 0x100 for j, s in enumerate(SECTIONS)}
        bid = f"{i:040x}"
        image.add(name, secs, core=(base, 0x4000), build_id=bid)
        for tree, zero in ((visible, False), (zeroed, True)):
            tree.add_module(name, base, sections=secs, zero=zero, build_id=bid, coresize=0x4000)
    kcore = image.save(tmp / "kcore")
    layout = module_layout(Btf.parse(kmodimage.old_btf()))
    link = {"modules": kmodimage.MODULES_HEAD - OFFSET}
    kmem = KernelMemory(Kcore.open(kcore), layout, OFFSET, link, "")
    return Root(visible.root), Root(zeroed.root), kmem, names


def run(quick: bool) -> list[Result]:
    """Modules read in kernel memory (kptr_restrict=2) against sysfs reads."""
    n = 10 if quick else 40
    with tempfile.TemporaryDirectory(prefix="kreld-bench-kmem-") as d:
        visible, zeroed, kmem, names = _build(Path(d))
        newest = names[-1]
        pv, pz = read_proc_modules(visible), read_proc_modules(zeroed)

        def start_sysfs() -> None:
            for name in names:
                read_module(visible, name, pv)

        def start_kmem() -> None:
            states = {name: read_module(zeroed, name, pz) for name in names}
            found = kmem.modules(set(names))
            for name, s in states.items():
                if s is None or see_through(s, found.get(name)).restricted:
                    raise RuntimeError(f"{name} not seen through")

        def load_sysfs() -> None:
            read_module(visible, newest, pv)

        def load_kmem() -> None:
            s = read_module(zeroed, newest, pz)
            if s is None or see_through(s, kmem.modules({newest}).get(newest)).restricted:
                raise RuntimeError(f"{newest} not seen through")

        log(f"bench_kmem: {MODULES} modules, {len(SECTIONS)} sections each, {n} runs")
        t = interleaved({"ss": start_sysfs, "sk": start_kmem, "ls": load_sysfs, "lk": load_kmem}, n)
        kmem.close()
    desc = "the same reads of a sysfs tree that shows addresses (today's path)"
    return [
        *_tables(max(3, n // 4)),
        Result(
            f"start: {MODULES} modules read, sections from kernel memory p50",
            median(t["sk"]),
            "ns",
            median(t["ss"]),
            "sysfs",
            desc,
            "<= 2x",
            median(t["sk"]) <= 2 * median(t["ss"]),
            "kmem",
        ),
        Result(
            "per load: the newest module, sections from kernel memory p50",
            median(t["lk"]),
            "ns",
            median(t["ls"]),
            "sysfs",
            desc,
            "<= 2x",
            median(t["lk"]) <= 2 * median(t["ls"]),
            "kmem",
        ),
    ]


SYMBOLS = 150_000


def _tables(n: int) -> list[Result]:
    """The kernel's table decoded from memory against a read of /proc/kallsyms."""
    load_faketree()
    from support import kallsymsbuild
    from support.kmembuild import KcoreImage

    text = 0xFFFFFFFFAB000000
    lines = [(0x1000, "A", "irq_stack_backing_store"), (text, "T", "_text"), (text, "T", "_stext")]
    lines += [(text + 0x1000 + 16 * i, "t", f"some_function_{i}") for i in range(SYMBOLS)]
    listed = kallsymsbuild.kallsyms_text(lines, zero=True).encode()
    with tempfile.TemporaryDirectory(prefix="kreld-bench-ksyms-") as d:
        img = KcoreImage()
        img.segment(0xFFFFFFFFAD000000, 0x800000)
        info = {"SYMBOL(_stext)": f"{text:x}"}
        info |= kallsymsbuild.place(img, 0xFFFFFFFFAD000000, lines, "percpu")
        path = img.save(Path(d) / "kcore", info)
        with Kcore.open(path) as kcore:
            t = interleaved(
                {
                    "decode": lambda: read_kallsyms(kcore, listed),
                    "read": lambda: KallsymsText.read(Root(Path("/"))),
                },
                n,
            )
    real = KallsymsText.read(Root(Path("/"))).data.count(b"\n")
    return [
        Result(
            f"kernel table: {SYMBOLS} symbols decoded from kernel memory, checked p50",
            median(t["decode"]),
            "ns",
            median(t["read"]),
            "kallsyms",
            f"one read of this host's /proc/kallsyms ({real} lines)",
            bench="kmem",
        )
    ]


if __name__ == "__main__":
    sys.exit(bench_main("kmem", run))
