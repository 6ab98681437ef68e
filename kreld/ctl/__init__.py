"""``kreldctl``'s command line (``args``) and its text output (``render``);
the commands themselves are in ``kreld/cli.py``, but for what ``--lines``
adds to resolve and symbolize (``lines``: the boot's layout, the line-table
provider, frames as JSON and as text; ``line-tables``' listing; ``perflines``:
the same for each kernel frame of a recording's perf script output) and
symbolize's streaming of addresses read from text (``stream``).

May import every folder.
"""

__all__: list[str] = []  # a folder: import its modules by name
