"""Module loads and frees, as the kernel's module tracepoints report them.

``module:module_load`` fires in load_module() once the module's sysfs
entries exist and before its init runs (kernel/module/main.c:
``trace_module_load(mod)`` right before ``do_init_module()``);
``module:module_free`` fires in free_module() as the module is freed
(include/trace/events/module.h).
So a load's time is exact and taken before any of its init code ran, and
its sections can be read at once.

One ``PERF_TYPE_TRACEPOINT`` event per tracepoint and online CPU, each with
its ring (:class:`~kreld.kernel.perfring.SidebandRings` with a tracepoint's
:func:`~kreld.kernel.perfring.tracepoint_spec`): a tracepoint writes its
sample only into the ring of the CPU it fires on.  Each sample carries its
time (on CLOCK_MONOTONIC: ``use_clockid``) and the tracepoint's raw record,
read here with the event's own ``format`` file from tracefs (the field
offsets are the kernel's to choose: read, not assumed).  ``name`` is a
``__data_loc char[]``: a 32-bit word whose low half is the string's offset in
the record and whose high half its length, NUL included.

tracefs must be mounted (``/sys/kernel/tracing``, or under debugfs at
``/sys/kernel/debug/tracing``); opening a CPU-wide tracepoint needs root at
every ``perf_event_paranoid``, else CAP_PERFMON (CAP_SYS_ADMIN at Debian's 3).
Every refusal is a :class:`~kreld.core.errors.KernelReadError` saying why.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Mapping
from enum import StrEnum

from kreld.core.errors import KernelReadError
from kreld.core.record import record
from kreld.kernel.info import Root
from kreld.kernel.perfring import SidebandRings, tracepoint_spec
from kreld.kernel.sideband import Lost, RawSample, merge_by_time

__all__ = [
    "MODULE_NAME_MAX",
    "TRACEFS",
    "Drained",
    "Field",
    "ModuleTrace",
    "ModuleTraceRings",
    "TraceEvent",
    "TraceFormat",
    "decode",
    "find_tracepoint",
    "parse_format",
]

# Where tracefs is mounted, in order (debugfs' tracing directory before 4.1).
TRACEFS = ("sys/kernel/tracing", "sys/kernel/debug/tracing")
MODULE_NAME_MAX = 56  # MODULE_NAME_LEN: 64 - sizeof(unsigned long)
RING_PAGES = 2  # a record is ~64 bytes: 128 loads or frees per CPU between two drains
_MAX_FORMAT = 16 << 10  # bytes of a format file read (module_load's is under 1 KiB)
_MAX_ID = 32  # bytes of an id file read
_MAX_FIELDS = 64
_FIELD = re.compile(
    r"^\s*field:(?P<decl>[^;]{1,256});\s*offset:(?P<off>\d{1,6});\s*size:(?P<size>\d{1,6});"
)
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")


class TraceEvent(StrEnum):
    LOAD = "module_load"
    FREE = "module_free"


@record
class Field:
    offset: int
    size: int
    data_loc: bool  # a __data_loc: offset and length of the value in the record


@record
class TraceFormat:
    """A tracepoint's id and the fields of its raw record, by name."""

    id: int
    fields: Mapping[str, Field]


@record
class ModuleTrace:
    """A module load or free, at *time* on CLOCK_MONOTONIC."""

    time: int
    cpu: int
    event: TraceEvent
    name: str
    taints: int | None


def parse_format(tp_id: int, text: str) -> TraceFormat:
    """The fields of a tracepoint's ``format`` file (bounded); ValueError when
    it has no ``common_type`` or ``name`` field."""
    fields: dict[str, Field] = {}
    for line in text[:_MAX_FORMAT].splitlines():
        m = _FIELD.match(line)
        if m is None:
            continue
        decl = m["decl"].strip()
        name = re.sub(r"\[.*\]$", "", decl.split()[-1]) if decl.split() else ""
        fields[name] = Field(int(m["off"]), int(m["size"]), decl.startswith("__data_loc"))
        if len(fields) >= _MAX_FIELDS:
            break
    common = fields.get("common_type")
    name_field = fields.get("name")
    if common is None or common.size != 2:
        raise ValueError("no 2-byte common_type field")
    if name_field is None or not name_field.data_loc or name_field.size != 4:
        raise ValueError("no __data_loc name field")
    return TraceFormat(tp_id, fields)


