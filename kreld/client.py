"""A small varlink client for kreld: what a Python profiler imports.

    from kreld.client import Client
    with Client("/run/kreld/kreld.sock") as kreld:
        print(kreld.resolve(["0xffffffffc0a01234"]))

``call`` returns a reply's parameters; ``stream`` iterates the replies of a
call made with ``more`` (``Subscribe``).  Error replies raise typed
:class:`~kreld.core.errors.KreldError` subclasses (:class:`~kreld.core.errors.NoSuchBoot`,
:class:`~kreld.core.errors.PermissionDenied`, ...), others :class:`RemoteError`.
A ``Resolve`` reply says what many addresses share once (see io.kreld.varlink);
:meth:`Client.resolve` and :func:`resolutions` spell it out per address.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator, Sequence
from typing import Any

from kreld.core import consts
from kreld.core.errors import KreldError, error_classes
from kreld.varlink.wire import encode_call

__all__ = [
    "Client",
    "ConnectError",
    "RemoteError",
    "connect_unix",
    "error_from_reply",
    "resolutions",
]


class RemoteError(KreldError):
    """An error reply kreld's client has no more specific class for."""

    def __init__(self, name: str, parameters: dict[str, Any]) -> None:
        detail = parameters.get("message") or parameters.get("reason") or parameters
        super().__init__(f"{name}: {detail}")
        self.varlink_name = name  # type: ignore[misc]
        self.params = parameters

    def parameters(self) -> dict[str, Any]:
        return self.params


class ConnectError(KreldError):
    """No kreld answers on the socket."""


def error_from_reply(name: str, p: dict[str, Any]) -> KreldError:
    """The error family's class for a reply's error name, rebuilt from its
    parameters; a name the family does not have stays a :class:`RemoteError`."""
    cls = _ERRORS.get(name)
    if cls is None:
        return RemoteError(name, p)
    try:
        return cls.from_parameters(p)
    except (TypeError, ValueError):  # parameters of a shape this kreld does not know
        return RemoteError(name, p)


_ERRORS = error_classes()


_CHUNK = 256 << 10  # bytes read at a time
# Replies from this size on are parsed by orjson (a dependency of kreld's, a
# third of json's time on a Resolve with lines of 100,000 addresses: some
# 3 MiB of integers); smaller ones by json, so that a small call never loads
# orjson.
_LARGE_REPLY = 64 << 10


def _loads(raw: bytes) -> Any:
    """A reply's JSON.  What orjson refuses and json takes (a lone surrogate
    escaped) is left to json.  Integers: varlink's are 64-bit, which orjson
    reads exactly (past 64 bits it would read a float)."""
    if len(raw) >= _LARGE_REPLY:
        try:
            import orjson
        except ImportError:  # a client copied without kreld's dependencies
            return json.loads(raw)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)


def connect_unix(path: str, timeout: float | None = 10.0) -> socket.socket:
    """A stream socket connected to `path`, with `timeout` set on it.

    A full listen backlog makes a connect() with a timeout fail at once with
    EAGAIN (a blocking one would sleep in the kernel): retry until the timeout,
    as a connect to a busy TCP server would wait."""
    deadline = time.monotonic() + (timeout if timeout is not None else 3600)
    delay = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            return sock
        except BlockingIOError as e:
            sock.close()
            if time.monotonic() + delay > deadline:
                raise ConnectError(f"{path}: {e.strerror or e}") from e
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        except OSError as e:
            sock.close()
            raise ConnectError(f"{path}: {e.strerror or e}") from e


