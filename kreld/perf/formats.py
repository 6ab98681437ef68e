"""The perf.data formats kreld reads: record and feature types, and the facts
they carry about the kernel a recording was made on, gathered by
:class:`_Collector` from bytes already read (no I/O here).  Read with
:func:`kreld.perf.reader.read_perf_header`; the layout follows
tools/perf/Documentation/perf.data-file-format.txt and tools/perf/util/header.c.
"""

from __future__ import annotations

import struct
from enum import IntEnum

from kreld.core.errors import PerfDataError, PerfDataTooLarge
from kreld.core.record import field, record

__all__ = [
    "KERNEL_MAP_PREFIX",
    "MAX_BUILD_IDS",
    "MAX_MODULE_MAPS",
    "MISC_BUILD_ID_SIZE",
    "MISC_KERNEL",
    "USER_TYPES",
    "BuildIdEntry",
    "ClockData",
    "ClockId",
    "Feature",
    "ModuleMap",
    "PerfHeader",
    "RecordType",
    "module_name",
]

_MAGIC = b"PERFILE2"
_FILE_HEADER_SIZE = 104  # magic, size, attr_size, 3 sections, 256 feature bits
_PIPE_HEADER_SIZE = 16  # magic, size
_ATTR_CLOCKID_OFFSET = 92  # perf_event_attr.clockid (s32)
_ATTR_FLAGS_OFFSET = 40
_ATTR_USE_CLOCKID = 1 << 25
_ATTR_MIN_SIZE = 96  # PERF_ATTR_SIZE_VER1 (clockid came with it)
_HOST_PID = 0xFFFFFFFF  # pid -1: the kernel's own maps (HOST_KERNEL_ID)
KERNEL_MAP_PREFIX = "[kernel.kallsyms]"
# perf writes one map per module of /proc/modules.  Linux has no fixed limit,
# but its module area is bounded (1 GiB on x86-64) and the Debian cloud kernel
# here ships 1,121 modules in all: more maps than this is not a recording.
MAX_MODULE_MAPS = 16_384
# Build-id entries (the feature, and pipe mode's HEADER_BUILD_ID records): one
# per image that had samples, or with --buildid-all per image mapped.
MAX_BUILD_IDS = 65_536


class Feature(IntEnum):
    """Feature bits of the header (``HEADER_*`` in tools/perf/util/header.h)."""

    BUILD_ID = 2
    HOSTNAME = 3
    OSRELEASE = 4
    SAMPLE_TIME = 21
    CLOCKID = 23
    COMPRESSED = 27
    CLOCK_DATA = 29


_FEATURES = frozenset(int(f) for f in Feature)


class RecordType(IntEnum):
    """``PERF_RECORD_*`` types read here (kernel ones, then perf's own from 64)."""

    MMAP = 1
    COMM = 3
    SAMPLE = 9
    MMAP2 = 10
    KSYMBOL = 17
    HEADER_ATTR = 64
    HEADER_TRACING_DATA = 66
    HEADER_BUILD_ID = 67
    AUXTRACE = 71
    HEADER_FEATURE = 80
    COMPRESSED = 81
    FINISHED_INIT = 82
    COMPRESSED2 = 83


class ClockId(IntEnum):
    """The clocks ``perf record -k`` takes (``clockid_t`` values)."""

    REALTIME = 0
    MONOTONIC = 1
    MONOTONIC_RAW = 4
    BOOTTIME = 7
    TAI = 11


_MISC_CPUMODE_MASK = 0x7
MISC_KERNEL = 1
_MISC_MMAP_BUILD_ID = 1 << 14  # MMAP2 carries a build-id instead of a device
MISC_BUILD_ID_SIZE = 1 << 15  # a build-id event says its build-id's size
# Record types from here on are perf's own (HEADER_ATTR on), and carry no time.
USER_TYPES = 64


@record
class BuildIdEntry:
    """One entry of the build-id table."""

    name: str  # "[kernel.kallsyms]", a module as "[name]" or its .ko path, or a file
    build_id: str
    kernel: bool  # recorded in kernel mode (the kernel and its modules)

    @property
    def module(self) -> str | None:
        return None if not self.kernel or self.name == KERNEL_MAP_PREFIX else module_name(self.name)


@record
class ModuleMap:
    """A module as ``/proc/modules`` showed it when recording started."""

    name: str  # as the kernel names it ("nf_tables", never "nf-tables")
    filename: str  # what perf wrote: "[name]" or the .ko path it found
    start: int
    length: int
    build_id: str | None = None  # MMAP2 with a build-id (perf >= 6.17)


