"""Running the DWARF reader in its own process and taking back its SymCache.

:func:`start` runs :mod:`kreld.debuginfo.lines_child` on a debug file (by
its path, or an anonymous file handed over as a descriptor), its output and
its errors going to anonymous files of this process (``memfd_create``, else
unlinked temporary files under *scratch*): nothing to drain while it runs, so
the caller reads the file's symbols meanwhile, on the machine's other core.
:meth:`Reading.finish` waits for it up to a deadline and answers the SymCache
with the reader's peak resident set (as it says it), or raises a
:class:`~kreld.core.errors.LineTableError` saying how it ended: refused by the
reader, over its memory bound (:data:`DEFAULT_BOUND` unless configured:
``[kernel] line_build_memory``), killed by a signal, or past the deadline
(then killed).  Whatever happens to it, the caller's process goes on.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

from kreld.core import consts
from kreld.core.errors import LineTableError
from kreld.debuginfo import lines_child
from kreld.debuginfo.lines_child import EXIT_MEMORY, EXIT_REFUSED, PEAK

__all__ = ["DEFAULT_BOUND", "TIMEOUT_S", "Reading", "Readings", "start", "start_parts"]

# The reader's address space, at most: a 6.1 vmlinux (590 MB, mapped whole)
# takes about 0.9 GiB of it and 0.26 GiB resident at the peak.
DEFAULT_BOUND = consts.DEFAULT_LINE_BUILD_MEMORY
# A build that takes longer is taken for hung, killed and named.
TIMEOUT_S = 900.0
# A SymCache larger than this is refused before it is read (a kernel's: ~40 MB).
MAX_SYMCACHE = 1 << 30
_ERR_MAX = 4096
_POLL_S = 0.005
T = TypeVar("T")


def _anonymous(scratch: Path | None) -> IO[bytes]:
    try:
        return os.fdopen(os.memfd_create("kreld-lines", os.MFD_CLOEXEC), "w+b")
    except (AttributeError, OSError):
        return tempfile.TemporaryFile(prefix="kreld-lines-", dir=scratch)


@dataclass
class Reading:
    """A reader process under way (see the module's docstring)."""

    proc: subprocess.Popen[bytes]
    out: IO[bytes]
    err: IO[bytes]
    what: str
    bound: int

    def meanwhile(self, work: Callable[[], T]) -> tuple[bytes, int, T]:
        """*work* done here while the reader runs, then :meth:`finish`'s
        answer with *work*'s; the reader killed if *work* raises."""
        try:
            done = work()
        except BaseException:
            self.kill()
            self.close()
            raise
        return *self.finish(), done

    def finish(self, timeout: float = TIMEOUT_S) -> tuple[bytes, int]:
        """The SymCache and the reader's peak RSS in bytes; else why not."""
        try:
            status = self._wait(timeout)
            if status == 0:
                size = os.fstat(self.out.fileno()).st_size
                if size > MAX_SYMCACHE:
                    raise LineTableError(self.what, f"a SymCache of {size} bytes is over "
                                                    f"{MAX_SYMCACHE}")  # fmt: skip
                return os.pread(self.out.fileno(), size, 0), self._peak()
            raise LineTableError(self.what, self._why(status))
        finally:
            self.close()

    def _wait(self, timeout: float) -> int:
        """The reader's exit status, woken by its end (a pidfd; else a
        poll every few ms); past *timeout*, killed and named."""
        deadline = time.monotonic() + timeout
        try:
            ended: int | None = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):
            ended = None
        try:
            while True:
                pid, status = os.waitpid(self.proc.pid, os.WNOHANG)
                if pid:
                    self.proc.returncode = os.waitstatus_to_exitcode(status)
                    return self.proc.returncode
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill()
                    raise LineTableError(self.what, f"the DWARF reader took over {timeout:g} s: "
                                                    "killed")  # fmt: skip
                if ended is None:
                    time.sleep(min(_POLL_S, left))
                else:
                    select.select([ended], [], [], left)
        finally:
            if ended is not None:
                os.close(ended)

    def _said(self) -> tuple[bytes, bytes]:
        """The head and the tail of what the reader wrote on standard error
        (a native abort says why first; Python's traceback last)."""
        fd = self.err.fileno()
        size = os.fstat(fd).st_size
        return os.pread(fd, _ERR_MAX, 0), os.pread(fd, _ERR_MAX, max(0, size - _ERR_MAX))

    def _peak(self) -> int:
        for line in reversed(self._said()[1].splitlines()):
            word = line.split()
            if len(word) == 2 and word[0] == PEAK.encode() and word[1].isdigit():
                return int(word[1])
        return 0

    def _why(self, status: int) -> str:
        head, tail = (b.decode("utf-8", "replace").strip() for b in self._said())
        last = tail.splitlines()[-1] if tail else ""
        bound = f"its memory bound of {self.bound >> 20} MiB"
        if status == EXIT_REFUSED:
            return last or "the DWARF reader refused the file"
        if status == EXIT_MEMORY or "memory allocation of" in head:
            return f"the DWARF reader went over {bound} ([kernel] line_build_memory)"
        if status < 0:
            name = signal.Signals(-status).name if -status in signal.valid_signals() else -status
            return f"the DWARF reader died by {name} within {bound}" + (f": {last}" if last else "")
        return f"the DWARF reader exited with status {status}" + (f": {last}" if last else "")

    def kill(self) -> None:
        """End the reader now (a caller that will not wait for it)."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(self.proc.pid, 0)
                self.proc.returncode = os.waitstatus_to_exitcode(status)

    def close(self) -> None:
        self.out.close()
        self.err.close()


@dataclass
class Readings:
    """Readers under way on parts of one file's units (:func:`start_parts`)."""

    parts: list[Reading]

    def meanwhile(self, work: Callable[[], T]) -> tuple[list[bytes], int, T]:
        """*work* done here while the readers run, then their SymCaches, the
        sum of their peaks (they ran at once) and *work*'s answer; every
        reader killed if *work* or one of them fails."""
        try:
            done = work()
            got = [r.finish() for r in self.parts]
        except BaseException:
            for r in self.parts:
                r.kill()
                r.close()
            raise
        return [raw for raw, _ in got], sum(peak for _, peak in got), done


