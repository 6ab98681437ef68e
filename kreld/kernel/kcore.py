"""Kernel memory read through ``/proc/kcore``, an ELF core file of the running kernel.

Where ``kernel.kptr_restrict=2`` zeroes kallsyms and ``/sys/module/*/sections``
for root too, the kernel's memory itself still says where everything is.
``/proc/kcore`` (fs/proc/kcore.c) is an ELF64 core: one ``PT_LOAD`` per range of
kernel virtual addresses it can show (the kernel text, the module area, vmalloc,
the direct map), whose ``p_vaddr`` is mapped to ``p_offset`` in the file, and a
``PT_NOTE`` with VMCOREINFO (``KERNELOFFSET=``, ``SYMBOL(name)=``; since Linux
4.19, commit 23c85094fe18 "proc/kcore: add vmcoreinfo note to /proc/kcore").
Opening it needs CAP_SYS_RAWIO, and the kernel refuses it under
``lockdown=confidentiality`` (security_locked_down(LOCKDOWN_KCORE)).

Every read is bounded (:data:`MAX_READ`) and must lie in a segment: a pointer
read from kernel memory that leads elsewhere is :class:`AddressNotMapped`,
never a read of whatever the file holds at some offset.
"""

from __future__ import annotations

import bisect
import errno
import os
import struct
import threading
from pathlib import Path
from types import TracebackType

from kreld.core.errors import AddressNotMapped, KernelMemoryError, KernelReadError, NoteError
from kreld.core.record import record
from kreld.kernel.elf import (
    ET_CORE,
    MAX_PROGRAM_HEADERS,
    PT_LOAD,
    PT_NOTE,
    ElfSource,
    elf_header,
    note_segment,
    program_headers,
)
from kreld.kernel.files import hex_address, kernel_offset
from kreld.kernel.notes import NoteType, iter_notes, parse_vmcoreinfo

__all__ = ["MAX_READ", "MAX_SEGMENTS", "Kcore", "Segment"]

MAX_READ = 1 << 20  # one read of kernel memory (a struct, a table of section attributes)
# PT_LOADs (one per memory range; hundreds on a large NUMA machine): with the
# PT_NOTE, the program headers elf.MAX_PROGRAM_HEADERS allows.
MAX_SEGMENTS = MAX_PROGRAM_HEADERS - 1
MAX_STRING = 512  # a C string read from kernel memory (a section name, a module name)
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


@record
class Segment:
    """One ``PT_LOAD``: kernel virtual addresses ``[vaddr, vaddr + size)`` at file ``offset``."""

    vaddr: int
    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.vaddr + self.size


