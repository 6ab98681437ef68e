"""Giving freed heap back to the kernel (glibc's ``malloc_trim``).

A start reads ``/proc/kallsyms`` whole (megabytes of text) and the symbol
worker parses it into a packed table; both are freed once the table is
stored, but glibc keeps freed chunks in its arenas (the worker thread's own
arena among them) instead of returning them, so the daemon's resident size
would stay at its startup peak for its whole life.  :func:`trim` asks glibc
to hand free pages of every arena back; it is called after each batch that
read kallsyms, when the large buffers are gone.

glibc also raises its mmap threshold each time a block it had mapped is freed
(up to 32 MiB), after which the same buffers (a kallsyms read, a Resolve
request or reply of some 100 KiB to a few MiB) are carved from an arena and
stay resident once freed.  :func:`tune`, called once when the daemon starts,
fixes the threshold at :data:`MMAP_THRESHOLD`: a block that large is mapped
for itself and unmapped when freed.  On this machine's root (122,000 kernel
symbols) that keeps 5 MiB less resident after Resolve batches
(bench/bench_memory.py).  Elsewhere than glibc both do nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

# Blocks this large or larger get a mapping of their own (glibc's default
# before it starts raising it).
MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3  # malloc.h

_trim: Callable[[int], int] | None = None
_looked = False


def _libc(name: str, *argtypes: Any) -> Callable[..., int] | None:
    """The glibc function *name*, or None (not Linux, not glibc)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # the daemon's libraries load it anyway; never on kreldctl's paths

    try:
        fn = getattr(ctypes.CDLL(None), name)  # glibc only (not musl)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [getattr(ctypes, t) for t in argtypes]
    fn.restype = ctypes.c_int
    found: Callable[..., int] = fn
    return found


def _find() -> Callable[[int], int] | None:
    return _libc("malloc_trim", "c_size_t")


def tune() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD`; whether it could."""
    mallopt = _libc("mallopt", "c_int", "c_int")
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1


def trim() -> bool:
    """Return free heap pages to the kernel; whether glibc could be asked."""
    global _trim, _looked
    if not _looked:
        _trim, _looked = _find(), True
    if _trim is None:
        return False
    _trim(0)
    return True
