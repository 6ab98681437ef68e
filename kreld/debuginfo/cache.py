"""The cache of debug files kreld made itself: fetched from debuginfod, or
unpacked from a compressed module.

``<state-dir>/debuginfo/<build-id>.debug``, each with ``<build-id>.from``
saying where it came from.  A file enters only whole and checked: it is
written as a private temporary file in the cache directory (``O_CREAT |
O_EXCL | O_NOFOLLOW``, mode 0600, an unpredictable name), made durable, its
build-id read from the written bytes, and only then renamed into place.  A
file of another build, a download cut short or over its bounds, never gets a
name a reader would open: its temporary file is removed.  Every step is
relative to the directory's descriptor, opened without following a link and
refused unless it is the caller's own and writable by nobody else.

The cache is bounded: past ``max_bytes`` the files used least recently (a
hit touches its file) are removed, never the one just added.  A hit is read
for its build-id again, and an entry that fails the check is removed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import time
from collections.abc import Callable
from pathlib import Path

from kreld.core.errors import DebuginfoMismatch, OutputError
from kreld.kernel.elf import fd_build_id

__all__ = ["DebugCache", "Filler"]

# Writes a file's bytes to the descriptor it is given, or raises.
Filler = Callable[[int], None]

_SUFFIX = ".debug"
_FROM = ".from"
_PART = ".part"
_MAX_FROM = 4096
# A temporary file older than this is left over from a process that died.
_STALE_PART = 24 * 3600.0


class DebugCache:
    """One cache directory; opened (and made, mode 0700) on first use."""

    __slots__ = ("directory", "max_bytes")

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes

    def lookup(self, build_id: str) -> tuple[Path, str] | None:
        """The cached file of *build_id* and where it came from, or ``None``."""
        try:
            dfd = self._open_dir(create=False)
        except OutputError:
            return None
        try:
            name = build_id + _SUFFIX
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
            except OSError:
                return None
            try:
                good = stat.S_ISREG(os.fstat(fd).st_mode) and fd_build_id(fd) == build_id
            finally:
                os.close(fd)
            if not good:
                _remove(dfd, build_id)
                return None
            with contextlib.suppress(OSError):
                os.utime(name, dir_fd=dfd, follow_symlinks=False)
            return self.directory / name, _read_from(dfd, build_id)
        finally:
            os.close(dfd)

    def store(self, build_id: str, source: str, fill: Filler) -> Path:
        """Let *fill* write a file, check it is of *build_id*, and rename it into
        the cache as *source*'s; on any failure nothing of it stays."""
        dfd = self._open_dir(create=True)
        try:
            part = _write(dfd, build_id, fill, source)
            side = _write(dfd, build_id, lambda fd: _write_all(fd, source.encode()), None)
            os.rename(side, build_id + _FROM, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.rename(part, build_id + _SUFFIX, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
            self._evict(dfd, keep=build_id)
            return self.directory / (build_id + _SUFFIX)
        except OSError as e:
            raise OutputError(str(self.directory), f"cannot keep a file there: {e}") from e
        finally:
            os.close(dfd)

    def _open_dir(self, create: bool) -> int:
        path = str(self.directory)
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
        try:
            dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise OutputError(path, f"cannot open the debuginfo cache: {e.strerror}") from e
        st = os.fstat(dfd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            os.close(dfd)
            raise OutputError(path, "the debuginfo cache is not ours alone to write")
        return dfd

    def _evict(self, dfd: int, keep: str) -> None:
        """Remove least recently used files until the cache is within bounds,
        and temporary files a dead process left."""
        now = time.time()
        entries: list[tuple[float, int, str]] = []
        total = 0
        with os.scandir(dfd) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if entry.name.endswith(_PART) and now - st.st_mtime > _STALE_PART:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.name, dir_fd=dfd)
                elif entry.name.endswith(_SUFFIX) and stat.S_ISREG(st.st_mode):
                    total += st.st_size
                    entries.append((st.st_mtime, st.st_size, entry.name[: -len(_SUFFIX)]))
        for _mtime, size, build_id in sorted(entries):
            if total <= self.max_bytes:
                break
            if build_id != keep:
                _remove(dfd, build_id)
                total -= size


def _write(dfd: int, build_id: str, fill: Filler, source: str | None) -> str:
    """A whole, durable private file in the cache under a temporary name; with
    a *source* it is a debug file and must be of *build_id*."""
    name = f".{build_id}.{secrets.token_hex(8)}{_PART}"
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(name, flags, 0o600, dir_fd=dfd)
    try:
        fill(fd)
        os.fsync(fd)
        if source is not None:
            found = fd_build_id(fd)
            if found != build_id:
                raise DebuginfoMismatch(build_id, source, found)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dfd)
        raise
    os.close(fd)
    return name


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _remove(dfd: int, build_id: str) -> None:
    for suffix in (_SUFFIX, _FROM):
        with contextlib.suppress(OSError):
            os.unlink(build_id + suffix, dir_fd=dfd)


def _read_from(dfd: int, build_id: str) -> str:
    try:
        fd = os.open(build_id + _FROM, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.pread(fd, _MAX_FROM, 0).decode("utf-8", "replace")
    finally:
        os.close(fd)
