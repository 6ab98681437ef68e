"""Where a debug file may be: the search roots, and the paths each layout gives.

A search root is a directory holding debug files the way a distribution lays
them out under ``/usr/lib/debug``:

* Debian and Ubuntu (the ``-dbg`` packages): ``boot/vmlinux-R`` and
  ``lib/modules/R/kernel/PATH.ko`` (also ``.ko.xz``, ``.ko.zst``); no
  ``.build-id`` links for the kernel, so these are found by path;
* Fedora (``kernel-debuginfo``): ``lib/modules/R/vmlinux`` and
  ``lib/modules/R/kernel/PATH.ko.debug``;
* ``.build-id/xx/rest.debug`` (the build-id's first byte, then the rest);
* and, for the directories of ``[kernel] debuginfo_dirs`` as they were first
  documented, a vmlinux at ``vmlinux-R``, ``R/vmlinux`` or ``vmlinux``.

A module's PATH (``kernel/drivers/block/brd``) is where it lives under
``lib/modules/R``: from ``modules.dep`` when the system has it, else from a
bounded walk of the root's ``lib/modules/R`` for a file named after the module
(``-`` and ``_`` are one in module names).  Every path found here is only a
candidate: the finder reads its build-id before it is believed.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Iterator, Sequence
from enum import StrEnum
from pathlib import Path

from kreld.core import consts
from kreld.core.errors import InvalidArgument
from kreld.core.record import record

__all__ = [
    "MODULE_SUFFIXES",
    "Kind",
    "Layout",
    "ModuleIndex",
    "SearchRoot",
    "Wanted",
    "candidates",
    "checked",
    "module_key",
    "read_modules_dep",
    "search_roots",
]

# Suffixes of a module file in the Debian layout, then Fedora's.
MODULE_SUFFIXES = (".ko", ".ko.xz", ".ko.zst")
_FEDORA_SUFFIX = ".ko.debug"
_ALL_SUFFIXES = (_FEDORA_SUFFIX, *MODULE_SUFFIXES)
_BUILD_ID = re.compile(r"(?:[0-9a-f]{2}){2,64}")
# MODULE_NAME_LEN is 56 with its NUL (include/linux/module.h); a release is a
# utsname field of 65 bytes with its NUL.
_MAX_NAME = 55
_MAX_RELEASE = 64
_MAX_PATH = 4095
# Bounds of the walk for a module's file and of modules.dep: entries looked
# at in one release's tree (Debian's -dbg package has some 4,000 modules), how
# deep, and the bytes of modules.dep read.
_MAX_WALK = 200_000
_MAX_DEPTH = 12
_MAX_MODULES_DEP = 32 << 20


class Kind(StrEnum):
    IMAGE = "image"
    MODULE = "module"


class Layout(StrEnum):
    BUILD_ID = "build-id"
    DEBIAN = "debian"
    FEDORA = "fedora"
    FLAT = "flat"


@record
class SearchRoot:
    """A directory searched in every layout, and who named it (for messages)."""

    path: str
    named_by: str  # "--debuginfo-dir", "--root", "debuginfo_dirs"


@record
class Wanted:
    """The build whose debug file is wanted: its build-id, the image or a
    module (by the name the kernel gives it, and its path under
    ``lib/modules/R`` without the suffix where known), and its release."""

    build_id: str
    kind: Kind
    release: str
    name: str = ""
    path: str = ""

    def describe(self) -> str:
        what = "the kernel image" if self.kind is Kind.IMAGE else f"module {self.name}"
        return f"{what} of {self.release}"


def checked(want: Wanted) -> Wanted:
    """*want* with its build-id in lowercase, or :class:`InvalidArgument` for
    a value that could name a path outside a search root."""
    build_id = want.build_id.lower()
    if not _BUILD_ID.fullmatch(build_id):
        raise InvalidArgument("build_id", "2 to 64 bytes in hex")
    if not _component(want.release, _MAX_RELEASE):
        raise InvalidArgument("release", "a kernel release, one path component")
    if want.kind is Kind.MODULE and not _component(want.name, _MAX_NAME):
        raise InvalidArgument("name", "a module name, one path component")
    if want.path:
        parts = want.path.split("/")
        if (
            len(want.path) > _MAX_PATH
            or want.path.startswith("/")
            or "\0" in want.path
            or any(p in ("", ".", "..") for p in parts)
        ):
            raise InvalidArgument("path", "a relative path without '.' or '..'")
    return Wanted(build_id, want.kind, want.release, want.name, want.path)


def _component(s: str, limit: int) -> bool:
    return 0 < len(s) <= limit and "/" not in s and "\0" not in s and s not in (".", "..")


def search_roots(
    root: str | Path, configured: Iterable[str] = (), given: Iterable[str] = ()
) -> tuple[SearchRoot, ...]:
    """The search roots in the order they are searched: the directories given
    on the command line (``--debuginfo-dir``), the distribution's
    ``/usr/lib/debug`` under *root*, then ``[kernel] debuginfo_dirs``."""
    out: list[SearchRoot] = []
    seen: set[str] = set()
    for path, by in (
        *((d, "--debuginfo-dir") for d in given),
        (str(Path(root) / consts.DEBUGINFO_ROOT), "--root"),
        *((d, "debuginfo_dirs") for d in configured),
    ):
        if path not in seen:
            seen.add(path)
            out.append(SearchRoot(path, by))
    return tuple(out)


def candidates(
    root: SearchRoot, want: Wanted, module_paths: Sequence[str]
) -> Iterator[tuple[Layout, Path]]:
    """The paths where *root* may hold *want*'s debug file, by layout, in the
    order tried; *module_paths* are the module's paths under ``lib/modules/R``
    without a suffix.  Existence is not checked here."""
    base = Path(root.path)
    bid = want.build_id
    yield Layout.BUILD_ID, base / ".build-id" / bid[:2] / f"{bid[2:]}.debug"
    release = base / "lib" / "modules" / want.release
    if want.kind is Kind.IMAGE:
        yield Layout.DEBIAN, base / "boot" / f"vmlinux-{want.release}"
        yield Layout.FEDORA, release / "vmlinux"
        yield Layout.FLAT, base / f"vmlinux-{want.release}"
        yield Layout.FLAT, base / want.release / "vmlinux"
        yield Layout.FLAT, base / "vmlinux"
        return
    for rel in module_paths:
        for suffix in MODULE_SUFFIXES:
            yield Layout.DEBIAN, release / f"{rel}{suffix}"
        yield Layout.FEDORA, release / f"{rel}{_FEDORA_SUFFIX}"


def module_key(name: str) -> str:
    """A module name as the kernel compares it: ``-`` and ``_`` are one."""
    return name.replace("-", "_")


def _strip_suffix(filename: str) -> str | None:
    for suffix in _ALL_SUFFIXES:
        if filename.endswith(suffix):
            return filename[: -len(suffix)]
    return None


def read_modules_dep(path: Path) -> dict[str, str]:
    """Module name -> its path under ``lib/modules/R`` without the suffix, from
    depmod's ``modules.dep`` (``kernel/drivers/block/brd.ko.xz: dep ...``);
    empty when the file is missing, not a regular file, or too large."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_MODULES_DEP:
            return {}
        raw = os.pread(fd, _MAX_MODULES_DEP, 0)
    except OSError:
        return {}
    finally:
        os.close(fd)
    out: dict[str, str] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        file, sep, _deps = line.partition(":")
        if not sep or file.startswith("/") or ".." in file.split("/"):
            continue
        stem = _strip_suffix(file)
        if stem:
            out.setdefault(module_key(stem.rsplit("/", 1)[-1]), stem)
    return out


