"""Writing a file the user named, safely whoever runs kreldctl and wherever.

``kreldctl export -o FILE`` and ``kreldctl inject -o FILE`` may run as root in
a directory other users can write (``/tmp``).  Whatever those users plant at
FILE, or beside it, must not turn the write into one somewhere else.  So:

* the target's directory is opened once and every later step is relative to
  that descriptor (a directory renamed or swapped meanwhile is not followed);
* a missing or regular target is written as a private temporary file, created
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` under an unpredictable name in that
  directory, made whole (fsync), then renamed over the target; a regular file
  keeps its permission bits, a new one gets the caller's umask applied to the
  mode the command asks for; the directory is fsynced after the rename;
* a character or block device, a FIFO, or ``-`` (standard output) is written in
  place: nothing is created, truncated or renamed (``-o /dev/null`` as root
  leaves ``/dev/null`` a device, ``-o >(gzip > k.gz)`` feeds gzip);
  ``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N`` and ``/proc/self/fd/N`` name
  one of kreldctl's own descriptors and are written through it;
* a symbolic link is followed only when it belongs to root or to the caller
  (``fs.protected_symlinks``' rule) and ends at a device or a FIFO, checked
  again on the opened descriptor; a link to a regular file, a dangling link
  or another user's link is refused: name the file itself;
* a directory, a socket, a missing parent, a full disk, a FIFO nobody reads:
  :class:`OutputError` (exit code 8) naming the path and why, with the
  temporary file removed and the target as it was.

:func:`safe_output` is a context manager yielding a :class:`Sink`; the file
appears at the target only when the block ends without an exception.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import stat
from collections.abc import Iterator

from kreld.core.errors import OutputError

__all__ = ["Sink", "safe_output", "write_output"]

# How much of the target's name the temporary name keeps: NAME_MAX is 255, and
# the two dots, 16 random hex digits and the 4-character suffix take 22 of them.
_BASE_KEPT = 200
_TEMP_TRIES = 8
_OWN_FD = re.compile(r"/(?:dev/fd|proc/self/fd)/(\d{1,9})")
_STD_NAMES = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}


class Sink:
    """Where the bytes go: a descriptor, and ``write`` that reports a failed
    write as an :class:`OutputError` naming the target."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.written = 0

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.fd, view)
            except BrokenPipeError:
                raise  # the reader went away: kreldctl ends quietly
            except OSError as e:
                raise self.failed(e) from e
            view = view[n:]
            self.written += n

    def failed(self, e: OSError) -> OutputError:
        return OutputError(self.path, f"cannot write it: {_why(e)}")


def _why(e: OSError) -> str:
    return e.strerror or errno.errorcode.get(e.errno or 0, str(e))


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "a file of another kind"


def _in_place(mode: int) -> bool:
    return stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode)


def _umasked(mode: int) -> int:
    # kreldctl is single-threaded: reading the umask by setting it is safe here.
    mask = os.umask(0o077)
    os.umask(mask)
    return mode & ~mask & 0o777


