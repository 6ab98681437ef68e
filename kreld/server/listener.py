"""The varlink server: how much one may ask, and the ``io.kreld`` methods
(who may ask is :mod:`kreld.server.access`).

One asyncio loop serves every connection; store reads are short LMDB read
transactions done inline, slow work (a fresh snapshot) runs in a thread.
Module events arrive from the tracker thread and fan out to subscribers
through bounded queues: a subscriber that does not keep up is dropped with
``io.kreld.SubscriberTooSlow`` and never holds anyone else back.

Connections are capped twice: all of them (``io.kreld.TooManyConnections``),
and those of one uid (``io.kreld.TooManyConnectionsPerUid``), so that one peer
holding the global cap cannot lock every other client out.  A uid's count takes
in every connection from its accept to its close, refused ones too.  Root and
kreld's own uid are not counted: they are admitted whatever the policy says,
and can stop kreld anyway; they stay under the global cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kreld.core import consts
from kreld.core.errors import KreldError, SocketError
from kreld.core.kcode import CodeEvent, KernelCode
from kreld.core.model import Incarnation, ModuleEvent
from kreld.core.record import record
from kreld.core.supervise import supervisor
from kreld.server.access import Policy, check_socket_dir, group_id, peer_comm, peer_cred
from kreld.server.methods import METHODS, answer, lookup
from kreld.server.service import Service
from kreld.varlink.requests import Subscribe, parse
from kreld.varlink.wire import (
    INTERFACE,
    SERVICE,
    Call,
    VarlinkError,
    error_reply,
    parse_call,
    reply,
    reply_encoded,
)

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from kreld.config.settings import Config

__all__ = [
    "ACCEPT_BATCH",
    "ACCEPT_HEADROOM",
    "LISTEN_BACKLOG",
    "RESERVED_FDS",
    "Limits",
    "Server",
    "bind_socket",
    "limits_of",
    "raise_fd_limit",
    "socket_answers",
]

# Pending connections the kernel queues for us (capped by net.core.somaxconn).
LISTEN_BACKLOG = 1024
# Connections asyncio accepts in one go: each holds a descriptor until its
# handler has run and its close has gone through (a few loop turns), so
# the connection cap leaves ACCEPT_HEADROOM descriptors free for them
# (limits_of()).
ACCEPT_BATCH = 32
ACCEPT_HEADROOM = 6 * ACCEPT_BATCH


@record
class Limits:
    max_message_bytes: int = consts.DEFAULT_MAX_MESSAGE_BYTES
    max_connections: int = consts.DEFAULT_MAX_CONNECTIONS
    max_connections_per_uid: int = consts.DEFAULT_MAX_CONNECTIONS_PER_UID
    idle_timeout: float = consts.DEFAULT_IDLE_TIMEOUT
    subscribe_queue: int = consts.DEFAULT_SUBSCRIBE_QUEUE


# Descriptors kept for the store, the sources, sysfs reads and the log.
RESERVED_FDS = 64


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


def limits_of(cfg: Config, log: FilteringBoundLogger | None = None) -> Limits:
    """The server's limits; connections capped so clients can never take the
    descriptors module tracking needs (EMFILE there would blind it)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    conns = cfg.max_connections
    room = soft - RESERVED_FDS - ACCEPT_HEADROOM
    if soft != resource.RLIM_INFINITY and conns > room:
        conns = max(1, room)
        if log is not None:
            log.warning("max_connections_capped", configured=cfg.max_connections, to=conns)
    return Limits(
        cfg.max_message_bytes,
        conns,
        cfg.max_connections_per_uid,
        cfg.idle_timeout,
        cfg.subscribe_queue,
    )


