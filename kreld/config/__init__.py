"""``kreld.toml`` loaded and checked (``settings``), each file read within
bounds (``files``) and its nesting and key lengths checked before tomllib
parses it (``shape``); the command-line options both programs share
(``options``).

May import: ``core``.
"""

__all__: list[str] = []  # a folder: import its modules by name
