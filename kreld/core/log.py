"""Logging with structlog: one event per fact, key=value.

Three renderings, chosen by ``--log-format``/``[log] format``:
``console`` (on a TTY), ``json`` (JSON lines, when stderr is not a TTY) and
``journal`` (native journal fields through systemd-python).  ``auto`` picks
the journal when stderr is the stream systemd connected to it
(``JOURNAL_STREAM`` names stderr's device and inode), else console on a TTY,
else JSON lines.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Callable, MutableMapping
from typing import Any

import structlog
from structlog.typing import FilteringBoundLogger

from kreld.core import consts

__all__ = [
    "FORMATS",
    "LEVELS",
    "JournalRenderer",
    "choose_format",
    "configure",
    "get",
    "journal_context",
    "journal_field",
    "journal_stream_is_stderr",
]

LEVELS = {name: logging.getLevelNamesMapping()[name.upper()] for name in consts.LOG_LEVELS}
FORMATS = consts.LOG_FORMATS

# syslog priorities (sd-daemon.h / syslog.h)
_PRIORITY = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "critical": 2}
# Event keys that become well-known journal fields instead of KRELD_<KEY>.
_WELL_KNOWN = {"boot_id": "KRELD_BOOT_ID", "module": "MODULE", "build_id": "BUILD_ID"}
_FIELD_OK = re.compile(r"[^A-Z0-9_]")

# Fields every journal entry carries (the daemon sets the boot once known).
journal_context: dict[str, str] = {}


def journal_field(key: str) -> str:
    if key in _WELL_KNOWN:
        return _WELL_KNOWN[key]
    return "KRELD_" + _FIELD_OK.sub("_", key.upper())


class JournalRenderer:
    """Send each event to the journal with structured fields; print nothing."""

    def __init__(self, send: Callable[..., Any] | None = None) -> None:
        if send is None:
            from systemd import journal

            send = journal.send
        self._send = send

    def __call__(self, _logger: Any, method: str, ev: MutableMapping[str, Any]) -> Any:
        level = str(ev.pop("level", method))
        event = str(ev.pop("event", ""))
        ev.pop("timestamp", None)
        fields = {
            "PRIORITY": str(_PRIORITY.get(level, 6)),
            "SYSLOG_IDENTIFIER": "kreld",
            "KRELD_EVENT": event,
        }
        fields.update(journal_context)
        for key, value in ev.items():
            if value is not None:
                fields[journal_field(key)] = str(value)
        message = " ".join([event, *(f"{k}={v}" for k, v in ev.items() if v is not None)])
        try:
            self._send(message, **fields)
        except OSError:
            # The journal's socket refuses (journald stopped, a stale socket):
            # logging must never stop the daemon.  Write the line to stderr,
            # with the sd-daemon(3) priority prefix a journal stream reads.
            print(f"<{fields['PRIORITY']}>{message}", file=sys.stderr, flush=True)
        raise structlog.DropEvent


def journal_stream_is_stderr(env: MutableMapping[str, str] = os.environ) -> bool:
    js = env.get("JOURNAL_STREAM", "")
    dev, sep, ino = js.partition(":")
    if not sep:
        return False
    try:
        st = os.fstat(2)
        return st.st_dev == int(dev) and st.st_ino == int(ino)
    except (OSError, ValueError):
        return False


def choose_format(fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if journal_stream_is_stderr():
        return "journal"
    return "console" if sys.stderr.isatty() else "json"


def configure(level: str = "info", fmt: str = "auto") -> str:
    """Set up structlog; returns the format chosen."""
    chosen = choose_format(fmt)
    renderer: Any
    if chosen == "journal":
        renderer = JournalRenderer()
    elif chosen == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    else:
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    return chosen


def get() -> FilteringBoundLogger:
    logger: FilteringBoundLogger = structlog.get_logger("kreld")
    return logger
