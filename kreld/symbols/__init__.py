"""Addresses to names: which image, section and symbol held an address at a
time (``queries``), a recorded boot rendered back as a kallsyms file
(``export``), source lines with inline chains from a build's line table
(``linequery``), and the worker that captures symbol tables as modules load
(``capture``).

May import: ``core``, ``config``, ``kernel``, ``debuginfo``, ``store``, ``varlink``.
"""

__all__: list[str] = []  # a folder: import its modules by name
