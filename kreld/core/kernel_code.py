"""The data model of kernel code beyond the image and modules.

BPF programs, BPF trampolines and dispatchers, ftrace trampolines and kprobe
instruction pages are executable kernel memory that comes and goes faster
than modules.  kreld records each as a :class:`KernelCode`, one per
appearance, like a module incarnation: its kind, name, range, the BPF
program's id and tag, when it was loaded and unloaded on the three clocks,
how it was seen and where its address came from.  Events kreld could not see
(a ring that overflowed, kreld not running, records dropped by retention)
are a :class:`LossWindow`: what came and went inside one is unknowable, and
addresses in the code area at such a time are answered as uncertain.

Plain records, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from kreld.core.model import JSON, Clock, Timestamp, hexaddr, parse_addr
from kreld.core.record import record

__all__ = [
    "OWNER_BPF",
    "OWNER_FTRACE",
    "OWNER_KPROBES",
    "CodeEvent",
    "CodeKind",
    "CodeSeen",
    "CodeSource",
    "KernelCode",
    "LossReason",
    "LossWindow",
    "kind_of",
    "owner_of",
]

# The owners /proc/kallsyms prints in brackets after such a symbol's name.
OWNER_BPF = "bpf"
OWNER_FTRACE = "__builtin__ftrace"
OWNER_KPROBES = "__builtin__kprobes"


class CodeKind(StrEnum):
    """What kind of kernel code a record holds (from its name: the kernel names each kind)."""

    BPF_PROGRAM = "bpf_program"  # bpf_prog_<tag>[_<name>] (kernel/bpf/core.c)
    BPF_TRAMPOLINE = "bpf_trampoline"  # bpf_trampoline_<key> (kernel/bpf/trampoline.c)
    BPF_DISPATCHER = "bpf_dispatcher"  # bpf_dispatcher_<name> (kernel/bpf/dispatcher.c)
    FTRACE_TRAMPOLINE = "ftrace_trampoline"  # arch/x86/kernel/ftrace.c
    KPROBE_PAGE = "kprobe_page"  # kprobe_insn_page, kprobe_optinsn_page
    OTHER = "other"  # a name kreld does not know: recorded as the kernel gave it


class CodeEvent(StrEnum):
    """What Subscribe tells of kernel code (its ``code`` member)."""

    LOAD = "code_load"
    UPDATE = "code_update"
    UNLOAD = "code_unload"


class CodeSeen(StrEnum):
    """How kreld saw kernel code come or go."""

    KSYMBOL = "ksymbol"  # a PERF_RECORD_KSYMBOL (exact time, address and length)
    KALLSYMS = "kallsyms"  # a reconciliation against /proc/kallsyms (no length)


class CodeSource(StrEnum):
    """Where a record's address came from."""

    PERF = "perf"  # the kernel's side-band record
    KALLSYMS = "kallsyms"


class LossReason(StrEnum):
    LOST_RECORDS = "lost_records"  # a ring overflowed (PERF_RECORD_LOST, or its count)
    NOT_RUNNING = "not_running"  # kreld was stopped: from its last record to its start
    NOT_FOLLOWED = "not_followed"  # no rings (unavailable): between two looks at kallsyms
    RETENTION = "retention"  # older records were dropped to bound the store
    CPU_HOTPLUG = "cpu_hotplug"  # a CPU came online (again): until kreld opened its ring


def kind_of(name: str) -> CodeKind:
    for prefix, kind in _PREFIXES:
        if name.startswith(prefix):
            return kind
    return CodeKind.OTHER


_PREFIXES = (
    ("bpf_prog_", CodeKind.BPF_PROGRAM),
    ("bpf_trampoline_", CodeKind.BPF_TRAMPOLINE),
    ("bpf_dispatcher_", CodeKind.BPF_DISPATCHER),
    ("ftrace_trampoline", CodeKind.FTRACE_TRAMPOLINE),
    ("kprobe_insn_page", CodeKind.KPROBE_PAGE),
    ("kprobe_optinsn_page", CodeKind.KPROBE_PAGE),
)


def owner_of(kind: CodeKind) -> str:
    """The bracketed owner kallsyms prints for *kind*."""
    if kind is CodeKind.FTRACE_TRAMPOLINE:
        return OWNER_FTRACE
    if kind is CodeKind.KPROBE_PAGE:
        return OWNER_KPROBES
    return OWNER_BPF


