"""The listening socket's file: bound safely, and whether a live server answers there."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from kreld.core.errors import SocketError
from kreld.server.access import check_socket_dir, group_id

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

__all__ = ["LISTEN_BACKLOG", "bind_socket", "socket_answers"]

# Pending connections the kernel queues for us (capped by net.core.somaxconn).
LISTEN_BACKLOG = 1024


def socket_answers(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def bind_socket(path: str, group: str, log: FilteringBoundLogger) -> socket.socket:
    """Bind a listening socket at *path*, mode 0660, group *group*.

    Refuses to take a path a live kreld answers on, and anything at the path
    that is not a socket (a planted symlink is never followed); a stale
    socket is removed.  The socket is bound under a temporary name, given
    its mode and group, then renamed into place: it is never reachable with
    looser permissions.
    """
    p = Path(path)
    check_socket_dir(p.parent)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise SocketError(f"{path}: exists and is not a socket; refusing to replace it")
        if socket_answers(path):
            raise SocketError(f"{path}: a live server answers there; refusing to take it over")
        log.info("stale_socket_removed", path=path)
        os.unlink(p)
    gid = group_id(group)
    if gid is None:
        log.warning("socket_group_missing", group=group, fallback="root")
        gid = 0
    tmp = p.with_name(f".{p.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            sock.bind(str(tmp))
        finally:
            os.umask(old)
        os.chown(tmp, -1, gid)
        os.chmod(tmp, 0o660)
        os.rename(tmp, p)
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        raise SocketError(f"{path}: cannot bind: {e.strerror}") from e
    return sock
