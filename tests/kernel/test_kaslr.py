"""The KASLR offset from fake trees under --root: vmcoreinfo, vmlinux, System.map, none.

The vmlinux files are real ELF executables linked by gcc at the kernel's
link address with the fake tree's build-id; /proc/kcore is a real ELF core
header with a VMCOREINFO note, built here with struct.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kreld.kernel.elf import elf_build_id, elf_symbols
from kreld.kernel.info import Root
from kreld.kernel.snapshot import take_snapshot
from kreld.store import Store

from support.faketree import FakeTree, kcore, link_vmlinux
from support.run import ctl_json, kreldctl

LINK = 0xFFFFFFFF81000000  # x86-64 __START_KERNEL_map + 16 MiB, where _text is linked
OFFSET = 0x2A600000  # a KASLR slide: a multiple of 2 MiB
BUILD_ID = "00112233445566778899aabbccddeeff0a0b0c0d"
OTHER_ID = "ffeeddccbbaa99887766554433221100f0e0d0c0"
RELEASE = "6.1.0-fake"
# Where the fake tree's kallsyms puts the anchors, relative to _text.
LAYOUT = {"_etext": 0x1000000, "_sinittext": 0x3000000, "_einittext": 0x3100000}

VMLINUX_ASM = """\
    .section .text, "ax"
    .globl _text, _stext, startup_64, _etext, _sinittext, _einittext
