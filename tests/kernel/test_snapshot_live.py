"""The snapshot of the test machine's own kernel agrees with /proc and /sys read directly."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from kreld.kernel.info import Root
from kreld.kernel.snapshot import take_snapshot

from support.run import ctl_json

pytestmark = pytest.mark.live

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
OSRELEASE = Path("/proc/sys/kernel/osrelease")
NOTES = Path("/sys/kernel/notes")
KALLSYMS = Path("/proc/kallsyms")
ANCHORS = ("_text", "_stext", "_etext", "_sinittext", "_einittext")


def need(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"{path} does not exist on this machine")


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: /proc/kallsyms shows zero addresses to other users")


def notes_build_id() -> str | None:
    """The GNU build-id in /sys/kernel/notes, parsed here with struct alone."""
    data = NOTES.read_bytes()
    pos = 0
    while pos + 12 <= len(data):
        namesz, descsz, ntype = struct.unpack_from("=III", data, pos)
        name = data[pos + 12 : pos + 12 + namesz]
        desc_at = pos + 12 + (namesz + 3) // 4 * 4
        if name == b"GNU\0" and ntype == 3:
            return data[desc_at : desc_at + descsz].hex()
        pos = desc_at + (descsz + 3) // 4 * 4
    return None


def kallsyms_core_symbols() -> dict[str, int]:
    """Core-kernel anchor addresses from /proc/kallsyms, first occurrence each."""
    found: dict[str, int] = {}
    with open(KALLSYMS) as f:
        for line in f:
            fields = line.split()
            if len(fields) == 3 and fields[2] in ANCHORS and fields[2] not in found:
                found[fields[2]] = int(fields[0], 16)
    return found


@pytest.fixture(scope="module")
def snap():
    need(BOOT_ID)
    s, _notes = take_snapshot(Root(Path("/")))
    return s


def test_boot_id_is_the_kernels(snap) -> None:
    assert snap.boot_id == BOOT_ID.read_text().strip()


def test_release_is_the_kernels(snap) -> None:
    need(OSRELEASE)
    assert snap.release == OSRELEASE.read_text().strip() == os.uname().release


def test_build_id_is_the_gnu_note_in_sys_kernel_notes(snap) -> None:
    need(NOTES)
    expected = notes_build_id()
    if expected is None:
        pytest.skip(f"{NOTES} has no GNU build-id note")
    assert snap.build_id == expected


def test_anchors_are_the_kallsyms_addresses(snap) -> None:
    """As root, _text (and the other anchors) equal /proc/kallsyms; nothing is restricted."""
    need(KALLSYMS)
    need_root()
    syms = kallsyms_core_symbols()
    if not syms.get("_text"):
        pytest.skip("/proc/kallsyms shows zeros even to root (kernel.kptr_restrict=2?)")
    assert snap.anchors.text == syms["_text"]
    assert snap.restricted is False
    assert snap.restricted_reason is None
    runtime = snap.anchors.known()
    for name, addr in syms.items():
        assert runtime[name] == addr, name


def test_kreldctl_snapshot_json_agrees(tmp_path: Path) -> None:
    """`kreldctl snapshot --json` records the live boot with the same facts, once."""
    need(BOOT_ID)
    need(NOTES)
    state = str(tmp_path / "state")
    out = ctl_json("snapshot", "--state-dir", state)
    boot = out["boot"]
    assert out["new"] is True
    assert boot["boot_id"] == BOOT_ID.read_text().strip()
    assert boot["build_id"] == notes_build_id()
    if os.geteuid() == 0 and KALLSYMS.exists():
        text = kallsyms_core_symbols().get("_text")
        if text:
            assert boot["anchors"]["text"] == f"{text:#x}"
            assert boot["restricted"] is False
    again = ctl_json("snapshot", "--state-dir", state)
    assert (again["new"], again["updated"]) == (False, False)
    assert ctl_json("show", "--state-dir", state) == boot
