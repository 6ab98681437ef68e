"""The kernel's side-band records about its code, read live: one perf event
per online CPU, each with its mmap'd ring.

Each event is a ``PERF_TYPE_SOFTWARE``/``PERF_COUNT_SW_DUMMY`` event opened
with ``perf_event_open(2)`` for every task (pid -1) on one CPU, asking for
``ksymbol`` and ``bpf_event`` records, the time on CLOCK_MONOTONIC
(``use_clockid``) in a ``sample_id`` trailer (``sample_id_all`` with
``PERF_SAMPLE_TIME``), and a wakeup for every record (``watermark`` of one
byte).  The kernel writes each record only into the ring of the CPU it
happens on (perf_iterate_sb() over the CPU's context), so one event per CPU,
merged by time (:mod:`kreld.kernel.sideband`).

``read_format=PERF_FORMAT_LOST`` (Linux 6.0, commit 119a784c8127) gives the
records lost so far at once, where ``PERF_RECORD_LOST`` waits for the next
record that fits; older kernels refuse it (EINVAL) and are opened without.

A CPU that goes offline takes its events off it for good: perf_event_exit_cpu()
removes them from the CPU's context and leaves them ``OFF``, and when the CPU
comes back nothing turns them on, so side-band records of that CPU stop
coming, silently (seen on 6.1 in the QEMU guest: programs loaded on a CPU
after it went off and on again were never told).  Suspend and resume do the
same to every CPU but the first.  An ``OFF`` event's enabled time stands
still (``PERF_FORMAT_TOTAL_TIME_ENABLED``), which is how :meth:`SidebandRings.reopen`
finds such a ring; the caller opens a new one once the CPU is online.

Who may open it: root at every ``perf_event_paranoid``; CAP_PERFMON (or
CAP_SYS_ADMIN) at 2 and below; only CAP_SYS_ADMIN at Debian's 3.  A refusal
is a :class:`~kreld.core.errors.KernelReadError` naming the errno and the
paranoid level.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
from collections.abc import Iterable

from kreld.core import consts
from kreld.core.errors import KernelReadError
from kreld.core.record import record
from kreld.kernel.info import Root
from kreld.kernel.sideband import IdLayout, Parsed, parse_records

__all__ = [
    "ONLINE_CPUS",
    "SIDEBAND",
    "EventSpec",
    "PerfRing",
    "SidebandRings",
    "online_cpus",
    "parse_cpu_list",
    "tracepoint_spec",
]

ONLINE_CPUS = "sys/devices/system/cpu/online"
_NR_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241, "riscv64": 241, "ppc64le": 319}
_PAGE = mmap.PAGESIZE
_PERF_TYPE_SOFTWARE = 1
_PERF_TYPE_TRACEPOINT = 2
_PERF_COUNT_SW_DUMMY = 9
_PERF_SAMPLE_TIME = 1 << 2
_PERF_SAMPLE_RAW = 1 << 10
_PERF_FORMAT_TOTAL_TIME_ENABLED = 1 << 0
_PERF_FORMAT_LOST = 1 << 4
_PERF_FLAG_FD_CLOEXEC = 1 << 3
# perf_event_attr's flag bits (include/uapi/linux/perf_event.h).
_WATERMARK, _SAMPLE_ID_ALL, _USE_CLOCKID, _KSYMBOL, _BPF_EVENT = 14, 18, 25, 29, 30
_ATTR_SIZE = 112  # PERF_ATTR_SIZE_VER5: every field kreld sets (clockid is at 92)
_U64 = struct.Struct("<Q")
# struct perf_event_mmap_page: data_head, data_tail, data_offset, data_size.
_HEAD, _TAIL, _DATA_OFFSET, _DATA_SIZE = 1024, 1032, 1040, 1048
_MAX_CPU_LIST = 4096  # bytes of sys/devices/system/cpu/online read
_MAX_CPUS = 8192  # CONFIG_NR_CPUS' largest


def parse_cpu_list(text: str) -> list[int]:
    """``0-3,5`` as the kernel prints CPU lists, bounded by :data:`_MAX_CPUS`."""
    out: set[int] = set()
    for part in text.strip().split(",")[:_MAX_CPUS]:
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if not 0 <= first <= last < _MAX_CPUS:
            raise ValueError(f"not a CPU range: {part!r}")
        out.update(range(first, last + 1))
    return sorted(out)


def online_cpus(root: Root) -> list[int]:
    try:
        raw = root.read_bytes(ONLINE_CPUS)[:_MAX_CPU_LIST]
        return parse_cpu_list(raw.decode("ascii", "replace"))
    except ValueError as e:
        raise KernelReadError(ONLINE_CPUS, str(e)) from e


@record
class EventSpec:
    """What each CPU's event counts and writes: perf_event_attr's type, config,
    sample period and type, and flag bits (every record on CLOCK_MONOTONIC)."""

    type: int
    config: int
    sample_type: int
    flag_bits: tuple[int, ...]
    sample_period: int = 0


# The side-band records about kernel code, with their time in a sample_id trailer.
SIDEBAND = EventSpec(
    _PERF_TYPE_SOFTWARE,
    _PERF_COUNT_SW_DUMMY,
    _PERF_SAMPLE_TIME,
    (_WATERMARK, _SAMPLE_ID_ALL, _USE_CLOCKID, _KSYMBOL, _BPF_EVENT),
)


def tracepoint_spec(tracepoint_id: int) -> EventSpec:
    """A sample of every hit of the tracepoint *tracepoint_id* (its ``id``
    file in tracefs), with its time and the tracepoint's raw record; a
    ``PERF_RECORD_LOST`` carries its time in a sample_id trailer."""
    return EventSpec(
        _PERF_TYPE_TRACEPOINT,
        tracepoint_id,
        _PERF_SAMPLE_TIME | _PERF_SAMPLE_RAW,
        (_WATERMARK, _SAMPLE_ID_ALL, _USE_CLOCKID),
        sample_period=1,
    )


def _attr(spec: EventSpec, lost: bool) -> ctypes.Array[ctypes.c_char]:
    buf = bytearray(_ATTR_SIZE)
    read_format = _PERF_FORMAT_TOTAL_TIME_ENABLED | (_PERF_FORMAT_LOST if lost else 0)
    struct.pack_into(
        "<IIQQQQ",
        buf,
        0,
        spec.type,
        _ATTR_SIZE,
        spec.config,
        spec.sample_period,
        spec.sample_type,
        read_format,
    )
    flags = sum(1 << b for b in spec.flag_bits)
    struct.pack_into("<QI", buf, 40, flags, 1)  # flags, wakeup_watermark: 1 byte
    struct.pack_into("<i", buf, 92, 1)  # clockid: CLOCK_MONOTONIC
    return ctypes.create_string_buffer(bytes(buf), _ATTR_SIZE)


class PerfRing:
    """One CPU's event and ring; :meth:`drain` parses what the kernel wrote."""

    def __init__(self, fd: int, cpu: int, pages: int, counts_lost: bool) -> None:
        self.fd, self.cpu, self.counts_lost = fd, cpu, counts_lost
        try:
            self.map = mmap.mmap(fd, (1 + pages) * _PAGE)
        except OSError:
            os.close(fd)
            raise
        offset, size = (int(x) for x in struct.unpack_from("<QQ", self.map, _DATA_OFFSET))
        # data_offset and data_size since Linux 4.1; before, the data follows the first page.
        self.offset, self.size = (offset, size) if size else (_PAGE, pages * _PAGE)
        self.tail = int(_U64.unpack_from(self.map, _TAIL)[0])
        self.enabled, _ = self.counts()  # the event's enabled time at the last look

    def drain(self, layout: IdLayout | None = None) -> Parsed:
        """Parse the records written since the last drain and give their room back."""
        head = int(_U64.unpack_from(self.map, _HEAD)[0])
        avail = min(head - self.tail, self.size)
        start = self.tail % self.size
        base = self.offset
        if start + avail <= self.size:
            data = self.map[base + start : base + start + avail]
        else:
            first = self.size - start
            data = self.map[base + start : base + self.size] + self.map[base : base + avail - first]
        parsed = parse_records(data, self.cpu, layout)
        self.tail += parsed.rest
        _U64.pack_into(self.map, _TAIL, self.tail)
        return parsed

    def counts(self) -> tuple[int, int]:
        """The event's enabled time (ns) and the records lost so far (0 where
        the kernel cannot count them): value, time_enabled[, lost]."""
        raw = os.read(self.fd, 24 if self.counts_lost else 16)
        enabled = int(_U64.unpack_from(raw, 8)[0]) if len(raw) >= 16 else 0
        lost = int(_U64.unpack_from(raw, 16)[0]) if len(raw) >= 24 else 0
        return enabled, lost

    def lost(self) -> int:
        """Records lost so far (0 where the kernel cannot count them)."""
        return self.counts()[1] if self.counts_lost else 0

    def stopped(self) -> bool:
        """Whether the event stopped since the last call (its enabled time stood
        still: the kernel turned it off, as when its CPU went offline)."""
        enabled, _ = self.counts()
        still, self.enabled = enabled == self.enabled, enabled
        return still

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class _Offline(Exception):
    """perf_event_open said ENODEV: the CPU is offline."""