class ModuleIndex:
    """The module files under one search root's ``lib/modules/R``, by module
    name, found by one bounded walk made the first time a module is asked for."""

    __slots__ = ("_by_name", "base", "complete", "walked")

    def __init__(self, base: Path) -> None:
        self.base = base
        self._by_name: dict[str, list[str]] | None = None
        self.walked = 0
        self.complete = True

    def paths(self, name: str) -> list[str]:
        if self._by_name is None:
            self._by_name = self._walk()
        return self._by_name.get(module_key(name), [])

    def _walk(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        stack: list[tuple[str, int]] = [("", 0)]
        while stack:
            rel, depth = stack.pop()
            try:
                entries = list(os.scandir(self.base / rel if rel else self.base))
            except OSError:
                continue
            for entry in sorted(entries, key=lambda e: e.name):
                self.walked += 1
                if self.walked > _MAX_WALK:
                    self.complete = False
                    return found
                sub = f"{rel}/{entry.name}" if rel else entry.name
                if entry.is_dir(follow_symlinks=False):
                    if depth < _MAX_DEPTH:
                        stack.append((sub, depth + 1))
                    continue
                stem = _strip_suffix(entry.name)
                if stem is not None:
                    path = sub[: len(sub) - len(entry.name)] + stem
                    found.setdefault(module_key(stem), []).append(path)
        return found
