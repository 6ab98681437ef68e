"""Load real BPF programs with the bpf(2) syscall, for the tests that follow
kernel code on this machine's kernel (root, or CAP_BPF with unprivileged BPF
off, is needed: callers skip with the reason when the load is refused)."""

from __future__ import annotations

import ctypes
import os
import platform
import struct

_NR_BPF = {"x86_64": 321, "aarch64": 280}
_BPF_PROG_LOAD = 5
_SOCKET_FILTER = 1
# r0 = 0; exit: the smallest program the verifier takes.
_INSNS = struct.pack("<BBhi", 0xB7, 0, 0, 0) + struct.pack("<BBhi", 0x95, 0, 0, 0)


def load_socket_filter(name: str) -> int:
    """A socket filter named *name* (at most 15 characters); its fd (close it to unload)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    insns = ctypes.create_string_buffer(_INSNS)
    license_ = ctypes.create_string_buffer(b"GPL")
    attr = bytearray(144)
    struct.pack_into(
        "<IIQQ", attr, 0, _SOCKET_FILTER, 2, ctypes.addressof(insns), ctypes.addressof(license_)
    )
    struct.pack_into("16s", attr, 48, name.encode()[:15])
    buf = ctypes.create_string_buffer(bytes(attr), len(attr))
    fd = int(libc.syscall(_NR_BPF.get(platform.machine(), -1), _BPF_PROG_LOAD, buf, len(attr)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf(BPF_PROG_LOAD): {os.strerror(err)}")
    return fd


def bpf_names_listed() -> set[str]:
    """The names of the BPF programs /proc/kallsyms lists now."""
    names = set()
    with open("/proc/kallsyms", "rb") as f:
        for line in f:
            if line.endswith(b"\t[bpf]\n"):
                sym = line.split()[2].decode()
                if sym.startswith("bpf_prog_"):  # bpf_prog_<tag>_<name>
                    names.add(sym.split("_", 3)[-1])
    return names


def wait_freed(*names: str, timeout: float = 30) -> None:
    """Until the programs named *names*, closed by the caller, are freed.

    The kernel frees a closed program from a work queue; it tells perf of the
    unload (PERF_RECORD_KSYMBOL) before it takes the program out of kallsyms,
    so once kallsyms no longer lists it, the unload's record is in the rings."""
    from support.wait import wait_until

    wait_until(
        f"{len(names)} BPF programs freed",
        lambda: not bpf_names_listed() & set(names),
        timeout,
        step=0.02,
    )
