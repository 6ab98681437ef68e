"""Runtime addresses to source lines: through the recorded layout to a build's
line table.

An address of a recorded boot lies in a region of an :class:`AddressMap`: the
kernel image, or a section of one module incarnation.  The image's table is
in link-time addresses, so the boot's recorded ``_text`` minus the table's
``_text`` (the KASLR offset) is taken off; a module's table answers by
(section, offset), the offset being the address minus the section's recorded
base in that incarnation, so one table serves every load of the build.

Where there is no table, or the table has no line there, the answer has no
frames and says why: never a line of another build, nor a guess.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kreld.debuginfo.lines import Frame, LineTable
from kreld.symbols.queries import AddressMap, Region

__all__ = ["LineAnswer", "TableSource", "lines_at", "lines_in"]

# The line table of a build-id, or None where no debuginfo could be had
# (the string then says why).
TableSource = Callable[[str], "LineTable | str"]


@dataclass(frozen=True)
class LineAnswer:
    """An address's frames, innermost first, or why there are none."""

    frames: tuple[Frame, ...]
    why_not: str | None = None


def _where(region: Region, address: int, table: LineTable) -> int | str:
    """The address in *table*'s terms, or why it has none."""
    if region.inc is None:
        text = table.meta.get("text")
        if not isinstance(text, int):
            return "the kernel's debug file has no _text symbol"
        return address - region.rel_base + text
    at = table.section_address(region.section, address - region.base)
    if at is None:
        off = address - region.base
        return f"section {region.section} at offset {off:#x} is not in the debug file"
    return at


def lines_at(amap: AddressMap, addresses: Sequence[int], tables: TableSource) -> list[LineAnswer]:
    """Each address's :class:`LineAnswer` in *amap*'s layout (see :func:`lines_in`)."""
    placed = [(a, amap.region_at(a)) for a in addresses]
    return lines_in(placed, amap.kernel_build_id, tables)


def lines_in(
    placed: Sequence[tuple[int, Region | None]], kernel_build_id: str | None, tables: TableSource
) -> list[LineAnswer]:
    """Each address's :class:`LineAnswer`, the address given with the region
    that held it then (None: none did) and *kernel_build_id* the boot's image;
    each build's table is asked once, and the addresses of one build are
    looked up together."""
    answers: list[LineAnswer | None] = [None] * len(placed)
    by_build: dict[str, list[tuple[int, int]]] = {}  # build-id -> (index, address)
    for k, (a, r) in enumerate(placed):
        if r is None:
            answers[k] = LineAnswer((), "not in the kernel image nor in a module loaded then")
        elif r.name is not None or r.image.startswith("["):
            answers[k] = LineAnswer((), f"{r.image} code has no debuginfo")
        else:
            build = kernel_build_id if r.inc is None else r.inc.state.build_id
            if build is None:
                answers[k] = LineAnswer((), f"no build-id recorded for {r.image}")
            else:
                by_build.setdefault(build, []).append((k, a))
    regions = [r for _, r in placed]
    for build, members in by_build.items():
        table = tables(build)
        if isinstance(table, str):
            for k, _ in members:
                answers[k] = LineAnswer((), table)
            continue
        _answer_build(table, build, members, regions, answers)
    return [a if a is not None else LineAnswer((), "unanswered") for a in answers]


def _answer_build(
    table: LineTable,
    build: str,
    members: list[tuple[int, int]],
    regions: Sequence[Region | None],
    answers: list[LineAnswer | None],
) -> None:
    placed: list[tuple[int, int]] = []
    for k, a in members:
        region = regions[k]
        where = "" if region is None else _where(region, a, table)
        if isinstance(where, str):
            answers[k] = LineAnswer((), where)
        else:
            placed.append((k, where))
    if not placed:
        return
    chains = table.frames_at(np.array([w for _, w in placed], dtype=np.uint64))
    for (k, _), frames in zip(placed, chains, strict=True):
        if not frames:
            answers[k] = LineAnswer((), f"no function at this address in build {build}'s DWARF")
            continue
        answers[k] = LineAnswer(tuple(frames))
