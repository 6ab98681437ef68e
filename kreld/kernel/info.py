"""Readers of the running kernel's own interfaces, all under ``--root``.

Each function reads one interface and returns plain values; nothing here
keeps state.  Missing files raise :class:`KernelReadError`; restricted
pointers (zeros) come back as ``None``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from kreld.core import consts, uuids
from kreld.core.errors import KernelReadError, NoteError
from kreld.core.model import Anchors
from kreld.core.record import record
from kreld.kernel.files import hex_address, read_bounded
from kreld.kernel.notes import find_build_id

__all__ = [
    "SYSFS_MAGIC",
    "Root",
    "bpf_programs_listed",
    "has_cap_syslog",
    "on_sysfs",
    "read_anchors",
    "read_boot_id",
    "read_int_sysctl",
    "read_kernel_build_id",
    "read_release",
    "read_version",
    "restriction_reason",
    "scan_kallsyms_anchors",
    "set_thread_name",
]


@record
class Root:
    """A filesystem root under which kernel interfaces are read."""

    path: Path

    def __truediv__(self, rel: object) -> Path:
        return self.path / str(rel)

    def read_bytes(self, rel: object, limit: int = consts.MAX_SMALL_FILE) -> bytes:
        """The file at *rel*, at most *limit* bytes of it (a named error past it)."""
        return read_bounded(self / rel, limit)

    def read_text(self, rel: object) -> str:
        return self.read_bytes(rel).decode("utf-8", "replace").strip()


def read_boot_id(root: Root) -> str:
    raw = root.read_text(consts.BOOT_ID)
    try:
        return uuids.canonical(raw)
    except ValueError as e:
        raise KernelReadError(str(root / consts.BOOT_ID), f"not a UUID: {raw[:64]!r}") from e


def read_release(root: Root) -> str:
    return root.read_text(consts.OSRELEASE)


def read_version(root: Root) -> str:
    return root.read_text(consts.KVERSION)


def read_int_sysctl(root: Root, rel: object) -> int | None:
    try:
        return int(root.read_text(rel))
    except (KernelReadError, ValueError):
        return None


def read_kernel_build_id(root: Root) -> str | None:
    """Build-id from the GNU note in ``/sys/kernel/notes``; ``None`` if it has none."""
    data = root.read_bytes(consts.KERNEL_NOTES, consts.MAX_KERNEL_NOTES)
    try:
        return find_build_id(data)
    except NoteError as e:
        raise KernelReadError(str(root / consts.KERNEL_NOTES), str(e)) from e


def scan_kallsyms_anchors(data: bytes) -> dict[str, int]:
    """Addresses of the anchor symbols in kallsyms text (first occurrence each).

    Searching for ``" NAME\\n"`` finds core-kernel symbols only: module
    symbols end in ``\\t[module]``.  A zero address is left out (restricted).
    """
    found: dict[str, int] = {}
    for name in consts.ANCHOR_SYMBOLS:
        needle = b" " + name.encode() + b"\n"
        pos = data.find(needle)
        if pos < 0 and data.endswith(needle[:-1]):
            pos = len(data) - len(needle) + 1
        if pos < 0:
            continue
        start = data.rfind(b"\n", 0, pos) + 1
        fields = data[start:pos].split()
        if len(fields) != 2:
            continue
        try:
            addr = hex_address(fields[0])
        except ValueError:
            continue  # not an address the kernel can have: no anchor rather than a wrong one
        if addr:
            found[name] = addr
    return found


def read_anchors(root: Root, data: bytes | None = None) -> tuple[Anchors, bool]:
    """The anchors, and whether kallsyms showed zeros where addresses belong
    (from *data*, a read of kallsyms already made, if given)."""
    if data is None:
        data = root.read_bytes(consts.KALLSYMS, consts.MAX_KALLSYMS)
    anchors = Anchors.from_symbols(scan_kallsyms_anchors(data))
    # Zeros throughout: the first field of the first line is all zeros.
    first = data.split(b" ", 1)[0]
    zeroed = bool(first) and not first.strip(b"0")
    return anchors, zeroed and not anchors.known()


def has_cap_syslog() -> bool:
    """Whether this process has CAP_SYSLOG in its effective set (real /proc)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"CapEff:"):
                    return bool(int(line.split()[1], 16) >> consts.CAP_SYSLOG & 1)
    except (OSError, ValueError, IndexError):
        pass
    return os.geteuid() == 0


def restriction_reason(kptr_restrict: int | None, perf_paranoid: int | None, cap: bool) -> str:
    """Why the kernel shows zeros, following ``kallsyms_show_value()``."""
    if kptr_restrict is not None and kptr_restrict >= 2:
        return f"kernel.kptr_restrict={kptr_restrict} hides kernel pointers from every reader"
    if not cap:
        return (
            f"kernel.kptr_restrict={kptr_restrict}, kernel.perf_event_paranoid={perf_paranoid} "
            "and the process lacks CAP_SYSLOG"
        )
    return f"kernel.kptr_restrict={kptr_restrict}: the kernel showed zero addresses"


_JIT_KALLSYMS = "proc/sys/net/core/bpf_jit_kallsyms"
_JIT_HARDEN = "proc/sys/net/core/bpf_jit_harden"


def bpf_programs_listed(root: Root) -> bool:
    """Whether kallsyms lists BPF programs: ``bpf_jit_kallsyms=1`` and
    ``bpf_jit_harden=0`` (kernel/bpf/core.c, bpf_prog_kallsyms_candidate())."""
    try:
        return root.read_text(_JIT_KALLSYMS) == "1" and root.read_text(_JIT_HARDEN) == "0"
    except KernelReadError:
        return False


def set_thread_name(name: str) -> None:
    """The OS name of the calling thread (``top -H``, /proc/PID/task/TID/comm):
    prctl(PR_SET_NAME), at most 15 bytes; where it fails, the thread keeps its name."""
    import ctypes  # loaded at start anyway (kreld.core.heap)

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)


SYSFS_MAGIC = 0x62656572  # statfs(2)'s f_type of sysfs (include/uapi/linux/magic.h)


def on_sysfs(path: str) -> bool:
    """Whether *path* lies on sysfs (where inotify sees nothing); where statfs(2)
    fails, True: the caller then polls, which works everywhere."""
    import ctypes  # ctypes.util's find_library would run ldconfig in a subprocess:
    # the process's own symbols have statfs.

    class Statfs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 120)]

    libc = ctypes.CDLL(None, use_errno=True)
    buf = Statfs()
    if libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        return True
    return bool((buf.f_type & 0xFFFFFFFF) == SYSFS_MAGIC)
