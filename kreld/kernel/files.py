"""Kernel files read within a bound, and the numbers in them checked where parsed.

kreld runs as root and reads what it finds under ``--root``; a file there may be
corrupt, hostile or merely huge.  So no kernel file is read whole on trust: each
kind has its bound in :mod:`kreld.core.consts` (``MAX_KALLSYMS``, ``MAX_SYSTEM_MAP``
...), and :func:`read_bounded` refuses a file past it by name, before it is read
whole.  Files are read, never mapped: a file cut short while it is read is a short
read, not a SIGBUS.

The numbers a reader takes out of those files are checked against what the kernel
can produce, before anything is made of them: an address lies in the kernel's half
(``consts.KERNEL_HALF``), a module's size fits its ``unsigned int``, the KASLR offset
keeps the image in the kernel's half.  A number outside is a :class:`ValueError`
saying why, which each reader turns into a fault or a named error for its file; it is
never stored, for the store's own readers would refuse it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from kreld.core import consts
from kreld.core.errors import KernelReadError

__all__ = [
    "KernelFileTooLarge",
    "hex_address",
    "hex_u64",
    "kernel_offset",
    "module_size",
    "moved",
    "pread_exact",
    "read_bounded",
]

# The longest text of a 64-bit number: "0x" and 16 hex digits; 20 decimal digits.
_HEX_CHARS = 18
_DEC_CHARS = 20
_CHUNK = 1 << 20


class KernelFileTooLarge(KernelReadError):
    """A kernel file larger than kreld reads of its kind."""

    def __init__(self, path: str, limit: int) -> None:
        super().__init__(path, f"larger than {limit:,} bytes, more than kreld reads of it")
        self.limit = limit


def read_bounded(path: str | Path, limit: int) -> bytes:
    """The bytes of *path*, at most *limit* of them (:class:`KernelFileTooLarge`
    past it, :class:`KernelReadError` when it cannot be read).

    A regular file that says it is larger is refused before a byte is read;
    files that say nothing of their size (``/proc``, sysfs) are read in chunks
    until the bound.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise KernelReadError(str(path), e.strerror or str(e)) from e
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size > limit:
            raise KernelFileTooLarge(str(path), limit)
        if stat.S_ISDIR(st.st_mode):
            raise KernelReadError(str(path), "a directory, not a file")
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, min(_CHUNK, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise KernelFileTooLarge(str(path), limit)
        return b"".join(chunks)
    except OSError as e:
        raise KernelReadError(str(path), e.strerror or str(e)) from e
    finally:
        os.close(fd)


def pread_exact(fd: int, length: int, offset: int, path: str) -> bytes:
    """*length* bytes at *offset* of an open file (:class:`KernelReadError` for an
    offset no file can have, a read error, or a file that ends first)."""
    if offset < 0 or length < 0 or offset + length >= 1 << 63:
        raise KernelReadError(path, f"{length} bytes at offset {offset:#x}: past any file")
    try:
        data = os.pread(fd, length, offset)
    except OSError as e:
        raise KernelReadError(path, f"read at offset {offset:#x}: {e.strerror or e}") from e
    if len(data) != length:
        raise KernelReadError(
            path, f"{length} bytes at offset {offset:#x}: the file ends after {len(data)}"
        )
    return data


def _number(text: str | bytes, base: int, width: int, what: str) -> tuple[str, int]:
    """*text* stripped, as ASCII, and its value in *base*: at most *width*
    digits, no ``_`` separators (:class:`ValueError` names *what* it is not)."""
    s = text.strip()
    if isinstance(s, bytes):
        s = s.decode("ascii", "replace")
    if not s or len(s) > width or "_" in s:
        raise ValueError(f"not {what}: {s[:40]!r}")
    return s, _int(s, base, repr(s))


def hex_address(text: str | bytes) -> int:
    """A kernel address as the kernel prints it (hex, ``0x`` optional): zero
    (restricted) or in the kernel's half; :class:`ValueError` says why not."""
    s, value = _number(text, 16, _HEX_CHARS, "a 64-bit hex address")
    low, high = consts.KERNEL_HALF
    if value and not low <= value < high:
        raise ValueError(f"{s} is not an address in the kernel's half")
    return value


def hex_u64(text: str | bytes) -> int:
    """A 64-bit value in hex (a per-cpu offset, which kallsyms prints absolute)."""
    s, value = _number(text, 16, _HEX_CHARS, "a 64-bit hex number")
    if not 0 <= value < 1 << 64:
        raise ValueError(f"{s} is not a 64-bit number")
    return value


def module_size(text: str | bytes) -> int:
    """A module's size (decimal, as ``coresize`` shows it): ``unsigned int``."""
    s, value = _number(text, 10, _DEC_CHARS, "a number")
    if not 0 <= value < consts.MAX_MODULE_SIZE:
        raise ValueError(f"{s} is not a size a module can have")
    return value


def kernel_offset(text: str) -> int:
    """VMCOREINFO's ``KERNELOFFSET`` (hex): how far the image moved, which keeps
    it in the kernel's half."""
    s = text.strip()
    if not s or len(s) > _HEX_CHARS or "_" in s:
        raise ValueError(f"KERNELOFFSET={s[:40]!r} is not a 64-bit hex number")
    value = _int(s, 16, f"KERNELOFFSET={s!r}")
    if not 0 <= value < consts.MAX_KERNEL_OFFSET:
        raise ValueError(f"KERNELOFFSET={s} is not an offset the kernel can have")
    return value


def moved(link: Mapping[str, int], offset: int) -> dict[str, int]:
    """Link-time addresses moved by the KASLR *offset*: those that land in the
    kernel's half (a vmlinux or System.map may say anything)."""
    low, high = consts.KERNEL_HALF
    return {k: v + offset for k, v in link.items() if low <= v + offset < high}


def _int(text: str, base: int, what: str) -> int:
    try:
        return int(text, base)
    except ValueError:
        raise ValueError(f"{what} is not a {'hex ' if base == 16 else ''}number") from None
