"""``kreldctl``'s command line: its options, commands and how it reads times and
addresses."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from kreld.config.options import HelpFormatter, add_common
from kreld.core.errors import InvalidArgument, exit_status_help
from kreld.core.model import Clock, hexaddr, parse_addr

__all__ = [
    "FROM_COMMANDS",
    "add_from",
    "add_json",
    "add_queries",
    "addresses_in",
    "at_options",
    "build_parser",
    "epilog",
    "for_option",
    "lines_options",
    "parse_time",
]


def epilog() -> str:
    """The help's closing part: exit codes, from the one table in :mod:`kreld.core.errors`."""
    return exit_status_help("kreldctl")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kreldctl",
        description="Inspect kernel and module relocations recorded by kreld.",
        epilog=epilog(),
        formatter_class=HelpFormatter,
    )
    add_common(p)
    add_from(p)
    add_json(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def cmd(name: str, help: str, aliases: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        sp = sub.add_parser(
            name, aliases=aliases, help=help, description=help, formatter_class=HelpFormatter
        )
        sp.set_defaults(command=name)  # the command's own name, whichever alias was typed
        add_common(sp, suppress=True)
        if name in FROM_COMMANDS:
            add_from(sp, suppress=True)
        add_json(sp, suppress=True)
        return sp

    cmd("snapshot", "scan the running kernel now, record it, print it")
    sp = cmd("show", "show one recorded boot (default: the current one)")
    sp.add_argument("boot", nargs="?", metavar="BOOT", help="boot-id or a unique prefix of one")
    cmd("boots", "list recorded boots, newest first")
    add_queries(cmd)
    sp = cmd("gc", "remove boots beyond the retention policy and unused symbol tables")
    sp.add_argument("--keep-boots", type=int, metavar="N", help="keep the N newest boots")
    sp.add_argument("--keep-days", type=float, metavar="D", help="keep boots first seen in D days")
    cmd("status", "the daemon's health, or the store's counts when no daemon runs")
    cmd(
        "line-tables",
        "list the builds whose source line tables the store keeps, their sizes"
        " and where their debuginfo came from",
    )
    cmd(
        "watch",
        "print module and kernel code loads and unloads as kreld records them (needs the daemon)",
    )
    sp = cmd(
        "resolve",
        "say which image and section holds each address (exit 1 when one lies in none)",
    )
    sp.add_argument("addresses", nargs="+", metavar="ADDR", help="hex address (0x optional)")
    at_options(sp)
    lines_options(sp)
    return p


def add_queries(cmd: Callable[..., argparse.ArgumentParser]) -> None:
    """The commands that ask about a boot at a time: modules, symbolize, export."""
    sp = cmd("modules", "list module incarnations loaded at a time")
    at_options(sp)
    sp.add_argument("--all", action="store_true", help="the boot's whole module history")
    sp = cmd(
        "kernel-code",
        "list BPF programs, trampolines, ftrace and kprobe pages live at a time",
        aliases=("code",),  # its first name, kept for scripts that use it
    )
    at_options(sp)
    sp.add_argument("--all", action="store_true", help="the boot's whole history of them")
    sp = cmd(
        "symbolize", "symbolize addresses read from stdin (one per line, or perf script output)"
    )
    at_options(sp)
    for_option(
        sp,
        "name the [unknown] kernel frames of its perf script output on stdin (with --json:"
        " an array, one object per sample with kernel frames: sample, time, kernel_frames,"
        " each address, symbol, dso, possible; with --lines, frames or no_lines too)",
    )
    lines_options(sp)
    sp = cmd("export", "export a recorded boot's symbols for other tools")
    sp.add_argument("what", choices=["kallsyms"], help="kallsyms: a file as /proc/kallsyms")
    at_options(sp)
    for_option(sp, "the boot and module loads it was recorded on (no --boot needed)")
    sp.add_argument(
        "-o", "--output", metavar="FILE",
        help="write FILE safely: a temporary file renamed over it, a device or FIFO in place,"
        " a link to a file refused (default: stdout)",
    )  # fmt: skip
    sp = cmd(
        "inject",
        "write a perf.data that maps the modules loaded while it was recorded (as perf inject)",
    )
    sp.add_argument(
        "-i",
        "--input",
        required=True,
        metavar="IN.data",
        help="the recording: a regular file, in file or pipe mode (not stdin: it is read twice)",
    )
    sp.add_argument(
        "-o", "--output", default="-", metavar="FILE",
        help="the new perf.data (default: stdout, for a pipe-mode recording; --json's"
        " summary then goes to stderr)",
    )  # fmt: skip


def at_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--boot", metavar="BOOT", help="boot-id or prefix (default: current)")
    sp.add_argument(
        "--at",
        metavar="T",
        help="a time on --clock: nanoseconds, seconds with an 's' suffix, "
        "or (realtime) an ISO-8601 date; default: now",
    )
    sp.add_argument(
        "--clock",
        choices=[c.value for c in Clock],
        default=Clock.MONOTONIC.value,
        help="the clock --at is on (default monotonic; perf samples on it only "
        "with perf record -k monotonic, its default clock is local_clock())",
    )


def lines_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--lines",
        action="store_true",
        help="also name each address's source file, line and inline chain (innermost"
        " first) from the debuginfo of its build, found by build-id",
    )
    sp.add_argument(
        "--debuginfo-dir",
        dest="debuginfo_dirs",
        action="append",
        default=[],
        metavar="DIR",
        help="with --lines: a directory of debug files (Debian, Fedora or .build-id"
        " layout), searched before /usr/lib/debug and [kernel] debuginfo_dirs; repeatable",
    )


def for_option(sp: argparse.ArgumentParser, what: str) -> None:
    sp.add_argument("--for", dest="for_perf", metavar="PERF.DATA", help=f"a perf.data: {what}")


#: The commands that can read a fleet bucket instead of the store (``--from``);
#: the others write, or ask the daemon for what only it knows.
FROM_COMMANDS = (
    "boots",
    "show",
    "modules",
    "kernel-code",
    "resolve",
    "symbolize",
    "export",
    "inject",
)


def add_from(p: argparse.ArgumentParser, suppress: bool = False) -> None:
    p.add_argument(
        "--from",
        dest="source",
        metavar="s3://BUCKET/PREFIX",
        default=argparse.SUPPRESS if suppress else None,
        help="read the fleet bucket kreld hosts publish to (read-only; docs/FLEET.md): "
        + ", ".join(FROM_COMMANDS),
    )


def add_json(p: argparse.ArgumentParser, suppress: bool = False) -> None:
    p.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS if suppress else False,
        help="print JSON (addresses as 0x strings)",
    )