def start(
    source: str | int,
    what: str,
    bound: int = DEFAULT_BOUND,
    scratch: Path | None = None,
    part: tuple[int, int, int] | None = None,
) -> Reading:
    """The reader started on *source*: a path, or a descriptor of this
    process (handed to the reader, read as ``/proc/self/fd/N`` there); with
    *part*, only the units of ``.debug_info`` it says (the section header's
    file offset, the part's file offset and size: see
    :mod:`kreld.debuginfo.lines_child`)."""
    out, err = _anonymous(scratch), _anonymous(scratch)
    fds: tuple[int, ...] = ()
    if isinstance(source, int):
        fds, source = (source,), f"/proc/self/fd/{source}"
    argv = [sys.executable, "-I", lines_child.__file__, source, str(bound)]
    argv += [] if part is None else [str(n) for n in part]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                pass_fds=fds, close_fds=True)  # fmt: skip
    except OSError as e:
        out.close()
        err.close()
        raise LineTableError(what, f"the DWARF reader could not be started: {e}") from None
    return Reading(proc, out, err, what, bound)


def start_parts(
    path: str, bound: int, scratch: Path | None, shdr: int, parts: list[tuple[int, int]]
) -> Readings:
    """A reader per part of the file's ``.debug_info`` (*parts*: file offset
    and size; *shdr*: where its section header lies), each bounded by
    *bound*; those started stopped if one cannot be."""
    started: list[Reading] = []
    try:
        for offset, size in parts:
            started.append(start(path, path, bound, scratch, (shdr, offset, size)))
    except BaseException:
        for r in started:
            r.kill()
            r.close()
        raise
    return Readings(started)
