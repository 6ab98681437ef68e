"""Kernel code in the fleet bucket: the shapes of a batch's ``code``,
``code_dropped`` and ``losses`` members, and how a reader merges them.

A batch carries the kernel-code records (:class:`~kreld.core.kernel_code.KernelCode`)
whose published form changed since the last round, the seqs retention deleted
from the store since then (``code_dropped``: a reader forgets them, so the
bucket holds what the store holds), and, when they changed, the boot's loss
windows whole (a boot keeps at most
:data:`~kreld.core.consts.KERNEL_CODE_KEEP_LOSSES`).  No I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from kreld.core.jsonin import Int, List, Obj, Opt, Str
from kreld.core.kernel_code import (
    CodeKind,
    CodeSeen,
    CodeSource,
    KernelCode,
    LossReason,
    LossWindow,
)
from kreld.core.record import record

__all__ = [
    "ADDR",
    "CODES_SHAPE",
    "CODE_SHAPE",
    "DROPPED_SHAPE",
    "I64",
    "LOSSES_SHAPE",
    "LOSS_SHAPE",
    "MAX_CODES",
    "MAX_LOSSES",
    "NO_CODE",
    "TIME",
    "U64",
    "CodeDelta",
    "merge_code",
]

# What one batch may carry (a boot keeps 50,000 closed records and every open one).
MAX_CODES = 1 << 20
MAX_LOSSES = 1 << 16

# 64-bit numbers, a timestamp on kreld's three clocks and an address: the
# shapes module and kernel code objects share (kreld.fleet.objects takes them
# from here).
I64 = Int(-(1 << 63), (1 << 63) - 1)
U64 = Int(0, (1 << 64) - 1)
TIME = Obj({"monotonic": I64, "boottime": I64, "realtime": I64})
ADDR = Str(18, r"0x[0-9a-f]{1,16}")


def _one_of(values: Iterable[str]) -> Str:
    return Str(32, "|".join(values))


CODE_SHAPE = Obj(
    {
        "boot_id": Str(36, r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"),
        "seq": Int(0, (1 << 63) - 1),
        "kind": _one_of(k.value for k in CodeKind),
        "name": Str(512),  # KSYM_NAME_LEN
        "owner": Str(64),
        "address": ADDR,
        "loaded": TIME,
        "seen_by": _one_of(s.value for s in CodeSeen),
        "source": _one_of(s.value for s in CodeSource),
    },
    {
        "length": Opt(U64),
        "prog_id": Opt(Int(0, (1 << 32) - 1)),
        "tag": Opt(Str(64)),
        "loaded_after": Opt(TIME),
        "unloaded": Opt(TIME),
        "unloaded_after": Opt(TIME),
        "unload_seen_by": Opt(_one_of(s.value for s in CodeSeen)),
    },
)
LOSS_SHAPE = Obj(
    {"start": TIME, "end": TIME, "reason": _one_of(r.value for r in LossReason)},
    {"lost": U64},
)
CODES_SHAPE = List(CODE_SHAPE, MAX_CODES)
DROPPED_SHAPE = List(Int(0, (1 << 63) - 1), MAX_CODES)
LOSSES_SHAPE = Opt(List(LOSS_SHAPE, MAX_LOSSES))


@record
class CodeDelta:
    """A batch's kernel code: records put in, seqs forgotten, and the boot's loss
    windows when they changed (None: as the previous batches left them)."""

    codes: tuple[KernelCode, ...] = ()
    dropped: tuple[int, ...] = ()
    losses: tuple[LossWindow, ...] | None = None

    def empty(self) -> bool:
        return not self.codes and not self.dropped and self.losses is None


NO_CODE = CodeDelta()


def merge_code(deltas: Iterable[CodeDelta]) -> tuple[list[KernelCode], list[LossWindow]]:
    """A boot's kernel code from its batches in order: a later record of a seq
    wins, a seq dropped is forgotten, the last loss windows given are the boot's."""
    codes: dict[int, KernelCode] = {}
    losses: tuple[LossWindow, ...] = ()
    for d in deltas:
        for seq in d.dropped:
            codes.pop(seq, None)
        for c in d.codes:
            codes[c.seq] = c
        if d.losses is not None:
            losses = d.losses
    wins = sorted(losses, key=lambda w: w.start.monotonic)
    return [codes[s] for s in sorted(codes)], wins