_SECONDS = re.compile(r"(-?)(\d+)(?:\.(\d{1,9}))?s")


def parse_time(text: str, clock: Clock) -> int:
    """``--at`` as nanoseconds on *clock*, exactly: integer arithmetic throughout
    (a realtime value in nanoseconds is past 2^53, where a float loses ~256 ns)."""
    import datetime as dt

    s = text.strip()
    if re.fullmatch(r"-?\d+", s):
        return int(s)
    if m := _SECONDS.fullmatch(s):
        sign, whole, frac = m.groups()
        ns = int(whole) * 1_000_000_000 + int((frac or "").ljust(9, "0"))
        return -ns if sign else ns
    if clock is Clock.REALTIME:
        try:
            when = dt.datetime.fromisoformat(s.replace("Z", "+00:00"))
        except ValueError:
            pass
        else:
            if when.tzinfo is None:
                when = when.replace(tzinfo=dt.UTC)
            since = when - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
            seconds = since.days * 86_400 + since.seconds
            return seconds * 1_000_000_000 + since.microseconds * 1_000
    raise InvalidArgument("--at", f"not a time: {text!r}")


_HEX_TOKEN = re.compile(r"(?<![0-9A-Za-z_])(?:0x)?([0-9a-fA-F]{8,16})(?![0-9A-Za-z_])")


def addresses_in(line: str) -> list[str]:
    """Addresses in a line: the line itself, or hex words of ``perf script`` output."""
    s = line.strip()
    if not s:
        return []
    try:
        return [hexaddr(parse_addr(s)) or ""]
    except ValueError:
        pass
    out = []
    for m in _HEX_TOKEN.finditer(s):
        value = int(m.group(1), 16)
        if value >= 1 << 47:  # kernel half of the address space
            out.append(f"{value:#x}")
    return out
