"""Where ``kreldctl inject`` writes: a private temporary file in the target's
directory, renamed over the target only once it is whole.

The temporary file is created ``O_CREAT | O_EXCL | O_NOFOLLOW`` (never through
a link someone planted, never someone else's file), mode 0600 as perf writes
its own; the rename happens only when the target is absent or a regular file
(a symlink, a directory, a FIFO or a device at the target is refused, and left
as it was).  On any failure the temporary file is removed and the target is
untouched.  ``-`` is standard output.

One function, :func:`safe_output`, so that a shared safe-output module can
stand in for this one later.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator

from kreld.core.errors import PerfDataError

__all__ = ["safe_output"]


def _refuse_target(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise PerfDataError(path, f"cannot write it: {e.strerror or e}") from e
    if not stat.S_ISREG(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise PerfDataError(path, f"refused as output: {kind}")


@contextlib.contextmanager
def safe_output(path: str) -> Iterator[int]:
    """A file descriptor to write *path* through; the file appears at *path*
    (renamed into place) only when the block ends without an exception."""
    if path == "-":
        yield 1
        return
    _refuse_target(path)
    directory = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    tmp = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except OSError as e:
        raise PerfDataError(path, f"cannot create a file beside it: {e.strerror or e}") from e
    try:
        yield fd
        os.fsync(fd)
        os.close(fd)
        fd = -1
        _refuse_target(path)  # checked again: something may have appeared meanwhile
        os.rename(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
