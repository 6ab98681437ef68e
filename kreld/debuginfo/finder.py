"""The debug file of a build, as a checked local path and where it came from.

:meth:`DebuginfoFinder.find` tries, in order: each search root in each
layout (:mod:`kreld.debuginfo.places`), the cache, then each debuginfod
server.  A file is believed only when its GNU build-id is the one asked for;
a file of another build is passed over (and said so in the error if nothing
else is found).  A compressed module (``.ko.xz``, ``.ko.zst``) is unpacked
into the cache, bounded like a download, so that whoever reads its DWARF gets
a plain ELF file.  Whatever the finder answers, :class:`Debuginfo` records
its origin for Status and ``kreldctl``; when nothing is found,
:class:`~kreld.core.errors.DebuginfoNotFound` says where it looked and what
each server answered.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path

from kreld.config.settings import Config
from kreld.core import consts
from kreld.core.errors import (
    DebuginfodError,
    DebuginfoError,
    DebuginfoMismatch,
    DebuginfoNotFound,
    OutputError,
)
from kreld.core.record import record
from kreld.debuginfo.cache import DebugCache
from kreld.debuginfo.fetch import FetchLimits, download, server_urls
from kreld.debuginfo.places import (
    Kind,
    Layout,
    ModuleIndex,
    SearchRoot,
    Wanted,
    candidates,
    checked,
    read_modules_dep,
    search_roots,
)
from kreld.debuginfo.unpack import unpacker
from kreld.kernel.elf import fd_build_id

__all__ = ["Debuginfo", "DebuginfoFinder", "Origin", "finder_for"]


class Origin(StrEnum):
    LOCAL = "local"  # a file in a search root
    CACHE = "cache"  # kreld's cache, filled earlier (source says from where)
    DEBUGINFOD = "debuginfod"  # fetched now


@record
class Debuginfo:
    """A debug file whose build-id was checked, and its provenance: the file
    found (a local path, or the URL it was fetched from), the search root and
    layout it was found in, and the path to read it at (which is the cached
    copy for a download or an unpacked module)."""

    path: Path
    build_id: str
    kind: Kind
    origin: Origin
    source: str
    root: SearchRoot | None = None
    layout: Layout | None = None

    def describe(self) -> str:
        if self.origin is Origin.LOCAL and self.root is not None:
            how = f" ({self.layout} layout in {self.root.path}, from {self.root.named_by})"
            unpacked = f", unpacked to {self.path}" if str(self.path) != self.source else ""
            return f"{self.source}{how}{unpacked}"
        if self.origin is Origin.CACHE:
            return f"{self.path} (cached, from {self.source or 'an unknown source'})"
        return f"{self.source} (debuginfod, cached as {self.path})"


class DebuginfoFinder:
    """Finds debug files; keeps each search root's module index between calls."""

    __slots__ = ("_dep", "_indexes", "cache", "limits", "notes", "roots", "servers", "system_root")

    def __init__(
        self,
        roots: Sequence[SearchRoot],
        *,
        servers: Sequence[str] = (),
        cache: DebugCache | None = None,
        limits: FetchLimits | None = None,
        system_root: Path = Path("/"),
        notes: Sequence[str] = (),
    ) -> None:
        self.roots = tuple(roots)
        self.servers = tuple(servers)
        self.cache = cache
        self.limits = limits or FetchLimits()
        self.system_root = system_root
        self.notes = tuple(notes)
        self._indexes: dict[tuple[str, str], ModuleIndex] = {}
        self._dep: dict[str, dict[str, str]] = {}

    def find(self, want: Wanted) -> Debuginfo:
        """The checked debug file of *want*, or :class:`DebuginfoNotFound`."""
        want = checked(want)
        looked: list[str] = []
        failures: list[str] = list(self.notes)
        for root in self.roots:
            found = self._local(root, want, looked, failures)
            if found is not None:
                return found
        if self.cache is not None:
            hit = self.cache.lookup(want.build_id)
            if hit is not None:
                return Debuginfo(hit[0], want.build_id, want.kind, Origin.CACHE, hit[1])
            looked.append(f"the cache {self.cache.directory}")
        for server in self.servers:
            try:
                return self._fetch(server, want)
            except (DebuginfodError, DebuginfoMismatch, OutputError) as e:
                failures.append(str(e).removeprefix(f"debuginfo for build {want.build_id}: "))
        if self.servers and self.cache is None:
            failures.append("debuginfod servers not asked: no cache directory to keep a file in")
        raise DebuginfoNotFound(want.build_id, want.describe(), tuple(looked), tuple(failures))

    def _local(
        self, root: SearchRoot, want: Wanted, looked: list[str], failures: list[str]
    ) -> Debuginfo | None:
        looked.append(f"{root.path} (from {root.named_by})")
        for layout, path in candidates(root, want, self._module_paths(root, want)):
            found = _build_id_at(path)
            if found is None:
                continue  # absent, not a regular file, or no ELF file
            if path.name.endswith((".xz", ".zst")):
                unpacked = self._unpack(path, want, found, failures)
                if unpacked is not None:
                    return Debuginfo(
                        unpacked, want.build_id, want.kind, Origin.LOCAL, str(path), root, layout
                    )
                continue
            if found == want.build_id:
                return Debuginfo(
                    path, want.build_id, want.kind, Origin.LOCAL, str(path), root, layout
                )
            failures.append(f"{path} has build-id {found}, refused")
        return None

    def _module_paths(self, root: SearchRoot, want: Wanted) -> list[str]:
        """Where the module may live under ``lib/modules/R``: the path the
        caller knows, the system's ``modules.dep``, the root's own tree."""
        if want.kind is not Kind.MODULE:
            return []
        out = [want.path] if want.path else []
        dep = self._dep.get(want.release)
        if dep is None:
            dep_file = self.system_root / "lib" / "modules" / want.release / "modules.dep"
            dep = self._dep[want.release] = read_modules_dep(dep_file)
        for path in (
            dep.get(want.name.replace("-", "_")),
            *self._index(root, want).paths(want.name),
        ):
            if path and path not in out:
                out.append(path)
        return out

    def _index(self, root: SearchRoot, want: Wanted) -> ModuleIndex:
        key = (root.path, want.release)
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = ModuleIndex(
                Path(root.path) / "lib" / "modules" / want.release
            )
        return index

    def _unpack(self, path: Path, want: Wanted, found: str, failures: list[str]) -> Path | None:
        """A compressed module unpacked into the cache, if it is of the build."""
        if self.cache is None:
            failures.append(f"{path} not unpacked: no cache directory to unpack it in")
            return None
        hit = self.cache.lookup(want.build_id)
        if hit is not None:
            return hit[0]
        try:
            return self.cache.store(
                want.build_id, str(path), unpacker(path, want.build_id, self.limits.max_bytes)
            )
        except (DebuginfoError, OutputError) as e:
            failures.append(str(e).removeprefix(f"debuginfo for build {want.build_id}: "))
            return None

    def _fetch(self, server: str, want: Wanted) -> Debuginfo:
        if self.cache is None:
            raise DebuginfodError(want.build_id, server, "no cache directory to keep the file in")
        answered: list[str] = []

        def fill(fd: int) -> None:
            answered.append(download(server, want.build_id, fd, self.limits))

        source = f"{server.rstrip('/')}/buildid/{want.build_id}/debuginfo"
        path = self.cache.store(want.build_id, source, fill)
        return Debuginfo(path, want.build_id, want.kind, Origin.DEBUGINFOD, answered[-1])


