"""Questions asked of recorded data: which modules were loaded at a time, and
which image and section held an address.  Pure functions over the model."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kreld.model import BootSnapshot, Clock, Incarnation, hexaddr

# A section's extent is not in sysfs; bound it by its module's size, or this.
_UNKNOWN_SIZE_BOUND = 1 << 24


def loaded_at(incs: Iterable[Incarnation], clock: Clock, t: int | None) -> list[Incarnation]:
    """Incarnations loaded at *t* on *clock*; with ``t=None``, those never seen unloaded."""
    if t is None:
        return [i for i in incs if i.unloaded is None]
    return [i for i in incs if i.loaded_at(clock, t)]


def init_live_at(inc: Incarnation, clock: Clock, t: int | None) -> bool:
    """Whether the module's ``.init.*`` sections held its init code at *t*."""
    if not inc.init_live:
        return False
    if t is None:
        return inc.init_done is None and inc.unloaded is None
    return inc.loaded.on(clock) <= t and (inc.init_done is None or t < inc.init_done.on(clock))


@dataclass(frozen=True, slots=True)
class Region:
    base: int
    limit: int  # exclusive upper bound
    image: str
    section: str
    inc: Incarnation | None


@dataclass(frozen=True, slots=True)
class Resolution:
    address: int
    region: Region | None

    def to_json(self) -> dict[str, object]:
        r = self.region
        if r is None:
            return {"address": hexaddr(self.address), "image": None}
        out: dict[str, object] = {
            "address": hexaddr(self.address),
            "image": r.image,
            "section": r.section,
            "base": hexaddr(r.base),
            "offset": hexaddr(self.address - r.base),
        }
        if r.inc is not None:
            out["seq"] = r.inc.seq
            out["build_id"] = r.inc.state.build_id
        return out


class AddressMap:
    """Sorted regions of one boot at one time, for bisecting addresses."""

    def __init__(
        self, boot: BootSnapshot, incs: Sequence[Incarnation], clock: Clock, t: int | None
    ) -> None:
        regions: list[Region] = []
        a = boot.anchors
        if a.text is not None and a.etext is not None:
            regions.append(Region(a.text, a.etext, "kernel", ".text", None))
        if a.sinittext is not None and a.einittext is not None:
            regions.append(Region(a.sinittext, a.einittext, "kernel", ".init.text", None))
        for inc in loaded_at(incs, clock, t):
            live_init = init_live_at(inc, clock, t)
            s = inc.state
            for name, base in s.sections.items():
                is_init = name.startswith(".init")
                if is_init and not live_init:
                    continue
                size = s.initsize if is_init else s.coresize
                regions.append(
                    Region(base, base + (size or _UNKNOWN_SIZE_BOUND), s.name, name, inc)
                )
        regions.sort(key=lambda r: (r.base, r.limit))
        self.regions = regions
        self._bases = [r.base for r in regions]

    def resolve(self, address: int) -> Resolution:
        i = bisect.bisect_right(self._bases, address) - 1
        # Several sections may share a base (empty ones); take the last that covers it.
        while i >= 0:
            r = self.regions[i]
            if address < r.limit:
                return Resolution(address, r)
            if i == 0 or self.regions[i - 1].base != r.base:
                break
            i -= 1
        return Resolution(address, None)
