"""Access control: who may ask kreld, and where its socket may go.

Module addresses defeat KASLR, so they are for root, kreld's own uid, and the
uids and groups the configuration's ``[access]`` section lists.  A peer is
known by its ``SO_PEERCRED`` credentials (taken by the kernel at connect
time, so they cannot be forged) and its supplementary groups from
``/proc/<pid>/status`` (both read by :mod:`kreld.kernel.peers`).

Whoever owns or may write a directory can swap a file in it under the
daemon: the socket's directory must belong to root or kreld's user and be
closed to other writers (a sticky directory such as ``/tmp`` is fine: nobody
removes another's file there).  The state directory's own check is
:mod:`kreld.store.ownership`.
"""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from kreld.core.errors import SocketError
from kreld.core.record import record
from kreld.kernel.peers import peer_groups

if TYPE_CHECKING:  # the socket and config types only: kreldctl show needs no socket
    from structlog.typing import FilteringBoundLogger

    from kreld.config.settings import Config


__all__ = [
    "Policy",
    "check_socket_dir",
    "group_id",
    "policy_of",
]


@record
class Policy:
    """Who may connect: root, kreld's own uid, listed uids, members of listed groups."""

    allowed_gids: frozenset[int] = frozenset()
    allowed_uids: frozenset[int] = frozenset()

    def allows(self, pid: int, uid: int, gid: int) -> bool:
        if uid in (0, os.geteuid()) or uid in self.allowed_uids:
            return True
        if gid in self.allowed_gids:
            return True
        return bool(peer_groups(pid) & self.allowed_gids)


def policy_of(cfg: Config, log: FilteringBoundLogger) -> Policy:
    """The policy a configuration asks for; a listed group that does not exist is logged."""
    gids = set()
    for name in cfg.allowed_groups:
        gid = group_id(name)
        if gid is None:
            log.warning("allowed_group_missing", group=name)
        else:
            gids.add(gid)
    return Policy(frozenset(gids), frozenset(cfg.allowed_uids))


def group_id(name: str) -> int | None:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def check_socket_dir(parent: Path) -> None:
    """Refuse to put the socket in a directory someone else controls.

    A symlink is followed only if root or kreld's user made it.  Whoever may
    write the directory can replace the socket with their own.
    """
    try:
        parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        lst = os.lstat(parent)
        dst = os.stat(parent)
    except OSError as e:
        raise SocketError(f"{parent}: cannot create: {e.strerror}") from e
    if stat.S_ISLNK(lst.st_mode) and lst.st_uid not in (0, os.geteuid()):
        raise SocketError(f"{parent}: a symlink of uid {lst.st_uid}; refusing to follow it")
    if dst.st_uid not in (0, os.geteuid()):
        raise SocketError(f"{parent}: owned by uid {dst.st_uid}; refusing to put the socket there")
    if dst.st_mode & 0o022 and not dst.st_mode & stat.S_ISVTX:
        raise SocketError(f"{parent}: writable by others; refusing to put the socket there")
