"""What a module incarnation's sections tell a symbol table: how far each may
reach, and whether kallsyms was read after its init text was freed.  Pure."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kreld.core.model import Incarnation

__all__ = ["init_gone", "section_sizes"]


def init_gone(inc: Incarnation, values: Iterable[tuple[int, Any, Any]] | None) -> bool:
    """Whether kallsyms' lines (*values*) of a module whose init text was seen
    live show nothing in it: read after its init ended and the text was freed."""
    base = inc.state.sections.get(".init.text")
    if base is None or not inc.init_live:
        return False
    end = base + (inc.state.initsize or 1)
    return not any(base <= v < end for v, _t, _n in values or ())


def section_sizes(inc: Incarnation) -> dict[str, int]:
    """How far each section of *inc* may reach: its allocation's size."""
    s = inc.state
    sizes = {
        sec: (s.initsize if sec.startswith(".init") else s.coresize) or 0 for sec in s.sections
    }
    return {k: v for k, v in sizes.items() if v}
