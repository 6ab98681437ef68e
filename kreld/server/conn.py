"""One client connection: who it is, and how a reply reaches it.

A reply goes out a chunk at a time, the next handed to the socket only once the
last has left kreld (the connection's writer pauses at any byte buffered: see
:meth:`Conn.pause_at_any_byte`), so a peer that does not read holds no more than a
chunk in kreld; the rest waits in the kernel's socket buffer, or in the reply, which
may be shared by many connections.  A reply its peer leaves unread past a deadline
is :class:`ReplyUnread`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

__all__ = ["WRITE_CHUNK", "Conn", "ReplyUnread"]

# The most of a reply kreld hands a socket at once.
WRITE_CHUNK = 8 << 10


class ReplyUnread(TimeoutError):
    """The peer left a reply unread past the write deadline; *left*: bytes unsent."""

    def __init__(self, left: int) -> None:
        super().__init__(f"{left} bytes of a reply left unread")
        self.left = left


class Conn:
    """One client connection's state: who it is and what it has done.  Mutable,
    so a plain slotted class rather than a record."""

    __slots__ = ("calls", "comm", "opened", "overflowed", "pid", "queue", "uid", "writer")

    def __init__(self, pid: int, uid: int, comm: str | None, writer: asyncio.StreamWriter) -> None:
        self.pid, self.uid, self.comm, self.writer = pid, uid, comm, writer
        self.queue: asyncio.Queue[dict[str, Any] | None] | None = None
        self.overflowed = False
        self.calls = 0
        self.opened = time.monotonic()

    def pause_at_any_byte(self) -> None:
        """Any byte left in kreld pauses the writer, so a drain waits until the
        socket has taken all of it (send() then hands over the next chunk)."""
        self.writer.transport.set_write_buffer_limits(high=0)

    async def send(self, data: bytes, deadline: float) -> None:
        """Write *data* a chunk at a time within *deadline* seconds, or ReplyUnread."""
        transport = self.writer.transport
        if transport.is_closing():  # the peer went away: stop serving it
            raise ConnectionResetError("connection lost")
        view, at = memoryview(data), 0
        try:
            # Most replies go into the socket at once: no drain, no timer.
            transport.write(view[:WRITE_CHUNK])
            at = WRITE_CHUNK
            if at >= len(view) and not transport.get_write_buffer_size():
                return
            async with asyncio.timeout(deadline):
                while True:
                    if transport.get_write_buffer_size():
                        await self.writer.drain()
                    if at >= len(view):
                        return
                    transport.write(view[at : at + WRITE_CHUNK])
                    at += WRITE_CHUNK
        except TimeoutError:
            left = max(len(view) - at, 0) + transport.get_write_buffer_size()
            raise ReplyUnread(left) from None
        finally:
            view.release()
