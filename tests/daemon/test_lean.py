"""Startup and memory: what kreld leaves out, and what it lets go."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from kreld.client import Client
from kreld.config.settings import load_config
from kreld.core import uuids
from kreld.core.errors import ConfigError
from kreld.kernel.kallsyms import KallsymsText

from support.faketree import FakeTree
from support.run import kreldctl, start
from support.smaps import file_rss
from support.startup import HEAVY, imported_by, run_cli
from support.symbols import symbol_worker
from support.wait import wait_until

COMMENTS = "# kreld's configuration: every key at its default.\n\n  #[log]\n\t# level = 'info'\n"


def test_uuids_read_and_print_what_the_uuid_module_does() -> None:
    for text in [
        "{12345678-1234-5678-1234-567812345678}",
        "12345678123456781234567812345678",
        "urn:uuid:12345678-1234-5678-1234-567812345678",
        "ABCDEF00-1234-5678-1234-567812345678",
    ]:
        assert uuids.canonical(text) == str(uuid.UUID(text))
        assert uuids.to_bytes(text) == uuid.UUID(text).bytes
    for _ in range(200):
        u = uuid.uuid4()
        assert uuids.to_text(u.bytes) == str(u)
    for bad in ["", "x" * 32, "1234", "12345678-1234-5678-1234-5678123456789", " " + "a" * 31]:
        with pytest.raises(ValueError):
            uuids.to_bytes(bad)


def test_a_config_of_only_comments_is_the_defaults_and_a_setting_after_them_counts(
    tmp_path: Path,
) -> None:
    cfg = tmp_path / "kreld.toml"
    cfg.write_text(COMMENTS)
    assert load_config(str(cfg)).log_level == load_config(None).log_level
    cfg.write_text(COMMENTS + "[log]\nlevel = 'debug'\n")
    assert load_config(str(cfg)).log_level == "debug"
    cfg.write_bytes(b"# \xff\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(cfg))


def test_kreldctl_show_with_a_commented_config_loads_no_toml_hash_uuid_or_logging(
    tree: FakeTree, tmp_path: Path
) -> None:
    cfg = tmp_path / "kreld.toml"
    cfg.write_text(COMMENTS)
    common = ["--config", str(cfg), "--root", str(tree.root), "--state-dir", str(tmp_path / "s")]
    kreldctl("snapshot", *common)
    mods = imported_by(run_cli(["show", "--json", *common]))
    assert {"kreld.store", "lmdb"} <= mods  # it did read the store
    assert mods & {"tomllib", "uuid", "hashlib", "_hashlib", "ssl"} == set()
    assert {m.split(".")[0] for m in mods} & HEAVY == set()


def test_the_symbol_worker_lets_go_of_the_raw_kallsyms_once_captured(
    tree: FakeTree, tmp_path: Path
) -> None:
    with symbol_worker(tree, tmp_path / "state") as (store, stored, _capture):
        assert store.boot_symbols(stored.boot_id) is not None  # it did capture
        gc.collect()
        assert [o for o in gc.get_objects() if isinstance(o, KallsymsText)] == []
    assert json.dumps(stored.to_json())  # the boot stays usable


def test_importing_the_daemon_loads_no_fleet_publishing() -> None:
    """kreld.fleet.publish (zstandard, the S3 client) only when ``[publish]`` is set."""
    mods = imported_by("import kreld.daemon")
    assert "kreld.daemon" in mods
    assert (
        mods
        & {"kreld.fleet.publish", "kreld.fleet.objects", "kreld.store.pubstate", "kreld.fleet.s3"}
        == set()
    )
    assert mods & {"zstandard", "configparser", "obstore"} == set()


HEAP_PROBE = """
import sys
from kreld.core import heap
if sys.argv[1] == "tune":
    assert heap.tune()
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
big = bytearray(4 << 20)  # freed, a mapped block: glibc would raise its threshold
del big
before = anon()
held, pins = [], []
for _ in range(20):  # 30 MiB of 1.5 MiB buffers, each with a small block that outlives it
    held.append(b"\\1" * (1536 << 10))
    pins.append(b"\\2" * (100 << 10))
del held
print(anon() - before)
"""


def test_the_daemons_heap_tuning_gives_freed_large_buffers_back() -> None:
    """With glibc's threshold fixed (kreld.core.heap.tune, at the daemon's start),
    freed 1.5 MiB buffers between blocks still in use leave the process;
    without, glibc keeps them: less than half as much stays resident."""

    def kept(mode: str) -> int:
        cp = subprocess.run(
            [sys.executable, "-c", HEAP_PROBE, mode], capture_output=True, text=True, check=True
        )
        return int(cp.stdout)

    tuned, default = kept("tune"), kept("default")
    assert default > 30 << 20  # the 30 MiB freed stayed: what the tuning is for
    assert tuned < default / 2


def test_the_daemon_serves_without_loading_openssl(
    tree: FakeTree, tmp_path: Path, daemon_factory: Any
) -> None:
    """asyncio would load ssl (OpenSSL) only to offer TLS; kreld's socket is AF_UNIX."""
    d = start(daemon_factory, tree, tmp_path / "state", tmp_path / "kreld.sock")
    assert Client(str(tmp_path / "kreld.sock")).call("GetBoot")["boot"]["boot_id"] == tree.boot_id
    maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
    mapped = {line.split()[-1] for line in maps.splitlines() if "/" in line}
    assert not [p for p in mapped if "libssl" in p or "/_ssl." in p], sorted(mapped)
    assert any("/_asyncio." in p for p in mapped)  # the probe sees extension modules
    assert d.stop() == 0