class Client:
    """One connection to kreld; not thread-safe (use one per thread)."""

    def __init__(self, path: str = consts.DEFAULT_SOCKET, timeout: float | None = 10.0) -> None:
        self.path = path
        self.sock = connect_unix(path, timeout)
        self._buf = bytearray()
        self._chunk = bytearray(_CHUNK)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _qualify(method: str) -> str:
        return method if "." in method else f"io.kreld.{method}"

    def send(self, method: str, parameters: dict[str, Any], more: bool = False) -> None:
        data = encode_call(self._qualify(method), parameters, more)
        # kreld may have answered and closed before reading the call (too many
        # connections, permission denied): that answer is still to be read, and
        # receive() raises ConnectError if there is none.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.sock.sendall(data)

    def receive(self) -> dict[str, Any]:
        """The next reply object (raw: with ``parameters``, ``continues`` or ``error``)."""
        buf = self._buf
        scanned = 0  # of buf, known to hold no NUL
        while True:
            end = buf.find(b"\0", scanned)
            if end >= 0:
                raw = bytes(buf[:end])
                del buf[: end + 1]
                try:
                    obj = _loads(raw)
                except ValueError as e:  # also a reply that is not UTF-8
                    raise RemoteError(
                        "io.kreld.Protocol", {"reason": f"reply is not JSON: {e}"}
                    ) from e
                if not isinstance(obj, dict):
                    raise RemoteError("io.kreld.Protocol", {"reason": "reply is not an object"})
                return obj
            scanned = len(buf)
            try:
                # Into one buffer kept for the connection: a fresh large
                # allocation per read costs more than a small reply's trip.
                n = self.sock.recv_into(self._chunk)
            except ConnectionError as e:
                raise ConnectError(f"{self.path}: {e.strerror or e}") from e
            if not n:
                raise ConnectError(f"{self.path}: connection closed by kreld")
            buf += memoryview(self._chunk)[:n]

    @staticmethod
    def _unwrap(obj: dict[str, Any]) -> dict[str, Any]:
        if "error" in obj:
            raise error_from_reply(str(obj["error"]), dict(obj.get("parameters") or {}))
        return dict(obj.get("parameters") or {})

    def call(self, method: str, **parameters: Any) -> dict[str, Any]:
        self.send(method, parameters)
        return self._unwrap(self.receive())

    def resolve(self, addresses: Sequence[str], **parameters: Any) -> list[dict[str, Any]]:
        """``Resolve`` *addresses*, one object per address (see :func:`resolutions`)."""
        return resolutions(addresses, self.call("Resolve", addresses=list(addresses), **parameters))

    def stream(self, method: str, **parameters: Any) -> Iterator[dict[str, Any]]:
        self.send(method, parameters, more=True)
        while True:
            obj = self.receive()
            yield self._unwrap(obj)
            if not obj.get("continues"):
                return


def resolutions(addresses: Sequence[str | int], reply: dict[str, Any]) -> list[dict[str, Any]]:
    """A ``Resolve`` reply, one object per address asked, as in kreldctl's
    ``resolve --json``: ``address``; where a region held it, that region's
    ``image``, ``section``, ``base`` (and ``seq``, ``build_id`` when known) and
    the ``offset`` into it; where a symbol is known, ``symbol`` and
    ``symbol_offset``.  Addresses and offsets as ``0x`` hex strings; no nulls.
    A reply asked with ``lines`` adds ``frames`` (innermost first, each with
    ``function``, ``file``, ``line``, ``column`` and ``inlined``; a ``file``
    or ``column`` the DWARF or the table lacks is null) and, where there are
    none, ``no_lines``: why (as ``kreldctl resolve --lines --json`` says)."""
    regions = [{k: v for k, v in r.items() if k != "names"} for r in reply["regions"]]
    bases = [int(r["base"], 16) for r in regions]
    # The names come region by region: the region each lies in.
    owner = [k for k, r in enumerate(reply["regions"]) for _ in range(r["names"])]
    names = reply["symbols"]
    out: list[dict[str, Any]] = []
    for a, si, so in zip(addresses, reply["symbol"], reply["symbol_offset"], strict=True):
        value = a if isinstance(a, int) else int(a, 16)
        r: dict[str, Any] = {"address": hex(value)}
        ri = owner[si] if si >= 0 else -2 - si
        if ri >= 0:
            r.update(regions[ri])
            r["offset"] = hex(value - bases[ri])
        if si >= 0:
            r["symbol"] = names[si]
            r["symbol_offset"] = hex(so)
        out.append(r)
    lines = reply.get("lines")
    if lines is not None:
        for r, frames in zip(out, line_frames(lines), strict=True):
            if isinstance(frames, str):
                r["frames"], r["no_lines"] = [], frames
            else:
                r["frames"] = frames
    return out


def line_frames(lines: dict[str, Any]) -> list[list[dict[str, Any]] | str]:
    """A Resolve reply's ``lines`` (``ResolveLines``), per address: its frames
    spelled out, innermost first, or why it has none."""
    functions, files, reasons = lines["functions"], lines["files"], lines["reasons"]
    function, file, line = lines["function"], lines["file"], lines["line"]
    out: list[list[dict[str, Any]] | str] = []
    at = 0
    for count in lines["frames"]:
        if count < 0:
            out.append(reasons[-1 - count])
            continue
        out.append(
            [
                {
                    "function": functions[function[j]],
                    "file": None if file[j] < 0 else files[file[j]],
                    "line": line[j],
                    "column": None,
                    "inlined": j + 1 < at + count,
                }
                for j in range(at, at + count)
            ]
        )
        at += count
    return out