_text:
_stext:
startup_64:
    nop
    ret
    .set _etext, _text + {_etext:#x}
    .set _sinittext, _text + {_sinittext:#x}
    .set _einittext, _text + {_einittext:#x}
"""

VmlinuxFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def make_vmlinux(tmp_path_factory: pytest.TempPathFactory) -> VmlinuxFactory:
    """Build (once per variant) a tiny vmlinux: _text at *link*, the given build-id."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed: cannot build a vmlinux")
    work = tmp_path_factory.mktemp("vmlinux")
    built: dict[tuple[Any, ...], Path] = {}

    def make(build_id: str = BUILD_ID, link: int = LINK, **layout: int) -> Path:
        lay = {**LAYOUT, **layout}
        key = (build_id, link, tuple(sorted(lay.items())))
        if key not in built:
            n = len(built)
            out = link_vmlinux(gcc, VMLINUX_ASM.format(**lay), work / f"vmlinux{n}", link, build_id)
            built[key] = out
        return built[key]

    return make


def place(src: Path, dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    return dest


def fake(tmp_path: Path, offset: int = OFFSET, **kw: Any) -> FakeTree:
    return FakeTree(tmp_path / "root", text=LINK + offset, build_id=BUILD_ID, release=RELEASE, **kw)


def snapshot(tree: FakeTree, tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = ctl_json(
        "snapshot", "--root", str(tree.root), "--state-dir", str(tmp_path / "st"), *extra
    )
    return dict(out["boot"])


def snap_here(tree: FakeTree, *debuginfo_dirs: Path) -> dict[str, Any]:
    """The same snapshot in this process (no CLI, no store): for the many variants."""
    snap, _notes = take_snapshot(Root(tree.root), [str(d) for d in debuginfo_dirs])
    return snap.to_json()


def system_map(path: Path, link: int, **moved: int) -> None:
    """A System.map for the fake layout; *moved* shifts single anchors (inconsistent)."""
    syms = {"_text": 0, "_stext": 0, "startup_64": 0, **LAYOUT}
    lines = [f"{link + off + moved.get(n, 0):016x} T {n}" for n, off in syms.items()]
    lines.insert(0, "0000000000000000 D __per_cpu_start")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(sorted(lines)) + "\n")


# -- vmlinux ------------------------------------------------------------------------------


def test_gcc_vmlinux_has_the_build_id_and_link_address(make_vmlinux: VmlinuxFactory) -> None:
    """The fixture itself: pyelftools sees the chosen build-id and _text (else tests lie)."""
    v = make_vmlinux()
    assert elf_build_id(v) == BUILD_ID
    assert elf_symbols(v, {"_text", "_etext"}) == {"_text": LINK, "_etext": LINK + 0x1000000}


def test_offset_from_matching_vmlinux_in_boot_is_exact(
    tmp_path: Path, make_vmlinux: VmlinuxFactory
) -> None:
    tree = fake(tmp_path)
    v = place(make_vmlinux(), tree.root / f"boot/vmlinux-{RELEASE}")
    boot = snapshot(tree, tmp_path)
    assert boot["kaslr_offset"] == f"{OFFSET:#x}"
    assert boot["kaslr_source"] == "vmlinux"
    assert boot["kaslr_path"] == str(v)
    assert boot["anchors"]["text"] == f"{LINK + OFFSET:#x}"
    # The build record keeps the link-time _text for later symbolization.
    with Store(tmp_path / "st", readonly=True) as store:
        build = store.boots.get_build(BUILD_ID)
    assert build is not None and build["link_text"] == f"{LINK:#x}"


def test_unrandomized_kernel_has_offset_zero_not_unknown(
    tmp_path: Path, make_vmlinux: VmlinuxFactory
) -> None:
    """nokaslr: runtime _text == link _text gives offset 0x0 from vmlinux, not null."""
    tree = fake(tmp_path, offset=0)
    place(make_vmlinux(), tree.root / f"lib/modules/{RELEASE}/build/vmlinux")
    boot = snap_here(tree)
    assert (boot["kaslr_offset"], boot["kaslr_source"]) == ("0x0", "vmlinux")


def test_vmlinux_found_by_build_id_in_a_configured_debuginfo_dir(
    tmp_path: Path, make_vmlinux: VmlinuxFactory
) -> None:
    tree = fake(tmp_path)
    debug = tmp_path / "debug"
    v = place(make_vmlinux(), debug / f".build-id/{BUILD_ID[:2]}/{BUILD_ID[2:]}.debug")
    cfg = tmp_path / "kreld.toml"
    cfg.write_text(f'[kernel]\ndebuginfo_dirs = ["{tmp_path / "elsewhere"}", "{debug}"]\n')
    # Without the config the file is not found ...
    assert snapshot(tree, tmp_path)["kaslr_offset"] is None
    # ... with it, a later snapshot of the same boot learns the offset.
    boot = snapshot(tree, tmp_path, "--config", str(cfg))
    assert boot["kaslr_offset"] == f"{OFFSET:#x}"
    assert (boot["kaslr_source"], boot["kaslr_path"]) == ("vmlinux", str(v))


def test_vmlinux_release_name_in_a_configured_debuginfo_dir(
    tmp_path: Path, make_vmlinux: VmlinuxFactory
) -> None:
    tree = fake(tmp_path)
    debug = tmp_path / "debug"
    v = place(make_vmlinux(), debug / f"vmlinux-{RELEASE}")
    boot = snap_here(tree, debug)
    assert (boot["kaslr_offset"], boot["kaslr_source"]) == (f"{OFFSET:#x}", "vmlinux")
    assert boot["kaslr_path"] == str(v)
    assert snap_here(tree)["kaslr_offset"] is None


def test_vmlinux_with_another_build_id_is_ignored(
    tmp_path: Path, make_vmlinux: VmlinuxFactory
) -> None:
    """Same release name, same _text, wrong build-id: never trusted, offset stays null."""
    tree = fake(tmp_path)
    place(make_vmlinux(OTHER_ID), tree.root / f"boot/vmlinux-{RELEASE}")
    boot = snapshot(tree, tmp_path)
    assert boot["kaslr_offset"] is None
    assert boot["kaslr_source"] is None
    assert boot["anchors"]["text"] == f"{LINK + OFFSET:#x}"  # still recorded


def test_matching_vmlinux_is_used_after_a_mismatching_one(
    tmp_path: Path, make_vmlinux: VmlinuxFactory
) -> None:
    tree = fake(tmp_path)
    # The mismatching one is earlier in the search order and links elsewhere.
    place(
        make_vmlinux(OTHER_ID, link=LINK + 0x200000),
        tree.root / f"usr/lib/debug/boot/vmlinux-{RELEASE}",
    )
    right = place(make_vmlinux(), tree.root / f"boot/vmlinux-{RELEASE}")
    boot = snap_here(tree)
    assert (boot["kaslr_offset"], boot["kaslr_path"]) == (f"{OFFSET:#x}", str(right))


def test_matching_vmlinux_whose_anchors_disagree_is_refused(
    tmp_path: Path, make_vmlinux: VmlinuxFactory
) -> None:
    """_text would give an offset, but _etext moved by another amount: not this image."""
    tree = fake(tmp_path)
    place(make_vmlinux(_etext=0x1001000), tree.root / f"boot/vmlinux-{RELEASE}")
    assert snap_here(tree)["kaslr_offset"] is None


# -- System.map ---------------------------------------------------------------------------


def test_offset_from_consistent_system_map(tmp_path: Path) -> None:
    tree = fake(tmp_path)
    system_map(tree.root / f"boot/System.map-{RELEASE}", LINK)
    boot = snapshot(tree, tmp_path)
    assert boot["kaslr_offset"] == f"{OFFSET:#x}"
    assert boot["kaslr_source"] == "system.map"
    assert boot["kaslr_path"] == str(tree.root / f"boot/System.map-{RELEASE}")


def test_inconsistent_system_map_is_refused(tmp_path: Path) -> None:
    """A System.map of another build (anchors spaced differently) gives no offset."""
    tree = fake(tmp_path)
    system_map(tree.root / f"boot/System.map-{RELEASE}", LINK, _sinittext=0x2000)
    boot = snap_here(tree)
    assert boot["kaslr_offset"] is None and boot["kaslr_source"] is None


def test_vmlinux_wins_over_system_map(tmp_path: Path, make_vmlinux: VmlinuxFactory) -> None:
    tree = fake(tmp_path)
    system_map(tree.root / f"boot/System.map-{RELEASE}", LINK)
    place(make_vmlinux(), tree.root / f"boot/vmlinux-{RELEASE}")
    assert snap_here(tree)["kaslr_source"] == "vmlinux"


# -- VMCOREINFO through /proc/kcore -------------------------------------------------------


def test_vmcoreinfo_in_kcore_wins_over_vmlinux(
    tmp_path: Path, make_vmlinux: VmlinuxFactory
) -> None:
    tree = fake(tmp_path, offset=0x1E000000)
    place(make_vmlinux(), tree.root / f"boot/vmlinux-{RELEASE}")
    tree.write("proc/kcore", kcore(b"OSRELEASE=6.1.0-fake\nPAGESIZE=4096\nKERNELOFFSET=1e000000\n"))
    boot = snapshot(tree, tmp_path)
    assert boot["kaslr_offset"] == "0x1e000000"
    assert boot["kaslr_source"] == "vmcoreinfo"
    assert boot["kaslr_path"] == str(tree.root / "proc/kcore")


def test_vmcoreinfo_offset_needs_no_runtime_text(tmp_path: Path) -> None:
    """With kallsyms restricted, VMCOREINFO still gives the offset (kcore needs no kallsyms)."""
    tree = fake(tmp_path, kptr_restrict=2)
    tree.set_text(LINK + OFFSET, zero=True)
    tree.write("proc/kcore", kcore(f"KERNELOFFSET={OFFSET:x}\n".encode()))
    boot = snapshot(tree, tmp_path)
    assert (boot["kaslr_offset"], boot["kaslr_source"]) == (f"{OFFSET:#x}", "vmcoreinfo")
    assert boot["restricted"] is True


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"OSRELEASE=6.1.0-fake\nPAGESIZE=4096\n", id="no-KERNELOFFSET"),
        pytest.param(b"KERNELOFFSET=zz\n", id="KERNELOFFSET-not-hex"),
        pytest.param(None, id="not-an-elf"),
    ],
)
def test_kcore_without_usable_offset_falls_back_to_vmlinux(
    tmp_path: Path, make_vmlinux: VmlinuxFactory, content: bytes | None
) -> None:
    tree = fake(tmp_path)
    place(make_vmlinux(), tree.root / f"boot/vmlinux-{RELEASE}")
    tree.write("proc/kcore", kcore(content) if content is not None else b"\0" * 4096)
    boot = snap_here(tree)
    assert (boot["kaslr_offset"], boot["kaslr_source"]) == (f"{OFFSET:#x}", "vmlinux")


