"""Giving freed heap back to the kernel (glibc's ``malloc_trim``).

A start reads ``/proc/kallsyms`` whole (megabytes of text) and the symbol
worker parses it into a packed table; both are freed once the table is
stored, but glibc keeps freed chunks in its arenas (the worker thread's own
arena among them) instead of returning them, so the daemon's resident size
would stay at its startup peak for its whole life.  :func:`trim` asks glibc
to hand free pages of every arena back; it is called after each batch that
read kallsyms, when the large buffers are gone.

glibc also raises its mmap threshold each time a block it had mapped is freed
(up to 32 MiB), after which the largest buffers (a kallsyms read of several
MiB, the reply to a Resolve of 100,000 addresses) are carved from an arena and
stay resident once freed.  :func:`tune`, called once when the daemon starts,
fixes the threshold at :data:`MMAP_THRESHOLD`: a block that large is mapped
for itself and unmapped when freed.  The threshold sits above a busy
profiler's usual Resolve (10,000 addresses: a reply of some 300 KiB): at
glibc's own 128 KiB every such reply was mapped and unmapped again, which
cost Resolve over the socket much of its throughput (bench/bench_symbols.py).
The same holds for every buffer a batch makes on the way: each must stay
below the mmap threshold, and all of them at once below the trim threshold,
or each call faults its pages in again; kreld.symbols.queries sizes its
slices from :data:`MMAP_THRESHOLD` for that.
Elsewhere than glibc both do nothing.

The store's LMDB map is not heap, but a Resolve reads its pages (a kernel's
symbol table, megabytes) into the resident set all the same, and they stay
there after it: :func:`drop_file_pages` lets them go once calls stop.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["MMAP_THRESHOLD", "drop_file_pages", "resident", "trim", "tune"]

# Blocks this large or larger get a mapping of their own: above the buffers
# of an everyday Resolve, below a kallsyms read.
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # malloc.h
_M_TRIM_THRESHOLD = -1
_MADV_DONTNEED = 4  # asm-generic/mman-common.h

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
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD`, and its trim
    threshold at twice that, as glibc's own adjustment would set it (fixing the
    one stops glibc moving the other, which would stay at 128 KiB and shrink the
    heap after nearly every large free); whether it could."""
    mallopt = _libc("mallopt", "c_int", "c_int")
    return (
        mallopt is not None
        and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        and mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD) == 1
    )


def trim() -> bool:
    """Return free heap pages to the kernel; whether glibc could be asked."""
    global _trim, _looked
    if not _looked:
        _trim, _looked = _find(), True
    if _trim is None:
        return False
    _trim(0)
    return True


def drop_file_pages(ranges: list[tuple[int, int]]) -> bool:
    """Drop the pages of shared file mappings *ranges* (page-aligned ``(start,
    end)``) from this process's resident set: ``madvise(MADV_DONTNEED)``.

    Only for shared mappings of files (the store's LMDB map): their pages stay
    in the kernel's page cache, dirty or not, and the next read of them faults
    them in from there, with the same bytes; nothing is lost.  (On a private
    mapping the same call would throw changes away.)  Whether it could ask."""
    madvise = _libc("madvise", "c_void_p", "c_size_t", "c_int")
    if madvise is None:
        return False
    for start, end in ranges:
        madvise(start, end - start, _MADV_DONTNEED)
    return True


def resident() -> int | None:
    """This process's resident set in bytes (``/proc/self/statm``), or None."""
    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * _PAGE


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
