"""Hostile configuration: every case is refused as a ConfigError naming the
file and the key or line, exit 6, by ``kreld --config`` and by ``kreldctl`` alike, in
bounded memory and time, never a traceback, a hang or all the memory there is.

Each run is the program as a child of the test under RLIMIT_AS of 512 MiB and a
timeout, its peak resident memory and CPU from ``wait4`` through tests/support/peak.py
(faultlib.run_measured).  Drop-ins are tried like the main file, and a running
daemon given a hostile drop-in on SIGHUP keeps its configuration and serves on.
"""

from __future__ import annotations

import os
import signal
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from kreld.client import Client
from kreld.config import files, shape
from kreld.core import consts
from kreld.core.errors import ExitCode

from support.faketree import FakeTree
from support.faultlib import run_measured
from support.run import bin_path, start

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

AS_LIMIT = 512 << 20
RSS_BOUND_KIB = 128 << 10  # kreld's imports and the largest file tomllib may parse
TIMEOUT = 30.0
DEEP = 100_000  # levels (the inline tables: half as many, to stay under the size cap)


class Run:
    def __init__(self, argv: list[str], rc: int, err: str, maxrss_kib: int, cpu_s: float):
        self.argv, self.rc, self.err, self.maxrss_kib, self.cpu_s = argv, rc, err, maxrss_kib, cpu_s

    def __repr__(self) -> str:
        return (
            f"{self.argv[0]}: rc={self.rc} maxrss={self.maxrss_kib} KiB cpu={self.cpu_s:.2f}s\n"
            f"stderr: {self.err[-2000:]}"
        )


def run(program: str, *args: str) -> Run:
    argv = [bin_path(program), *args]
    with tempfile.TemporaryFile() as err:
        m = run_measured(argv, stdout=err, stderr=err, timeout=TIMEOUT, as_limit=AS_LIMIT)
        if m.timed_out:
            pytest.fail(f"{' '.join(argv)} still running after {TIMEOUT} s (it hung)")
        err.seek(0)
        return Run(argv, m.rc, err.read().decode(errors="replace"), m.maxrss_kib, m.cpu_s)


def both(tmp: Path, *args: str) -> list[Run]:
    """*args* given to kreld (which must stop before its store and socket) and to
    kreldctl (which must stop before reading anything)."""
    state, sock = tmp / "state", tmp / "k.sock"
    daemon = run("kreld", *args, "--state-dir", str(state), "--socket", str(sock))
    assert not state.exists() and not sock.exists(), daemon
    ctl = run("kreldctl", *args, "--state-dir", str(state), "status")
    return [daemon, ctl]


def assert_config_error(runs: list[Run], *words: str) -> None:
    for r in runs:
        assert r.rc == ExitCode.CONFIG == 6, r
        assert "Traceback" not in r.err, r
        prog = Path(r.argv[0]).name
        assert r.err.startswith(f"{prog}: "), r
        for w in words:
            assert w in r.err, (w, r)
        assert len(r.err) < 4000, "the message is bounded, whatever the value"
        assert r.maxrss_kib < RSS_BOUND_KIB, r


def config(tmp: Path, text: str | bytes, name: str = "kreld.toml") -> Path:
    p = tmp / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


# -- values ----------------------------------------------------------------------------------

NUL_CASES = [
    ('[paths]\nstate_dir = "/var/lib/kr\\u0000eld"\n', "paths.state_dir"),
    ('[paths]\nsocket = "/run/kreld/k\\u0000.sock"\n', "paths.socket"),
    ('[paths]\nroot = "/\\u0000"\n', "paths.root"),
    ('[kernel]\ndebuginfo_dirs = ["/usr/lib/debug", "/x\\u0000y"]\n', "kernel.debuginfo_dirs"),
    ('[access]\nsocket_group = "kre\\u0000ld"\n', "access.socket_group"),
    ('[access]\nallowed_groups = ["\\u0000"]\n', "access.allowed_groups"),
]


