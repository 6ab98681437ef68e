"""What the kernel says of each loaded BPF program through bpf(2): its id, tag,
and the address and length of each of its JITed functions.

kallsyms lists a program's functions (``bpf_prog_<tag>_<name> [bpf]``) with
their addresses but no length, id or tag of its own; a program kreld first
finds there (loaded before kreld started, or inside a loss window) gets them
here.  The walk is ``BPF_PROG_GET_NEXT_ID`` over every program id, then
``BPF_PROG_GET_FD_BY_ID`` and ``BPF_OBJ_GET_INFO_BY_FD`` for each: twice, first
for the number of functions, then with room for their addresses
(``jited_ksyms``) and lengths (``jited_func_lens``); ``struct bpf_prog_info``
as in include/uapi/linux/bpf.h (its layout up to ``jited_func_lens`` has not
changed since Linux 4.18).

Who may walk: CAP_SYS_ADMIN (``BPF_PROG_GET_NEXT_ID``); the addresses come
back zero unless the reader may see kernel addresses (``bpf_dump_raw_ok()``,
as kallsyms: kptr_restrict).  Where either is refused the walk gives nothing
and kreld keeps what kallsyms alone says.  Bounded: at most
:data:`MAX_PROGRAMS` programs and :data:`MAX_FUNCS` functions each.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

from kreld.core.record import record

__all__ = ["MAX_FUNCS", "MAX_PROGRAMS", "ProgramInfo", "bpf_functions", "bpf_programs"]

MAX_PROGRAMS = 65_536  # programs walked at most (prog ids are 31-bit)
MAX_FUNCS = 256  # functions of one program at most (the verifier's subprog limit)
_NR_BPF = {"x86_64": 321, "aarch64": 280, "riscv64": 280, "ppc64le": 361}
_PROG_GET_NEXT_ID, _PROG_GET_FD_BY_ID, _OBJ_GET_INFO_BY_FD = 11, 13, 15
_INFO_SIZE = 128  # struct bpf_prog_info up to and including jited_func_lens
_ATTR_SIZE = 16


@record
class ProgramInfo:
    """One loaded program: its id, tag (hex) and JITed functions (address, length)."""

    prog_id: int
    tag: str
    funcs: tuple[tuple[int, int], ...]


class _Bpf:
    def __init__(self) -> None:
        self.nr = _NR_BPF.get(platform.machine())
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.syscall.restype = ctypes.c_long

    def call(self, cmd: int, attr: ctypes.Array[ctypes.c_char]) -> int:
        if self.nr is None:
            raise OSError(errno.ENOSYS, "bpf: no syscall number for this machine")
        r = int(self.libc.syscall(self.nr, cmd, attr, ctypes.sizeof(attr)))
        if r < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        return r

    def next_id(self, start: int) -> int | None:
        attr = ctypes.create_string_buffer(struct.pack("<III", start, 0, 0), _ATTR_SIZE)
        try:
            self.call(_PROG_GET_NEXT_ID, attr)
        except OSError as e:
            if e.errno == errno.ENOENT:
                return None
            raise
        return int(struct.unpack_from("<I", attr, 4)[0])

    def info(self, prog_id: int) -> ProgramInfo | None:
        attr = ctypes.create_string_buffer(struct.pack("<III", prog_id, 0, 0), _ATTR_SIZE)
        try:
            fd = self.call(_PROG_GET_FD_BY_ID, attr)
        except OSError as e:
            if e.errno == errno.ENOENT:  # unloaded since its id was read
                return None
            raise
        try:
            head = self._info(fd, 0, 0)
            nsyms, nlens = struct.unpack_from("<II", head, 104)
            n = min(nsyms, nlens, MAX_FUNCS)
            addrs = (ctypes.c_uint64 * max(n, 1))()
            lens = (ctypes.c_uint32 * max(n, 1))()
            full = self._info(fd, n, ctypes.addressof(addrs), ctypes.addressof(lens))
        finally:
            os.close(fd)
        got = min(n, *struct.unpack_from("<II", full, 104))
        funcs = tuple((int(addrs[i]), int(lens[i])) for i in range(got))
        pid = int(struct.unpack_from("<I", full, 4)[0])
        return ProgramInfo(pid, bytes(full[8:16]).hex(), funcs)

    def _info(self, fd: int, n: int, addrs: int = 0, lens: int = 0) -> bytes:
        info = bytearray(_INFO_SIZE)
        struct.pack_into("<IIQQ", info, 104, n, n, addrs, lens)
        buf = ctypes.create_string_buffer(bytes(info), _INFO_SIZE)
        attr = ctypes.create_string_buffer(
            struct.pack("<IIQ", fd, _INFO_SIZE, ctypes.addressof(buf)), _ATTR_SIZE
        )
        self.call(_OBJ_GET_INFO_BY_FD, attr)
        return bytes(buf.raw)


def bpf_programs(limit: int = MAX_PROGRAMS) -> list[ProgramInfo] | None:
    """Every loaded program (at most *limit*), or None where bpf(2) refuses the walk."""
    try:
        bpf = _Bpf()
        out: list[ProgramInfo] = []
        prog_id: int | None = 0
        while len(out) < limit:
            prog_id = bpf.next_id(prog_id or 0)
            if prog_id is None:
                break
            p = bpf.info(prog_id)
            if p is not None:
                out.append(p)
        return out
    except OSError:  # EPERM without CAP_SYS_ADMIN; ENOSYS, EINVAL where there is no bpf(2)
        return None


def bpf_functions(programs: list[ProgramInfo]) -> dict[int, tuple[int, ProgramInfo]]:
    """Each JITed function's address: its length and program (zero addresses,
    hidden by kptr_restrict, left out)."""
    return {a: (n, p) for p in programs for a, n in p.funcs if a}
