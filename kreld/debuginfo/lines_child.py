"""The DWARF reader's own process: one SymCache built under a memory bound.

``python -I lines_child.py PATH BOUND`` (run by its file, isolated) reads the
debug file at *PATH* with ``symbolic`` and writes its SymCache to its standard output (a
file the parent made, never a terminal or a pipe it must drain).  The reader
is native code that takes a few hundred MiB for a kernel; run here, in a
process of its own, its memory is bounded (``RLIMIT_AS`` of *BOUND* bytes, set
before anything is read), its peak is freed with the process, and a crash of
it is a failed build, not a dead daemon.  It dies with the thread that started
it (``PR_SET_PDEATHSIG``).

Nothing but the standard library and ``symbolic`` is imported (not even
kreld), so that the bound and the peak are the reader's own.  The exit
status says how it ended: 0 the SymCache written (and on standard error
``peak_rss BYTES``, the process's own high-water mark since its ``exec``);
:data:`EXIT_REFUSED` the reader refused the file (the reason on standard
error, one line); :data:`EXIT_MEMORY` an allocation was refused within the
bound (the file's mapping, or an allocation Python asked for).  A native
allocation refused aborts the process (``SIGABRT``, "memory allocation of N
bytes failed" on standard error); :mod:`kreld.debuginfo.lines_spawn` tells
those apart.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import resource
import signal
import sys
import threading

__all__ = ["EXIT_MEMORY", "EXIT_REFUSED", "PEAK", "main"]

EXIT_REFUSED = 3
EXIT_MEMORY = 4
PEAK = "peak_rss"
_PR_SET_PDEATHSIG = 1
_MADV_DONTNEED = 4
_M_ARENA_MAX = -8
# How often the file's pages are dropped from the reader's mapping.
SHED_PERIOD_S = 0.05


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent went before the signal was asked for
        os._exit(1)


def _peak_rss() -> int:
    """``VmHWM`` in bytes: this process's peak since its exec (``wait4``'s
    ``ru_maxrss`` would count the parent's, whose memory the child had
    until then)."""
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _file_mappings(dev: int, ino: int) -> list[tuple[int, int]]:
    """The read-only mappings of the file (*dev*, *ino*) in this process."""
    out = []
    with open("/proc/self/maps", "rb") as f:
        for line in f:
            field = line.split(maxsplit=5)
            if len(field) < 5 or b"w" in field[1] or int(field[4]) != ino:
                continue
            major, minor = (int(x, 16) for x in field[3].split(b":"))
            if os.makedev(major, minor) == dev:
                start, end = (int(x, 16) for x in field[0].split(b"-"))
                out.append((start, end - start))
    return out


def _shed_file_pages(path: str) -> threading.Event:
    """Drop the pages of *path*'s mappings every :data:`SHED_PERIOD_S` until
    the event answered is set (nothing where the thread cannot be had)."""
    done = threading.Event()
    try:
        st = os.stat(path)
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        # One malloc arena: a thread's own would reserve 64 MiB of the bound.
        if not libc.mallopt(_M_ARENA_MAX, 1):
            return done
    except (OSError, AttributeError):
        return done

    def shed() -> None:
        while not done.wait(SHED_PERIOD_S):
            for start, size in _file_mappings(st.st_dev, st.st_ino):
                madvise(start, size, _MADV_DONTNEED)

    threading.stack_size(1 << 18)
    # No thread to be had: the pages stay mapped, the build goes on.
    with contextlib.suppress(RuntimeError):
        threading.Thread(target=shed, name="shed-file-pages", daemon=True).start()
    return done


def _refuse(reason: str) -> int:
    sys.stderr.write(reason.splitlines()[0] if reason else "refused")
    return EXIT_REFUSED


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        return _refuse("usage: lines_child.py PATH BOUND")
    path, bound = argv[1], int(argv[2])
    _die_with_parent()
    shedding = _shed_file_pages(path)
    resource.setrlimit(resource.RLIMIT_AS, (bound, bound))
    try:
        try:
            from symbolic import Archive, SymbolicError  # type: ignore[attr-defined]
            from symbolic.symcache import SymCache
        except ImportError as e:
            return _refuse(f"symbolic is not installed (kreld's [lines] extra): {e}")

        try:
            objects = list(Archive.open(path).iter_objects())
            if not objects:
                return _refuse("no object in the file")
            cache = SymCache.from_object(objects[0])  # type: ignore[no-untyped-call]
            del objects
            shedding.set()
            with os.fdopen(1, "wb", closefd=False) as out:
                cache.dump_into(out)
            sys.stderr.write(f"{PEAK} {_peak_rss()}\n")
        except SymbolicError as e:
            if f"(os error {errno.ENOMEM})" in str(e):  # the file's mapping past the bound
                return EXIT_MEMORY
            return _refuse(str(e))
    except MemoryError:
        return EXIT_MEMORY
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