@pytest.mark.parametrize(("text", "key"), NUL_CASES, ids=[k for _, k in NUL_CASES])
def test_a_nul_byte_in_a_path_or_name_is_a_config_error(
    tmp_path: Path, text: str, key: str
) -> None:
    cfg = config(tmp_path, text)
    assert_config_error(both(tmp_path, "--config", str(cfg)), f"{cfg}: {key}", "NUL")


def test_a_socket_path_longer_than_sun_path_takes_is_refused_at_config_time(
    tmp_path: Path,
) -> None:
    """109 bytes (past sun_path) and 99 (past it with the temporary name kreld binds
    first); in the file and on the command line.  98 bytes is taken."""
    for size in (109, consts.MAX_SOCKET_PATH + 1, 400):
        path = "/tmp/" + "s" * (size - 5)
        cfg = config(tmp_path, f'[paths]\nsocket = "{path}"\n')
        assert_config_error(
            both(tmp_path, "--config", str(cfg)), f"{cfg}: paths.socket", f"has {size}"
        )
        runs = [run("kreld", "--socket", path, "--state-dir", str(tmp_path / "state"))]
        runs.append(run("kreldctl", "--socket", path, "status"))
        assert_config_error(runs, "the command line: --socket", f"has {size}")
    ok = "/tmp/" + "s" * (consts.MAX_SOCKET_PATH - 5)
    cfg = config(tmp_path, f'[paths]\nsocket = "{ok}"\n')
    r = run("kreldctl", "--config", str(cfg), "--state-dir", str(tmp_path / "st"), "status")
    assert r.rc == ExitCode.STORE and "no kreld store here" in r.err, r


ENDPOINTS = [
    "http://",
    "https://",
    "http://:9000",
    "http://host:99999",
    "http://host:0",
    "http://host:port",
    "ftp://host",
    "http://user:secret@host",
    "http://ho st",
    "http://host/\\u0000",
    "http://[::1",
    "http://-/",
]


@pytest.mark.parametrize("url", ENDPOINTS)
def test_an_endpoint_url_without_a_usable_host_and_port_is_refused(
    tmp_path: Path, url: str
) -> None:
    cfg = config(tmp_path, f'[publish]\nendpoint_url = "{url}"\n')
    assert_config_error(both(tmp_path, "--config", str(cfg)), f"{cfg}: publish.endpoint_url")


NUMBERS = [
    ("[limits]\nmax_connections = 1" + "0" * 5000 + "\n", "(4300 digits)"),
    ("[limits]\nmax_connections = 1000000000000000000\n", "limits.max_connections"),
    ("[limits]\nmax_connections_per_uid = 0\n", "limits.max_connections_per_uid"),
    ("[limits]\nidle_timeout = inf\n", "limits.idle_timeout"),
    ("[limits]\nidle_timeout = 1" + "0" * 400 + "\n", "limits.idle_timeout"),
    ("[modules]\npoll_interval = nan\n", "modules.poll_interval"),
    ("[retention]\nkeep_days = -1\n", "retention.keep_days"),
    ("[retention]\nkeep_boots = 1e300\n", "retention.keep_boots"),
    ("[access]\nallowed_uids = [4294967296]\n", "access.allowed_uids"),
    ("[access]\nallowed_uids = [" + "0," * 2000 + "]\n", "at most 1024"),
]


@pytest.mark.parametrize(("text", "named"), NUMBERS, ids=[n for _, n in NUMBERS])
def test_every_number_is_range_checked(tmp_path: Path, text: str, named: str) -> None:
    cfg = config(tmp_path, text)
    assert_config_error(both(tmp_path, "--config", str(cfg)), str(cfg), named)


def test_invalid_utf8_is_a_named_error_with_its_place(tmp_path: Path) -> None:
    cfg = config(tmp_path, b'[log]\nlevel = "\xff\xfe"\n')
    assert_config_error(both(tmp_path, "--config", str(cfg)), "not UTF-8 (byte 15, line 2)")


