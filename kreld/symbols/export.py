"""A recorded boot rendered back as a ``/proc/kallsyms`` file: the kernel's
lines at this boot's addresses (``_text`` plus each symbol's offset), then each
module incarnation's at its own section bases, its init sections only while
they were live at the time asked.  ``perf report --kallsyms`` reads the result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kreld.core.model import Clock, Incarnation
from kreld.core.symtab import ABSOLUTE, MODULE_ABSOLUTE, SymbolTables, module_symbol_key
from kreld.symbols.queries import init_live_at, is_init_section

__all__ = ["module_key", "render_kallsyms"]


def module_key(inc: Incarnation) -> str | None:
    return module_symbol_key(inc.state.build_id, inc.name, inc.state.srcversion)


def render_kallsyms(
    text: int,
    tables: SymbolTables,
    kernel_key: str,
    incs: list[Incarnation],
    extras: Sequence[str],
    clock: Clock,
    t: int | None,
    absolutes: Mapping[int, Sequence[int]] | None = None,
) -> str:
    """A kallsyms file: kernel lines in the kernel's order at this boot's
    addresses, then each module's at its incarnation's section bases, its
    per-cpu (absolute) entries at what that load printed (*absolutes*, by
    seq, where it differed from the load the table came from)."""
    out: list[str] = []
    kernel = tables.get(kernel_key)
    if kernel is not None:
        for e in kernel:
            value = e.value if e.section == ABSOLUTE else text + e.value
            out.append(f"{value & 0xFFFFFFFFFFFFFFFF:016x} {e.type} {e.name}\n")
    for inc in incs:
        key = module_key(inc)
        table = tables.get(key) if key else None
        if table is None:
            continue
        live_init = init_live_at(inc, clock, t)
        bases = [
            0 if name == MODULE_ABSOLUTE else inc.state.sections.get(name)
            for name in table.sections
        ]
        skip = [is_init_section(name) and not live_init for name in table.sections]
        absolute = table.section_index(MODULE_ABSOLUTE)
        own = list((absolutes or {}).get(inc.seq, ()))
        k = 0  # absolute entries seen
        for e in table:
            base = bases[e.section]
            if base is None or skip[e.section]:
                continue
            value = base + e.value
            if e.section == absolute:
                if k < len(own):
                    value = own[k]
                k += 1
            out.append(f"{value & 0xFFFFFFFFFFFFFFFF:016x} {e.type} {e.name}\t[{inc.name}]\n")
    out.extend(line + "\n" for line in extras)
    return "".join(out)
