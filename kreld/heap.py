"""Giving freed heap back to the kernel (glibc's ``malloc_trim``).

A start reads ``/proc/kallsyms`` whole (megabytes of text) and the symbol
worker parses it into a packed table; both are freed once the table is
stored, but glibc keeps freed chunks in its arenas (the worker thread's own
arena among them) instead of returning them, so the daemon's resident size
would stay at its startup peak for its whole life.  :func:`trim` asks glibc
to hand free pages of every arena back; it is called after each batch that
read kallsyms, when the large buffers are gone.  Elsewhere than glibc it does
nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

_trim: Callable[[int], int] | None = None
_looked = False


def _find() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # only once a batch is done, never on kreldctl's paths

    try:
        libc = ctypes.CDLL(None)
        fn = libc.malloc_trim  # glibc only (not musl)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    trim_fn: Callable[[int], int] = fn
    return trim_fn


def trim() -> bool:
    """Return free heap pages to the kernel; whether glibc could be asked."""
    global _trim, _looked
    if not _looked:
        _trim, _looked = _find(), True
    if _trim is None:
        return False
    _trim(0)
    return True