def test_a_process_that_loaded_ssl_keeps_it_when_it_imports_the_daemon() -> None:
    code = "import ssl, kreld.daemon, sys; print(sys.modules['ssl'] is ssl, ssl.OPENSSL_VERSION)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("True OpenSSL")


def test_the_daemon_process_holds_ssl_out_of_asyncio_alone_so_https_needs_no_undoing() -> None:
    """The entry point imports asyncio without ssl and leaves no trace: an https
    debuginfod server, reached through http.client later, finds TLS there."""
    code = (
        "import kreld.programs as p, sys; p.lean_process(); import kreld.daemon; "
        "print('ssl' in sys.modules, sys.modules['asyncio.sslproto'].ssl is None); "
        "import http.client; print(hasattr(http.client, 'HTTPSConnection')); "
        "from kreld.debuginfo.fetch import _tls_context; print(type(_tls_context()).__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "True", "SSLContext"]


def test_importing_the_daemon_module_changes_no_global_state() -> None:
    """Only the entry point (kreld.programs.lean_process) keeps ssl out: a program
    that imports kreld.daemon as a library can still import ssl afterwards."""
    code = "import kreld.daemon, sys; import ssl; print(ssl.OPENSSL_VERSION)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("OpenSSL")


def test_the_daemon_gives_freed_heap_back_once_large_calls_stop(
    tree: FakeTree, tmp_path: Path, daemon_factory: Any
) -> None:
    """A burst of Resolve calls of thousands of addresses (answered on the
    worker thread) leaves freed buffers in glibc's arenas; once no such call
    has come for a while they are given back, and again after the next burst."""
    sock = tmp_path / "kreld.sock"
    d = start(daemon_factory, tree, tmp_path / "state", sock, "--log-level", "debug")
    # Resolve names kernel addresses from the captured table: wait for it.
    d.wait_for("kernel_symbols")
    for burst in (1, 2):
        with Client(str(sock), timeout=60) as c:
            for k in range(5):
                addresses = [hex(tree.text + 0x10 * (i + k)) for i in range(5000)]
                reply = c.call("Resolve", addresses=addresses)
                assert sum(1 for s in reply["symbol"] if s >= 0) == 5000
        trimmed = d.wait_for("heap_trimmed", timeout=30, count=burst)
        assert trimmed["rss_before"] > 0 and trimmed["rss_after"] > 0
    assert d.stop() == 0


def test_resolve_without_lines_loads_no_numpy_and_its_store_pages_go_once_calls_stop(
    tree: FakeTree, tmp_path: Path, daemon_factory: Any
) -> None:
    """Resolve names a batch with the standard library: the daemon maps no
    numpy library for it, the kernel's addresses alone or with a module's
    (numpy's import would cost the daemon some 20 MiB for the rest of its
    life); and the store's pages the calls read leave its resident set once
    they stop, with the heap they freed."""
    tree.add_module("dummy", 0xFFFFFFFFC0000000)
    sock, state = tmp_path / "kreld.sock", tmp_path / "state"
    d = start(daemon_factory, tree, state, sock, "--log-level", "debug")
    kernel = [hex(tree.text + 0x10 * i + 3) for i in range(5000)]
    mixed = kernel[:2000] + [hex(0xFFFFFFFFC0000000 + 0x10 * i) for i in range(2000)]
    with Client(str(sock), timeout=60) as c:
        wait_until(
            "the kernel's symbol table",
            lambda: c.call("Resolve", addresses=kernel[:1])["symbol"][0] >= 0,
        )
        for batch in (kernel, mixed):
            reply = c.call("Resolve", addresses=batch)
            assert sum(1 for s in reply["symbol"] if s >= 0) >= 2000
            assert reply["regions"][0]["image"] == "kernel"
    held = file_rss(state / "data.mdb", d.proc.pid)
    assert held > 0  # the calls read the tables in the map
    d.wait_for("heap_trimmed", timeout=30)
    maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
    mapped = {line.split()[-1] for line in maps.splitlines() if "/" in line}
    assert not [p for p in mapped if "numpy" in p or "openblas" in p.lower()], sorted(mapped)
    assert any("/orjson" in p for p in mapped)  # the probe sees what Resolve did load
    assert file_rss(state / "data.mdb", d.proc.pid) < held / 2, held
    assert d.stop() == 0