def _open(cpu: int, lost: bool, spec: EventSpec) -> int:
    nr = _NR_PERF_EVENT_OPEN.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"perf_event_open: no syscall number for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    attr = _attr(spec, lost)
    fd = int(libc.syscall(nr, attr, -1, cpu, -1, _PERF_FLAG_FD_CLOEXEC))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


class SidebandRings:
    """The rings of every online CPU (CPUs coming online are added by :meth:`add_online`),
    one event of *spec* on each (the side-band records about kernel code by default)."""

    def __init__(
        self, root: Root, pages: int = consts.KERNEL_CODE_RING_PAGES, spec: EventSpec = SIDEBAND
    ) -> None:
        self.root = root
        self.pages = pages
        self.spec = spec
        self.rings: dict[int, PerfRing] = {}
        self.counts_lost = True
        self.add_online()

    def add_online(self, online: list[int] | None = None) -> list[int]:
        """Open the CPUs online now (*online*, else read) that have no ring; returns them."""
        added = []
        for cpu in online if online is not None else online_cpus(self.root):
            if cpu not in self.rings:
                try:
                    self.rings[cpu] = self._ring(cpu)
                except _Offline:  # gone offline since the list was read: opened once back
                    continue
                added.append(cpu)
        return added

    def reopen(self) -> tuple[list[int], list[int]]:
        """Close the rings whose events stopped since the last call (their CPU
        went offline, even if it is back) and those of CPUs offline now, then
        open one for each online CPU without a ring: (closed, opened) CPUs."""
        online = online_cpus(self.root)
        up = set(online)
        dead = [cpu for cpu, r in self.rings.items() if cpu not in up or r.stopped()]
        for cpu in dead:
            self.rings.pop(cpu).close()
        return dead, self.add_online(online)

    def _ring(self, cpu: int) -> PerfRing:
        try:
            try:
                fd = _open(cpu, self.counts_lost, self.spec)
            except OSError as e:
                if e.errno != errno.EINVAL or not self.counts_lost:
                    raise
                self.counts_lost = False  # before Linux 6.0: no PERF_FORMAT_LOST
                fd = _open(cpu, False, self.spec)
            return PerfRing(fd, cpu, self.pages, self.counts_lost)
        except OSError as e:
            if e.errno == errno.ENODEV and self.rings:
                raise _Offline from e
            self.close()
            raise KernelReadError("perf_event_open", self._why(e)) from e

    def _why(self, e: OSError) -> str:
        name = errno.errorcode.get(e.errno or 0, str(e.errno))
        try:
            paranoid = self.root.read_text(consts.PERF_EVENT_PARANOID)
        except KernelReadError:
            paranoid = "unreadable"
        hint = ""
        if e.errno in (errno.EACCES, errno.EPERM):
            hint = " (needs CAP_PERFMON, or CAP_SYS_ADMIN at paranoid 3 and above)"
        return f"{name}: {e.strerror}; perf_event_paranoid={paranoid}{hint}"

    def fds(self) -> Iterable[int]:
        return [r.fd for r in self.rings.values()]

    def close(self) -> None:
        for r in self.rings.values():
            r.close()
        self.rings.clear()
