"""The state directory is kreld's own: whoever owns a directory, or may write
to it, can swap ``data.mdb`` under the daemon, so the store opens only a
directory (and LMDB files in it) belonging to root or kreld's user, closed to
other writers, and never through a symlink.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kreld.core.errors import StoreError

__all__ = ["check_owner"]


def check_owner(path: Path) -> None:
    """Refuse a state directory someone else controls (or a symlink to one).

    Whoever owns the directory, or may write to it, can swap data.mdb under
    the daemon; kreld writes only into a directory of its own user (or root).
    """
    try:
        st = os.lstat(path)
    except OSError as e:
        raise StoreError(str(path), f"cannot stat: {e.strerror}") from e
    if stat.S_ISLNK(st.st_mode):
        raise StoreError(str(path), "is a symlink; refusing to follow it")
    if st.st_uid not in (0, os.geteuid()):
        raise StoreError(str(path), f"owned by uid {st.st_uid}, not by kreld's uid {os.geteuid()}")
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        raise StoreError(str(path), "is writable by every user")
    for name in ("data.mdb", "lock.mdb"):
        try:
            fst = os.lstat(path / name)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(fst.st_mode) or fst.st_uid not in (0, os.geteuid()):
            raise StoreError(str(path / name), "a symlink or another user's file; refusing it")
