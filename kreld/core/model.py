"""The data model: plain frozen records, no I/O.

Addresses are Python ints internally; :func:`hexaddr` renders them as the
``"0x..."`` strings that travel in JSON (most JSON readers lose precision
past 2**53).  ``None`` always means *unknown or restricted*, never zero.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from kreld.core.consts import ANCHOR_SYMBOLS
from kreld.core.record import record

__all__ = [
    "BOOT_START",
    "JSON",
    "WIRE_ANCHORS",
    "AddressSource",
    "Anchors",
    "BootSnapshot",
    "BootSymbols",
    "Clock",
    "HintAction",
    "Incarnation",
    "KaslrOffset",
    "ModuleEvent",
    "ModuleState",
    "OffsetSource",
    "SeenBy",
    "Timestamp",
    "clock_now",
    "hexaddr",
    "merge_boot",
    "parse_addr",
]

JSON = dict[str, Any]


def hexaddr(value: int | None) -> str | None:
    return None if value is None else f"{value:#x}"


def parse_addr(text: str) -> int:
    """Parse an address as users and JSON give it: ``0x``-prefixed or bare hex."""
    value = int(text, 16)  # accepts an optional 0x and surrounding blanks
    if not 0 <= value < 1 << 64 or "_" in text:
        raise ValueError(f"not a 64-bit hex address: {text!r}")
    return value


class Clock(StrEnum):
    MONOTONIC = "monotonic"
    BOOTTIME = "boottime"
    REALTIME = "realtime"


_CLOCK_IDS = {
    Clock.MONOTONIC: time.CLOCK_MONOTONIC,
    Clock.BOOTTIME: time.CLOCK_BOOTTIME,
    Clock.REALTIME: time.CLOCK_REALTIME,
}


@record
class Timestamp:
    """One instant on the three clocks a profiler may have sampled with (ns)."""

    monotonic: int
    boottime: int
    realtime: int

    @classmethod
    def now(cls) -> Timestamp:
        return cls(
            time.clock_gettime_ns(time.CLOCK_MONOTONIC),
            time.clock_gettime_ns(time.CLOCK_BOOTTIME),
            time.clock_gettime_ns(time.CLOCK_REALTIME),
        )

    def on(self, clock: Clock) -> int:
        return int(getattr(self, clock.value))

    def to_json(self) -> JSON:
        return {"monotonic": self.monotonic, "boottime": self.boottime, "realtime": self.realtime}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Timestamp:
        return cls(int(d["monotonic"]), int(d["boottime"]), int(d["realtime"]))


#: The boot's first instant on every clock: "since the boot", where a load
#: happened before kreld looked (or a loss window opens at the start).
BOOT_START = Timestamp(0, 0, 0)


def clock_now(clock: Clock) -> int:
    return time.clock_gettime_ns(_CLOCK_IDS[clock])


class OffsetSource(StrEnum):
    """Where a KASLR offset came from, most authoritative first."""

    VMCOREINFO = "vmcoreinfo"
    VMLINUX = "vmlinux"
    SYSTEM_MAP = "system.map"


class AddressSource(StrEnum):
    """Where a record's runtime addresses came from (``None`` on a record: none
    were seen, the boot or load is restricted)."""

    KALLSYMS = "kallsyms"  # a boot's anchors, as /proc/kallsyms shows them
    SYSFS = "sysfs"  # a module's sections, as /sys/module/<m>/sections shows them
    VMLINUX = "vmlinux"  # a matching vmlinux's anchors, moved by the KASLR offset
    # Kernel memory through /proc/kcore (kptr_restrict=2): a boot's anchors from
    # a System.map checked there and moved by VMCOREINFO's KERNELOFFSET, a
    # module's sections from its struct module, laid out as BTF says.
    KCORE = "kcore"
    # Kernel memory, where no checked System.map or vmlinux is at hand: a
    # boot's anchors from the kernel's own kallsyms tables, decoded there and
    # checked line for line against /proc/kallsyms' names.
    KCORE_KALLSYMS = "kcore-kallsyms"


@record
class KaslrOffset:
    value: int
    source: OffsetSource
    path: str

    def to_json(self) -> JSON:
        return {"value": hexaddr(self.value), "source": self.source.value, "path": self.path}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> KaslrOffset:
        return cls(parse_addr(d["value"]), OffsetSource(d["source"]), str(d["path"]))


# The anchors' names on the wire, in ANCHOR_SYMBOLS order (Anchors' attributes).
WIRE_ANCHORS = tuple(sym.removeprefix("_") for sym in ANCHOR_SYMBOLS)


@record
class Anchors:
    """Runtime addresses of the symbols that mark out the kernel image.

    On the wire each is named as its attribute here: the kernel symbol
    without its leading underscore (``text`` for ``_text``), since a varlink
    field name may not start with one.  :meth:`to_ints` and
    :meth:`from_symbols` speak the kernel's own names.
    """

    text: int | None = None
    stext: int | None = None
    etext: int | None = None
    sinittext: int | None = None
    einittext: int | None = None

    def to_json(self) -> JSON:
        return {wire: hexaddr(v) for wire, v in zip(WIRE_ANCHORS, self._values(), strict=True)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Anchors:
        return cls(*(None if d.get(k) is None else parse_addr(d[k]) for k in WIRE_ANCHORS))

    @classmethod
    def from_symbols(cls, syms: Mapping[str, int]) -> Anchors:
        return cls(*(syms.get(k) for k in ANCHOR_SYMBOLS))

    def known(self) -> dict[str, int]:
        return {k: v for k, v in self.to_ints().items() if v is not None}

    def to_ints(self) -> dict[str, int | None]:
        """By kernel symbol name: ``{"_text": ..., "_stext": ...}``."""
        return dict(zip(ANCHOR_SYMBOLS, self._values(), strict=True))

    def _values(self) -> tuple[int | None, ...]:
        return (self.text, self.stext, self.etext, self.sinittext, self.einittext)


@record
class BootSnapshot:
    """What kreld knows of one boot of the kernel."""

    boot_id: str
    release: str
    version: str
    build_id: str | None
    anchors: Anchors
    kaslr: KaslrOffset | None
    restricted: bool
    restricted_reason: str | None
    kptr_restrict: int | None
    first_seen: Timestamp
    faults: tuple[str, ...] = ()
    address_source: AddressSource | None = None

    def to_json(self) -> JSON:
        return {
            "boot_id": self.boot_id,
            "release": self.release,
            "version": self.version,
            "build_id": self.build_id,
            "anchors": self.anchors.to_json(),
            "kaslr_offset": hexaddr(self.kaslr.value) if self.kaslr else None,
            "kaslr_source": self.kaslr.source.value if self.kaslr else None,
            "kaslr_path": self.kaslr.path if self.kaslr else None,
            "restricted": self.restricted,
            "restricted_reason": self.restricted_reason,
            "kptr_restrict": self.kptr_restrict,
            "first_seen": self.first_seen.to_json(),
            "faults": list(self.faults),
            "address_source": _source_json(self.address_source),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> BootSnapshot:
        kaslr = None
        if d.get("kaslr_offset") is not None:
            kaslr = KaslrOffset(
                parse_addr(d["kaslr_offset"]), OffsetSource(d["kaslr_source"]), d["kaslr_path"]
            )
        return cls(
            boot_id=d["boot_id"],
            release=d["release"],
            version=d["version"],
            build_id=d.get("build_id"),
            anchors=Anchors.from_json(d["anchors"]),
            kaslr=kaslr,
            restricted=bool(d["restricted"]),
            restricted_reason=d.get("restricted_reason"),
            kptr_restrict=d.get("kptr_restrict"),
            first_seen=Timestamp.from_json(d["first_seen"]),
            faults=tuple(d.get("faults", ())),
            address_source=_source(d.get("address_source")),
        )


@record
class BootSymbols:
    """Which symbol tables name a boot's kernel: the table's key (its build's,
    ``k:<build-id>``, or the boot's own, ``b:<boot-id>``, where it differs) and
    the kallsyms lines the kernel printed that no table holds (``extras``)."""

    kernel: str
    extras: tuple[str, ...] = ()

    def to_json(self) -> JSON:
        return {"kernel": self.kernel, "extras": list(self.extras)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> BootSymbols:
        return cls(str(d["kernel"]), tuple(str(x) for x in d.get("extras") or ()))


def _source_json(source: AddressSource | None) -> str | None:
    return None if source is None else source.value


def _source(value: Any) -> AddressSource | None:
    return None if value is None else AddressSource(value)


def merge_boot(old: BootSnapshot, new: BootSnapshot) -> BootSnapshot:
    """Fill what *old* did not know from *new*; never change what it knew.

    A later snapshot of the same boot may see more (it runs with CAP_SYSLOG,
    or a matching vmlinux was installed since), never something different:
    the kernel image does not move within a boot.
    """
    anchors = Anchors(
        *(
            o if o is not None else n
            for o, n in zip(
                old.anchors.to_ints().values(), new.anchors.to_ints().values(), strict=True
            )
        )
    )
    kaslr = old.kaslr or new.kaslr
    restricted = (old.restricted or new.restricted) and not anchors.known()
    return BootSnapshot(
        boot_id=old.boot_id,
        release=old.release,
        version=old.version,
        build_id=old.build_id or new.build_id,
        anchors=anchors,
        kaslr=kaslr,
        restricted=restricted,
        restricted_reason=(old.restricted_reason or new.restricted_reason) if restricted else None,
        kptr_restrict=old.kptr_restrict if old.kptr_restrict is not None else new.kptr_restrict,
        first_seen=old.first_seen,
        faults=old.faults,
        address_source=old.address_source if old.anchors.known() else new.address_source,
    )


class SeenBy(StrEnum):
    """How kreld saw a module come or go."""

    STARTUP = "startup"
    UEVENT = "uevent"
    POLL = "poll"
    INOTIFY = "inotify"
    TRACEPOINT = "tracepoint"  # module:module_load / module_free: the exact time


class HintAction(StrEnum):
    """What an event source says happened in ``sys/module``: only ever a hint to
    look again; the tracker reconciles against what it reads there."""

    ADD = "add"
    REMOVE = "remove"
    CHANGE = "change"  # any other uevent action on a module
    RESCAN = "rescan"  # events were lost: look at every module

    @classmethod
    def of(cls, action: str) -> HintAction:
        """A uevent's action; those kreld does not name are a change."""
        try:
            return cls(action)
        except ValueError:
            return cls.CHANGE


class ModuleEvent(StrEnum):
    """What the tracker recorded of a module incarnation (as Subscribe tells it)."""

    LOAD = "load"
    UPDATE = "update"
    UNLOAD = "unload"


@record
class ModuleState:
    """One read of ``/sys/module/<name>``: what the kernel shows now."""

    name: str
    build_id: str | None
    sections: Mapping[str, int]
    coresize: int | None
    initsize: int | None
    initstate: str | None
    srcversion: str | None
    taint: str | None
    core_base: int | None
    restricted: bool
    inode: int | None
    faults: tuple[str, ...] = ()
    source: AddressSource | None = None  # where the sections came from


@record
class Incarnation:
    """One load of a module, from when it was seen loaded to when it was seen gone.

    ``unloaded_after`` and ``unloaded`` bound the unload: the module was
    present at the former and gone at the latter.  ``loaded_after`` and
    ``loaded`` bound the load the same way: the look before the one that found
    it did not (absent on a load found by the start-up scan).  kreld sees a load
    only once the module's directory is up, after its memory is allocated and
    often after its init has run (the uevent comes then), so its code may run
    a little before ``loaded``, never before ``loaded_after``.  ``init_live`` says its
    ``.init.*`` sections were live when first seen; ``init_done`` is when the
    read that first showed ``initstate`` ``live`` had ended (its init over by then).
    """

    boot_id: str
    seq: int
    state: ModuleState
    loaded: Timestamp
    seen_by: SeenBy
    init_live: bool
    init_done: Timestamp | None = None
    unloaded: Timestamp | None = None
    unloaded_after: Timestamp | None = None
    unload_seen_by: SeenBy | None = None
    loaded_after: Timestamp | None = None

    @property
    def name(self) -> str:
        return self.state.name

    def loaded_at(self, clock: Clock, t: int) -> bool:
        if self.loaded.on(clock) > t:
            return False
        return self.unloaded is None or self.unloaded.on(clock) > t

    def to_json(self) -> JSON:
        s = self.state
        return {
            "boot_id": self.boot_id,
            "seq": self.seq,
            "name": s.name,
            "build_id": s.build_id,
            "sections": {k: hexaddr(v) for k, v in s.sections.items()},
            "coresize": s.coresize,
            "initsize": s.initsize,
            "initstate": s.initstate,
            "srcversion": s.srcversion,
            "taint": s.taint,
            "core_base": hexaddr(s.core_base),
            "restricted": s.restricted,
            "inode": s.inode,
            "faults": list(s.faults),
            "address_source": _source_json(s.source),
            "loaded": self.loaded.to_json(),
            "seen_by": self.seen_by.value,
            "init_live": self.init_live,
            "init_done": self.init_done.to_json() if self.init_done else None,
            "unloaded": self.unloaded.to_json() if self.unloaded else None,
            "unloaded_after": self.unloaded_after.to_json() if self.unloaded_after else None,
            "unload_seen_by": self.unload_seen_by.value if self.unload_seen_by else None,
            "loaded_after": self.loaded_after.to_json() if self.loaded_after else None,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Incarnation:
        def ts(k: str) -> Timestamp | None:
            v = d.get(k)
            return None if v is None else Timestamp.from_json(v)

        state = ModuleState(
            name=d["name"],
            build_id=d.get("build_id"),
            sections={k: parse_addr(v) for k, v in d["sections"].items()},
            coresize=d.get("coresize"),
            initsize=d.get("initsize"),
            initstate=d.get("initstate"),
            srcversion=d.get("srcversion"),
            taint=d.get("taint"),
            core_base=None if d.get("core_base") is None else parse_addr(d["core_base"]),
            restricted=bool(d.get("restricted", False)),
            inode=d.get("inode"),
            faults=tuple(d.get("faults", ())),
            source=_source(d.get("address_source")),
        )
        loaded = ts("loaded")
        if loaded is None:
            raise ValueError("incarnation record without a load time")
        usb = d.get("unload_seen_by")
        return cls(
            boot_id=d["boot_id"],
            seq=int(d["seq"]),
            state=state,
            loaded=loaded,
            seen_by=SeenBy(d["seen_by"]),
            init_live=bool(d["init_live"]),
            init_done=ts("init_done"),
            unloaded=ts("unloaded"),
            unloaded_after=ts("unloaded_after"),
            unload_seen_by=SeenBy(usb) if usb else None,
            loaded_after=ts("loaded_after"),
        )
