"""The DWARF reader's own process: one SymCache built under a memory bound.

``python -I lines_child.py PATH BOUND`` (run by its file, isolated) reads the
debug file at *PATH* with ``symbolic`` and writes its SymCache to its standard output (a
file the parent made, never a terminal or a pipe it must drain).  With
``SHDR OFFSET SIZE`` after them it reads only part of the file's units: the
file is mapped as it is but for the page (or two) holding its ``.debug_info``
section header, at file offset *SHDR*, which is an anonymous copy saying the
section lies at *OFFSET* for *SIZE* bytes (whole units: the parent cuts the
section at a unit's start; :func:`kreld.debuginfo.symcache.merge` puts the
parts together).  The reader
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
import mmap
import os
import resource
import signal
import struct
import sys
import threading
from typing import Any

__all__ = ["EXIT_MEMORY", "EXIT_REFUSED", "PEAK", "main"]

EXIT_REFUSED = 3
EXIT_MEMORY = 4
PEAK = "peak_rss"
_PR_SET_PDEATHSIG = 1
_MADV_DONTNEED = 4
_M_ARENA_MAX = -8
_SHDR_SIZE = 64  # Elf64_Shdr
_SH_OFFSET = 24  # its sh_offset, then sh_size
_MAP_FIXED = 0x10
_MAP_FAILED = ctypes.c_void_p(-1).value
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


def _part_mapping(path: str, shdr: int, offset: int, size: int) -> tuple[int, int]:
    """The file at *path* mapped read-only whole, its ``.debug_info`` section
    header (an ``Elf64_Shdr`` at file offset *shdr*) saying *offset* and
    *size* in an anonymous copy of the page(s) it lies in: (address, length).
    The file's own pages stay its (shed like any of its pages)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        length = os.fstat(fd).st_size
        if shdr < 0 or shdr + _SHDR_SIZE > length:
            raise ValueError(f"no section header at {shdr:#x} in {length} bytes")
        addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        lo = shdr - shdr % mmap.PAGESIZE
        hi = -(-(shdr + _SHDR_SIZE) // mmap.PAGESIZE) * mmap.PAGESIZE
        page = bytearray(os.pread(fd, hi - lo, lo).ljust(hi - lo, b"\0"))
    finally:
        os.close(fd)
    struct.pack_into("<QQ", page, shdr - lo + _SH_OFFSET, offset, size)
    got = libc.mmap(addr + lo, hi - lo, mmap.PROT_READ | mmap.PROT_WRITE,
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)  # fmt: skip
    if got != addr + lo:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    ctypes.memmove(got, bytes(page), len(page))
    return addr, length


def _archive(path: str, part: list[str]) -> Any:
    """The file's archive for symbolic: the file itself, or its mapping with
    part of its units (:func:`_part_mapping`), which the archive borrows
    (mapped until the process ends)."""
    from symbolic import Archive  # type: ignore[attr-defined]

    if not part:
        return Archive.open(path)
    from symbolic._lowlevel import ffi, lib
    from symbolic.utils import rustcall

    addr, length = _part_mapping(path, *map(int, part))
    return Archive._from_objptr(
        rustcall(lib.symbolic_archive_from_bytes, ffi.cast("const uint8_t *", addr), length)  # type: ignore[no-untyped-call]
    )


def _refuse(reason: str) -> int:
    sys.stderr.write(reason.splitlines()[0] if reason else "refused")
    return EXIT_REFUSED


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 6):
        return _refuse("usage: lines_child.py PATH BOUND [SHDR OFFSET SIZE]")
    path, bound, part = argv[1], int(argv[2]), argv[3:]
    _die_with_parent()
    shedding = _shed_file_pages(path)
    resource.setrlimit(resource.RLIMIT_AS, (bound, bound))
    try:
        try:
            from symbolic import SymbolicError  # type: ignore[attr-defined]
            from symbolic.symcache import SymCache
        except ImportError as e:
            return _refuse(f"symbolic is not installed (kreld's [lines] extra): {e}")

        try:
            objects = list(_archive(path, part).iter_objects())
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
        except OSError as e:
            if e.errno == errno.ENOMEM:
                return EXIT_MEMORY
            return _refuse(f"{path}: {e.strerror or e}")
        except ValueError as e:
            return _refuse(f"{path}: {e}")
    except MemoryError:
        return EXIT_MEMORY
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
