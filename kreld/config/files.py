"""The configuration's files, read within bounds.

A configuration file is a regular file (or ``/dev/null``, the usual way to say
"none", read as empty); anything else at its path is refused before a byte is
read: ``/dev/zero`` would fill memory, a FIFO would wait for a writer for ever,
other devices may act on being opened.  The path is looked at first (``stat``,
following a link: configuration managers link files into ``/etc``), then
opened without waiting (``O_NONBLOCK``) and the open file looked at again
(``fstat``): a swap between the two is refused too.  Its size is checked
before reading and the read itself stops one byte past the cap (a file under
``/proc`` says it has 0 bytes).  Drop-ins are counted while their directory is
listed, and all the files together share one budget of bytes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kreld.core.errors import ConfigError

__all__ = ["MAX_DROPINS", "MAX_FILE_BYTES", "MAX_TOTAL_BYTES", "Budget", "dropins", "read_file"]

# A configuration file: real ones are a few KiB (etc/kreld/kreld.toml, every key
# commented, is 4 KiB).  tomllib takes some 35 MiB and 0.6 s at worst for this much.
MAX_FILE_BYTES = 256 << 10
# The main file and its drop-ins together: what one load (a start, a SIGHUP) parses.
MAX_TOTAL_BYTES = 1 << 20
# Drop-ins (``*.toml``) in ``kreld.toml.d``.
MAX_DROPINS = 256

_DEV_NULL = os.makedev(1, 3)  # drivers/char/mem.c: /dev/null is char 1:3
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class Budget:
    """What is left of :data:`MAX_TOTAL_BYTES` for the files of one load."""

    __slots__ = ("left",)

    def __init__(self, total: int = MAX_TOTAL_BYTES) -> None:
        self.left = total

    def take(self, file: str, size: int) -> None:
        if size > self.left:
            raise ConfigError(
                file,
                f"the configuration files together are over {MAX_TOTAL_BYTES:,} bytes",
            )
        self.left -= size


def _kind(mode: int) -> str:
    return next((what for is_, what in _KINDS if is_(mode)), "of another kind")


def _dev_null_or_regular(file: str, st: os.stat_result) -> bool:
    """Whether *st* is /dev/null (read as empty); anything but a regular file within
    :data:`MAX_FILE_BYTES` is a ConfigError."""
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == _DEV_NULL:
        return True
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(file, f"not a regular file ({_kind(st.st_mode)}); refusing to read it")
    if st.st_size > MAX_FILE_BYTES:
        raise ConfigError(
            file, f"{st.st_size:,} bytes: over the {MAX_FILE_BYTES:,} a configuration file may be"
        )
    return False


def _read_capped(fd: int, file: str) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while chunk := os.read(fd, MAX_FILE_BYTES + 1 - got):
        chunks.append(chunk)
        got += len(chunk)
        if got > MAX_FILE_BYTES:
            raise ConfigError(
                file, f"over the {MAX_FILE_BYTES:,} bytes a configuration file may be"
            )
    return b"".join(chunks)


def read_file(path: Path, budget: Budget) -> bytes:
    """The bytes of the configuration file *path*, or a ConfigError naming it."""
    file = str(path)
    try:
        if _dev_null_or_regular(file, os.stat(path)):
            return b""
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(file, f"cannot read: {e.strerror}") from e
    try:
        opened = os.fstat(fd)
        if _dev_null_or_regular(file, opened):
            return b""
        raw = _read_capped(fd, file)
    except OSError as e:
        raise ConfigError(file, f"cannot read: {e.strerror}") from e
    finally:
        os.close(fd)
    budget.take(file, len(raw))
    return raw


def dropins(directory: Path) -> list[Path]:
    """The drop-ins of *directory* in name order: ``*.toml``, hidden files left out
    (as a shell glob does), at most :data:`MAX_DROPINS` of them."""
    names: list[str] = []
    try:
        with os.scandir(directory) as it:
            for entry in it:
                if entry.name.endswith(".toml") and not entry.name.startswith("."):
                    names.append(entry.name)
                    if len(names) > MAX_DROPINS:
                        raise ConfigError(
                            str(directory), f"more than {MAX_DROPINS} drop-ins (*.toml)"
                        )
    except OSError as e:
        raise ConfigError(str(directory), f"cannot list: {e.strerror}") from e
    return [directory / n for n in sorted(names)]