# -- restricted kallsyms ------------------------------------------------------------------


def addresses(obj: Any, path: str = "") -> list[tuple[str, str]]:
    """Every "0x..." string anywhere in a JSON value, with where it was."""
    if isinstance(obj, dict):
        return [a for k, v in obj.items() for a in addresses(v, f"{path}.{k}")]
    if isinstance(obj, list):
        return [a for i, v in enumerate(obj) for a in addresses(v, f"{path}[{i}]")]
    if isinstance(obj, str) and obj.startswith("0x"):
        return [(path, obj)]
    return []


def test_restricted_kallsyms_records_no_zero_address(
    tmp_path: Path, make_vmlinux: VmlinuxFactory
) -> None:
    """All-zero kallsyms: restricted with a reason, no 0x0 anywhere, a warning on stderr."""
    tree = fake(tmp_path, kptr_restrict=2)
    tree.set_text(LINK + OFFSET, zero=True)
    place(make_vmlinux(), tree.root / f"boot/vmlinux-{RELEASE}")  # useless without _text
    state = str(tmp_path / "st")
    snap = kreldctl("snapshot", "--json", "--root", str(tree.root), "--state-dir", state)
    assert "warning" in snap.stderr and "restricted" in snap.stderr

    shown = kreldctl("show", "--json", "--root", str(tree.root), "--state-dir", state)
    assert "warning" in shown.stderr and "kptr_restrict" in shown.stderr
    boot = json.loads(shown.stdout)
    assert boot["boot_id"] == tree.boot_id
    assert boot["restricted"] is True
    assert "kernel.kptr_restrict=2" in boot["restricted_reason"]
    assert set(boot["anchors"].values()) == {None}
    assert boot["kaslr_offset"] is None
    assert addresses(boot) == []
    assert addresses(ctl_json("boots", "--state-dir", state)) == []

    table = kreldctl("show", "--root", str(tree.root), "--state-dir", state)
    assert "restricted" in table.stdout and "0x0" not in table.stdout
    assert "0x0000000000000000" not in table.stdout