@record
class ClockData:
    """``HEADER_CLOCK_DATA``: the sample clock, and one instant read on it and on
    CLOCK_REALTIME when recording started."""

    clockid: int
    realtime_ns: int
    clock_ns: int


@record
class PerfHeader:
    """What one recording says about its kernel."""

    path: str
    pipe: bool
    compressed: bool
    kernel_build_id: str | None
    text: int | None  # runtime _text at record start (pgoff of the kernel map)
    modules: tuple[ModuleMap, ...]
    build_ids: tuple[BuildIdEntry, ...]
    hostname: str | None
    osrelease: str | None
    sample_time: tuple[int, int] | None  # first and last sample, on the sample clock
    clockid: int | None  # set by perf record -k; None: perf_clock() (local_clock())
    clock_data: ClockData | None
    bytes_read: int  # of the file, to show the scan stayed in its prefix
    file_size: int | None = field(default=None)
    # The symbol the kernel map is relative to: "_text", or "_stext" where the
    # kernel has no _text (perf's ref_reloc_sym_names); ``text`` is its address.
    ref_symbol: str = "_text"
    # The bound that ended the scan before perf's synthesized records were seen
    # to end ("records", "bytes"); None when they were.
    scan_limit: str | None = None

    def module_build_id(self, name: str) -> str | None:
        for m in self.modules:
            if m.name == name and m.build_id:
                return m.build_id
        for e in self.build_ids:
            if e.module == name:
                return e.build_id
        return None


def module_name(filename: str) -> str:
    """The kernel's name of a module from perf's map name: ``[nf_tables]`` or
    ``/lib/modules/R/kernel/net/netfilter/nf_tables.ko.xz``."""
    if filename.startswith("[") and filename.endswith("]"):
        return filename[1:-1]
    base = filename.rsplit("/", 1)[-1]
    base = base.split(".ko", 1)[0]
    return base.replace("-", "_")


def _is_module_map(filename: str) -> bool:
    """Module maps are ``[name]`` or a .ko path; other kernel maps perf makes
    (x86's entry trampolines, ``[kernel.kallsyms]`` itself) are neither."""
    if filename.startswith(KERNEL_MAP_PREFIX):
        return False
    if filename.startswith("[") and filename.endswith("]"):
        return True
    return ".ko" in filename.rsplit("/", 1)[-1]


def _cstr(data: bytes) -> str:
    return data.split(b"\0", 1)[0].decode("utf-8", "replace")