def test_a_huge_unknown_key_is_named_in_a_bounded_message(tmp_path: Path) -> None:
    cfg = config(tmp_path, "[limits]\n" + "k" * 200_000 + " = 1\n")
    assert_config_error(both(tmp_path, "--config", str(cfg)), "limits.kkk", "unknown key")


# -- the shape of the text -------------------------------------------------------------------

SHAPES = [
    ("[kernel]\ndebuginfo_dirs = " + "[" * DEEP + "]" * DEEP + "\n", "nested deeper than 32"),
    ("[kernel]\ndebuginfo_dirs = " + "[" * DEEP + "\n", "nested deeper than 32"),
    (
        "[kernel]\nx = " + "{a=" * (DEEP // 2) + "1" + "}" * (DEEP // 2) + "\n",
        "nested deeper than 32",
    ),
    ("[kernel]\ndebuginfo_dirs." + ".".join(["a"] * DEEP) + " = 1\n", "more than 32 parts"),
    ("[" + ".".join(["k"] * DEEP) + "]\n", "more than 32 parts"),
]


@pytest.mark.parametrize(
    ("text", "named"), SHAPES, ids=["arrays", "unclosed", "tables", "dotted", "header"]
)
def test_nesting_and_dotted_keys_100000_deep_are_refused_before_parsing(
    tmp_path: Path, text: str, named: str
) -> None:
    """Arrays 100,000 deep were RecursionError; a dotted key of 100,000 parts ran for
    minutes and took all the memory (tomllib builds every prefix of the key)."""
    cfg = config(tmp_path, text)
    assert_config_error(both(tmp_path, "--config", str(cfg)), str(cfg), named, "line ")


def test_nesting_up_to_the_cap_is_parsed_and_checked_as_usual(tmp_path: Path) -> None:
    depth = shape.MAX_NESTING - 1  # the [kernel] header's bracket is one level
    cfg = config(tmp_path, "[kernel]\ndebuginfo_dirs = " + "[" * depth + "]" * depth + "\n")
    assert_config_error(
        both(tmp_path, "--config", str(cfg)),
        "kernel.debuginfo_dirs: expected a non-empty string, got [[[[...]]]]",
    )


# -- what is at the path ---------------------------------------------------------------------


def fifo(p: Path) -> Path:
    os.mkfifo(p)
    return p


def unix_socket(p: Path) -> Path:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(p))
    s.close()
    return p


