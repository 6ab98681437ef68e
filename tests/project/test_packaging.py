"""Packaging: the systemd units, the man pages, the default config and ``make install``.

The man pages are parsed and compared with the live argparse parsers and the
config schema, so that a new option, subcommand or key that is not documented
(or a documented one that went away) fails here.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kreld import daemon
from kreld.config.settings import SCHEMA, Config, load_config
from kreld.core import consts
from kreld.core import log as klog
from kreld.core.errors import EXIT_STATUS, ConfigError, ExitCode
from kreld.ctl import args as kreldctl

REPO = Path(__file__).resolve().parents[2]
MAN = REPO / "man"
UNITS = REPO / "systemd"
KRELD = Path(sys.executable).parent / "kreld"

# --- roff ------------------------------------------------------------------------

_FONT = re.compile(r"\\f([BI])(.*?)\\f[RP]")
# A bold option and, right after it, its italic argument: \fB\-\-at\fR \fIT\fR
_OPTION = re.compile(r"\\fB(\\-(?:\\-|\w)*)\\fR(?: \\fI([^\\]+)\\fR)?")


def unescape(s: str) -> str:
    for esc, text in (
        ("\\-", "-"),
        ("\\(dq", '"'),
        ("\\&", ""),
        ("\\c", ""),
        ("\\ ", " "),
        ("\\e", "\\"),
    ):
        s = s.replace(esc, text)
    return re.sub(r"\\f[BIRP]", "", s)


def plain(lines: list[str] | str) -> str:
    """The text of roff lines: request names and quotes dropped, escapes resolved."""
    text = lines if isinstance(lines, str) else "\n".join(lines)
    out = []
    for line in text.splitlines():
        if line.startswith('.\\"'):
            continue
        if line.startswith("."):
            _, _, line = line.partition(" ")
            line = line.replace('"', "")
        out.append(unescape(line))
    return " ".join(out)


def sections(page: str, marker: str = ".SH") -> dict[str, list[str]]:
    """Lines under each ``.SH`` (or ``.SS``) heading, by heading."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in page.splitlines():
        if line.startswith(marker + " "):
            current = out.setdefault(line[len(marker) + 1 :].strip().strip('"'), [])
        elif current is not None:
            current.append(line)
    return out


def tagged(lines: list[str]) -> list[tuple[str, str]]:
    """``.TP`` entries: (tag line, paragraph)."""
    entries = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == ".TP" and i + 1 < len(lines):
            tag, body = lines[i + 1], []
            i += 2
            while i < len(lines) and not re.match(r"\.(TP|SH|SS|PP|LP|P)\b", lines[i]):
                body.append(lines[i])
                i += 1
            entries.append((tag, "\n".join(body)))
        else:
            i += 1
    return entries


def page(name: str) -> str:
    return (MAN / name).read_text()


# --- argparse --------------------------------------------------------------------


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings]


def positionals(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if not a.option_strings and not isinstance(a, argparse._SubParsersAction)
    ]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command by its own name (aliases left out: they are documented with it)."""
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return {c.dest: a.choices[c.dest] for c in a._choices_actions}
    return {}


@dataclass
class Documented:
    """One documented option: its option strings, argument name and paragraph."""

    strings: set[str]
    metavar: str | None
    text: str


def documented_options(lines: list[str]) -> list[Documented]:
    out = []
    for tag, body in tagged(lines):
        found = _OPTION.findall(tag)
        if found:
            metavars = {m for _, m in found if m}
            assert len(metavars) <= 1, tag
            out.append(
                Documented(
                    {unescape(o) for o, _ in found},
                    metavars.pop() if metavars else None,
                    plain(body),
                )
            )
    return out


def check_documented(action: argparse.Action, doc: Documented, where: str) -> None:
    """The option's argument is named as argparse names it; choices are listed."""
    name = "/".join(action.option_strings)
    takes_value = action.nargs != 0
    assert (doc.metavar is not None) == takes_value, f"{where}: {name} argument"
    if action.metavar is not None:
        assert doc.metavar == action.metavar, f"{where}: {name} is {action.metavar}"
    for choice in action.choices or ():
        assert re.search(rf"\b{re.escape(str(choice))}\b", doc.text), (
            f"{where}: {name} does not list its choice {choice!r}"
        )