class _Collector:
    """Gathers the facts as records and features are met (one per file)."""

    def __init__(self, path: str, endian: str) -> None:
        self.path = path
        self.e = endian
        self.build_ids: list[BuildIdEntry] = []
        self.modules: list[ModuleMap] = []
        self.text: int | None = None
        self.kernel_build_id: str | None = None
        self.kernel_map_seen = False
        self.ref_symbol = "_text"
        self.hostname: str | None = None
        self.osrelease: str | None = None
        self.sample_time: tuple[int, int] | None = None
        self.clockid: int | None = None
        self.clock_data: ClockData | None = None
        self.compressed = False

    def error(self, reason: str, offset: int | None = None) -> PerfDataError:
        return PerfDataError(self.path, reason, offset)

    # -- features ----------------------------------------------------------------

    def feature(self, feat: int, data: bytes, offset: int) -> None:
        e = self.e
        if feat == Feature.BUILD_ID:
            self.build_id_events(data, offset)
        elif feat in (Feature.HOSTNAME, Feature.OSRELEASE):
            if len(data) < 4:
                raise self.error(f"feature {Feature(feat).name} truncated", offset)
            (n,) = struct.unpack_from(e + "I", data, 0)
            if n > len(data) - 4:
                raise self.error(f"feature {Feature(feat).name}: string overruns it", offset)
            text = _cstr(data[4 : 4 + n])
            if feat == Feature.HOSTNAME:
                self.hostname = text
            else:
                self.osrelease = text
        elif feat == Feature.SAMPLE_TIME:
            if len(data) < 16:
                raise self.error("feature SAMPLE_TIME truncated", offset)
            first, last = struct.unpack_from(e + "QQ", data, 0)
            # zeros: perf did not process the samples (pipe mode, perf record -z)
            self.sample_time = (first, last) if last else None
        elif feat == Feature.CLOCK_DATA:
            if len(data) < 24:
                raise self.error("feature CLOCK_DATA truncated", offset)
            _version, clockid, tod, ref = struct.unpack_from(e + "IIQQ", data, 0)
            self.clock_data = ClockData(clockid, tod, ref)
            self.clockid = clockid
        elif feat == Feature.COMPRESSED:
            self.compressed = True

    def build_id_events(self, data: bytes, offset: int) -> None:
        """A sequence of ``struct build_id_event`` (header, pid, 24 bytes, name)."""
        pos = 0
        while pos + 8 <= len(data):
            _type, misc, size = struct.unpack_from(self.e + "IHH", data, pos)
            if size < 36 or pos + size > len(data):
                raise self.error(f"build-id entry of size {size}", offset + pos)
            self.build_id_event(data[pos : pos + size], misc)
            pos += size

    def build_id_event(self, rec: bytes, misc: int) -> None:
        raw = rec[12:36]
        n = raw[20] if misc & MISC_BUILD_ID_SIZE else 20
        if n > 20:
            raise self.error(f"build-id of {n} bytes")
        entry = BuildIdEntry(
            _cstr(rec[36:]), raw[:n].hex(), misc & _MISC_CPUMODE_MASK == MISC_KERNEL
        )
        if len(self.build_ids) >= MAX_BUILD_IDS:
            raise PerfDataTooLarge(self.path, "build-id entries", MAX_BUILD_IDS)
        self.build_ids.append(entry)
        if entry.kernel and entry.name == KERNEL_MAP_PREFIX and self.kernel_build_id is None:
            self.kernel_build_id = entry.build_id

    def attr(self, data: bytes) -> None:
        """One ``perf_event_attr``: its clock, when ``use_clockid`` is set."""
        if len(data) < _ATTR_MIN_SIZE:
            return
        (flags,) = struct.unpack_from(self.e + "Q", data, _ATTR_FLAGS_OFFSET)
        if flags & _ATTR_USE_CLOCKID and self.clockid is None:
            (self.clockid,) = struct.unpack_from(self.e + "i", data, _ATTR_CLOCKID_OFFSET)

    # -- records -----------------------------------------------------------------

    def mmap(self, rtype: int, misc: int, rec: bytes, offset: int) -> None:
        fixed = 40 if rtype == RecordType.MMAP else 72
        if len(rec) < fixed:
            raise self.error(f"{RecordType(rtype).name} record of {len(rec)} bytes", offset)
        pid, _tid, start, length, pgoff = struct.unpack_from(self.e + "IIQQQ", rec, 8)
        if pid != _HOST_PID or misc & _MISC_CPUMODE_MASK != MISC_KERNEL:
            return
        build_id = None
        if rtype == RecordType.MMAP2 and misc & _MISC_MMAP_BUILD_ID:
            n = rec[40]
            if n > 20:
                raise self.error(f"MMAP2 build-id of {n} bytes", offset)
            build_id = rec[44 : 44 + n].hex()
        name = _cstr(rec[fixed:])
        if name.startswith(KERNEL_MAP_PREFIX):
            if not self.kernel_map_seen:
                self.kernel_map_seen = True
                # pgoff 0: kallsyms was restricted when perf read it
                self.text = pgoff or None
                self.ref_symbol = name[len(KERNEL_MAP_PREFIX) :] or "_text"
                if build_id and self.kernel_build_id is None:
                    self.kernel_build_id = build_id
        elif _is_module_map(name):
            if len(self.modules) >= MAX_MODULE_MAPS:
                raise PerfDataTooLarge(self.path, "module maps", MAX_MODULE_MAPS, offset)
            self.modules.append(ModuleMap(module_name(name), name, start, length, build_id))

    def header(
        self, path: str, pipe: bool, bytes_read: int, size: int | None, limit: str | None
    ) -> PerfHeader:
        return PerfHeader(
            path=path,
            pipe=pipe,
            compressed=self.compressed,
            kernel_build_id=self.kernel_build_id,
            text=self.text,
            modules=tuple(self.modules),
            build_ids=tuple(self.build_ids),
            hostname=self.hostname,
            osrelease=self.osrelease,
            sample_time=self.sample_time,
            clockid=self.clockid,
            clock_data=self.clock_data,
            bytes_read=bytes_read,
            file_size=size,
            ref_symbol=self.ref_symbol,
            scan_limit=limit,
        )
