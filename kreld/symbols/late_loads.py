"""Modules whose load kreld learnt late: known only as an interval (seen by the
poll, a uevent or kreld's own start, not by the module tracepoint), absent at
``loaded_after`` and there at ``loaded``.  A time inside that interval is
answered as kernel code in a window is: the module possibly there, marked so,
and named where nothing certainly held the address."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kreld.core.model import Clock, Incarnation
from kreld.core.record import replace

if TYPE_CHECKING:
    from kreld.symbols.queries import Region

__all__ = ["coexisted", "possible_regions", "possibly_held", "possibly_loaded_at", "shadows"]


def possibly_loaded_at(inc: Incarnation, clock: Clock, t: int | None) -> bool:
    """Whether the module may have been loaded at *t* though not certainly: its
    load is known only as an interval (seen by the poll, a uevent or kreld's
    start: absent at ``loaded_after``, there at ``loaded``) and *t* lies in it."""
    after = inc.loaded_after
    if t is None or after is None:
        return False
    return after.on(clock) < t < inc.loaded.on(clock)


def possibly_held(r: Region, clock: Clock, t: int | None) -> bool:
    """Whether region *r* of a module load may have held its range at *t*
    though not certainly: the load possibly there (:func:`possibly_loaded_at`)
    and, for an init section, init not known to have ended by *t*."""
    from kreld.symbols.queries import is_init_section  # which imports this module

    inc = r.inc
    if inc is None or not possibly_loaded_at(inc, clock, t):
        return False
    if not is_init_section(r.section):
        return True
    done = inc.init_done
    return inc.init_live and (done is None or t is None or t < done.on(clock))


def possible_regions(
    incs: Iterable[Incarnation], clock: Clock, t: int | None, certain: Sequence[Region]
) -> list[Region]:
    """The regions of modules possibly loaded at *t* (see :func:`possibly_loaded_at`),
    as kernel code in a window is answered: marked, and only where no region
    certainly there at *t* lies (*certain*), so that no sample is left unnamed
    because kreld learnt of a load late.  Their init sections count as live
    unless init is known to have ended by *t*."""
    from kreld.symbols.queries import module_regions  # which imports this module

    out: list[Region] = []
    for inc in incs:
        if not possibly_loaded_at(inc, clock, t):
            continue
        done = inc.init_done
        live_init = inc.init_live and (done is None or t is None or t < done.on(clock))
        for r in module_regions(inc, live_init):
            if not any(shadows(c, r, clock) for c in certain):
                out.append(replace(r, possible=True))
    return out


def shadows(held: Region, r: Region, clock: Clock) -> bool:
    """Whether *held*, a region certainly there at some time, may hold the
    start of *r*, a module's region possibly there then, so that *r* must
    yield to it.

    A base is exact, a module region's limit only a bound (sysfs gives no
    section sizes: :func:`~kreld.symbols.queries.module_regions`).  Regions
    resident at once never overlap, so where *held*'s module was still loaded
    when *r*'s load was seen, the two were resident together and *held* ends
    before *r* begins: the nearest base names the address.  Otherwise (the
    same base, kernel memory of exact extent, or *held*'s module gone before
    *r*'s came, when its memory may have been reused) *held* wins."""
    if not (held.base < r.limit and r.base < held.limit):
        return False
    if held.base == r.base or held.inc is None or r.inc is None:
        return True
    if r.base < held.base:  # r's addresses below held's are not held's
        return False
    return not coexisted(held.inc, r.inc, clock)


def coexisted(held: Incarnation, late: Incarnation, clock: Clock) -> bool:
    """Whether module load *held* was certainly still there when *late* was:
    not known to be gone before *late* was seen loaded (``late.loaded``, at or
    after its real load)."""
    gone = held.unloaded_after or held.unloaded  # present at the former
    return gone is None or gone.on(clock) >= late.loaded.on(clock)
