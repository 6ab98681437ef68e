"""Addresses to names: which image, section and symbol held an address at a
time (``queries``; a batch of addresses at once: ``batch``; and
``kernel_code`` for BPF programs, trampolines, ftrace and kprobe pages,
``late_loads`` for modules whose load kreld saw late), a recorded boot
rendered back as a kallsyms file (``export``), and the worker that captures
symbol tables as modules load (``capture``: when to read kallsyms and for
which loads; ``table_sources``: where each table comes from, with what a
load's sections tell it: ``sections``), and source lines with inline chains
from a build's line table (``linequery``; in bulk, as Resolve's columns:
``linereply``), the table had from the store or built from debuginfo found
by build-id (``linetables``; builds found without debuginfo remembered for a
while: ``absences``).  Names travel quoted into JSON in bulk (``quoting``).

May import: ``core``, ``config``, ``kernel``, ``debuginfo``, ``store``, ``varlink``.
"""

__all__: list[str] = []  # a folder: import its modules by name
