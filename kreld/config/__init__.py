"""``kreld.toml`` loaded and checked (``settings``) and the command-line options
both programs share (``options``).

May import: ``core``.
"""

__all__: list[str] = []  # a folder: import its modules by name