def compare_options(
    actions: list[argparse.Action], docs: list[Documented], where: str
) -> dict[str, Documented]:
    by_string = {s: d for d in docs for s in d.strings}
    wanted = {s for a in actions for s in a.option_strings}
    assert wanted - by_string.keys() == set(), f"{where}: options not documented"
    assert by_string.keys() - wanted == set(), f"{where}: documented options that do not exist"
    for a in actions:
        docs_of = {id(by_string[s]) for s in a.option_strings}
        assert len(docs_of) == 1, f"{where}: {a.option_strings} documented apart"
        check_documented(a, by_string[a.option_strings[0]], where)
    return by_string


def exit_codes_of_epilog(epilog: str) -> set[int]:
    section = epilog.split("exit status:", 1)[1]
    return {int(n) for n in re.findall(r"^\s+(\d+)\s", section, re.M)}


def documented_exit_codes(text: str) -> dict[int, str]:
    return {
        int(plain(tag)): plain(body)
        for tag, body in tagged(sections(text)["EXIT STATUS"])
        if plain(tag).strip().isdigit()
    }


# --- man pages: drift against the parsers and the schema -----------------------------


@pytest.mark.parametrize("name", ["kreld.8", "kreldctl.1", "kreld.toml.5"])
def test_man_page_has_the_standard_sections(name: str) -> None:
    text = page(name)
    title = re.search(r"^\.TH (\S+) (\d)", text, re.M)
    assert title is not None
    assert (title[1].lower(), title[2]) == tuple(name.rsplit(".", 1))
    wanted = {"NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "FILES", "EXAMPLES", "SEE ALSO"}
    wanted |= {
        "kreld.8": {"EXIT STATUS", "SIGNALS"},
        "kreldctl.1": {"COMMANDS", "EXIT STATUS"},
    }.get(name, set())
    assert wanted <= sections(text).keys()


@pytest.mark.skipif(
    shutil.which("groff") is None, reason="groff is not installed (scripts/setup installs it)"
)
@pytest.mark.parametrize("name", ["kreld.8", "kreldctl.1", "kreld.toml.5"])
def test_groff_reports_no_warning(name: str) -> None:
    cp = subprocess.run(
        ["groff", "-man", "-ww", "-z", str(MAN / name)], capture_output=True, text=True
    )
    assert (cp.returncode, cp.stderr) == (0, "")


@pytest.mark.skipif(
    shutil.which("mandoc") is None, reason="mandoc is not installed (scripts/setup installs it)"
)
@pytest.mark.parametrize("name", ["kreld.8", "kreldctl.1", "kreld.toml.5"])
def test_mandoc_lint_reports_no_warning(name: str) -> None:
    cp = subprocess.run(
        ["mandoc", "-T", "lint", "-W", "warning", str(MAN / name)], capture_output=True, text=True
    )
    assert (cp.returncode, cp.stdout + cp.stderr) == (0, "")


def test_kreld_8_documents_exactly_kreld_options() -> None:
    parser = daemon.build_parser()
    text = page("kreld.8")
    docs = compare_options(
        options(parser), documented_options(sections(text)["OPTIONS"]), "kreld.8 OPTIONS"
    )
    assert positionals(parser) == []
    # The synopsis shows every option.
    synopsis = plain(sections(text)["SYNOPSIS"])
    for a in options(parser):
        assert any(s in synopsis.split() for s in a.option_strings), a.option_strings
    for opt, default in (
        ("--config", consts.DEFAULT_CONFIG),
        ("--state-dir", consts.DEFAULT_STATE_DIR),
        ("--socket", consts.DEFAULT_SOCKET),
        ("--log-level", Config().log_level),
        ("--log-format", Config().log_format),
    ):
        assert f"default {default}" in docs[opt].text, opt


def test_kreldctl_1_documents_exactly_its_commands_and_options() -> None:
    parser = kreldctl.build_parser()
    text = page("kreldctl.1")
    sect = sections(text)
    option_sections = sections("\n".join(sect["OPTIONS"]), ".SS")
    common = options(parser)
    common_strings = {s for a in common for s in a.option_strings}
    docs = compare_options(
        common, documented_options(option_sections["Common options"]), "kreldctl.1 common options"
    )
    for opt, default in (
        ("--config", consts.DEFAULT_CONFIG),
        ("--state-dir", consts.DEFAULT_STATE_DIR),
        ("--socket", consts.DEFAULT_SOCKET),
    ):
        assert f"default {default}" in docs[opt].text, opt

    # Every option of a command, once, under "Command options".
    commands = subcommands(parser)
    per_command = {
        name: [a for a in options(sp) if not set(a.option_strings) & common_strings]
        for name, sp in commands.items()
    }
    command_docs = documented_options(option_sections["Command options"])
    by_string = {s: d for d in command_docs for s in d.strings}
    every = {s for acts in per_command.values() for a in acts for s in a.option_strings}
    assert every - by_string.keys() == set(), "command options not documented"
    assert by_string.keys() - every == set(), "documented command options that do not exist"
    for name, acts in per_command.items():
        for a in acts:
            check_documented(a, by_string[a.option_strings[0]], f"kreldctl {name}")

    # COMMANDS: one entry per subcommand, its synopsis naming its own options
    # and arguments, nothing more.
    entries = {}
    for tag, body in tagged(sect["COMMANDS"]):
        words = _FONT.findall(tag)
        assert words and words[0][0] == "B", tag
        entries[unescape(words[0][1])] = (tag, plain(body))
    assert sorted(entries) == sorted(commands), "COMMANDS differs from kreldctl's subcommands"
    for name, sp in commands.items():
        tag = entries[name][0]
        shown = {unescape(o): m or None for o, m in _OPTION.findall(tag)}
        acts = per_command[name]
        by_string = {s: a for a in acts for s in a.option_strings}
        assert shown.keys() <= by_string.keys(), f"kreldctl {name}: unknown options shown"
        assert sorted(id(by_string[s]) for s in shown) == sorted(id(a) for a in acts), (
            f"kreldctl {name}: each option shown once"
        )
        for s, metavar in shown.items():
            assert (metavar is not None) == (by_string[s].nargs != 0), f"kreldctl {name} {s}"
        rest = _OPTION.sub("", tag)
        words = [(f, unescape(w)) for f, w in _FONT.findall(rest)][1:]
        literals = {w for f, w in words if f == "B"}
        placeholders = {w for f, w in words if f == "I"}
        args = positionals(sp)
        assert literals == {str(c) for a in args if a.choices for c in a.choices}, name
        assert placeholders == {a.metavar for a in args if not a.choices}, name
        for a in args:
            if a.nargs == "?":
                assert f"[\\fI{a.metavar}\\fR]" in tag, f"kreldctl {name}: [{a.metavar}]"
            if a.nargs == "+":
                assert f"\\fI{a.metavar}\\fR..." in tag, f"kreldctl {name}: {a.metavar}..."


def example_commands(text: str, program: str) -> list[list[str]]:
    """The command lines of *program* in a page's EXAMPLES, as argv (after the name)."""
    examples = "\n".join(sections(text)["EXAMPLES"])
    argvs = []
    for block in re.findall(r"^\.EX\n(.*?)^\.EE", examples, re.M | re.S):
        shell = unescape(block).replace("\\\n", " ")  # continued lines
        for line in shell.splitlines():
            if not line.startswith(("$ ", "# ")):
                continue
            for part in line[2:].split("|"):
                words = shlex.split(part)
                if words and words[0] == program:
                    argvs.append(words[1:])
    return argvs


@pytest.mark.parametrize(
    ("name", "program", "build"),
    [("kreld.8", "kreld", daemon.build_parser), ("kreldctl.1", "kreldctl", kreldctl.build_parser)],
)
def test_examples_parse_with_the_real_parsers(
    name: str, program: str, build: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    argvs = example_commands(page(name), program)
    assert argvs, f"{name} shows no {program} command"
    for argv in argvs:
        try:
            build().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{name}: {program} {' '.join(argv)}: {capsys.readouterr().err}")


def test_exit_status_sections_match_the_exit_codes() -> None:
    """Help and man pages list the same codes with the same words: both are made
    from EXIT_STATUS, and every code kreldctl can end with is in its table."""
    ctl_codes = documented_exit_codes(page("kreldctl.1"))
    assert set(ctl_codes) == {int(c) for c in ExitCode} == exit_codes_of_epilog(kreldctl.epilog())
    for code, (_short, sentence) in EXIT_STATUS["kreldctl"].items():
        assert ctl_codes[code] == sentence
    kreld_codes = documented_exit_codes(page("kreld.8"))
    assert set(kreld_codes) == exit_codes_of_epilog(daemon.epilog()) == set(EXIT_STATUS["kreld"])
    assert "configuration" in kreld_codes[ExitCode.CONFIG]
    assert "store" in kreld_codes[ExitCode.STORE]
    cp = subprocess.run([KRELD, "--no-such-option"], capture_output=True, text=True, timeout=30)
    assert cp.returncode == ExitCode.USAGE


def test_kreld_8_describes_the_varlink_interface_signals_and_journal_fields() -> None:
    text = page("kreld.8")
    sect = sections(text)
    interface = (REPO / "kreld" / "io.kreld.varlink").read_text()
    methods = set(re.findall(r"^method (\w+)\(", interface, re.M))
    errors = {f"io.kreld.{e}" for e in re.findall(r"^error (\w+) ", interface, re.M)}
    varlink = sect["VARLINK INTERFACE"]
    assert {plain(tag) for tag, _ in tagged(varlink)} == methods
    assert set(re.findall(r"io\.kreld\.\w+", plain(varlink))) == errors
    assert "PermissionDenied" in plain(sect["ACCESS CONTROL"])
    assert "SO_PEERCRED" in plain(sect["ACCESS CONTROL"])
    signals = plain(sect["SIGNALS"])
    for sig in ("SIGTERM", "SIGINT", "SIGHUP"):
        assert sig in signals
    for key in daemon.RESTART_KEYS:
        assert re.search(rf"\b{key}\b", signals), f"SIGHUP: {key} needs a restart"
    logging = plain(sect["LOGGING"])
    for field in (
        "PRIORITY=",
        "SYSLOG_IDENTIFIER=kreld",
        "KRELD_EVENT=",
        *klog._WELL_KNOWN.values(),
    ):
        assert field in logging, field


def _toml_value(literal: str) -> Any:
    return tomllib.loads(f"v = {literal}")["v"]


def _default(attr: str) -> Any:
    value = getattr(Config(), attr)
    return list(value) if isinstance(value, tuple) else value


def test_kreld_toml_5_documents_exactly_the_schema_with_its_defaults() -> None:
    tables = sections("\n".join(sections(page("kreld.toml.5"))["OPTIONS"]), ".SS")
    assert sorted(t.strip("[]") for t in tables) == sorted(SCHEMA)
    for table, lines in tables.items():
        section = table.strip("[]")
        keys = {}
        for tag, body in tagged(lines):
            key = re.match(r"\\fB(\w+)=\\fR", tag)
            assert key, tag
            keys[key[1]] = body
        assert sorted(keys) == sorted(SCHEMA[section]), f"[{section}]"
        for key, body in keys.items():
            literal = re.search(r"Default: \\fB(.+?)\\fR", body)
            assert literal, f"{section}.{key}: no default"
            attr = SCHEMA[section][key][0]
            assert _toml_value(unescape(literal[1])) == _default(attr), f"{section}.{key}"


def test_kreld_toml_5_examples_are_what_kreld_accepts_and_says(tmp_path: Path) -> None:
    blocks = re.findall(r"^\.EX\n(.*?)^\.EE", page("kreld.toml.5"), re.M | re.S)
    dropin, error = (unescape(b) for b in blocks)
    path = dropin.splitlines()[0].removeprefix("# ")
    assert path.startswith("/etc/kreld/kreld.toml.d/")
    main = tmp_path / "kreld.toml"
    main.write_text("")
    (tmp_path / "kreld.toml.d").mkdir()
    (tmp_path / "kreld.toml.d" / Path(path).name).write_text(dropin)
    cfg = load_config(str(main))
    assert cfg.allowed_groups == ("kreld", "perf") and cfg.keep_days == 90
    # The error shown is the one kreld gives for that typo.
    bad = tmp_path / "kreld.toml.d" / Path(path).name
    bad.write_text(dropin.replace("keep_days", "keep_dayz"))
    with pytest.raises(ConfigError) as e:
        load_config(str(main))
    assert f"kreld: {e.value}".replace(str(bad), path) == error.strip()


def test_default_config_file_lists_every_key_with_its_default(tmp_path: Path) -> None:
    """etc/kreld/kreld.toml: every key commented out with its default, nothing else."""
    text = (REPO / "etc/kreld/kreld.toml").read_text()
    assert load_config(str(REPO / "etc/kreld/kreld.toml")) == Config()
    uncommented = re.sub(r"^#(\w+ = )", r"\1", text, flags=re.M)
    data = tomllib.loads(uncommented)
    assert sorted(data) == sorted(SCHEMA)
    for section, keys in SCHEMA.items():
        assert sorted(data[section]) == sorted(keys), f"[{section}]"
        for key, (attr, _) in keys.items():
            assert data[section][key] == _default(attr), f"{section}.{key}"
    f = tmp_path / "kreld.toml"
    f.write_text(uncommented)
    assert load_config(str(f)) == Config()


# --- the units -------------------------------------------------------------------


def unit(name: str) -> dict[str, list[str]]:
    """key -> values (in order) of a unit file, sections flattened."""
    out: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


# STYLE.md's hardening list.  Three switches are off on purpose (the unit says
# why): ProtectKernelTunables=yes hides /proc/kallsyms, ProtectKernelLogs=yes
# drops CAP_SYSLOG, ProtectKernelModules=yes hides /usr/lib/modules.
HARDENING = {
    "Type": "notify",
    "Restart": "on-failure",
    "StateDirectory": "kreld",
    "ConfigurationDirectory": "kreld",
    "UMask": "0077",
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "ProtectControlGroups": "yes",
    "ProtectClock": "yes",
    "ProtectHostname": "yes",
    "RestrictAddressFamilies": "AF_UNIX AF_NETLINK",
    "IPAddressDeny": "any",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "MemoryDenyWriteExecute": "yes",
    "SystemCallArchitectures": "native",
    "CapabilityBoundingSet": "CAP_SYSLOG CAP_PERFMON",
    "AmbientCapabilities": "CAP_SYSLOG CAP_PERFMON",
    "ProtectKernelTunables": "no",
    "ProtectKernelLogs": "no",
    "ProtectKernelModules": "no",
}


def test_service_unit_carries_the_hardening_and_agrees_with_kreld() -> None:
    svc = unit("kreld.service")
    for key, value in HARDENING.items():
        assert svc.get(key) == [value], key
    assert svc["SystemCallFilter"][0] == "@system-service"
    # The module tracepoints: perf_event_open (in @debug) allowed, tracefs mounted first.
    assert svc["SystemCallFilter"][1] == "perf_event_open"
    assert "sys-kernel-tracing.mount" in " ".join(svc["After"]).split()
    assert "PrivateNetwork" not in svc, "a private network namespace gets no uevents"
    assert svc["WatchdogSec"] and svc["ExecStart"] == ["/usr/bin/kreld"]
    assert svc["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert "kreld.socket" in svc["Requires"][0].split()
    assert "kreld.socket" in " ".join(svc["After"]).split()
    assert {ExitCode.STORE, ExitCode.CONFIG} <= {
        int(c) for c in svc["RestartPreventExitStatus"][0].split()
    }
    assert "/var/lib/" + svc["StateDirectory"][0] == consts.DEFAULT_STATE_DIR
    assert str(Path(consts.DEFAULT_CONFIG).parent) == "/etc/" + svc["ConfigurationDirectory"][0]
    for doc in svc["Documentation"][0].split():
        m = re.fullmatch(r"man:(.+)\((\d)\)", doc)
        assert m, doc
        assert (MAN / f"{m[1]}.{m[2]}").is_file(), doc
    assert "InaccessiblePaths" in svc and "-/proc/kcore" in svc["InaccessiblePaths"][0].split()


def test_socket_and_sysusers_agree_with_kreld() -> None:
    sock = unit("kreld.socket")
    assert sock["ListenStream"] == [consts.DEFAULT_SOCKET]
    assert sock["SocketMode"] == ["0660"]
    assert sock["SocketGroup"] == [Config().socket_group]
    assert Config().socket_group in Config().allowed_groups
    sysusers = [
        line.split()
        for line in (UNITS / "kreld.sysusers").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert sysusers == [["g", Config().socket_group, "-", "-"]]


# --- make install ------------------------------------------------------------------


@dataclass
class Installed:
    dest: Path
    prefix: str
    site: Path  # the package's site directory, inside dest

    def path(self, rel: str) -> Path:
        return self.dest / rel.lstrip("/")


def make(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-C", str(REPO), *args], capture_output=True, text=True, timeout=120, **kw
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    tmp = tmp_path_factory.mktemp("install")
    dest = tmp / "root"
    cp = make(
        "install",
        "PREFIX=/usr",
        f"DESTDIR={dest}",
        f"PYTHON={sys.executable}",
        "NO_DEPS=1",
        f"BUILDDIR={tmp / 'build'}",
    )
    assert cp.returncode == 0, cp.stdout + cp.stderr
    (init,) = dest.glob("usr/lib/python3*/*-packages/kreld/__init__.py")
    yield Installed(dest, "/usr", init.parent.parent)


def test_install_puts_every_file_where_systemd_and_man_look(installed: Installed) -> None:
    files = {
        "/usr/bin/kreld": 0o755,
        "/usr/bin/kreldctl": 0o755,
        "/usr/lib/systemd/system/kreld.service": 0o644,
        "/usr/lib/systemd/system/kreld.socket": 0o644,
        "/usr/lib/sysusers.d/kreld.conf": 0o644,
        "/etc/kreld/kreld.toml": 0o644,
        "/usr/share/man/man1/kreldctl.1": 0o644,
        "/usr/share/man/man5/kreld.toml.5": 0o644,
        "/usr/share/man/man8/kreld.8": 0o644,
    }
    for rel, mode in files.items():
        p = installed.path(rel)
        assert p.is_file(), rel
        assert p.stat().st_mode & 0o777 == mode, rel
    assert (
        installed.path("/etc/kreld/kreld.toml").read_text()
        == (REPO / "etc/kreld/kreld.toml").read_text()
    )
    service = installed.path("/usr/lib/systemd/system/kreld.service").read_text()
    assert re.findall(r"^ExecStart=(.*)$", service, re.M) == ["/usr/bin/kreld"]
    for name in ("kreld", "kreldctl"):
        shebang = installed.path(f"/usr/bin/{name}").read_text().splitlines()[0]
        assert shebang == f"#!{sys.executable}"
    pkg = installed.site / "kreld"
    shipped = {p.name for p in (REPO / "kreld").iterdir() if p.suffix in (".py", ".varlink")}
    assert shipped <= {p.name for p in pkg.iterdir()}
    (dist,) = installed.site.glob("kreld-*.dist-info")
    assert "kreld = kreld.programs:kreld" in (dist / "entry_points.txt").read_text()
    if shutil.which("man") is not None:
        env = dict(os.environ, MANPATH=str(installed.path("/usr/share/man")))
        for section, name in (("1", "kreldctl"), ("5", "kreld.toml"), ("8", "kreld")):
            cp = subprocess.run(
                ["man", "-w", section, name], capture_output=True, text=True, env=env
            )
            assert cp.stdout.strip() == str(
                installed.path(f"/usr/share/man/man{section}/{name}.{section}")
            ), name


def test_installed_programs_run_from_the_installed_package(installed: Installed) -> None:
    env = dict(os.environ, PYTHONPATH=str(installed.site))
    cp = subprocess.run(
        [sys.executable, "-c", "import kreld; print(kreld.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=installed.dest,
    )
    assert Path(cp.stdout.strip()).parent == installed.site / "kreld"
    for name, words in (("kreld", ["--log-format", "exit status"]), ("kreldctl", ["resolve"])):
        cp = subprocess.run(
            [installed.path(f"/usr/bin/{name}"), "--help"],
            capture_output=True,
            text=True,
            env=env,
            cwd=installed.dest,
            timeout=60,
        )
        assert cp.returncode == 0, cp.stderr
        assert cp.stdout.startswith(f"usage: {name} ")
        for w in words:
            assert w in cp.stdout


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="needs systemd-sysusers")
def test_installed_sysusers_file_creates_the_socket_group(installed: Installed) -> None:
    root = installed.dest.parent / "sysusers-root"
    shutil.copytree(installed.dest, root, symlinks=True)
    cp = subprocess.run(
        ["systemd-sysusers", f"--root={root}"], capture_output=True, text=True, timeout=60
    )
    assert cp.returncode == 0, cp.stderr
    groups = [line.split(":")[0] for line in (root / "etc/group").read_text().splitlines()]
    assert groups == [Config().socket_group]


def _verify(root: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    cp = subprocess.run(
        ["systemd-analyze", "verify", "--recursive-errors=no", f"--root={root}", *extra,
         "kreld.service", "kreld.socket"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    return cp.returncode, cp.stdout + cp.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_analyze_verify_passes_on_the_installed_units(installed: Installed) -> None:
    # verify --root= looks up the units by name in the root's unit path, and
    # the programs they run in it too: ExecReload's /bin/kill is the host's.
    kill = shutil.which("kill", path="/bin:/usr/bin")
    assert kill, "no kill(1) on this host"
    (installed.dest / "bin").mkdir(exist_ok=True)
    shutil.copy(kill, installed.dest / "bin/kill")
    if shutil.which("man") is not None:
        # ... and checks Documentation= with man(1): the installed pages.
        env = dict(os.environ, MANPATH=str(installed.path("/usr/share/man")))
        rc, out = _verify(installed.dest, env=env)
    else:
        rc, out = _verify(installed.dest, "--man=no")
    assert (rc, out) == (0, "")

    # The same check fails on a unit it should refuse.
    broken = installed.dest.parent / "broken-root"
    shutil.copytree(installed.dest, broken, symlinks=True)
    svc = broken / "usr/lib/systemd/system/kreld.service"
    svc.write_text(svc.read_text().replace("Type=notify", "Type=notify\nWatchdogSecs=5"))
    rc, out = _verify(broken, "--man=no")
    assert rc != 0 and "WatchdogSecs" in out


def _security(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", f"--root={root}", *extra,
         "kreld.service"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_analyze_security_rates_the_service_ok_or_better(installed: Installed) -> None:
    cp = _security(installed.dest)
    if cp.returncode != 0 and "offline" in cp.stderr:
        pytest.skip(f"systemd-analyze security cannot run offline here: {cp.stderr.strip()}")
    m = re.search(r"Overall exposure level for kreld\.service: (\d+\.\d) (\w+)", cp.stdout)
    assert m, cp.stdout + cp.stderr
    score, verdict = float(m[1]), m[2]
    assert verdict in ("PERFECT", "SAFE", "OK"), f"{score} {verdict}"
    assert score < 5.0
    # --threshold is on a 0-100 scale: anything above "OK" fails the command.
    assert _security(installed.dest, "--threshold=49").returncode == 0


def test_install_keeps_an_existing_config_and_rewrites_execstart_for_the_prefix(
    tmp_path: Path,
) -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    dest = tmp_path / "root"
    conf = dest / "etc/kreld/kreld.toml"
    conf.parent.mkdir(parents=True)
    conf.write_text("[modules]\npoll_interval = 2.0\n")
    common = [f"DESTDIR={dest}", "PREFIX=/usr/local", f"PYTHON={sys.executable}"]
    cp = make("install-data", *common)
    assert cp.returncode == 0, cp.stderr
    assert conf.read_text() == "[modules]\npoll_interval = 2.0\n"
    service = (dest / "usr/local/lib/systemd/system/kreld.service").read_text()
    assert re.findall(r"^ExecStart=(.*)$", service, re.M) == ["/usr/local/bin/kreld"]
    assert (dest / "usr/local/lib/sysusers.d/kreld.conf").is_file()
    assert (dest / "usr/local/share/man/man8/kreld.8").is_file()
    cp = make("uninstall", *common)
    assert cp.returncode == 0, cp.stderr
    assert [p for p in dest.rglob("*") if p.is_file()] == [conf]


# --- a bad configuration stops kreld ----------------------------------------------------


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ("[limits]\nmax_conections = 5\n", "limits.max_conections"),
        ('[modules]\npoll_interval = "fast"\n', "modules.poll_interval"),
        ("[limits]\nmax_connections = 0\n", "limits.max_connections"),
        ('[log]\nlevel = "verbose"\n', "log.level"),
        ("[nosuch]\nkey = 1\n", "[nosuch]"),
        ("[paths]\nstate_dir = /var\n", "line 2"),
    ],
)
def test_bad_config_makes_kreld_exit_6_naming_the_key(
    tmp_path: Path, content: str, named: str
) -> None:
    cfg = tmp_path / "kreld.toml"
    cfg.write_text(content)
    state = tmp_path / "state"
    cp = subprocess.run(
        [KRELD, "--config", str(cfg), "--state-dir", str(state), "--socket",
         str(tmp_path / "k.sock"), "--root", str(tmp_path)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert cp.returncode == ExitCode.CONFIG == 6
    assert cp.stderr.startswith(f"kreld: {cfg}: ")
    assert named in cp.stderr
    assert not state.exists() and not (tmp_path / "k.sock").exists()


def test_bad_drop_in_makes_kreld_exit_6_naming_the_drop_in(tmp_path: Path) -> None:
    cfg = tmp_path / "kreld.toml"
    cfg.write_text("[limits]\nmax_connections = 100\n")
    (tmp_path / "kreld.toml.d").mkdir()
    bad = tmp_path / "kreld.toml.d" / "50-bad.toml"
    bad.write_text('[access]\nallowed_uids = ["root"]\n')
    cp = subprocess.run(
        [KRELD, "--config", str(cfg), "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert cp.returncode == 6
    assert f"{bad}: access.allowed_uids: expected a list of numeric uids" in cp.stderr
