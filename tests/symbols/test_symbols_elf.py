"""The symbol cache from ELF files built here with gcc and ld: a module's table
from its .ko (plain, xz, zstd) when its build-id matches, the kernel's from
vmlinux when kallsyms is restricted, and neither from another build."""

from __future__ import annotations

import lzma
import shutil
import subprocess
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from support.faketree import kcore, link_vmlinux
from support.run import Daemon, kreldctl
from support.symanswers import (
    OTHER_ID,
    call,
    ok,
    resolved,
    sym,
    symtab_keys,
)
from support.symbols import (
    BASE_A,
    BASE_B,
    BASE_C,
    BUILD_ID,
    INIT,
    LINK,
    RELEASE,
    SLIDES,
    Machine,
    mod_build_id,
    mod_lines,
)
from support.symbols import daemons as daemons
from support.symbols import sock_dir as sock_dir

# -- ELF sources: .ko files and vmlinux built here --------------------------------------------


MODULE_C = """\
int kofake_counter = 7;
const char kofake_banner[] = "kofake";
__attribute__((noinline)) static int kofake_helper(int x) { return x * 3 + kofake_counter; }
__attribute__((noinline)) int kofake_func_a(int x) { return kofake_helper(x) + 1; }
__attribute__((noinline)) int kofake_func_b(int x)
{
    return kofake_func_a(x) * 2 + kofake_banner[x & 3];
}
__attribute__((section(".init.text"), noinline)) int kofake_init(void) { return kofake_func_b(1); }
"""


def ko_symbols(ko: Path) -> dict[str, tuple[str, int]]:
    """name -> (section, value) of the defined symbols of a relocatable object."""
    out = {}
    with open(ko, "rb") as f:
        elf = ELFFile(f)
        symtab = elf.get_section_by_name(".symtab")
        assert isinstance(symtab, SymbolTableSection)
        for s in symtab.iter_symbols():
            if s["st_info"]["type"] in ("STT_FUNC", "STT_OBJECT") and s.name:
                out[s.name] = (elf.get_section(s["st_shndx"]).name, int(s["st_value"]))
    return out


class Kos:
    def __init__(self, m: Machine, d: Daemon, symbols: dict[str, tuple[str, int]]) -> None:
        self.m = m
        self.daemon = d
        self.symbols = symbols
        self.missing: dict[str, str] = {}  # case -> why its file could not be made


KO_CASES = {"plain": ".ko", "xz": ".ko.xz", "zst": ".ko.zst"}
UPGRADE_BASE = BASE_A + 0x2000000
SECTION_OFFSETS = {".text": 0, ".data": 0x2000, ".rodata": 0x3000, ".init.text": INIT}


@pytest.fixture(scope="module")
def kos(tmp_path_factory: pytest.TempPathFactory, sock_dir: Path, daemons: list[Daemon]) -> Kos:
    gcc, ld = shutil.which("gcc"), shutil.which("ld")
    if gcc is None or ld is None:
        pytest.skip("gcc/ld not installed: cannot build a .ko")
    base = tmp_path_factory.mktemp("kos")
    src = base / "kofake.c"
    src.write_text(MODULE_C)
    obj = base / "kofake.o"
    subprocess.run(
        [gcc, "-c", "-O2", "-fno-pic", "-fno-asynchronous-unwind-tables", "-o", obj, src],
        check=True,
        capture_output=True,
    )

    def link(build_id: str) -> bytes:
        out = base / f"{build_id}.ko"
        subprocess.run(
            [ld, "-r", f"--build-id=0x{build_id}", "-o", out, obj], check=True, capture_output=True
        )
        return out.read_bytes()

    m = Machine(base / "machine", sock_dir / "kos.sock", daemons)
    misc = m.tree.root / f"lib/modules/{RELEASE}/kernel/drivers/misc"
    misc.mkdir(parents=True)
    missing = {}
    for case, suffix in KO_CASES.items():
        data = link(mod_build_id(f"ko_{case}"))
        if suffix == ".ko.xz":
            data = lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32)
        elif suffix == ".ko.zst":
            try:
                import zstandard
            except ImportError:
                missing[case] = "the zstandard module is not installed"
                continue
            data = zstandard.ZstdCompressor().compress(data)
        # The file name uses '-', the module name '_' (as modprobe maps them).
        (misc / f"ko-{case}{suffix}").write_bytes(data)
    # Right name, right place, another build: never used.
    (misc / "ko-wrong.ko").write_bytes(link(OTHER_ID))
    # Its table from the .ko first, then from kallsyms (test_a_table_from_a_ko_...).
    (misc / "ko-upgrade.ko").write_bytes(link(mod_build_id("ko_upgrade")))
    symbols = ko_symbols(base / f"{OTHER_ID}.ko")

    # The modules are loaded with no lines in kallsyms: the .ko is the only source.
    d = m.start()
    d.wait_for("kernel_symbols", action="stored")
    for i, case in enumerate([*KO_CASES, "wrong"]):
        m.tree.add_module(f"ko_{case}", BASE_A + i * 0x400000, build_id=mod_build_id(f"ko_{case}"))
    for case in KO_CASES:
        if case not in missing:
            d.wait_for("module_symbols", module=f"ko_{case}")
    d.wait_for("module_symbols_unavailable", module="ko_wrong")
    m.tree.add_module("ko_upgrade", UPGRADE_BASE, build_id=mod_build_id("ko_upgrade"))
    d.wait_for("module_symbols", module="ko_upgrade", source="ko")
    kos = Kos(m, d, symbols)
    kos.missing = missing
    return kos