def _ts(d: Mapping[str, Any], key: str) -> Timestamp | None:
    v = d.get(key)
    return None if v is None else Timestamp.from_json(v)


def _tj(t: Timestamp | None) -> JSON | None:
    return None if t is None else t.to_json()


@record
class KernelCode:
    """One appearance of kernel code, from its load to its unload.

    ``loaded`` is the first time it was certainly there; ``loaded_after``,
    when set, a time it was not yet there (its load fell between; all zeros:
    some time since the boot, as for what kallsyms showed at kreld's first
    look).  ``unloaded_after`` and ``unloaded`` bound an unload seen late
    (present at the former, gone at the latter); an unload seen by its own
    record has ``unloaded`` alone.  ``length`` is None when only kallsyms
    showed it (kallsyms lists no lengths).
    """

    boot_id: str
    seq: int
    kind: CodeKind
    name: str
    owner: str
    addr: int
    length: int | None
    loaded: Timestamp
    seen_by: CodeSeen
    source: CodeSource
    prog_id: int | None = None
    tag: str | None = None
    loaded_after: Timestamp | None = None
    unloaded: Timestamp | None = None
    unloaded_after: Timestamp | None = None
    unload_seen_by: CodeSeen | None = None

    def certain_at(self, clock: Clock, t: int | None) -> bool:
        """Whether it was certainly there at *t* (None: now)."""
        if t is None:
            return self.unloaded is None
        if t < self.loaded.on(clock):
            return False
        if self.unloaded_after is not None:
            return t <= self.unloaded_after.on(clock)
        return self.unloaded is None or t < self.unloaded.on(clock)

    def possible_at(self, clock: Clock, t: int | None) -> bool:
        """Whether it may have been there at *t* (certain or not)."""
        if t is None:
            return self.unloaded is None
        if self.unloaded is not None and t >= self.unloaded.on(clock):
            return False
        if self.loaded_after is not None:
            return t > self.loaded_after.on(clock)
        return t >= self.loaded.on(clock)

    def to_json(self) -> JSON:
        return {
            "boot_id": self.boot_id,
            "seq": self.seq,
            "kind": self.kind.value,
            "name": self.name,
            "owner": self.owner,
            "address": hexaddr(self.addr),
            "length": self.length,
            "prog_id": self.prog_id,
            "tag": self.tag,
            "loaded": self.loaded.to_json(),
            "loaded_after": _tj(self.loaded_after),
            "seen_by": self.seen_by.value,
            "source": self.source.value,
            "unloaded": _tj(self.unloaded),
            "unloaded_after": _tj(self.unloaded_after),
            "unload_seen_by": None if self.unload_seen_by is None else self.unload_seen_by.value,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> KernelCode:
        loaded = _ts(d, "loaded")
        if loaded is None:
            raise ValueError("kernel code record without a load time")
        usb = d.get("unload_seen_by")
        length = d.get("length")
        prog_id = d.get("prog_id")
        return cls(
            boot_id=str(d["boot_id"]),
            seq=int(d["seq"]),
            kind=CodeKind(d["kind"]),
            name=str(d["name"]),
            owner=str(d["owner"]),
            addr=parse_addr(d["address"]),
            length=None if length is None else int(length),
            loaded=loaded,
            seen_by=CodeSeen(d["seen_by"]),
            source=CodeSource(d["source"]),
            prog_id=None if prog_id is None else int(prog_id),
            tag=None if d.get("tag") is None else str(d["tag"]),
            loaded_after=_ts(d, "loaded_after"),
            unloaded=_ts(d, "unloaded"),
            unloaded_after=_ts(d, "unloaded_after"),
            unload_seen_by=None if usb is None else CodeSeen(usb),
        )


@record
class LossWindow:
    """A span in which kreld may have missed loads and unloads."""

    start: Timestamp
    end: Timestamp
    reason: LossReason
    lost: int = 0  # records the kernel said it dropped (0: unknown or none)

    def covers(self, clock: Clock, t: int) -> bool:
        return self.start.on(clock) <= t <= self.end.on(clock)

    def to_json(self) -> JSON:
        return {
            "start": self.start.to_json(),
            "end": self.end.to_json(),
            "reason": self.reason.value,
            "lost": self.lost,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LossWindow:
        return cls(
            Timestamp.from_json(d["start"]),
            Timestamp.from_json(d["end"]),
            LossReason(d["reason"]),
            int(d.get("lost", 0)),
        )
