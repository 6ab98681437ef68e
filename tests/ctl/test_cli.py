"""`kreldctl snapshot/show/boots` as a real subprocess on fake trees under --root."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from support.faketree import FakeTree
from support.run import ctl_json, kreldctl

TEXT2 = 0xFFFFFFFFA4200000
HEX = re.compile(r"^0x[0-9a-f]+$")


def common(tree: FakeTree, state: Path) -> list[str]:
    return ["--root", str(tree.root), "--state-dir", str(state)]


def check_addresses(boot: dict[str, Any], text: int) -> None:
    """Addresses travel as lowercase "0x..." strings, never JSON numbers."""
    anchors = boot["anchors"]
    assert set(anchors) == {"text", "stext", "etext", "sinittext", "einittext"}
    for value in anchors.values():
        assert isinstance(value, str) and HEX.match(value), value
    assert int(anchors["text"], 16) == text
    assert int(anchors["etext"], 16) == text + 0x1000000
    assert boot["kaslr_offset"] is None or HEX.match(boot["kaslr_offset"])


class Recorded:
    """A fake tree with two boots recorded; the second (current) one slid elsewhere."""

    def __init__(self, base: Path) -> None:
        self.tree = FakeTree(base / "root")
        self.state = base / "state"
        self.opts = common(self.tree, self.state)
        ctl_json("snapshot", *self.opts)
        self.first = self.tree.boot_id
        self.second = self.tree.new_boot(text=TEXT2)
        ctl_json("snapshot", *self.opts)


@pytest.fixture(scope="module")
def rec(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    """Shared by the read-only tests below (they never write to it)."""
    return Recorded(tmp_path_factory.mktemp("two-boots"))


def test_snapshot_prints_a_table_and_records_once(tree: FakeTree, state_dir: Path) -> None:
    cp = kreldctl("snapshot", *common(tree, state_dir))
    assert cp.stdout.startswith(f"Boot {tree.boot_id} recorded.\n")
    assert re.search(rf"^_text\s+{tree.text:#x}$", cp.stdout, re.M)
    assert re.search(rf"^Build-id\s+{tree.build_id}$", cp.stdout, re.M)
    assert re.search(r"^Release\s+6\.1\.0-fake$", cp.stdout, re.M)
    assert "warning" not in cp.stderr  # nothing restricted, nothing to warn about
    again = kreldctl("snapshot", *common(tree, state_dir))
    assert again.stdout.startswith(f"Boot {tree.boot_id} already recorded.\n")


def test_snapshot_json(tree: FakeTree, state_dir: Path) -> None:
    out = ctl_json("snapshot", *common(tree, state_dir))
    assert (out["new"], out["updated"]) == (True, False)
    boot = out["boot"]
    assert boot["boot_id"] == tree.boot_id
    assert boot["build_id"] == tree.build_id
    assert boot["release"] == "6.1.0-fake"
    assert boot["restricted"] is False
    assert boot["kaslr_offset"] is None and boot["kaslr_source"] is None
    check_addresses(boot, tree.text)
    again = ctl_json("snapshot", *common(tree, state_dir))
    assert (again["new"], again["updated"]) == (False, False)
    assert again["boot"] == boot


def test_boots_lists_newest_first(rec: Recorded) -> None:
    boots = ctl_json("boots", "--state-dir", str(rec.state))
    assert [b["boot_id"] for b in boots] == [rec.second, rec.first]
    check_addresses(boots[0], TEXT2)
    check_addresses(boots[1], 0xFFFFFFFF9D000000)
    assert boots[0]["first_seen"]["realtime"] > boots[1]["first_seen"]["realtime"]

    table = kreldctl("boots", "--state-dir", str(rec.state)).stdout.splitlines()
    assert table[0].split() == ["BOOT-ID", "FIRST-SEEN", "RELEASE", "BUILD-ID", "OFFSET"]
    assert [line.split()[0] for line in table[1:]] == [rec.second, rec.first]
    assert all(rec.tree.build_id in line and "6.1.0-fake" in line for line in table[1:])


def test_show_defaults_to_the_current_boot(rec: Recorded) -> None:
    boot = ctl_json("show", *rec.opts)
    assert boot["boot_id"] == rec.second
    check_addresses(boot, TEXT2)
    text = kreldctl("show", *rec.opts).stdout
    assert re.search(rf"^Boot\s+{rec.second}$", text, re.M)
    assert re.search(rf"^_text\s+{TEXT2:#x}$", text, re.M)


def test_show_a_boot_by_prefix(rec: Recorded) -> None:
    boot = ctl_json("show", rec.first[:8], *rec.opts)
    assert boot["boot_id"] == rec.first
    check_addresses(boot, 0xFFFFFFFF9D000000)
    assert ctl_json("show", rec.first.upper(), *rec.opts)["boot_id"] == rec.first
    text = kreldctl("show", rec.first[:6], *rec.opts).stdout
    assert re.search(rf"^Boot\s+{rec.first}$", text, re.M)


def test_show_unknown_boot_exits_3(rec: Recorded) -> None:
    prefix = next(c for c in "0123456789abcdef" if c not in (rec.first[0], rec.second[0]))
    unknown = prefix + "1234567-89ab-cdef-0123-456789abcdef"
    cp = kreldctl("show", unknown, *rec.opts, check=False)
    assert cp.returncode == 3
    assert f"no boot {unknown!r} is recorded" in cp.stderr
    assert cp.stdout == ""


def test_show_current_boot_not_yet_recorded_exits_3(tree: FakeTree, state_dir: Path) -> None:
    kreldctl("snapshot", *common(tree, state_dir))
    current = tree.new_boot()
    cp = kreldctl("show", "--json", *common(tree, state_dir), check=False)
    assert cp.returncode == 3
    assert current in cp.stderr


def test_ambiguous_boot_prefix_exits_3(tree: FakeTree, state_dir: Path) -> None:
    ids = ["abcd0001-0000-4000-8000-000000000001", "abcd0002-0000-4000-8000-000000000002"]
    for boot in ids:
        tree.write("proc/sys/kernel/random/boot_id", boot + "\n")
        kreldctl("snapshot", *common(tree, state_dir))
    cp = kreldctl("show", "abcd", *common(tree, state_dir), check=False)
    assert cp.returncode == 3
    assert "matches 2 boots" in cp.stderr
    assert ctl_json("show", "abcd0002", *common(tree, state_dir))["boot_id"] == ids[1]


def test_show_without_a_store_exits_5(tree: FakeTree, tmp_path: Path) -> None:
    cp = kreldctl("show", *common(tree, tmp_path / "none"), check=False)
    assert cp.returncode == 5
    assert "no kreld store" in cp.stderr
    assert not (tmp_path / "none").exists()  # a reader never creates one


@pytest.mark.parametrize(
    "order",
    [
        pytest.param(lambda c: [*c, "snapshot", "--json"], id="before"),
        pytest.param(lambda c: ["snapshot", "--json", *c], id="after"),
        pytest.param(lambda c: [c[0], c[1], "snapshot", c[2], c[3], "--json"], id="split"),
        pytest.param(lambda c: ["--json", *c, "snapshot"], id="json-first"),
    ],
)
def test_common_options_before_or_after_the_subcommand(
    tree: FakeTree, state_dir: Path, order
) -> None:
    cp = kreldctl(*order(common(tree, state_dir)))
    assert json.loads(cp.stdout)["boot"]["boot_id"] == tree.boot_id
    assert (state_dir / "data.mdb").is_file()
    # The store really is where --state-dir said, whatever the order of the options.
    listed = ctl_json("boots", "--state-dir", str(state_dir))
    assert [b["boot_id"] for b in listed] == [tree.boot_id]


def test_config_before_or_after_and_command_line_overrides_it(
    tree: FakeTree, tmp_path: Path
) -> None:
    from_cfg, from_cli = tmp_path / "cfg-state", tmp_path / "cli-state"
    cfg = tmp_path / "kreld.toml"
    cfg.write_text(f'[paths]\nstate_dir = "{from_cfg}"\nroot = "{tree.root}"\n')
    kreldctl("--config", str(cfg), "snapshot")
    assert (from_cfg / "data.mdb").is_file()
    assert ctl_json("show", "--config", str(cfg))["boot_id"] == tree.boot_id
    kreldctl("snapshot", "--config", str(cfg), "--state-dir", str(from_cli))
    assert (from_cli / "data.mdb").is_file()


@pytest.mark.parametrize(
    ("content", "named"),
    [
        pytest.param(
            '[kernel]\ndebuginfo_dir = ["/usr/lib/debug"]\n', "kernel.debuginfo_dir", id="key"
        ),
        pytest.param('[kernal]\ndebuginfo_dirs = ["/x"]\n', "[kernal]", id="section"),
        pytest.param(
            '[kernel]\ndebuginfo_dirs = ["relative"]\n', "kernel.debuginfo_dirs", id="value"
        ),
        pytest.param("[paths]\nstate_dir = 5\n", "paths.state_dir", id="type"),
        pytest.param("[paths\n", "line 1", id="toml"),
    ],
)
def test_bad_config_exits_6_naming_the_key(
    tree: FakeTree, state_dir: Path, tmp_path: Path, content: str, named: str
) -> None:
    cfg = tmp_path / "kreld.toml"
    cfg.write_text(content)
    cp = kreldctl("snapshot", "--config", str(cfg), *common(tree, state_dir), check=False)
    assert cp.returncode == 6, cp.stderr
    assert str(cfg) in cp.stderr and named in cp.stderr
    assert "Traceback" not in cp.stderr
    assert not state_dir.exists()  # nothing was recorded with a broken config


def test_missing_config_file_given_explicitly_exits_6(tree: FakeTree, tmp_path: Path) -> None:
    cp = kreldctl("boots", "--config", str(tmp_path / "nope.toml"), check=False)
    assert cp.returncode == 6
    assert "nope.toml" in cp.stderr


@pytest.mark.parametrize("command", ["snapshot", "status", "gc", "watch"])
@pytest.mark.parametrize("where", ["before", "after"])
def test_from_is_refused_by_commands_that_cannot_read_a_bucket(
    tree: FakeTree, state_dir: Path, command: str, where: str
) -> None:
    """--from is offered only where it works: elsewhere a usage error, before any
    store, daemon or bucket is touched."""
    src = ["--from", "s3://bucket/prefix"]
    argv = [*src, command] if where == "before" else [command, *src]
    cp = kreldctl(*argv, *common(tree, state_dir), check=False, timeout=30)
    assert cp.returncode == 2, cp.stderr
    assert "--from" in cp.stderr
    assert not state_dir.exists()


def test_help_of_a_command_offers_from_only_where_it_works() -> None:
    from kreld.ctl.args import FROM_COMMANDS

    for command in ("boots", "show", "modules", "kernel-code", "resolve", "symbolize", "export"):
        assert "--from" in kreldctl(command, "--help").stdout, command
    assert set(FROM_COMMANDS) >= {"boots", "show", "resolve", "inject"}
    for command in ("snapshot", "status", "gc", "watch"):
        assert "--from" not in kreldctl(command, "--help").stdout, command


@pytest.mark.parametrize(
    ("text", "clock", "ns"),
    [
        ("1733400000123456789", "realtime", 1733400000123456789),
        ("1733400000.123456789s", "realtime", 1733400000123456789),
        ("2.5s", "monotonic", 2_500_000_000),
        ("-0.000000001s", "boottime", -1),
        ("2024-12-05T12:00:00.000001Z", "realtime", 1733400000000001000),
        ("2024-12-05T13:00:00.000001+01:00", "realtime", 1733400000000001000),
    ],
)
def test_at_is_parsed_exactly_as_integers(text: str, clock: str, ns: int) -> None:
    """No float in between: a realtime time in nanoseconds keeps its last digit."""
    from kreld.core.model import Clock
    from kreld.ctl.args import parse_time

    assert parse_time(text, Clock(clock)) == ns


@pytest.mark.parametrize("text", ["1.5e9", "1.0000000001s", "s", "12ms", "2024-12-05"])
def test_at_that_is_not_a_time_is_a_usage_error(text: str) -> None:
    from kreld.core.errors import InvalidArgument
    from kreld.core.model import Clock
    from kreld.ctl.args import parse_time

    with pytest.raises(InvalidArgument):
        parse_time(text, Clock.MONOTONIC)