def test_restricted_reason_without_kptr_restrict_2(tmp_path: Path) -> None:
    """Zeros with kptr_restrict=1 still count as restricted, with a reason naming it."""
    tree = fake(tmp_path, kptr_restrict=1)
    tree.set_text(LINK + OFFSET, zero=True)
    boot = snap_here(tree)
    assert boot["restricted"] is True
    assert "kernel.kptr_restrict=1" in boot["restricted_reason"]
    assert addresses(boot) == []


def test_unrestricted_snapshot_after_restricted_one_fills_in(
    tmp_path: Path, make_vmlinux: VmlinuxFactory
) -> None:
    """Same boot seen restricted, then with pointers visible: the record learns them."""
    tree = fake(tmp_path, kptr_restrict=2)
    tree.set_text(LINK + OFFSET, zero=True)
    place(make_vmlinux(), tree.root / f"boot/vmlinux-{RELEASE}")
    assert snapshot(tree, tmp_path)["restricted"] is True
    tree.write("proc/sys/kernel/kptr_restrict", "0\n")
    tree.set_text(LINK + OFFSET)
    out = ctl_json("snapshot", "--root", str(tree.root), "--state-dir", str(tmp_path / "st"))
    assert (out["new"], out["updated"]) == (False, True)
    boot = out["boot"]
    assert boot["restricted"] is False and boot["restricted_reason"] is None
    assert boot["kaslr_offset"] == f"{OFFSET:#x}"
    assert boot["anchors"]["text"] == f"{LINK + OFFSET:#x}"


def test_random_fake_build_id_never_matches(tmp_path: Path, make_vmlinux: VmlinuxFactory) -> None:
    """Sanity of the fixtures: a FakeTree with its own random build-id ignores our vmlinux."""
    tree = FakeTree(tmp_path / "root", text=LINK + OFFSET, build_id=uuid.uuid4().hex + "00000000")
    place(make_vmlinux(), tree.root / f"boot/vmlinux-{tree.release}")
    assert snap_here(tree)["kaslr_offset"] is None
