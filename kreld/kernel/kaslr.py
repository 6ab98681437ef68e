"""Finding the KASLR offset, most authoritative source first.

1. ``KERNELOFFSET=`` in VMCOREINFO, read through ``/proc/kcore``;
2. runtime ``_text`` minus ``_text`` of a vmlinux whose build-id matches;
3. runtime ``_text`` minus ``_text`` of a System.map whose anchors agree;
4. otherwise unknown: the runtime ``_text`` is still recorded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from kreld.core import consts
from kreld.core.errors import KernelReadError
from kreld.core.model import Anchors, KaslrOffset, OffsetSource
from kreld.kernel.elf import elf_build_id, elf_symbols
from kreld.kernel.files import hex_address, read_bounded
from kreld.kernel.info import Root
from kreld.kernel.kcore import Kcore

__all__ = [
    "find_offset",
    "matching_vmlinux",
    "parse_system_map",
    "read_system_map",
    "system_map_symbols",
    "vmlinux_candidates",
]


def _fill(template: str, release: str, build_id: str | None) -> str | None:
    if "{xx}" in template:
        if not build_id or len(build_id) < 3:
            return None
        return template.format(xx=build_id[:2], rest=build_id[2:], release=release)
    return template.format(release=release)


def vmlinux_candidates(
    root: Root, release: str, build_id: str | None, extra_dirs: Iterable[str]
) -> Iterator[Path]:
    """Paths where a vmlinux for this kernel may be, in order; existing ones only."""
    seen: set[Path] = set()
    templates = [(root.path, t) for t in consts.VMLINUX_CANDIDATES]
    for d in extra_dirs:
        for t in (
            ".build-id/{xx}/{rest}.debug",
            "vmlinux-{release}",
            "{release}/vmlinux",
            "vmlinux",
        ):
            templates.append((Path(d), t))
    for base, template in templates:
        rel = _fill(template, release, build_id)
        if rel is None:
            continue
        p = base / rel
        if p not in seen and p.is_file():
            seen.add(p)
            yield p


def matching_vmlinux(
    root: Root, release: str, build_id: str | None, extra_dirs: Iterable[str] = ()
) -> Path | None:
    """The first vmlinux candidate whose build-id is the running kernel's."""
    if build_id is None:
        return None
    for path in vmlinux_candidates(root, release, build_id, extra_dirs):
        if elf_build_id(path) == build_id:
            return path
    return None


def read_system_map(path: Path) -> bytes:
    """A System.map's text, at most ``consts.MAX_SYSTEM_MAP`` bytes of it."""
    return read_bounded(path, consts.MAX_SYSTEM_MAP)


def system_map_symbols(text: bytes, names: Iterable[str]) -> dict[str, int]:
    """The link-time values of *names* (the first of each) in a System.map's text;
    a value that is no kernel address is left out."""
    wanted = {n.encode() for n in names}
    found: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[2] in wanted:
            name = fields[2].decode()
            if name in found:
                continue
            try:
                found[name] = hex_address(fields[0])
            except ValueError:
                continue
            if len(found) == len(wanted):
                break
    return found


def parse_system_map(path: Path, names: Iterable[str]) -> dict[str, int]:
    """:func:`system_map_symbols` of the System.map at *path* (a named error when it
    cannot be read, or is larger than any)."""
    return system_map_symbols(read_system_map(path), names)


def _consistent_offset(runtime: dict[str, int], link: dict[str, int]) -> int | None:
    """The one offset by which every anchor known on both sides moved, if there is one."""
    if "_text" not in runtime or "_text" not in link:
        return None
    offset = runtime["_text"] - link["_text"]
    if not 0 <= offset < consts.MAX_KERNEL_OFFSET:
        return None
    for name, value in runtime.items():
        if name in link and value - link[name] != offset:
            return None
    return offset


def find_offset(
    root: Root,
    anchors: Anchors,
    build_id: str | None,
    release: str,
    extra_dirs: Iterable[str] = (),
) -> tuple[KaslrOffset | None, list[str]]:
    """The offset and, for the log, why each source that was tried gave none."""
    notes: list[str] = []
    from_kcore = _vmcoreinfo_offset(root, notes)
    if from_kcore is not None:
        return from_kcore, notes

    runtime = anchors.known()
    if "_text" not in runtime:
        notes.append("runtime _text unknown: vmlinux and System.map cannot give an offset")
        return None, notes

    extra = list(extra_dirs)
    for path in vmlinux_candidates(root, release, build_id, extra):
        try:
            found = elf_build_id(path, strict=True)
        except KernelReadError as e:
            notes.append(str(e))
            continue
        if build_id is None or found != build_id:
            notes.append(f"{path}: build-id {found} does not match the kernel's {build_id}")
            continue
        link = elf_symbols(path, set(consts.ANCHOR_SYMBOLS))
        offset = _consistent_offset(runtime, link)
        if offset is None:
            notes.append(f"{path}: its _text does not relocate to the runtime anchors")
            continue
        return KaslrOffset(offset, OffsetSource.VMLINUX, str(path)), notes

    for template in consts.SYSTEM_MAP_CANDIDATES:
        path = root / template.format(release=release)
        if not path.is_file():
            continue
        try:
            link = parse_system_map(path, consts.ANCHOR_SYMBOLS)
        except KernelReadError as e:
            notes.append(str(e))
            continue
        offset = _consistent_offset(runtime, link)
        if offset is None:
            notes.append(f"{path}: its anchors do not match the running kernel")
            continue
        return KaslrOffset(offset, OffsetSource.SYSTEM_MAP, str(path)), notes
    notes.append("no matching vmlinux or System.map found")
    return None, notes


def _vmcoreinfo_offset(root: Root, notes: list[str]) -> KaslrOffset | None:
    """``KERNELOFFSET=`` read through ``/proc/kcore``, or ``None`` with why among *notes*."""
    path = root / consts.KCORE
    try:
        with Kcore.open(path) as kcore:
            offset = kcore.kernel_offset()
    except KernelReadError as e:
        notes.append(str(e))
        return None
    if offset is None:
        notes.append(f"{path}: VMCOREINFO has no KERNELOFFSET")
        return None
    return KaslrOffset(offset, OffsetSource.VMCOREINFO, str(path))
