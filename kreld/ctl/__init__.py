"""``kreldctl``'s command line (``args``) and its text output (``render``);
the commands themselves are in ``kreld/cli.py``.

May import every folder.
"""

__all__: list[str] = []  # a folder: import its modules by name