class Kcore:
    """An open ``/proc/kcore`` (or a file shaped like it): segments, VMCOREINFO, reads."""

    __slots__ = ("_fd", "_fd_lock", "_starts", "path", "segments", "vmcoreinfo")

    def __init__(
        self, path: str, fd: int, segments: list[Segment], vmcoreinfo: dict[str, str]
    ) -> None:
        self.path = path
        self._fd = fd
        # One open kcore serves the tracepoint thread, the tracker, the symbol
        # capture and a Snapshot at once.  pread keeps no file position, so reads
        # need no order among themselves; the lock keeps a close from landing
        # between a read's look at the fd and its pread, where the number could
        # already name another file opened meanwhile.
        self._fd_lock = threading.Lock()
        self.segments = sorted(segments, key=lambda s: s.vaddr)
        self._starts = [s.vaddr for s in self.segments]
        self.vmcoreinfo = vmcoreinfo

    @classmethod
    def open(cls, path: Path) -> Kcore:
        """Open and read the headers; :class:`KernelReadError` says why not
        (EPERM without CAP_SYS_RAWIO or under lockdown, ENOENT without
        CONFIG_PROC_KCORE)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise KernelReadError(str(path), _why_not(e)) from e
        try:
            segments, info = _read_headers(fd, str(path))
        except BaseException:
            os.close(fd)
            raise
        return cls(str(path), fd, segments, info)

    def close(self) -> None:
        with self._fd_lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> Kcore:
        return self

    def __exit__(
        self,
        typ: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- where an address lies ---------------------------------------------------

    def segment_of(self, address: int) -> Segment | None:
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0 and address < self.segments[i].end:
            return self.segments[i]
        return None

    def mapped(self, address: int, length: int = 1) -> bool:
        """Whether ``[address, address + length)`` lies in one segment."""
        seg = self.segment_of(address)
        return seg is not None and address + length <= seg.end

    # -- reads ------------------------------------------------------------------

    def read(self, address: int, length: int) -> bytes:
        """*length* bytes of kernel memory at *address*, which must lie in a segment."""
        if not 0 <= length <= MAX_READ:
            raise KernelMemoryError(self.path, f"a read of {length} bytes (limit {MAX_READ})")
        seg = self.segment_of(address)
        if seg is None or address + length > seg.end:
            raise AddressNotMapped(self.path, address, length)
        try:
            with self._fd_lock:
                if self._fd < 0:
                    raise KernelReadError(self.path, "closed")
                # Offsets past 2^63 are dropped with their segment (_read_headers).
                data = os.pread(self._fd, length, seg.offset + (address - seg.vaddr))
        except OSError as e:
            raise KernelReadError(self.path, f"read at {address:#x}: {e.strerror}") from e
        if len(data) != length:
            raise KernelMemoryError(
                self.path, f"read of {length} bytes at {address:#x} returned {len(data)}"
            )
        return data

    def u64(self, address: int) -> int:
        value: int = _U64.unpack(self.read(address, 8))[0]
        return value

    def u32(self, address: int) -> int:
        value: int = _U32.unpack(self.read(address, 4))[0]
        return value

    def pointer(self, address: int, what: str, length: int = 1) -> int:
        """The pointer stored at *address*, checked to point into a segment
        (*length* bytes of it); *what* names it in the error."""
        value = self.u64(address)
        if not self.mapped(value, length):
            raise AddressNotMapped(self.path, value, length, what)
        return value

    def string(self, address: int, limit: int = MAX_STRING) -> str:
        """A NUL-ended string of at most *limit* bytes at *address*."""
        seg = self.segment_of(address)
        if seg is None:
            raise AddressNotMapped(self.path, address, 1)
        raw = self.read(address, min(limit, seg.end - address))
        end = raw.find(b"\0")
        if end < 0:
            raise KernelMemoryError(self.path, f"no NUL in {len(raw)} bytes at {address:#x}")
        return raw[:end].decode("utf-8", "replace")

    # -- VMCOREINFO ---------------------------------------------------------------

    def kernel_offset(self) -> int | None:
        """``KERNELOFFSET=`` (hex), or ``None`` where VMCOREINFO has none; one the
        kernel cannot have (negative, past the kernel's half) is
        :class:`KernelMemoryError`."""
        text = self.vmcoreinfo.get("KERNELOFFSET")
        if text is None:
            return None
        try:
            return kernel_offset(text)
        except ValueError as e:
            raise KernelMemoryError(self.path, f"VMCOREINFO: {e}") from e

    def symbol(self, name: str) -> int | None:
        """``SYMBOL(name)=`` (the runtime address), or ``None``; a value that is no
        kernel address is :class:`KernelMemoryError`."""
        text = self.vmcoreinfo.get(f"SYMBOL({name})")
        if text is None:
            return None
        try:
            return hex_address(text) or None
        except ValueError as e:
            raise KernelMemoryError(self.path, f"VMCOREINFO SYMBOL({name}): {e}") from e


def _why_not(e: OSError) -> str:
    if e.errno in (errno.EPERM, errno.EACCES):
        return (
            f"{e.strerror}: reading kernel memory needs CAP_SYS_RAWIO, and the kernel "
            "refuses it under lockdown=confidentiality"
        )
    return e.strerror or str(e)


def _read_headers(fd: int, path: str) -> tuple[list[Segment], dict[str, str]]:
    """The PT_LOAD segments and VMCOREINFO of an ELF64 little-endian core.

    The ELF reading is :mod:`kreld.kernel.elf`'s, bounded there (the program
    header table, the note segment); here, what a core of the running kernel
    must be besides: nothing is read past the 2^63 bytes a file can have (a
    segment that lies there cannot be read, and is left out), no segment wraps
    around the address space, and there are at most :data:`MAX_SEGMENTS`.
    """
    src = ElfSource.of_fd(fd, path)
    header = elf_header(src)
    if not header.wide or header.endian != "<":
        # Kcore's reads of kernel memory (u64, pointer) are little-endian.
        raise KernelMemoryError(path, "not an ELF64 little-endian file")
    if header.type != ET_CORE:
        raise KernelMemoryError(path, f"ELF type {header.type}, not a core file")
    phdrs = program_headers(src, header)
    if not phdrs:
        raise KernelMemoryError(path, "no program headers")
    segments: list[Segment] = []
    info: dict[str, str] = {}
    for i, ph in enumerate(phdrs):
        if ph.type == PT_LOAD and ph.filesz:
            if ph.vaddr + ph.filesz > 1 << 64:
                raise KernelMemoryError(path, f"segment {i} wraps around the address space")
            if ph.offset + ph.filesz < 1 << 63:
                segments.append(Segment(ph.vaddr, ph.offset, ph.filesz))
        elif ph.type == PT_NOTE and not info:
            info = _vmcoreinfo(note_segment(src, ph.offset, ph.filesz))
    if len(segments) > MAX_SEGMENTS:
        raise KernelMemoryError(path, f"more than {MAX_SEGMENTS} PT_LOAD segments")
    return segments, info


def _vmcoreinfo(blob: bytes) -> dict[str, str]:
    try:
        for note in iter_notes(blob, "little"):
            if note.name == b"VMCOREINFO" and note.type == NoteType.NT_VMCOREINFO:
                return parse_vmcoreinfo(note.desc)
    except NoteError:
        return {}
    return {}