class _Conn:
    """One client connection's state: who it is and what it has done.  Mutable,
    so a plain slotted class rather than a record."""

    __slots__ = ("calls", "comm", "opened", "overflowed", "pid", "queue", "uid", "writer")

    def __init__(self, pid: int, uid: int, comm: str | None, writer: asyncio.StreamWriter) -> None:
        self.pid, self.uid, self.comm, self.writer = pid, uid, comm, writer
        self.queue: asyncio.Queue[dict[str, Any] | None] | None = None
        self.overflowed = False
        self.calls = 0
        self.opened = time.monotonic()


class Server:
    """Accepts connections on a listening socket and speaks varlink."""

    def __init__(
        self, service: Service, policy: Policy, limits: Limits, log: FilteringBoundLogger
    ) -> None:
        self.service = service
        self.policy = policy
        self.limits = limits
        self.log = log
        self.conns: set[_Conn] = set()
        self.subscribers: set[_Conn] = set()
        self.refused = 0
        # Open connections of each uid not exempt from the per-uid cap; the uids
        # whose refusal was logged since they last held none.
        self.per_uid: dict[int, int] = {}
        self._capped: set[int] = set()
        self._exempt = frozenset({0, os.geteuid()})
        self._tasks: set[asyncio.Task[None]] = set()
        # One thread for the calls that may take a while (see kreld.server.methods, Method.quick).
        self._worker = supervisor().executor("calls", 1)
        self._server: asyncio.base_events.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, sock: socket.socket) -> None:
        self._loop = asyncio.get_running_loop()
        sock.setblocking(False)
        self._loop.set_exception_handler(self._loop_error)
        self._server = await asyncio.start_unix_server(
            self._handle, sock=sock, limit=self.limits.max_message_bytes, backlog=ACCEPT_BATCH
        )
        # asyncio listened with its batch size; the kernel may queue many more.
        sock.listen(LISTEN_BACKLOG)

    def _loop_error(self, _loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio's own troubles (a failed accept, say) go to kreld's log, not
        as bare tracebacks on stderr."""
        exc = context.get("exception")
        self.log.error(
            "event_loop_error",
            message=context.get("message"),
            error=str(exc) if exc else None,
            kind=type(exc).__name__ if exc else None,
        )

    async def close(self) -> None:
        """Stop accepting, end every connection's task, and wait for them."""
        if self._server is not None:
            self._server.close()
        for c in list(self.subscribers):
            self._end_subscription(c)
        for c in list(self.conns):
            c.writer.close()
        tasks = [t for t in self._tasks if not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        if self._server is not None:
            await self._server.wait_closed()
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _end_subscription(self, c: _Conn) -> None:
        self.subscribers.discard(c)
        if c.queue is not None:
            while not c.queue.empty():
                c.queue.get_nowait()
            c.queue.put_nowait(None)

    # -- module events from the tracker thread ------------------------------------

    def publish(self, kind: ModuleEvent | CodeEvent, inc: Incarnation | KernelCode) -> None:
        """Thread-safe: hand an event (a module's, or kernel code's) to the loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._broadcast, kind, inc)

    def _broadcast(self, kind: ModuleEvent | CodeEvent, inc: Incarnation | KernelCode) -> None:
        self.service.invalidate()
        if not self.subscribers:
            return
        event = {"event": kind, "code" if isinstance(inc, KernelCode) else "module": inc.to_json()}
        for c in list(self.subscribers):
            if c.queue is None:  # not a subscriber (cannot happen: set before it is added)
                continue
            try:
                c.queue.put_nowait(event)
            except asyncio.QueueFull:
                self._drop(c)

    def _drop(self, c: _Conn) -> None:
        """Drop a subscriber that fell behind: tell it why if its socket can take it."""
        c.overflowed = True
        self._end_subscription(c)
        if c.writer.transport.get_write_buffer_size():
            # It is not reading at all: nothing more can reach it.
            c.writer.transport.abort()
        self.log.warning(
            "subscriber_dropped", pid=c.pid, uid=c.uid, queued=self.limits.subscribe_queue
        )

    # -- connections ---------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        sock = writer.get_extra_info("socket")
        try:
            pid, uid, gid = peer_cred(sock)
        except OSError:
            writer.close()
            return
        over = self._over_a_limit(pid, uid)
        if over is not None:
            # Said without waiting for the peer: the descriptor goes at once.
            writer.write(error_reply(over))
            writer.close()
            return
        conn = _Conn(pid, uid, None, writer)
        try:
            if not self.policy.allows(pid, uid, gid):
                conn.comm = peer_comm(pid)
                self.refused += 1
                self.log.warning("peer_refused", pid=pid, uid=uid, gid=gid, comm=conn.comm)
                await self._refuse(reader, conn)
                return
            self.conns.add(conn)
            await self._serve(reader, conn)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except Exception as e:  # one connection's failure must never stop the daemon
            self.log.error("connection_failed", pid=pid, error=str(e), kind=type(e).__name__)
        finally:
            self.conns.discard(conn)
            self.subscribers.discard(conn)
            self._let_go(uid)
            writer.close()

    def _over_a_limit(self, pid: int, uid: int) -> VarlinkError | None:
        """The refusal of a connection over the global or its uid's cap, or None:
        then the connection counts against its uid until :meth:`_let_go`."""
        if len(self.conns) >= self.limits.max_connections:
            return VarlinkError(
                f"{INTERFACE}.TooManyConnections", {"limit": self.limits.max_connections}
            )
        if uid in self._exempt:
            return None
        held, cap = self.per_uid.get(uid, 0), self.limits.max_connections_per_uid
        if held >= cap:
            if uid not in self._capped:  # once, not once per connection of a flood
                self._capped.add(uid)
                self.log.warning("peer_connection_limit", pid=pid, uid=uid, limit=cap)
            return VarlinkError(f"{INTERFACE}.TooManyConnectionsPerUid", {"uid": uid, "limit": cap})
        self.per_uid[uid] = held + 1
        return None

    def _let_go(self, uid: int) -> None:
        held = self.per_uid.pop(uid, 0) - 1
        if held > 0:
            self.per_uid[uid] = held
        else:
            self._capped.discard(uid)

    async def _refuse(self, reader: asyncio.StreamReader, conn: _Conn) -> None:
        err = VarlinkError(
            f"{INTERFACE}.PermissionDenied",
            {"message": f"uid {conn.uid} is not allowed to use kreld"},
        )
        with contextlib.suppress(
            asyncio.LimitOverrunError, asyncio.IncompleteReadError, TimeoutError
        ):
            async with asyncio.timeout(2):
                await reader.readuntil(b"\0")
        await self._send(conn, error_reply(err))

    async def _send(self, conn: _Conn, data: bytes) -> None:
        """Write a reply; wait (bounded) only while the peer leaves it unread."""
        writer = conn.writer
        if writer.transport.is_closing():  # the peer went away: stop serving it
            raise ConnectionResetError("connection lost")
        writer.write(data)
        # Most replies go into the socket at once: no drain, no timer.
        if writer.transport.get_write_buffer_size():
            async with asyncio.timeout(self.limits.idle_timeout):
                await writer.drain()

    async def _serve(self, reader: asyncio.StreamReader, conn: _Conn) -> None:
        while True:
            try:
                # A timeout context, not wait_for(): no task per message.
                async with asyncio.timeout(self.limits.idle_timeout):
                    raw = await reader.readuntil(b"\0")
            except asyncio.LimitOverrunError:
                err = VarlinkError(
                    f"{INTERFACE}.MessageTooLarge", {"limit": self.limits.max_message_bytes}
                )
                self.log.warning("message_too_large", pid=conn.pid, uid=conn.uid)
                await self._send(conn, error_reply(err))
                return
            except asyncio.IncompleteReadError as e:
                if e.partial.strip():
                    err = VarlinkError(
                        f"{INTERFACE}.InvalidRequest", {"reason": "message not ended by NUL"}
                    )
                    await self._send(conn, error_reply(err))
                return
            except TimeoutError:
                self.log.debug("connection_idle_closed", pid=conn.pid)
                return
            conn.calls += 1
            try:
                call = parse_call(raw[:-1])
            except VarlinkError as bad:
                if not bad.oneway:
                    await self._send(conn, error_reply(bad))
                continue
            method = METHODS.get(call.method)
            if method is not None and method.streaming:
                if call.oneway:  # it could stream nothing: no subscription, no reply
                    continue
                if not call.more:
                    await self._send(conn, error_reply(VarlinkError(f"{SERVICE}.ExpectedMore")))
                    continue
                await self._subscribe(conn, call, reader)
                return
            if method is None or method.quick(call.parameters, self.service):
                data = self._dispatch(call)
            else:
                # Work that grows with the store or the request runs on the worker
                # thread, so the loop goes on answering everyone else meanwhile.
                loop = asyncio.get_running_loop()
                data = await loop.run_in_executor(self._worker, self._dispatch, call)
            if not call.oneway:  # a oneway call is carried out, its reply dropped
                await self._send(conn, data)

    def _dispatch(self, call: Call) -> bytes:
        """The reply to a call: its answer, or the error that stopped it."""
        try:
            out = answer(self.service, lookup(call.method), call.parameters)
            return reply_encoded(out) if isinstance(out, bytes) else reply(out)
        except KreldError as e:
            return error_reply(VarlinkError.from_kreld(e))
        except RecursionError:
            return error_reply(VarlinkError(f"{INTERFACE}.InvalidRequest", {"reason": "too deep"}))
        except Exception as e:  # a bug must cost one call, never the daemon
            self.log.error("call_failed", method=call.method, error=str(e), kind=type(e).__name__)
            return error_reply(
                VarlinkError(f"{INTERFACE}.InternalError", {"message": f"{type(e).__name__}: {e}"})
            )

    def counts(self) -> dict[str, int]:
        """What Status says of the server: its connections and subscribers."""
        return {"connections": len(self.conns), "subscribers": len(self.subscribers)}

    async def _subscribe(self, conn: _Conn, call: Call, reader: asyncio.StreamReader) -> None:
        try:
            parse(Subscribe, call.parameters)
        except KreldError as err:
            await self._send(conn, error_reply(VarlinkError.from_kreld(err)))
            return
        conn.queue = asyncio.Queue(maxsize=self.limits.subscribe_queue)
        self.subscribers.add(conn)
        code = self.service.live_code()
        first = {
            "event": "snapshot",
            "modules": [i.to_json() for i in self.service.loaded()],
            "kernel_code": None if code is None else [c.to_json() for c in code],
        }
        conn.writer.write(reply(first, continues=True))
        await conn.writer.drain()
        queue = conn.queue

        async def hangup() -> None:
            # A subscriber sends nothing more: the read ends when it goes away.
            with contextlib.suppress(ConnectionError, asyncio.LimitOverrunError):
                while await reader.read(4096):
                    pass
            self._end_subscription(conn)

        watcher = supervisor().task("subscriber", hangup(), forever=False, transient=True)
        try:
            while (event := await queue.get()) is not None:
                conn.writer.write(reply(event, continues=True))
                # A reader that lets its socket buffer fill stalls only this task;
                # its bounded queue then overflows and _drop() cuts it off.
                async with asyncio.timeout(self.limits.idle_timeout):
                    await conn.writer.drain()
        finally:
            watcher.cancel()
        if conn.overflowed:
            too_slow = VarlinkError(
                f"{INTERFACE}.SubscriberTooSlow", {"queued": self.limits.subscribe_queue}
            )
            conn.writer.write(error_reply(too_slow))
            async with asyncio.timeout(5):
                await conn.writer.drain()


# -- the listening socket --------------------------------------------------------


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