def find_tracepoint(root: Root, event: TraceEvent) -> TraceFormat:
    """The id and format of ``module:<event>`` in the first tracefs that has it."""
    tried = []
    for base in TRACEFS:
        rel = f"{base}/events/module/{event.value}"
        try:
            raw_id = root.read_bytes(f"{rel}/id")[:_MAX_ID]
        except KernelReadError as e:
            tried.append(f"{root / rel}: {e.reason}")
            continue
        text = root.read_bytes(f"{rel}/format")[:_MAX_FORMAT].decode("utf-8", "replace")
        try:
            return parse_format(int(raw_id.strip() or b"x"), text)
        except ValueError as e:
            raise KernelReadError(str(root / rel), f"not a module tracepoint: {e}") from e
    raise KernelReadError(
        f"module:{event.value}", "no tracefs with it (is tracefs mounted?): " + "; ".join(tried)
    )


def decode(
    sample: RawSample, formats: Mapping[int, tuple[TraceEvent, TraceFormat]]
) -> ModuleTrace | None:
    """The load or free in *sample*; None when its record is of another
    tracepoint or does not hold together (every offset checked against it)."""
    raw = sample.raw
    if len(raw) < _U16.size:
        return None
    (common_type,) = _U16.unpack_from(raw, 0)
    known = formats.get(common_type)
    if known is None:
        return None
    event, fmt = known
    loc = fmt.fields["name"]
    if loc.offset + loc.size > len(raw):
        return None
    (word,) = _U32.unpack_from(raw, loc.offset)
    start, length = word & 0xFFFF, word >> 16
    if length > MODULE_NAME_MAX + 1 or start + length > len(raw):
        return None
    name = raw[start : start + length].split(b"\0", 1)[0].decode("utf-8", "replace")
    if not name or "/" in name:
        return None
    taints = None
    tf = fmt.fields.get("taints")
    if tf is not None and tf.size == 4 and tf.offset + 4 <= len(raw):
        taints = int(_U32.unpack_from(raw, tf.offset)[0])
    return ModuleTrace(sample.time, sample.cpu, event, name, taints)


@record
class Drained:
    """What one drain of every ring gave: the loads and frees in time order, and
    whether any record was lost since the last drain (a ring overflowed)."""

    traces: list[ModuleTrace]
    lost: int
    skipped: int


class ModuleTraceRings:
    """The rings of both module tracepoints on every online CPU."""

    def __init__(self, root: Root, pages: int = RING_PAGES) -> None:
        self.root = root
        self.formats: dict[int, tuple[TraceEvent, TraceFormat]] = {}
        self.rings: list[SidebandRings] = []
        specs = [(ev, find_tracepoint(root, ev)) for ev in TraceEvent]
        try:
            for ev, fmt in specs:
                self.formats[fmt.id] = (ev, fmt)
                self.rings.append(SidebandRings(root, pages, tracepoint_spec(fmt.id)))
        except KernelReadError:
            self.close()
            raise
        self._counted: dict[tuple[int, int], int] = {}

    def drain(self) -> Drained:
        """Every ring's records: lost counts read first (see the kernel-code
        follower: a record written before a counted loss is in its ring now)."""
        lost = 0
        streams = []
        skipped = 0
        for k, rings in enumerate(self.rings):
            for cpu, ring in rings.rings.items():
                total = ring.lost()
                lost += max(0, total - self._counted.get((k, cpu), 0))
                self._counted[(k, cpu)] = total
                parsed = ring.drain()
                skipped += parsed.skipped
                streams.append(parsed.records)
        traces = []
        lost_records = 0
        for r in merge_by_time(streams):
            if isinstance(r, RawSample):
                t = decode(r, self.formats)
                if t is None:
                    skipped += 1
                else:
                    traces.append(t)
            elif isinstance(r, Lost):
                lost_records += r.lost
        return Drained(traces, max(lost, lost_records), skipped)

    def reopen(self) -> bool:
        """Reopen the rings of CPUs that went offline and open those of CPUs come
        online; True when any changed (their records meanwhile are lost)."""
        changed = False
        for k, rings in enumerate(self.rings):
            closed, opened = rings.reopen()
            for cpu in [*closed, *opened]:
                self._counted.pop((k, cpu), None)
            changed = changed or bool(closed or opened)
        return changed

    def fds(self) -> Iterable[int]:
        return [fd for rings in self.rings for fd in rings.fds()]

    def cpus(self) -> int:
        return min((len(r.rings) for r in self.rings), default=0)

    def close(self) -> None:
        for rings in self.rings:
            rings.close()
        self.rings.clear()
