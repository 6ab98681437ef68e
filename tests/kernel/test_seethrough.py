"""kptr_restrict=2 seen through: a fake root whose kallsyms and
/sys/module/*/sections show zeros, with a kcore-shaped proc/kcore holding the
kernel's notes and module list, BTF in sys/kernel/btf/vmlinux and a System.map
in boot/.  kreldctl and kreld run as real subprocesses against it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kreld.core.model import AddressSource, Anchors
from kreld.kernel.info import Root
from kreld.kernel.modules_kcore import KernelModule
from kreld.kernel.modules_sysfs import read_module
from kreld.kernel.seethrough import open_kernel_memory, see_through

from support.faketree import FakeTree
from support.kmodimage import KTEXT, MODAREA, MODULES_HEAD, ModuleImage, new_btf, old_btf
from support.run import kreldctl, start
from support.wait import wait_until

RELEASE = "6.1.0-fake"
OFFSET = 0x2A000000
RUNTIME_TEXT = KTEXT  # the kcore image's kernel segment starts at _text
LINK_TEXT = KTEXT - OFFSET
NOTES_AT = KTEXT + 0x40000  # __start_notes, runtime
# (offset from _text, type, name) in kallsyms' (address) order, as kallsyms lists them
KERNEL = [
    (0, "T", "_text"),
    (0, "T", "_stext"),
    (0x1000, "T", "start_kernel"),
    (0x2000, "t", "do_one_initcall"),
    (0x40000, "R", "__start_notes"),
    (0x1000000, "T", "_etext"),
    (0x3000000, "T", "_sinittext"),
    (0x3100000, "T", "_einittext"),
]
DUMMY = {
    ".text": MODAREA + 0x100000,
    ".data": MODAREA + 0x102000,
    ".init.text": MODAREA + 0x180000,
    ".note.gnu.build-id": MODAREA + 0x101000,
}
DUMMY_ID = "4bd0a1f1c9c4f23a4399a7b977c69cd5bde729a0"
BRD = {
    ".text": MODAREA + 0x200000,
    ".data": MODAREA + 0x203000,
    ".exit.text": MODAREA + 0x200800,
    ".note.gnu.build-id": MODAREA + 0x202000,
}


class Restricted:
    """A root at kptr_restrict=2 whose kernel memory is readable."""

    def __init__(self, tmp_path: Path, layout: str = "old") -> None:
        self.tree = FakeTree(tmp_path / "root", release=RELEASE, kptr_restrict=2)
        self.tree.set_text(RUNTIME_TEXT, zero=True)
        self.root = self.tree.root
        self.image = ModuleImage(layout)
        self.notes = (self.root / "sys/kernel/notes").read_bytes()
        self.image.img.write(NOTES_AT, self.notes)
        self.tree.write("sys/kernel/btf/vmlinux", old_btf() if layout == "old" else new_btf())
        self.write_map()
        self.kcore = self.root / "proc/kcore"
        self.save()

    def write_map(self, notes_size: int | None = None) -> None:
        syms = [(LINK_TEXT + off, t, n) for off, t, n in KERNEL]
        size = len(self.notes) if notes_size is None else notes_size
        syms += [
            (NOTES_AT - OFFSET + size, "R", "__stop_notes"),
            (MODULES_HEAD - OFFSET, "d", "modules"),
        ]
        lines = [f"{a:016x} {t} {n}\n" for a, t, n in sorted(syms, key=lambda s: s[0])]
        self.tree.write(f"boot/System.map-{RELEASE}", "".join(lines))

    info = {"OSRELEASE": RELEASE, "KERNELOFFSET": f"{OFFSET:x}", "SYMBOL(_stext)": f"{KTEXT:x}"}

    def save(self) -> None:
        self.image.img.save(self.kcore, self.info)

    def load(
        self, name: str, sections: dict[str, int], core: int, build_id: str, *, zero: bool = True
    ) -> int:
        """The kernel's order: on the module list first, then in sysfs (zeros,
        unless not *zero*).  Its symbols: ``NAME_init`` in .text, exported, and
        ``NAME_data`` in .data."""
        syms = [(f"{name}_init", sections[".text"], "t", True)]
        syms.append((f"{name}_data", sections[".data"] + 8, "d", False))
        mod = self.image.add(
            name, sections, core=(sections[".text"], core), build_id=build_id, symbols=syms
        )
        kallsyms = self.root / "proc/kallsyms"  # names listed, addresses zeroed
        lines = "".join(f"{0 if zero else v:016x} {t} {n}\t[{name}]\n" for n, v, t, _e in syms)
        kallsyms.write_text(kallsyms.read_text() + lines)
        self.image.rewrite(self.kcore, self.info)
        self.tree.add_module(
            name, sections[".text"], sections=sections, zero=zero, build_id=build_id, coresize=core
        )
        return mod

    def kptr_restrict(self, value: int) -> None:
        """The sysctl written while kreld runs: 2 zeroes kallsyms (and later
        loads' sections), 0 shows the kernel's addresses again."""
        self.tree.write("proc/sys/kernel/kptr_restrict", f"{value}\n")
        self.tree.set_text(RUNTIME_TEXT, zero=value == 2)


def snapshot(r: Restricted, tmp_path: Path) -> dict[str, Any]:
    state = str(tmp_path / "state")
    kreldctl("snapshot", "--root", str(r.root), "--state-dir", state)
    shown = kreldctl("show", "--json", "--root", str(r.root), "--state-dir", state)
    boot: dict[str, Any] = json.loads(shown.stdout)
    return boot


@pytest.mark.parametrize("layout", ["old", "new"])
def test_a_restricted_boot_takes_its_anchors_from_kernel_memory(
    tmp_path: Path, layout: str
) -> None:
    r = Restricted(tmp_path, layout)
    boot = snapshot(r, tmp_path)
    assert boot["restricted"] is False and boot["restricted_reason"] is None
    assert boot["address_source"] == "kcore"
    assert (
        boot["anchors"]
        == Anchors(
            RUNTIME_TEXT,
            RUNTIME_TEXT,
            RUNTIME_TEXT + 0x1000000,
            RUNTIME_TEXT + 0x3000000,
            RUNTIME_TEXT + 0x3100000,
        ).to_json()
    )
    assert (boot["kaslr_offset"], boot["kaslr_source"]) == (f"{OFFSET:#x}", "vmcoreinfo")
    text = kreldctl("show", "--root", str(r.root), "--state-dir", str(tmp_path / "state")).stdout
    assert "from kernel memory" in text


def _no_kcore(r: Restricted) -> None:
    r.kcore.unlink()


def _no_btf(r: Restricted) -> None:
    (r.root / "sys/kernel/btf/vmlinux").unlink()


def _another_builds_map(r: Restricted) -> None:
    r.image.img.write(
        NOTES_AT, b"\x01" * len(r.notes)
    )  # memory at its __start_notes is not our notes
    r.save()


def _map_in_another_order(r: Restricted) -> None:
    """Anchors and notes where they belong, the other names in reverse order."""
    r.write_map()
    path = r.root / f"boot/System.map-{RELEASE}"
    lines = path.read_text().splitlines(keepends=True)
    names = ["start_kernel", "do_one_initcall", "_etext", "_sinittext", "_einittext"]
    at = [i for i, line in enumerate(lines) if line.split()[2] in names]
    fields = [lines[i].split() for i in at]
    for i, f, name in zip(at, fields, reversed([f[2] for f in fields]), strict=True):
        lines[i] = f"{f[0]} {f[1]} {name}\n"
    path.write_text("".join(lines))


def _locked_down(r: Restricted) -> None:
    r.kcore.unlink()  # as the kernel refuses it: the reason says why
    r.tree.write("sys/kernel/security/lockdown", "none integrity [confidentiality]\n")


def _no_kerneloffset(r: Restricted) -> None:
    r.image.img.save(r.kcore, {"OSRELEASE": RELEASE})


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_no_kcore, "cannot read kernel memory"),
        (_locked_down, "lockdown=confidentiality"),
        (_no_btf, "no usable BTF"),
        (_another_builds_map, "does not hold the kernel's notes"),
        (_map_in_another_order, "kallsyms' neighbouring names"),
        (_no_kerneloffset, "no KERNELOFFSET"),
    ],
)
def test_where_kernel_memory_cannot_be_read_the_boot_stays_restricted_with_the_reason(
    tmp_path: Path, damage: Callable[[Restricted], None], reason: str
) -> None:
    r = Restricted(tmp_path)
    damage(r)
    boot = snapshot(r, tmp_path)
    assert boot["restricted"] is True and boot["address_source"] is None
    assert "kernel.kptr_restrict=2" in boot["restricted_reason"]
    assert reason in boot["restricted_reason"], boot["restricted_reason"]
    assert all(v is None for v in boot["anchors"].values()), "no zero, no guessed address"


def test_a_module_read_in_memory_must_be_the_load_sysfs_shows(tmp_path: Path) -> None:
    r = Restricted(tmp_path)
    r.load("dummy", DUMMY, 0x3000, DUMMY_ID)
    kmem, why = open_kernel_memory(Root(r.root), RELEASE)
    assert kmem is not None, why
    found = kmem.modules()["dummy"]
    state = read_module(Root(r.root), "dummy")
    assert state is not None and state.restricted and not state.sections
    seen = see_through(state, found)
    assert dict(seen.sections) == DUMMY and seen.source == AddressSource.KCORE
    assert not seen.restricted and seen.core_base == DUMMY[".text"]
    other = KernelModule("dummy", found.address, "live", DUMMY, 0x3000, 0, None, "00" * 20)
    refused = see_through(state, other)
    assert refused.restricted and not refused.sections and "build-id" in refused.faults[-1]
    bigger = KernelModule("dummy", found.address, "live", DUMMY, 0x9000, 0, None, DUMMY_ID)
    assert see_through(state, bigger).restricted
    assert see_through(state, None).restricted
    kmem.close()


def modules(r: Restricted, sock: Path) -> list[dict[str, Any]]:
    out = kreldctl("modules", "--all", "--json", "--socket", str(sock), "--root", str(r.root))
    mods: list[dict[str, Any]] = json.loads(out.stdout)
    return mods


@pytest.mark.parametrize("layout", ["old", "new"])
def test_the_daemon_follows_loads_and_unloads_with_sections_from_kernel_memory(
    tmp_path: Path, layout: str, daemon_factory: Any, sockdir: Path
) -> None:
    r = Restricted(tmp_path, layout)
    r.load("dummy", DUMMY, 0x3000, DUMMY_ID)
    sock = sockdir / "kreld.sock"
    d = start(daemon_factory, r.tree, tmp_path / "state", sock)
    status = json.loads(kreldctl("status", "--json", "--socket", str(sock)).stdout)
    assert status["restricted"] is False and status["address_source"] == "kcore"
    r.load("brd", BRD, 0x5000, "710ab937b3c59fe0e41cfdec42b39d352ff0bd8b")
    wait_until("brd recorded", lambda: any(m["name"] == "brd" for m in modules(r, sock)))
    r.image.unlink(r.image.mods[-1])  # dummy: off the list, then out of sysfs
    r.image.rewrite(r.kcore, r.info)
    r.tree.remove_module("dummy")
    wait_until("dummy unloaded", lambda: modules(r, sock)[0]["unloaded"] is not None)
    dummy, brd = modules(r, sock)
    assert {k: int(v, 16) for k, v in dummy["sections"].items()} == DUMMY
    assert {k: int(v, 16) for k, v in brd["sections"].items()} == BRD
    for m in (dummy, brd):
        assert m["address_source"] == "kcore" and m["restricted"] is False
        assert m["core_base"] == f"{m['sections']['.text']}"
    assert dummy["build_id"] == DUMMY_ID
    # The kernel's lines: kallsyms' names in its order, addresses from the map, moved.
    want = [f"{RUNTIME_TEXT + off:016x} {t} {n}" for off, t, n in KERNEL if n != "__start_notes"]
    wait_until("kernel symbols", lambda: "kernel_symbols" in {e["event"] for e in d.events()})
    wait_until(
        "brd's symbols",
        lambda: any(e.get("module") == "brd" for e in d.events() if e["event"] == "module_symbols"),
    )
    export = kreldctl("export", "kallsyms", "--socket", str(sock)).stdout.splitlines()
    assert export[: len(want)] == want
    # brd's lines (kallsyms names them with zeros): its own table, read in kernel memory.
    assert export[len(want) :] == [
        f"{BRD['.text']:016x} T brd_init\t[brd]",
        f"{BRD['.data'] + 8:016x} d brd_data\t[brd]",
    ]
    assert d.stop() == 0
    # What was stored says the same, read back without the daemon.
    state = str(tmp_path / "state")
    got = kreldctl("modules", "--all", "--json", "--state-dir", state, "--root", str(r.root))
    stored = json.loads(got.stdout)
    assert [(m["name"], m["address_source"]) for m in stored] == [
        ("dummy", "kcore"),
        ("brd", "kcore"),
    ]


def test_kernel_lines_take_the_maps_addresses_in_kallsyms_order_per_cpu_ones_unmoved(
    tmp_path: Path,
) -> None:
    """kallsyms' names and types, its order; the n-th line of a name takes the
    map's n-th address of it, moved (per-cpu ``A`` lines as the map has them);
    a name the map lacks gets no line, and owned lines are left out."""
    from kreld.kernel.kallsyms import KallsymsText
    from kreld.kernel.seethrough import kallsyms_from_map

    r = Restricted(tmp_path)
    zeroed = (
        "0000000000000000 A fixed_percpu_data\n"
        "0000000000000000 A irq_stack_backing_store\n"
        "0000000000000000 T _text\n"
        "0000000000000000 t helper\n"
        "0000000000000000 t helper\n"
        "0000000000000000 t only_in_kallsyms\n"
        "0000000000000000 t bpf_prog_1\t[bpf]\n"
    )
    mapped = (
        "0000000000000000 D fixed_percpu_data\n"
        "0000000000001000 D irq_stack_backing_store\n"
        f"{LINK_TEXT:016x} T _text\n"
        f"{LINK_TEXT + 0x10:016x} t helper\n"
        f"{LINK_TEXT + 0x20:016x} t helper\n"
    )
    r.tree.write(f"boot/System.map-{RELEASE}", mapped)
    kmem, why = open_kernel_memory(Root(r.root), RELEASE)
    assert kmem is None and "lacks" in (why or "")  # no __start_notes: not this kernel's map
    r.write_map()
    kmem, why = open_kernel_memory(Root(r.root), RELEASE)
    assert kmem is not None, why
    kmem.system_map = str(tmp_path / "map")
    Path(kmem.system_map).write_text(mapped)
    ks, dropped = kallsyms_from_map(KallsymsText.of(zeroed.encode()), kmem)
    assert ks.data.decode().splitlines() == [
        "0000000000000000 A fixed_percpu_data",
        "0000000000001000 A irq_stack_backing_store",
        f"{RUNTIME_TEXT:016x} T _text",
        f"{RUNTIME_TEXT + 0x10:016x} t helper",
        f"{RUNTIME_TEXT + 0x20:016x} t helper",
    ]
    assert dropped == 1
    kmem.close()


def test_pointers_hidden_while_the_daemon_runs_send_later_loads_to_kernel_memory_and_back(
    tmp_path: Path, daemon_factory: Any, sockdir: Path
) -> None:
    """Started at kptr_restrict=0 (sysfs, no kernel memory opened); raised to 2:
    the next load, zeros in sysfs, is read in kernel memory opened then, once;
    lowered to 0: the next load is read in sysfs again.  Status says each."""
    r = Restricted(tmp_path)
    r.kptr_restrict(0)
    r.load("dummy", DUMMY, 0x3000, DUMMY_ID, zero=False)
    sock = sockdir / "kreld.sock"
    d = start(daemon_factory, r.tree, tmp_path / "state", sock)
    status = json.loads(kreldctl("status", "--json", "--socket", str(sock)).stdout)
    assert status["restricted"] is False and status["address_source"] == "kallsyms"
    assert not [e for e in d.events() if e["event"] == "kernel_memory"]
    r.kptr_restrict(2)
    r.load("brd", BRD, 0x5000, "710ab937b3c59fe0e41cfdec42b39d352ff0bd8b")
    wait_until("brd recorded", lambda: any(m["name"] == "brd" for m in modules(r, sock)))
    # brd's own table (kallsyms names it with zeros), read in the kernel memory opened then.
    wait_until(
        "brd's symbols",
        lambda: any(e.get("module") == "brd" for e in d.events() if e["event"] == "module_symbols"),
    )
    status = json.loads(kreldctl("status", "--json", "--socket", str(sock)).stdout)
    assert status["restricted"] is False and status["address_source"] == "kcore", status
    export = kreldctl("export", "kallsyms", "--socket", str(sock)).stdout.splitlines()
    assert f"{BRD['.text']:016x} T brd_init\t[brd]" in export
    assert f"{BRD['.data'] + 8:016x} d brd_data\t[brd]" in export
    r.kptr_restrict(0)  # kallsyms rewritten: brd's captured first
    r.tree.add_module("loop", MODAREA + 0x300000, zero=False)
    wait_until("loop recorded", lambda: any(m["name"] == "loop" for m in modules(r, sock)))
    dummy, brd, loop = modules(r, sock)
    assert [m["address_source"] for m in (dummy, brd, loop)] == ["sysfs", "kcore", "sysfs"]
    assert {k: int(v, 16) for k, v in dummy["sections"].items()} == DUMMY
    assert {k: int(v, 16) for k, v in brd["sections"].items()} == BRD
    assert int(loop["sections"][".text"], 16) == MODAREA + 0x300000
    assert not any(m["restricted"] for m in (dummy, brd, loop))
    opened = [e for e in d.events() if e["event"] == "kernel_memory"]
    assert [e["system_map"] for e in opened] == [str(r.root / f"boot/System.map-{RELEASE}")]
    status = json.loads(kreldctl("status", "--json", "--socket", str(sock)).stdout)
    assert status["restricted"] is False and status["address_source"] == "kallsyms", status
    assert d.stop() == 0


def test_pointers_hidden_while_running_without_kernel_memory_record_why_and_try_once_a_minute(
    tmp_path: Path, daemon_factory: Any, sockdir: Path
) -> None:
    """Raised to 2 where /proc/kcore cannot be read: the load is recorded
    restricted, no address, the reason among its faults (and in Status); a
    second load within the minute does not try again (one ``kernel_memory`` event)."""
    r = Restricted(tmp_path)
    r.kptr_restrict(0)
    r.kcore.unlink()
    sock = sockdir / "kreld.sock"
    d = start(daemon_factory, r.tree, tmp_path / "state", sock)
    r.kptr_restrict(2)
    r.tree.add_module("brd", BRD[".text"], sections=BRD, zero=True)
    r.tree.add_module("loop", MODAREA + 0x300000, zero=True)
    wait_until("both recorded", lambda: len(modules(r, sock)) == 2)
    for m in modules(r, sock):
        assert m["restricted"] is True and m["address_source"] is None
        assert not m["sections"] or not any(int(v, 16) for v in m["sections"].values())
        assert any("kernel memory: cannot read kernel memory" in f for f in m["faults"])
    tries = [e for e in d.events() if e["event"] == "kernel_memory"]
    assert len(tries) == 1 and tries[0]["system_map"] is None and "kcore" in tries[0]["why"]
    status = json.loads(kreldctl("status", "--json", "--socket", str(sock)).stdout)
    assert status["restricted"] is True and status["address_source"] is None, status
    assert status["restricted_reason"].startswith("kernel memory: cannot read"), status
    assert d.stop() == 0


def stock(tmp_path: Path, layout: str = "old") -> tuple[Restricted, list[str]]:
    """A stock host at kptr_restrict=2: Debian's placeholder System.map, the
    kernel's own kallsyms tables in its memory (named in VMCOREINFO); the
    true kernel lines, as kallsyms prints them at kptr_restrict=0."""
    from support.kallsymsbuild import kallsyms_text, place

    r = Restricted(tmp_path, layout)
    r.tree.write(f"boot/System.map-{RELEASE}", "ffffffffffffffff B The real System.map is in ...\n")
    lines = [(RUNTIME_TEXT + off, t, n) for off, t, n in KERNEL]
    lines = sorted([*lines, (MODULES_HEAD, "D", "modules")], key=lambda x: x[0])
    lines = [(0x1000, "A", "irq_stack_backing_store"), *lines]
    r.info = {**r.info, **place(r.image.img, KTEXT + 0xC0000, lines, "percpu")}
    r.tree.write("proc/kallsyms", kallsyms_text(lines, zero=True))
    r.save()
    return r, kallsyms_text(lines, zero=False).splitlines()


def test_a_stock_host_takes_its_anchors_from_the_kernels_own_tables(tmp_path: Path) -> None:
    r, _true = stock(tmp_path)
    boot = snapshot(r, tmp_path)
    assert boot["restricted"] is False and boot["address_source"] == "kcore-kallsyms"
    assert (
        boot["anchors"]
        == Anchors(
            RUNTIME_TEXT,
            RUNTIME_TEXT,
            RUNTIME_TEXT + 0x1000000,
            RUNTIME_TEXT + 0x3000000,
            RUNTIME_TEXT + 0x3100000,
        ).to_json()
    )


def test_a_stock_host_whose_tables_disagree_with_kallsyms_stays_restricted(
    tmp_path: Path,
) -> None:
    r, _true = stock(tmp_path)
    listed = (r.root / "proc/kallsyms").read_text().replace(" start_kernel", " start_kernal")
    r.tree.write("proc/kallsyms", listed)
    boot = snapshot(r, tmp_path)
    assert boot["restricted"] is True and boot["address_source"] is None
    assert "no System.map of this kernel" in boot["restricted_reason"]
    assert "disagree with it at line 4" in boot["restricted_reason"], boot["restricted_reason"]


@pytest.mark.parametrize("layout", ["old", "new"])
def test_a_stock_daemon_exports_the_true_kernel_lines_and_follows_modules(
    tmp_path: Path, layout: str, daemon_factory: Any, sockdir: Path
) -> None:
    r, true = stock(tmp_path, layout)
    sock = sockdir / "kreld.sock"
    d = start(daemon_factory, r.tree, tmp_path / "state", sock)
    status = json.loads(kreldctl("status", "--json", "--socket", str(sock)).stdout)
    assert status["restricted"] is False, status
    r.load("brd", BRD, 0x5000, "710ab937b3c59fe0e41cfdec42b39d352ff0bd8b")
    wait_until("brd recorded", lambda: any(m["name"] == "brd" for m in modules(r, sock)))
    (brd,) = modules(r, sock)
    assert {k: int(v, 16) for k, v in brd["sections"].items()} == BRD
    assert brd["address_source"] == "kcore"
    wait_until("kernel symbols", lambda: "kernel_symbols" in {e["event"] for e in d.events()})
    export = kreldctl("export", "kallsyms", "--socket", str(sock)).stdout.splitlines()
    assert export[: len(true)] == true
    assert d.stop() == 0