def big(p: Path) -> Path:
    p.write_text("# x\n" * (files.MAX_FILE_BYTES // 4 + 1))
    return p


PLACES: list[tuple[str, Callable[[Path], Path], str]] = [
    ("dev-zero", lambda p: (p.symlink_to("/dev/zero"), p)[1], "a character device"),
    ("dev-urandom", lambda p: (p.symlink_to("/dev/urandom"), p)[1], "a character device"),
    ("fifo", fifo, "a FIFO"),
    ("socket", unix_socket, "a socket"),
    ("directory", lambda p: (p.mkdir(), p)[1], "a directory"),
    ("over-256-KiB", big, f"over the {files.MAX_FILE_BYTES:,}"),
]


@pytest.mark.parametrize(
    ("make", "named"), [(m, n) for _, m, n in PLACES], ids=[i for i, _, _ in PLACES]
)
def test_a_config_that_is_not_a_small_regular_file_is_refused_unread(
    tmp_path: Path, make: Callable[[Path], Path], named: str
) -> None:
    """/dev/zero would be all the memory, a FIFO a hang: both refused before a read."""
    d = tmp_path / "etc"
    d.mkdir()
    cfg = make(d / "kreld.toml")
    assert_config_error(both(tmp_path, "--config", str(cfg)), f"{cfg}: ", named)


@pytest.mark.parametrize(
    ("make", "named"), [(m, n) for _, m, n in PLACES], ids=[i for i, _, _ in PLACES]
)
def test_a_drop_in_that_is_not_a_small_regular_file_is_refused_unread(
    tmp_path: Path, make: Callable[[Path], Path], named: str
) -> None:
    cfg = config(tmp_path, "[log]\nlevel = 'info'\n")
    (tmp_path / "kreld.toml.d").mkdir()
    config(tmp_path / "kreld.toml.d", "[log]\nlevel = 'debug'\n", "10-fine.toml")
    drop = make(tmp_path / "kreld.toml.d" / "50-bad.toml")
    assert_config_error(both(tmp_path, "--config", str(cfg)), f"{drop}: ", named)


def test_a_proc_file_that_claims_0_bytes_is_cut_off_at_the_cap(tmp_path: Path) -> None:
    """/proc/kallsyms says it has 0 bytes and holds megabytes: the read stops one
    byte past the cap."""
    if not Path("/proc/kallsyms").exists() or Path("/proc/kallsyms").stat().st_size != 0:
        pytest.skip("no /proc/kallsyms of size 0 here")
    assert_config_error(
        both(tmp_path, "--config", "/proc/kallsyms"), "/proc/kallsyms: ", "over the"
    )


def test_dev_null_is_an_empty_configuration(tmp_path: Path) -> None:
    r = run("kreldctl", "--config", "/dev/null", "--state-dir", str(tmp_path / "s"), "status")
    assert r.rc == ExitCode.STORE and "no kreld store here" in r.err, r


def test_too_many_drop_ins_or_bytes_in_all_are_refused(tmp_path: Path) -> None:
    cfg = config(tmp_path, "")
    dropins = tmp_path / "kreld.toml.d"
    dropins.mkdir()
    for i in range(files.MAX_DROPINS + 1):
        (dropins / f"{i:04}.toml").touch()
    assert_config_error(both(tmp_path, "--config", str(cfg)), f"{dropins}: more than 256")
    for p in dropins.iterdir():
        p.unlink()
    chunk = "# x\n" * (files.MAX_FILE_BYTES // 4 - 16)  # each under the cap of one file
    for i in range(files.MAX_TOTAL_BYTES // len(chunk) + 1):
        config(dropins, chunk, f"{i:02}.toml")
    assert_config_error(both(tmp_path, "--config", str(cfg)), "together are over 1,048,576")


# -- a running daemon -----------------------------------------------------------------------


def test_sighup_with_a_fifo_or_deep_drop_in_keeps_the_running_config_and_serves(
    daemon_factory: object, tmp_path: Path, sockdir: Path
) -> None:
    tree = FakeTree(tmp_path / "root")
    cfg = config(tmp_path, "[log]\nlevel = 'info'\n")
    dropins = tmp_path / "kreld.toml.d"
    dropins.mkdir()
    sock = sockdir / "k.sock"
    d = start(daemon_factory, tree, tmp_path / "state", sock, "--config", str(cfg))
    bad = [
        fifo(dropins / "50-fifo.toml"),
        config(dropins, "[kernel]\ndebuginfo_dirs = " + "[" * DEEP, "50-deep.toml"),
        (dropins / "50-zero.toml").symlink_to("/dev/zero") or dropins / "50-zero.toml",
    ]
    for n, drop in enumerate(bad, start=1):
        for other in bad:
            if other != drop and (other.exists() or other.is_symlink()):
                other.rename(other.with_suffix(".off"))
        if not drop.exists() and not drop.is_symlink():
            drop.with_suffix(".off").rename(drop)
        d.proc.send_signal(signal.SIGHUP)
        ev = d.wait_for("config_reload_failed", count=n, timeout=30)
        assert str(drop) in ev["error"], ev
        with Client(str(sock)) as c:
            assert c.call("GetBoot")["boot"]["boot_id"] == tree.boot_id
    assert d.proc.poll() is None
    assert d.stop() == 0
