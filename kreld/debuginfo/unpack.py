"""Unpacking a compressed module file (``.ko.xz``, ``.ko.zst``), bounded.

Distributions ship modules compressed (kmod reads them so); a debug tree may
too.  The unpacked bytes go to the descriptor the cache gives, a piece at a
time, and stop with :class:`~kreld.core.errors.DebuginfoError` past
``max_bytes`` or at a stream that does not end whole: a bomb is never
expanded into memory, a cut file never kept.  zstd is fed 1 KiB at a time, so
one call can give at most some 32 MiB (a 4-byte RLE block is 128 KiB).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

from kreld.core.errors import DebuginfoError
from kreld.debuginfo.cache import Filler

__all__ = ["unpacker"]

_CHUNK = 1 << 20
_ZSTD_FEED = 1024


def unpacker(path: Path, build_id: str, max_bytes: int) -> Filler:
    """A filler writing *path* unpacked, at most *max_bytes* of it."""

    def fill(fd: int) -> None:
        try:
            with open(path, "rb") as f:
                if path.name.endswith(".xz"):
                    _unxz(f, _Out(fd, path, build_id, max_bytes))
                else:
                    _unzstd(f, _Out(fd, path, build_id, max_bytes))
        except OSError as e:
            raise DebuginfoError(build_id, f"{path}: {e.strerror or e}") from e

    return fill


class _Out:
    __slots__ = ("build_id", "fd", "max_bytes", "path", "total")

    def __init__(self, fd: int, path: Path, build_id: str, max_bytes: int) -> None:
        self.fd = fd
        self.path = path
        self.build_id = build_id
        self.max_bytes = max_bytes
        self.total = 0

    def put(self, data: bytes) -> None:
        self.total += len(data)
        if self.total > self.max_bytes:
            raise self.error(f"unpacks to more than {self.max_bytes:,} bytes")
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def error(self, reason: str) -> DebuginfoError:
        return DebuginfoError(self.build_id, f"{self.path}: {reason}")


def _unxz(src: BinaryIO, out: _Out) -> None:
    import lzma

    d = lzma.LZMADecompressor()
    try:
        while not d.eof:
            data = src.read(_CHUNK) if d.needs_input else b""
            if d.needs_input and not data:
                raise out.error("the xz stream is cut short")
            out.put(d.decompress(data, max_length=_CHUNK))
    except lzma.LZMAError as e:
        raise out.error(f"not an xz stream: {e}") from e


def _unzstd(src: BinaryIO, out: _Out) -> None:
    import zstandard

    d = zstandard.ZstdDecompressor().decompressobj()
    try:
        while not d.eof:
            data = src.read(_ZSTD_FEED)
            if not data:
                raise out.error("the zstd stream is cut short")
            out.put(d.decompress(data))
    except zstandard.ZstdError as e:
        raise out.error(f"not a zstd stream: {e}") from e
