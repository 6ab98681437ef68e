"""Asking a debuginfod server for a debug file, every download bounded.

``GET <server>/buildid/<hex>/debuginfo`` (debuginfod(8)); the body is written
to a descriptor the cache gives (:mod:`kreld.debuginfo.cache`), which checks
its build-id before the file gets a name.  The standard library's
:mod:`http.client` does the HTTP, so the bounds are kreld's own:

* connecting, and each read, may take ``timeout`` seconds; the whole download
  ``max_time`` (each read's timeout is cut to what is left of it);
* ``max_bytes``: a ``Content-Length`` above it is refused before any of the
  body is read, and a body without one is counted as it is read;
* a body shorter than its ``Content-Length``, or a chunked body that breaks
  off, is truncated; redirects are followed a few times, to http(s) only.

Each failure is its own :class:`~kreld.core.errors.DebuginfodError`: a 404
(:class:`DebuginfodMissing`), a timeout, a truncated or an oversize reply.
"""

from __future__ import annotations

import http.client
import os
import socket
import time
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urljoin, urlsplit

from kreld.config.settings import http_url_fault
from kreld.core import consts
from kreld.core.errors import (
    DebuginfodError,
    DebuginfodMissing,
    DebuginfodTimeout,
    DebuginfodTooLarge,
    DebuginfodTruncated,
)
from kreld.core.record import record

__all__ = ["FetchLimits", "debuginfo_url", "download", "server_urls"]

_CHUNK = 1 << 20
_MAX_REDIRECTS = 4
_REDIRECTS = (301, 302, 303, 307, 308)
_MAX_SERVERS = 64


@record
class FetchLimits:
    """Bounds of one download: seconds to connect and of silence while reading,
    seconds for the whole file, bytes of the file."""

    timeout: float = consts.DEFAULT_DEBUGINFOD_TIMEOUT
    max_time: float = consts.DEFAULT_DEBUGINFOD_MAX_TIME
    max_bytes: int = consts.DEFAULT_DEBUGINFOD_MAX_BYTES


