"""The options both programs share say what each program does with them."""

from __future__ import annotations

import re

from kreld.config.options import build_parser
from kreld.ctl.args import build_parser as kreldctl_parser


def _help_of(help_text: str, option: str) -> str:
    """The help of *option* in an argparse help text, on one line."""
    m = re.search(rf"^  {option}\b(.*?)(?=^  -|^\S|\Z)", help_text, re.M | re.S)
    assert m, option
    return " ".join(m[1].split())


def test_debug_says_the_daemon_logs_at_the_debug_level_and_kreldctl_shows_tracebacks() -> None:
    daemon = _help_of(build_parser().format_help(), "--debug")
    assert "debug level" in daemon and "traceback" in daemon
    ctl = _help_of(kreldctl_parser().format_help(), "--debug")
    assert "traceback" in ctl and "debug level" not in ctl
