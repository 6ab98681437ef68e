"""The varlink server: how much one may ask, and the ``io.kreld`` methods
(who may ask is :mod:`kreld.server.access`).

One asyncio loop serves every connection; store reads are short LMDB read
transactions done inline, slow work (a fresh snapshot) runs in a thread,
whose freed buffers go back to the kernel once its calls stop
(:mod:`kreld.server.heapback`).
Module events arrive from the tracker thread and fan out to subscribers
through bounded queues: a subscriber that does not keep up is dropped with
``io.kreld.SubscriberTooSlow`` and never holds anyone else back.

A peer that does not read costs a bounded amount: a reply goes out in chunks,
the next one handed to the socket only when the last has left kreld, so no more
than a chunk per connection waits in kreld (the rest waits in the kernel's
socket buffer, or in the reply, which for the subscription's first reply is one
encoding shared by every subscriber).  A reply its peer leaves unread for
``write_timeout`` seconds ends the connection: it is dropped, logged and
counted (Status ``dropped``), as is a subscriber whose queue overflows.

Connections are capped twice: all of them (``io.kreld.TooManyConnections``),
and those of one uid (``io.kreld.TooManyConnectionsPerUid``), so that one peer
holding the global cap cannot lock every other client out.  A uid's count takes
in every connection from its accept to its close, refused ones too.  Root and
kreld's own uid are counted too (``cap_root``, on by default): a root client
that never reads costs memory like any other; with ``cap_root`` off they are
held only by the global cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import resource
import socket
from typing import TYPE_CHECKING, Any

from kreld.config.settings import Limits
from kreld.core import consts
from kreld.core.errors import (
    KreldError,
    MessageTooLarge,
    SubscriberTooSlow,
    TooManyConnections,
    TooManyConnectionsPerUid,
)
from kreld.core.kernel_code import CodeEvent, KernelCode
from kreld.core.model import Incarnation, ModuleEvent
from kreld.core.record import replace
from kreld.core.supervise import supervisor
from kreld.kernel.peers import peer_comm, peer_cred
from kreld.server.access import Policy
from kreld.server.conn import Conn as _Conn
from kreld.server.conn import ReplyUnread
from kreld.server.heapback import QuietTrim
from kreld.server.methods import METHODS, answer, lookup
from kreld.server.service import Service
from kreld.server.socketfile import LISTEN_BACKLOG, bind_socket, socket_answers
from kreld.varlink.requests import Subscribe, parse
from kreld.varlink.wire import (
    INTERFACE,
    SERVICE,
    Call,
    VarlinkError,
    error_reply,
    invalid_request,
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

# Connections asyncio accepts in one go: each holds a descriptor until its
# handler has run and its close has gone through (a few loop turns), so
# the connection cap leaves ACCEPT_HEADROOM descriptors free for them
# (limits_of()).
ACCEPT_BATCH = 32
ACCEPT_HEADROOM = 6 * ACCEPT_BATCH


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
    return replace(Limits.of(cfg), max_connections=conns)


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
        self.dropped = 0  # connections cut off for leaving their replies unread
        # Open connections of each uid not exempt from the per-uid cap; the uids
        # whose refusal was logged since they last held none.
        self.per_uid: dict[int, int] = {}
        self._capped: set[int] = set()
        # The subscription's first reply, encoded once for every subscriber until
        # the next event: (events broadcast when it was made, its bytes).
        self._events = 0
        self._first: tuple[int, bytes] | None = None
        # Cleared by the daemon while it starts behind a listening socket.
        self.started = asyncio.Event()
        self.started.set()
        self._tasks: set[asyncio.Task[None]] = set()
        # One thread for the calls that may take a while (see kreld.server.methods, Method.quick).
        self._worker = QuietTrim(supervisor().executor("calls", 1), log, service.drop_pages)
        self._server: asyncio.base_events.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, sock: socket.socket) -> None:
        self._loop = asyncio.get_running_loop()
        sock.setblocking(False)
        self._loop.set_exception_handler(functools.partial(_loop_error, self.log))
        self._server = await asyncio.start_unix_server(
            self._handle, sock=sock, limit=self.limits.max_message_bytes, backlog=ACCEPT_BATCH
        )
        # asyncio listened with its batch size; the kernel may queue many more.
        sock.listen(LISTEN_BACKLOG)

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

    def refresh(self) -> None:
        """On the loop, once the daemon has started: what the service answered
        from may have changed with no event (the boot's record made, the
        tracker's first look taken): drop what was answered from before, and
        let the calls waiting for the start go on."""
        self.service.invalidate()
        self._first = None
        self.started.set()

    def _broadcast(self, kind: ModuleEvent | CodeEvent, inc: Incarnation | KernelCode) -> None:
        self.service.invalidate()
        self._events += 1
        self._first = None
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
        self.dropped += 1
        self._end_subscription(c)
        if c.writer.transport.get_write_buffer_size():
            # It is not reading at all: nothing more can reach it.
            c.writer.transport.abort()
        self.log.warning(
            "subscriber_dropped", pid=c.pid, uid=c.uid, queued=self.limits.subscribe_queue
        )

    def _drop_unread(self, c: _Conn, left: int) -> None:
        """Cut off a peer that left a reply unread past the write deadline."""
        self.dropped += 1
        self._end_subscription(c)
        c.writer.transport.abort()  # what it left unread goes with it
        self.log.warning(
            "peer_dropped",
            pid=c.pid,
            uid=c.uid,
            reason="reply unread",
            unsent_bytes=left,
            write_timeout=self.limits.write_timeout,
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
            conn.pause_at_any_byte()
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
            return VarlinkError.from_kreld(TooManyConnections(self.limits.max_connections))
        if uid in (0, os.geteuid()) and not self.limits.cap_root:
            return None
        held, cap = self.per_uid.get(uid, 0), self.limits.max_connections_per_uid
        if held >= cap:
            if uid not in self._capped:  # once, not once per connection of a flood
                self._capped.add(uid)
                self.log.warning("peer_connection_limit", pid=pid, uid=uid, limit=cap)
            return VarlinkError.from_kreld(TooManyConnectionsPerUid(uid, cap))
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
        """Write a reply (kreld.server.conn says how); a peer that leaves it unread
        past the write deadline is dropped (TimeoutError, after it is counted)."""
        try:
            await conn.send(data, self.limits.write_timeout)
        except ReplyUnread as e:
            self._drop_unread(conn, e.left)
            raise

    async def _serve(self, reader: asyncio.StreamReader, conn: _Conn) -> None:
        while True:
            try:
                # A timeout context, not wait_for(): no task per message.
                async with asyncio.timeout(self.limits.idle_timeout):
                    raw = await reader.readuntil(b"\0")
            except asyncio.LimitOverrunError:
                err = VarlinkError.from_kreld(MessageTooLarge(self.limits.max_message_bytes))
                self.log.warning("message_too_large", pid=conn.pid, uid=conn.uid)
                await self._send(conn, error_reply(err))
                return
            except asyncio.IncompleteReadError as e:
                if e.partial.strip():
                    err = invalid_request("message not ended by NUL")
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
            if not (method and method.while_starting):
                await _started(self.started)
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
        return reply_to(self.service, call, self.log)

    def counts(self) -> dict[str, int]:
        """What Status says of the server: its connections and subscribers."""
        return {
            "connections": len(self.conns),
            "subscribers": len(self.subscribers),
            "dropped": self.dropped,
        }

    def _first_reply(self) -> bytes:
        if self._first is None or self._first[0] != self._events:
            self._first = (self._events, first_reply(self.service))
        return self._first[1]

    async def _subscribe(self, conn: _Conn, call: Call, reader: asyncio.StreamReader) -> None:
        try:
            parse(Subscribe, call.parameters)
        except KreldError as err:
            await self._send(conn, error_reply(VarlinkError.from_kreld(err)))
            return
        conn.queue = asyncio.Queue(maxsize=self.limits.subscribe_queue)
        self.subscribers.add(conn)
        await self._send(conn, self._first_reply())
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
                # A reader that lets its socket buffer fill stalls only this task;
                # its bounded queue overflows and _drop() cuts it off, or the
                # write deadline does.
                await self._send(conn, reply(event, continues=True))
        finally:
            watcher.cancel()
        if conn.overflowed:
            too_slow = VarlinkError.from_kreld(SubscriberTooSlow(self.limits.subscribe_queue))
            conn.writer.write(error_reply(too_slow))
            async with asyncio.timeout(5):
                await conn.writer.drain()


async def _started(started: asyncio.Event) -> None:
    """Wait a little for the daemon's start, if it is under way."""
    if not started.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(consts.STARTING_WAIT):
                await started.wait()


def first_reply(service: Service) -> bytes:
    """The subscription's first reply: the modules and kernel code live now."""
    code = service.live_code()
    first = {
        "event": "snapshot",
        "modules": [i.to_json() for i in service.loaded()],
        "kernel_code": None if code is None else [c.to_json() for c in code],
    }
    return reply(first, continues=True)


def reply_to(service: Service, call: Call, log: FilteringBoundLogger) -> bytes:
    """The reply to a call: its answer, or the error that stopped it."""
    try:
        out = answer(service, lookup(call.method), call.parameters)
        return reply_encoded(out) if isinstance(out, bytes) else reply(out)
    except KreldError as e:
        return error_reply(VarlinkError.from_kreld(e))
    except RecursionError:
        return error_reply(invalid_request("too deep"))
    except Exception as e:  # a bug must cost one call, never the daemon
        log.error("call_failed", method=call.method, error=str(e), kind=type(e).__name__)
        return error_reply(
            VarlinkError(f"{INTERFACE}.InternalError", {"message": f"{type(e).__name__}: {e}"})
        )


def _loop_error(
    log: FilteringBoundLogger, _loop: asyncio.AbstractEventLoop, context: dict[str, Any]
) -> None:
    """asyncio's own troubles (a failed accept, say) go to kreld's log, not
    as bare tracebacks on stderr."""
    exc = context.get("exception")
    log.error(
        "event_loop_error",
        message=context.get("message"),
        error=str(exc) if exc else None,
        kind=type(exc).__name__ if exc else None,
    )
