"""Where the bytes of a perf.data come from, each read bounded.

``kreldctl ... --for`` takes a regular file (read at any offset), or for a
pipe-mode recording (``perf record -o -``) a pipe, a FIFO, a socket or ``-``
(standard input), read once and in order.  Nothing here waits unbounded: the
open does not wait for a FIFO's writer (O_NONBLOCK), each wait for data on a
pipe is bounded by :data:`PIPE_IDLE_TIMEOUT` and the whole read by
:data:`PIPE_DEADLINE`; a device is refused; every read error (EIO) is a
:class:`~kreld.core.errors.PerfDataError`.
"""

from __future__ import annotations

import os
import select
import stat
import time

from kreld.core.errors import PerfDataError

__all__ = ["PIPE_DEADLINE", "PIPE_IDLE_TIMEOUT", "Input", "is_stdin", "open_input"]

# A pipe: each wait for data, and the whole read.
PIPE_IDLE_TIMEOUT = 10.0
PIPE_DEADLINE = 60.0
_PIPE_CHUNK = 1 << 16


class Input:
    """The bytes of one recording; every read bounded, every OSError a PerfDataError.

    A regular file is read at any offset (pread).  A pipe, FIFO or socket is
    read once, in order: each wait for data at most PIPE_IDLE_TIMEOUT, the
    whole read within PIPE_DEADLINE of the open, so a FIFO nobody writes to
    (an open with O_NONBLOCK does not wait for a writer) is refused, not
    waited on for ever.
    """

    def __init__(self, fd: int, path: str, size: int | None, own: bool) -> None:
        self.fd = fd
        self.path = path
        self.size = size  # None: a pipe
        self.own = own
        self.pos = 0
        self.bytes_read = 0
        self.deadline = time.monotonic() + PIPE_DEADLINE

    @property
    def pipe(self) -> bool:
        return self.size is None

    def close(self) -> None:
        if self.own:
            os.close(self.fd)

    def read(self, offset: int, n: int) -> bytes:
        """Up to *n* bytes at *offset*, fewer only at the end."""
        if self.pipe and offset != self.pos:
            raise PerfDataError(self.path, "a pipe cannot be read out of order", offset)
        parts: list[bytes] = []
        got = 0
        while got < n:
            try:
                part = (
                    self._pipe_read(n - got)
                    if self.pipe
                    else os.pread(self.fd, n - got, offset + got)
                )
            except OSError as e:
                raise PerfDataError(
                    self.path, f"read error: {e.strerror or e}", offset + got
                ) from e
            if not part:
                break
            parts.append(part)
            got += len(part)
        self.pos = offset + got
        self.bytes_read += got
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def exact(self, offset: int, n: int, what: str) -> bytes:
        data = self.read(offset, n)
        if len(data) != n:
            raise PerfDataError(self.path, f"{what} truncated ({len(data)} of {n} bytes)", offset)
        return data

    def _pipe_read(self, n: int) -> bytes:
        while True:
            left = self.deadline - time.monotonic()
            wait = min(PIPE_IDLE_TIMEOUT, left)
            if wait <= 0 or not select.select([self.fd], [], [], wait)[0]:
                why = (
                    f"nothing written to it for {PIPE_IDLE_TIMEOUT:g} s"
                    if left > PIPE_IDLE_TIMEOUT
                    else f"its synthesized records did not arrive within {PIPE_DEADLINE:g} s"
                )
                raise PerfDataError(self.path, f"pipe: {why}", self.pos)
            try:
                return os.read(self.fd, min(n, _PIPE_CHUNK))
            except BlockingIOError:
                continue


def open_input(path: str) -> Input:
    """*path* opened without waiting (a FIFO's open does not block), checked to
    be a regular file or a pipe; a directory is read through its ``data``
    file (perf record --threads)."""
    if path == "-":
        return _checked(0, "-", os.fstat(0), own=False)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise PerfDataError(path, e.strerror or str(e)) from e
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            try:
                sub = os.open("data", flags, dir_fd=fd)
            except OSError as e:
                raise PerfDataError(
                    path, "a directory without the data file perf record --threads writes"
                ) from e
            os.close(fd)
            fd, path = sub, os.path.join(path, "data")
            st = os.fstat(fd)
        return _checked(fd, path, st, own=True)
    except BaseException:
        os.close(fd)
        raise


def _checked(fd: int, path: str, st: os.stat_result, own: bool) -> Input:
    if stat.S_ISREG(st.st_mode):
        return Input(fd, path, st.st_size, own)
    if stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        return Input(fd, path, None, own)
    kind = "a character device" if stat.S_ISCHR(st.st_mode) else "neither"
    raise PerfDataError(path, f"not a regular file or a pipe ({kind})")


def is_stdin(inp: Input) -> bool:
    if inp.path == "-":
        return True
    if not inp.pipe:
        return False
    try:
        ours, zero = os.fstat(inp.fd), os.fstat(0)
    except OSError:
        return False
    return (ours.st_dev, ours.st_ino) == (zero.st_dev, zero.st_ino)
