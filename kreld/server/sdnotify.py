"""sd_notify(3), sent without ever blocking the daemon's event loop.

libsystemd's ``sd_notify`` (and python-systemd's ``daemon.notify`` over it)
sends on a blocking datagram socket.  A Unix datagram receiver holds only
``net.unix.max_dgram_qlen`` messages (10 by default); once its reader falls
behind (systemd busy, a test's socket not read), the next send waits, and the
daemon's whole asyncio loop with it: no call is answered and a supervisor
failure is never looked at.  Here every message is sent with MSG_DONTWAIT; one
the receiver has no room for is dropped and counted.  Dropping is safe for
what kreld sends: ``WATCHDOG=1`` comes again within half the watchdog's
interval, and ``STATUS=`` is resent whenever it changes.
"""

from __future__ import annotations

import os
import socket

__all__ = ["Notifier"]


class Notifier:
    """Messages to ``$NOTIFY_SOCKET``, as sd_notify(3) sends them."""

    def __init__(self, address: str | None = None) -> None:
        addr = os.environ.get("NOTIFY_SOCKET") if address is None else address
        if addr and addr.startswith("@"):  # the abstract namespace
            addr = "\0" + addr[1:]
        self.address = addr if addr and addr[0] in "/\0" else None
        self.dropped = 0
        self._sock: socket.socket | None = None

    def __call__(self, message: str) -> bool:
        """Send *message*; False where there is no socket or no room in it."""
        if self.address is None:
            return False
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.sendto(
                message.encode(), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL, self.address
            )
        except (BlockingIOError, ConnectionRefusedError, FileNotFoundError):
            self.dropped += 1  # the receiver is behind, or gone: never wait for it
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