@pytest.mark.parametrize("case", list(KO_CASES))
def test_ko_with_matching_build_id_gives_the_module_symbols(kos: Kos, case: str) -> None:
    if case in kos.missing:
        pytest.skip(kos.missing[case])
    name = f"ko_{case}"
    [ev] = [
        e
        for e in kos.daemon.events()
        if e.get("event") == "module_symbols" and e.get("module") == name
    ]
    assert (ev["source"], ev["build_id"]) == ("ko", mod_build_id(name))
    assert f"m:{mod_build_id(name)}" in symtab_keys(kos.m.state)
    base = BASE_A + list(KO_CASES).index(case) * 0x400000
    wanted = ["kofake_helper", "kofake_func_a", "kofake_func_b", "kofake_counter", "kofake_banner"]
    addrs, expect = [], []
    for n in wanted:
        section, value = kos.symbols[n]
        for k in (0, 3):
            addrs.append(base + SECTION_OFFSETS[section] + value + k)
            expect.append((name, n, f"{k:#x}"))
    res = resolved(kos.m.sock, [f"{a:#x}" for a in addrs])
    assert [sym(r) for r in res] == expect
    assert {r["section"] for r in res} == {".text", ".data", ".rodata"}


def test_ko_with_another_build_id_is_refused(kos: Kos) -> None:
    [ev] = [
        e
        for e in kos.daemon.events()
        if e.get("event") == "module_symbols_unavailable" and e.get("module") == "ko_wrong"
    ]
    assert ev["build_id"] == mod_build_id("ko_wrong")
    assert f"m:{mod_build_id('ko_wrong')}" not in symtab_keys(kos.m.state)
    assert not any(
        e.get("event") == "module_symbols" and e.get("module") == "ko_wrong"
        for e in kos.daemon.events()
    )
    base = BASE_A + len(KO_CASES) * 0x400000
    _, value = kos.symbols["kofake_func_b"]
    [r] = resolved(kos.m.sock, [f"{base + value + 3:#x}"])
    # Still placed in its section, but with no symbol.
    assert (r["image"], r["section"], r["offset"]) == ("ko_wrong", ".text", f"{value + 3:#x}")
    assert "symbol" not in r


def test_a_table_from_a_ko_is_replaced_once_kallsyms_shows_the_module(kos: Kos) -> None:
    """ko_upgrade's table came from its .ko (kallsyms did not show it): the kernel
    prints symbols a .ko lacks, so its next load that kallsyms shows replaces the
    table, once, and Resolve (past its cached accelerator) names the kernel's."""
    m, d, name = kos.m, kos.daemon, "ko_upgrade"
    section, value = kos.symbols["kofake_func_b"]
    before = f"{UPGRADE_BASE + SECTION_OFFSETS[section] + value + 3:#x}"
    [r] = resolved(m.sock, [before])
    assert sym(r) == (name, "kofake_func_b", "0x3")
    m.tree.remove_module(name)
    d.wait_for("module_unloaded", module=name)
    m.load(name, BASE_B)  # now with its lines in kallsyms
    ev = d.wait_for("module_symbols", module=name, source="kallsyms")
    assert ev["replaced"] == "ko"
    [r] = resolved(m.sock, [f"{BASE_B + 0x85:#x}"])
    assert sym(r) == (name, f"{name}_read", "0x5")
    lines = [ln for ln in m.export().splitlines() if ln.endswith(f"\t[{name}]")]
    assert lines == mod_lines(name, BASE_B)
    m.unload(name)
    d.wait_for("module_unloaded", module=name, count=2)
    m.load(name, BASE_B + 0x100000)  # a later load changes nothing more
    d.wait_for("module_loaded", module=name, count=3)
    # The symbol worker takes loads in order: once it has the table of a module
    # loaded after, it has handled this load too.
    m.load("ko_after", BASE_C)
    d.wait_for("module_symbols", module="ko_after", source="kallsyms")
    replaced = [e for e in d.events() if e.get("event") == "module_symbols" and e["module"] == name]
    assert [e["source"] for e in replaced] == ["ko", "kallsyms"]