@contextlib.contextmanager
def safe_output(path: str, mode: int = 0o666) -> Iterator[Sink]:
    """A :class:`Sink` writing *path*; a new file gets *mode* less the umask."""
    if path == "-":
        yield Sink("standard output", 1)
        return
    if not path or "\0" in path:
        raise OutputError(repr(path), "not a file name")
    own = _own_descriptor(path)
    if own is not None:
        yield Sink(path, own)
        return
    head, base = os.path.split(path)
    if not base or base in (".", ".."):
        raise OutputError(path, "names a directory, not a file")
    try:
        dfd = os.open(head or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise OutputError(path, f"its directory {head!r} does not exist") from e
    except NotADirectoryError as e:
        raise OutputError(path, f"{head!r} is not a directory") from e
    except OSError as e:
        raise OutputError(path, f"cannot open its directory: {_why(e)}") from e
    try:
        st = _lstat(dfd, base, path)
        if st is not None and stat.S_ISLNK(st.st_mode):
            with _through_link(dfd, base, path, st) as sink:
                yield sink
        elif st is not None and _in_place(st.st_mode):
            with _device(dfd, base, path, st) as sink:
                yield sink
        elif st is None or stat.S_ISREG(st.st_mode):
            keep = stat.S_IMODE(st.st_mode) & 0o777 if st is not None else _umasked(mode)
            with _replacing(dfd, base, path, keep) as sink:
                yield sink
        else:
            raise OutputError(path, f"refused as output: it is {_kind(st.st_mode)}")
    finally:
        os.close(dfd)


def write_output(path: str, data: bytes, mode: int = 0o666) -> None:
    """*data* to *path* through :func:`safe_output`."""
    with safe_output(path, mode) as sink:
        sink.write(data)


def _own_descriptor(path: str) -> int | None:
    """The descriptor ``/dev/stdout``-like names mean, if it is open."""
    fd = _STD_NAMES.get(path)
    if fd is None:
        m = _OWN_FD.fullmatch(path)
        fd = int(m.group(1)) if m else None
    if fd is None:
        return None
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError as e:
        raise OutputError(path, f"descriptor {fd} is not open") from e
    if flags & os.O_ACCMODE == os.O_RDONLY:
        raise OutputError(path, f"descriptor {fd} is open for reading only")
    return fd


def _lstat(dfd: int, base: str, path: str) -> os.stat_result | None:
    try:
        return os.stat(base, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise OutputError(path, f"cannot examine it: {_why(e)}") from e


@contextlib.contextmanager
def _through_link(dfd: int, base: str, path: str, link: os.stat_result) -> Iterator[Sink]:
    if link.st_uid not in (0, os.geteuid()):
        raise OutputError(
            path, f"refused as output: a symbolic link owned by uid {link.st_uid} (name its target)"
        )
    try:
        end = os.stat(base, dir_fd=dfd)
    except FileNotFoundError as e:
        raise OutputError(path, "refused as output: a symbolic link to nothing") from e
    except OSError as e:
        raise OutputError(path, f"cannot follow its link: {_why(e)}") from e
    if not _in_place(end.st_mode):
        what = "a regular file" if stat.S_ISREG(end.st_mode) else _kind(end.st_mode)
        raise OutputError(
            path, f"refused as output: a symbolic link to {what} (name the file itself)"
        )
    with _device(dfd, base, path, end, follow=True) as sink:
        yield sink


@contextlib.contextmanager
def _device(
    dfd: int, base: str, path: str, seen: os.stat_result, follow: bool = False
) -> Iterator[Sink]:
    """A device or FIFO, opened without creating or truncating anything and
    checked on the descriptor to be what was examined."""
    flags = os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    if not follow:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(base, flags, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise OutputError(path, "a FIFO that nobody reads") from e
        raise OutputError(path, f"cannot open it: {_why(e)}") from e
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (seen.st_dev, seen.st_ino) or not _in_place(now.st_mode):
            raise OutputError(path, "changed while it was being opened: not written")
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, fl & ~os.O_NONBLOCK)
        yield Sink(path, fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _replacing(dfd: int, base: str, path: str, mode: int) -> Iterator[Sink]:
    tmp, fd = _create_temp(dfd, base, path)
    try:
        sink = Sink(path, fd)
        yield sink
        try:
            os.fchmod(fd, mode)
            os.fsync(fd)
        except OSError as e:
            raise sink.failed(e) from e
        os.close(fd)
        fd = -1
        now = _lstat(dfd, base, path)  # again: something may have been put there meanwhile
        if now is not None and not stat.S_ISREG(now.st_mode):
            what = _kind(now.st_mode)
            raise OutputError(path, f"became {what} while it was written: not replaced")
        try:
            os.rename(tmp, base, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as e:
            raise OutputError(path, f"cannot put it in place: {_why(e)}") from e
        tmp = ""
        with contextlib.suppress(OSError):  # some file systems cannot fsync a directory
            os.fsync(dfd)
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)


def _create_temp(dfd: int, base: str, path: str) -> tuple[str, int]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_TEMP_TRIES):
        name = f".{base[:_BASE_KEPT]}.{secrets.token_hex(8)}.tmp"
        try:
            return name, os.open(name, flags, 0o600, dir_fd=dfd)
        except FileExistsError:
            continue  # planted under a guessed name: draw another
        except OSError as e:
            raise OutputError(path, f"cannot create a file beside it: {_why(e)}") from e
    raise OutputError(path, f"cannot create a file beside it: {_TEMP_TRIES} names taken")
