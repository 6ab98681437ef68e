"""A process at the other end of a Unix socket, as the kernel tells of it:
its ``SO_PEERCRED`` credentials and, from ``/proc/<pid>``, its supplementary
groups and command name."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import socket

__all__ = ["peer_comm", "peer_cred", "peer_groups"]


def peer_groups(pid: int) -> set[int]:
    """The supplementary groups of a process, from ``/proc/<pid>/status``."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def peer_comm(pid: int) -> str | None:
    """A peer's command name, for the log."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket."""
    import socket  # here: only the server asks, and kreldctl show imports this module

    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid
