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
    """Import asyncio without Python's ssl module (OpenSSL).

    asyncio imports ssl as it is imported (``base_events``, ``selector_events``
    and ``sslproto`` each try ``import ssl``), only to offer TLS, which a varlink
    server on an AF_UNIX socket never uses (publishing to a bucket goes through
    obstore's own TLS); loading it is a tenth of the daemon's start
    (bench/RESULTS.md).  asyncio guards those imports, as for a Python built
    without ssl, so ssl is held out for asyncio's import alone: asyncio keeps
    ``ssl = None``, and nothing else is changed, so a later ``import ssl`` (by
    http.client, for an https debuginfod server) loads it as usual.  A process
    that has loaded ssl or asyncio already keeps them as they are.
    """
    if "ssl" in sys.modules or "asyncio" in sys.modules:
        return
    sys.modules["ssl"] = None  # type: ignore[assignment]
    try:
        import asyncio  # noqa: F401
    finally:
        del sys.modules["ssl"]


def kreld() -> int:
    """``kreld``: the daemon, in a lean process."""
    lean_process()
    from kreld.daemon import main

    return main()


def kreldctl() -> int:
    """``kreldctl``."""
    from kreld.cli import main

    return main()
