"""Debug information: source lines with their inline chains, read from DWARF
(``lines``, ``lines_reloc``) into tables kept by the store.

May import: ``core``, ``config``, ``store``.
"""

__all__: list[str] = []  # a folder: import its modules by name
