"""The two programs' entry points, as ``pyproject.toml``'s ``[project.scripts]``
names them: ``kreld`` and ``kreldctl``.

What makes a program start faster by changing the process, rather than kreld's
own code, lives here, in :func:`lean_process`, called before the program is
imported; importing any other module of kreld changes no global state.
"""

from __future__ import annotations

import sys

__all__ = ["kreld", "kreldctl", "lean_process"]


def lean_process() -> None:
    """Keep Python's ssl module (OpenSSL) out of this process.

    asyncio imports ssl only to offer TLS, which a varlink server on an
    AF_UNIX socket never uses (publishing to a bucket goes through obstore's
    own TLS), and loading it is a tenth of the daemon's start
    (bench/RESULTS.md).  asyncio guards its imports of ssl, as for a Python
    built without it.  A process that has loaded ssl already keeps it.
    """
    if "ssl" not in sys.modules:
        sys.modules["ssl"] = None  # type: ignore[assignment]


def kreld() -> int:
    """``kreld``: the daemon, in a lean process."""
    lean_process()
    from kreld.daemon import main

    return main()


def kreldctl() -> int:
    """``kreldctl``."""
    from kreld.cli import main

    return main()
