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
from kreld.core.model import Anchors, KaslrOffset, OffsetSource
from kreld.kernel.elf import elf_build_id, elf_symbols, kcore_vmcoreinfo
from kreld.kernel.info import Root

__all__ = ["find_offset", "matching_vmlinux", "parse_system_map", "vmlinux_candidates"]


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


def parse_system_map(path: Path, names: Iterable[str]) -> dict[str, int]:
    wanted = set(names)
    found: dict[str, int] = {}
    try:
        with open(path, "rb") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 3:
                    name = fields[2].decode("ascii", "replace")
                    if name in wanted and name not in found:
                        try:
                            found[name] = int(fields[0], 16)
                        except ValueError:
                            continue
                        if len(found) == len(wanted):
                            break
    except OSError:
        return {}
    return found


def _consistent_offset(runtime: dict[str, int], link: dict[str, int]) -> int | None:
    """The one offset by which every anchor known on both sides moved, if there is one."""
    if "_text" not in runtime or "_text" not in link:
        return None
    offset = runtime["_text"] - link["_text"]
    if offset < 0:
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
    kcore = root / consts.KCORE
    info = kcore_vmcoreinfo(kcore)
    if info is None:
        notes.append(f"{kcore}: unreadable or without VMCOREINFO")
    elif "KERNELOFFSET" in info:
        try:
            return KaslrOffset(
                int(info["KERNELOFFSET"], 16), OffsetSource.VMCOREINFO, str(kcore)
            ), notes
        except ValueError:
            notes.append(f"{kcore}: KERNELOFFSET={info['KERNELOFFSET']!r} is not hex")
    else:
        notes.append(f"{kcore}: VMCOREINFO has no KERNELOFFSET")

    runtime = anchors.known()
    if "_text" not in runtime:
        notes.append("runtime _text unknown: vmlinux and System.map cannot give an offset")
        return None, notes

    extra = list(extra_dirs)
    for path in vmlinux_candidates(root, release, build_id, extra):
        found = elf_build_id(path)
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
        link = parse_system_map(path, consts.ANCHOR_SYMBOLS)
        offset = _consistent_offset(runtime, link)
        if offset is None:
            notes.append(f"{path}: its anchors do not match the running kernel")
            continue
        return KaslrOffset(offset, OffsetSource.SYSTEM_MAP, str(path)), notes
    notes.append("no matching vmlinux or System.map found")
    return None, notes