def _build_id_at(path: Path) -> str | None:
    """The build-id of a regular file at *path* (a compressed one: the
    sentinel ``""``), or ``None``; a link is followed (``.build-id`` entries
    are links), a FIFO or device is never opened for reading."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        if path.name.endswith((".xz", ".zst")):
            return ""
        return fd_build_id(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def finder_for(
    cfg: Config,
    root: str | Path,
    given_dirs: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> DebuginfoFinder:
    """The finder a configuration describes: ``--debuginfo-dir`` *given_dirs*
    first, then ``/usr/lib/debug`` under *root*, then ``[kernel]
    debuginfo_dirs``; the debuginfod servers of ``[kernel] debuginfod_urls``
    or ``DEBUGINFOD_URLS``; the cache under the state directory."""
    servers, notes = server_urls(cfg.debuginfod_urls, os.environ if environ is None else environ)
    return DebuginfoFinder(
        search_roots(root, cfg.debuginfo_dirs, given_dirs),
        servers=servers,
        cache=DebugCache(Path(cfg.state_dir) / consts.DEBUGINFO_CACHE, cfg.debuginfo_cache_bytes),
        limits=FetchLimits(
            cfg.debuginfod_timeout, cfg.debuginfod_max_time, cfg.debuginfod_max_bytes
        ),
        system_root=Path(root),
        notes=notes,
    )
