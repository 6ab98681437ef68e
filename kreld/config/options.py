"""Command-line options shared by ``kreld`` and ``kreldctl``."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from kreld.config.settings import Config, load_config, socket_path_fault
from kreld.core import consts
from kreld.core.errors import ConfigError, exit_status_help
from kreld.core.record import replace

__all__ = [
    "SIGNALS",
    "HelpFormatter",
    "add_common",
    "build_parser",
    "epilog",
    "leave",
    "resolve_config",
]


def _columns() -> int:
    """What ``shutil.get_terminal_size`` says, without importing shutil
    (and with it zlib, bz2 and lzma: 2 ms of every start)."""
    with contextlib.suppress(KeyError, ValueError):
        if (columns := int(os.environ["COLUMNS"])) > 0:
            return columns
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns or 80  # type: ignore[union-attr]
    except (AttributeError, ValueError, OSError):
        return 80


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's formatter (descriptions kept as written), sized without shutil;
    every parser and subparser of both programs is given it."""

    def __init__(
        self,
        prog: str,
        indent_increment: int = 2,
        max_help_position: int = 24,
        width: int | None = None,
    ) -> None:
        width = _columns() - 2 if width is None else width
        super().__init__(prog, indent_increment, max_help_position, width)


# What --debug does: kreldctl shows an error's traceback; the daemon also logs
# at the debug level.
DEBUG_HELP = "show tracebacks of errors"
DAEMON_DEBUG_HELP = (
    "log at the debug level (unless --log-level says otherwise) and with the"
    " traceback of an error that stops kreld"
)


def add_common(
    parser: argparse.ArgumentParser, *, suppress: bool = False, debug_help: str = DEBUG_HELP
) -> None:
    """The options both programs accept (before or after a subcommand).

    With *suppress*, an option left out does not overwrite a value given
    earlier on the command line (argparse subparsers would otherwise reset it).
    """

    def d(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    g = parser.add_argument_group("common options")
    g.add_argument(
        "--config",
        metavar="FILE",
        default=d(None),
        help=f"config file (default {consts.DEFAULT_CONFIG})",
    )
    g.add_argument(
        "--state-dir",
        metavar="DIR",
        default=d(None),
        help=f"LMDB store directory (default {consts.DEFAULT_STATE_DIR})",
    )
    g.add_argument(
        "--socket",
        metavar="PATH",
        default=d(None),
        help=f"varlink socket (default {consts.DEFAULT_SOCKET})",
    )
    g.add_argument(
        "--root",
        metavar="DIR",
        default=d(None),
        help="read every kernel path under DIR (default /; tests use a fake tree)",
    )
    g.add_argument("--debug", action="store_true", default=d(False), help=debug_help)


def resolve_config(args: argparse.Namespace) -> Config:
    """The config file's values, overridden by what the command line says."""
    cfg = load_config(args.config)
    changes = {}
    for attr in ("state_dir", "socket", "root"):
        value = getattr(args, attr, None)
        if value is not None:
            changes[attr] = value
    if "socket" in changes and (fault := socket_path_fault(changes["socket"])) is not None:
        raise ConfigError("the command line", f"expected {fault}", "--socket")
    return replace(cfg, **changes)


def leave(rc: int) -> int:
    """Exit with *rc* at once, skipping interpreter finalization, when obstore was used:
    its Tokio runtime is never shut down, and a worker thread that meets ``Py_Finalize``
    can abort the process (SIGABRT) after all the work is done (the race lancedb fixed for
    its own runtime in lancedb/lancedb#4175).  Without obstore, returns *rc*."""
    if sys.modules.get("obstore") is None:
        return rc
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(rc)


# kreld(8)'s options and exit codes (the daemon's parser: here, beside the common options).
SIGNALS = """\
signals:
  SIGTERM, SIGINT  stop cleanly (exit 0), removing the socket kreld bound
  SIGHUP           reload the configuration; an invalid one is logged and
                   the running configuration kept
"""


def epilog() -> str:
    """kreld's help's closing part: signals, then exit codes from the one table in
    :mod:`kreld.core.errors`."""
    return SIGNALS + "\n" + exit_status_help("kreld")


def build_parser() -> argparse.ArgumentParser:
    from kreld import __version__
    from kreld.core import log as klog  # the daemon's: kreldctl's start loads no logging

    p = argparse.ArgumentParser(
        prog="kreld",
        description="Record the kernel's and its modules' relocations for profilers.",
        epilog=epilog(),
        formatter_class=HelpFormatter,
    )
    add_common(p, debug_help=DAEMON_DEBUG_HELP)
    p.add_argument(
        "--log-level", choices=tuple(klog.LEVELS), default=None, help="log level (default info)"
    )
    p.add_argument(
        "--log-format",
        choices=klog.FORMATS,
        default=None,
        help="console, json (JSON lines), journal, or auto (journal under systemd, "
        "console on a TTY, JSON lines otherwise)",
    )
    p.add_argument("--version", action="version", version=f"kreld {__version__}")
    return p