VMLINUX_ASM = """\
    .text
    .globl _text, _stext, startup_64, _etext, _sinittext, _einittext
    .globl vm_func_one, vm_func_two
_text:
_stext:
startup_64:
    nop
    ret
    .balign 0x40
    .type vm_func_one, @function
vm_func_one:
    .fill 0x30, 1, 0x90
    ret
    .size vm_func_one, . - vm_func_one
    .balign 0x40
    .type vm_helper, @function
vm_helper:
    .fill 0x20, 1, 0x90
    ret
    .size vm_helper, . - vm_helper
    .balign 0x40
    .type vm_func_two, @function
vm_func_two:
    .fill 0x10, 1, 0x90
    ret
    .size vm_func_two, . - vm_func_two
    .set _etext, _text + 0x1000000
    .set _sinittext, _text + 0x3000000
    .set _einittext, _text + 0x3100000
"""


def build_vmlinux(work: Path, build_id: str) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed: cannot build a vmlinux")
    return link_vmlinux(gcc, VMLINUX_ASM, work / f"vmlinux-{build_id[:8]}", LINK, build_id)


def nm_symbols(path: Path) -> dict[str, int]:
    out = subprocess.run(["nm", str(path)], check=True, capture_output=True, text=True).stdout
    return {p[2]: int(p[0], 16) for p in (ln.split() for ln in out.splitlines()) if len(p) == 3}


def restricted_machine(tmp_path: Path, sock: Path, started: list[Daemon], vm_id: str) -> Machine:
    """kallsyms all zeros, VMCOREINFO readable in kcore, a vmlinux of build *vm_id*."""
    m = Machine(tmp_path / "m", sock, started, kptr_restrict=2)
    m.tree.set_text(LINK + SLIDES[0], zero=True)
    m.tree.write("proc/kcore", kcore(f"OSRELEASE={RELEASE}\nKERNELOFFSET={SLIDES[0]:x}\n".encode()))
    vmlinux = build_vmlinux(tmp_path, vm_id)
    dest = m.tree.root / f"boot/vmlinux-{RELEASE}"
    dest.parent.mkdir(parents=True)
    shutil.copyfile(vmlinux, dest)
    return m


def test_matching_vmlinux_gives_symbols_when_kallsyms_is_restricted(
    tmp_path: Path, sock_dir: Path, daemons: list[Daemon]
) -> None:
    m = restricted_machine(tmp_path, sock_dir / "vm.sock", daemons, BUILD_ID)
    d = m.start()
    d.wait_for("kernel_symbols_from_vmlinux", path=str(m.tree.root / f"boot/vmlinux-{RELEASE}"))
    ev = d.wait_for("kernel_symbols", action="stored")
    assert ev["table"] == f"v:{BUILD_ID}"
    boot = ok(call(m.sock, "GetBoot"))["boot"]
    assert boot["restricted"] is True
    assert (boot["kaslr_offset"], boot["kaslr_source"]) == (f"{SLIDES[0]:#x}", "vmcoreinfo")
    text = LINK + SLIDES[0]
    assert boot["anchors"]["text"] == f"{text:#x}"
    assert boot["anchors"]["etext"] == f"{text + 0x1000000:#x}"

    nm = nm_symbols(build_vmlinux(tmp_path, BUILD_ID))
    addrs, want = [], []
    for name in ("vm_func_one", "vm_helper", "vm_func_two"):
        for k in (0, 0x7, 0x10):
            addrs.append(nm[name] - LINK + text + k)
            want.append(("kernel", name, f"{k:#x}"))
    res = resolved(m.sock, [f"{a:#x}" for a in addrs])
    assert [sym(r) for r in res] == want
    assert symtab_keys(m.state) == [f"v:{BUILD_ID}"]
    # kreldctl on the store alone says the same.
    assert [sym(r) for r in m.resolve(None, *addrs)] == want
    assert d.stop() == 0


def test_vmlinux_with_another_build_id_gives_no_symbols(
    tmp_path: Path, sock_dir: Path, daemons: list[Daemon]
) -> None:
    m = restricted_machine(tmp_path, sock_dir / "vmx.sock", daemons, OTHER_ID)
    d = m.start()
    d.wait_for("kernel_symbols_unavailable", restricted=True)
    assert not any(e.get("event") == "kernel_symbols_from_vmlinux" for e in d.events())
    boot = ok(call(m.sock, "GetBoot"))["boot"]
    # The slide is known from VMCOREINFO, but without the image no address is.
    assert boot["kaslr_offset"] == f"{SLIDES[0]:#x}"
    assert boot["anchors"]["text"] is None
    assert symtab_keys(m.state) == []
    text = LINK + SLIDES[0]
    for method, params in (
        ("ExportKallsyms", {}),
        ("Resolve", {"addresses": [f"{text + 0x47:#x}"]}),
    ):
        reply = call(m.sock, method, **params)
        assert reply.get("error") == "io.kreld.AddressesRestricted", reply
        assert "kptr_restrict=2" in reply["parameters"]["reason"]
    cp = kreldctl("export", "kallsyms", *m.opts, check=False)
    assert cp.returncode == 4 and cp.stdout == "", cp.stderr
    assert d.stop() == 0
