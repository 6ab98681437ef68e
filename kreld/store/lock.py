"""One writer per store, and a damaged store set aside instead of the end of recording.

The writer lock is ``flock(LOCK_EX)`` on ``kreld.lock`` in the state
directory, held for the writer's life: the kernel drops it when the process
dies, so a kreld killed with SIGKILL never leaves a stale lock, and a second
kreld (a manual run beside the service) is refused with
:class:`~kreld.core.errors.StoreLocked` instead of recording every event twice.
Readers (kreldctl without a daemon) never take it: LMDB lets readers and one
writer work side by side.

A kreld store LMDB can no longer read whole (:class:`~kreld.core.errors.StoreDamaged`:
cut short, damaged pages) is moved, never changed or deleted, into
``damaged-YYYYmmddTHHMMSSZ/`` inside the state directory, with its
``lock.mdb``: a state directory of its own, so ``kreldctl --state-dir`` can
be pointed at it.  A file that is not a kreld store, or a store of a newer
kreld, is somebody else's and stays where it is (refused, exit 5).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kreld.core.errors import StoreDamaged, StoreError, StoreFull, StoreLocked
from kreld.store import Store
from kreld.store.ownership import check_owner

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

__all__ = [
    "DAMAGED_PREFIX",
    "LOCK_NAME",
    "WriterLock",
    "damaged_stores",
    "open_writable",
    "set_aside",
    "writer_lock",
]

LOCK_NAME = "kreld.lock"
DAMAGED_PREFIX = "damaged-"
_STORE_FILES = ("data.mdb", "lock.mdb")


class WriterLock:
    """The exclusive writer lock on a state directory, held until :meth:`release`."""

    @classmethod
    def taken(cls, state_dir: str | os.PathLike[str], log: Any) -> WriterLock:
        """The lock, taken; where the disk had no room for the pid, held all the
        same (only the pid is missing) and said in the log."""
        lock = cls(state_dir)
        if lock.unwritten is not None:
            log.warning("writer_lock_pid_unwritten", error=str(lock.unwritten))
        return lock

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.state_dir = Path(state_dir)
        try:
            self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(str(self.state_dir), f"cannot create: {e.strerror}") from e
        check_owner(self.state_dir)
        path = self.state_dir / LOCK_NAME
        try:
            self._fd: int | None = os.open(
                path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
            )
        except OSError as e:
            raise StoreError(str(path), f"cannot open the writer lock: {e.strerror}") from e
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            self.release()
            raise StoreLocked(
                str(self.state_dir), f"another kreld (pid {holder}) writes to this store"
            ) from None
        self.unwritten: StoreFull | None = self._write_pid(path)

    def _write_pid(self, path: Path) -> StoreFull | None:
        """Write our pid for a refused second writer to name; on a full disk the lock
        is held all the same and the file left empty (a StoreFull to log is returned).

        The pid goes over the old one before the tail is cut: the blocks the file has
        already hold it, so a full disk costs it only when the file was new."""
        fd = self._fd
        if fd is None:
            return None
        pid = f"{os.getpid()}\n".encode()
        try:
            written = os.pwrite(fd, pid, 0)
            os.ftruncate(fd, len(pid) if written == len(pid) else 0)
        except OSError as e:
            # Cutting a file to nothing needs no room: no stale pid is left to mislead.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                return StoreFull(str(path), f"cannot write the pid into the lock: {e.strerror}")
            self.release()
            raise StoreError(str(path), f"cannot write the writer lock: {e.strerror}") from e
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@contextlib.contextmanager
def writer_lock(state_dir: str | os.PathLike[str]) -> Iterator[WriterLock]:
    lock = WriterLock(state_dir)
    try:
        yield lock
    finally:
        lock.release()


def set_aside(state_dir: Path, now: float | None = None) -> Path:
    """Move the store files into a new ``damaged-<UTC time>/``; returns it."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    for n in range(1, 1000):
        dest = state_dir / (f"{DAMAGED_PREFIX}{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            dest.mkdir(mode=0o700)
            break
        except FileExistsError:
            continue
        except OSError as e:
            raise StoreError(str(state_dir), f"cannot set the damaged store aside: {e}") from e
    else:
        raise StoreError(str(state_dir), "cannot set the damaged store aside: no free name")
    for name in _STORE_FILES:
        with contextlib.suppress(FileNotFoundError):
            # rename(2) within one directory tree: atomic, nothing copied or lost.
            os.rename(state_dir / name, dest / name)
    return dest


def damaged_stores(state_dir: str | os.PathLike[str]) -> list[str]:
    """The stores set aside in *state_dir*, oldest first."""
    try:
        names = os.listdir(state_dir)
    except OSError:
        return []
    return [
        str(Path(state_dir) / n)
        for n in sorted(names)
        if n.startswith(DAMAGED_PREFIX) and os.path.isfile(Path(state_dir) / n / "data.mdb")
    ]


def open_writable(state_dir: Path, log: FilteringBoundLogger) -> Store:
    """Open the store for writing (the writer lock already held); a damaged one
    is set aside, logged at error level, and a fresh store started."""
    try:
        return Store(state_dir)
    except StoreDamaged as e:
        dest = set_aside(state_dir)
        log.error("store_set_aside", error=str(e), moved_to=str(dest), files=list(_STORE_FILES))
        return Store(state_dir)