def server_urls(
    configured: Iterable[str], environ: Mapping[str, str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The servers to ask, and a note for each one skipped: ``[kernel]
    debuginfod_urls`` when set, else ``DEBUGINFOD_URLS`` (space-separated, as
    the elfutils client reads it), of which only http(s) URLs are used."""
    urls = list(configured)
    named_by = "debuginfod_urls"
    if not urls:
        urls = environ.get("DEBUGINFOD_URLS", "").split()
        named_by = "DEBUGINFOD_URLS"
    out: list[str] = []
    notes: list[str] = []
    for url in urls[:_MAX_SERVERS]:
        fault = http_url_fault(url)
        if fault is not None:
            notes.append(f"{named_by}: {url[:200]!r} skipped: {fault}")
        elif url not in out:
            out.append(url)
    return tuple(out), tuple(notes)


def debuginfo_url(server: str, build_id: str) -> str:
    return f"{server.rstrip('/')}/buildid/{build_id}/debuginfo"


def download(server: str, build_id: str, fd: int, limits: FetchLimits) -> str:
    """Write the debug file of *build_id* from *server* to *fd*; returns the
    URL that answered (after redirects)."""
    url = debuginfo_url(server, build_id)
    deadline = time.monotonic() + limits.max_time
    for _ in range(_MAX_REDIRECTS + 1):
        conn = _connect(url, build_id, limits, deadline)
        try:
            response = _request(conn, url, build_id, limits, deadline)
            if response.status in _REDIRECTS:
                target = response.getheader("Location") or ""
                if len(target) > 4096 or http_url_fault(urljoin(url, target)) is not None:
                    raise DebuginfodError(build_id, url, f"redirected to {target[:200]!r}")
                url = urljoin(url, target)
                continue
            if response.status == 404:
                raise DebuginfodMissing(build_id, url, "404: the server has no such file")
            if response.status != 200:
                raise DebuginfodError(
                    build_id, url, f"answered {response.status} {response.reason[:200]}"
                )
            _copy_body(conn, response, url, build_id, fd, limits, deadline)
            return url
        finally:
            conn.close()
    raise DebuginfodError(build_id, url, f"more than {_MAX_REDIRECTS} redirects")


def _remaining(deadline: float, url: str, build_id: str, limits: FetchLimits) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DebuginfodTimeout(
            build_id, url, f"the download took longer than {limits.max_time:g} s"
        )
    return min(limits.timeout, left)


def _connect(
    url: str, build_id: str, limits: FetchLimits, deadline: float
) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    timeout = _remaining(deadline, url, build_id, limits)
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        tls = getattr(http.client, "HTTPSConnection", None)
        if tls is None:  # http.client was imported where ssl could not be
            raise DebuginfodError(build_id, url, "TLS is not available in this process")
        conn = tls(parts.hostname or "", parts.port, timeout=timeout, context=_tls_context())
    else:
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    try:
        conn.connect()
    except TimeoutError as e:
        conn.close()
        raise DebuginfodTimeout(build_id, url, f"no connection within {timeout:g} s") from e
    except OSError as e:
        conn.close()
        raise DebuginfodError(build_id, url, f"cannot connect: {e.strerror or e}") from e
    return conn


def _request(
    conn: http.client.HTTPConnection,
    url: str,
    build_id: str,
    limits: FetchLimits,
    deadline: float,
) -> http.client.HTTPResponse:
    parts = urlsplit(url)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    try:
        conn.putrequest("GET", path, skip_accept_encoding=True)
        conn.putheader("User-Agent", "kreld")
        conn.endheaders()
        _set_timeout(conn, _remaining(deadline, url, build_id, limits))
        return conn.getresponse()
    except TimeoutError as e:
        raise DebuginfodTimeout(build_id, url, f"no answer within {limits.timeout:g} s") from e
    except (OSError, http.client.HTTPException) as e:
        raise DebuginfodError(build_id, url, f"no answer: {e}") from e


def _set_timeout(conn: http.client.HTTPConnection, timeout: float) -> None:
    sock = conn.sock
    if isinstance(sock, socket.socket):
        sock.settimeout(timeout)


def _copy_body(
    conn: http.client.HTTPConnection,
    response: http.client.HTTPResponse,
    url: str,
    build_id: str,
    fd: int,
    limits: FetchLimits,
    deadline: float,
) -> None:
    announced = _content_length(response, url, build_id)
    if announced is not None and announced > limits.max_bytes:
        raise DebuginfodTooLarge(build_id, url, limits.max_bytes)
    got = 0
    while True:
        _set_timeout(conn, _remaining(deadline, url, build_id, limits))
        try:
            chunk = response.read(_CHUNK)
        except TimeoutError as e:
            raise DebuginfodTimeout(
                build_id, url, f"silent for {limits.timeout:g} s after {got:,} bytes"
            ) from e
        except http.client.IncompleteRead as e:
            raise DebuginfodTruncated(
                build_id, url, f"the reply broke off after {got:,} bytes"
            ) from e
        except (OSError, http.client.HTTPException) as e:
            raise DebuginfodError(build_id, url, f"reading the reply: {e}") from e
        if not chunk:
            break
        got += len(chunk)
        if got > limits.max_bytes:
            raise DebuginfodTooLarge(build_id, url, limits.max_bytes)
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view) :]
    if announced is not None and got != announced:
        raise DebuginfodTruncated(
            build_id, url, f"{got:,} of the {announced:,} bytes announced came"
        )


def _content_length(response: http.client.HTTPResponse, url: str, build_id: str) -> int | None:
    value = response.getheader("Content-Length")
    if value is None:
        return None
    value = value.strip()
    if not value.isdigit() or len(value) > 20:
        raise DebuginfodError(build_id, url, f"Content-Length {value[:40]!r} is not a number")
    return int(value)


def _tls_context() -> Any:
    """A TLS context for an https server (ssl imported when one is used:
    see kreld.daemon.line_builder)."""
    import ssl

    return ssl.create_default_context()
