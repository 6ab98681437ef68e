"""A Go profiler's path to kreld: the bindings varlink/go's generator
(``varlink-go-interface-generator``, Debian's golang-github-varlink-go-dev, varlink/go
0.4.0) makes from ``kreld/io.kreld.varlink`` compile, and examples/go, built on them
at build time, offline, answers as kreldctl does from kreld running as a real
subprocess on a fake tree.

The generator turns each error ``E`` into a type ``E`` and a method ``ReplyE`` of
``VarlinkCall``, which embeds the library's ``varlink.Call``; each method ``M`` into a
function ``M``, a type ``M_methods`` and a method ``ReplyM``
(cmd/varlink-go-interface-generator/main.go).  A name that meets another, or one of
the library's, breaks the generated package: an error named ``Error`` made
``ReplyError(ctx, message)``, which hides ``varlink.Call.ReplyError(ctx, name,
params)`` that every other ``ReplyE`` calls.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kreld.varlink.interface import IO_KRELD, Interface, parse_interface

from support.faketree import FakeTree
from support.run import Daemon, ctl_json, kreldctl, start
from support.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "go"
IDL = REPO / "kreld" / "io.kreld.varlink"
MODULE_BASE = 0xFFFFFFFFC0000000
MISSING_BOOT = "00000000-0000-4000-8000-000000000000"

# What the generated package declares besides the interface's own names, and the
# methods VarlinkCall gets from varlink.Call (varlink/go 0.4.0: call.go,
# orgvarlinkservice.go).
GENERATED = {"Dispatch_Error", "VarlinkCall", "VarlinkInterface", "VarlinkNew"}
CALL_METHODS = {
    "WantsMore", "WantsUpgrade", "IsOneway", "GetParameters", "Reply", "ReplyError",
    "ReplyInterfaceNotFound", "ReplyMethodNotFound", "ReplyMethodNotImplemented",
    "ReplyInvalidParameter",
}  # fmt: skip


def go_name_clashes(iface: Interface) -> list[str]:
    """Every name the generator would declare twice for *iface*: package-level
    identifiers, and the methods of VarlinkCall."""
    package: dict[str, str] = {n: "the generator's own" for n in GENERATED}
    call: dict[str, str] = {n: "varlink.Call's" for n in CALL_METHODS}
    clashes: list[str] = []

    def declare(table: dict[str, str], name: str, what: str) -> None:
        if name in table:
            clashes.append(f"{name}: {what} meets {table[name]}")
        table[name] = what

    for t in iface.types:
        declare(package, t, f"type {t}")
    for e in iface.errors:
        declare(package, e, f"error {e}")
        declare(call, f"Reply{e}", f"error {e}'s reply")
    for m in iface.methods:
        declare(package, m, f"method {m}")
        declare(package, f"{m}_methods", f"method {m}")
        declare(call, f"Reply{m}", f"method {m}'s reply")
    return clashes


def test_no_name_of_io_kreld_meets_another_in_the_generated_go_package() -> None:
    """io.kreld's types, errors and methods give the generated package no name twice,
    and none hides a method of varlink.Call; the check finds the old error Error."""
    assert go_name_clashes(IO_KRELD) == []
    old = parse_interface(IDL.read_text().replace("error InternalError (", "error Error ("))
    assert go_name_clashes(old) == ["ReplyError: error Error's reply meets varlink.Call's"]


# -- the Go toolchain, from Debian's packages ---------------------------------------------------


def varlink_go_source() -> Path:
    """Where examples/go/go.mod's replace points varlink/go (Debian's package)."""
    m = re.search(
        r"^replace github\.com/varlink/go => (\S+)$", (EXAMPLE / "go.mod").read_text(), re.M
    )
    assert m, "examples/go/go.mod replaces github.com/varlink/go"
    return Path(m[1])


def go_missing() -> str | None:
    if shutil.which("go") is None:
        return "no go toolchain (Debian: golang-go, which scripts/setup installs)"
    src = varlink_go_source()
    if not (src / "varlink" / "connection.go").is_file():
        return f"no varlink/go source at {src} (Debian: golang-github-varlink-go-dev)"
    return None


needs_go = pytest.mark.skipif(go_missing() is not None, reason=go_missing() or "")


def go_env(work: Path) -> dict[str, str]:
    """Offline and self-contained: no module proxy, caches under *work*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GO")}
    env.update(
        GOPROXY="off", GOFLAGS="-mod=readonly", GOCACHE=str(work / "gocache"),
        GOPATH=str(work / "gopath"), GO111MODULE="on",
    )  # fmt: skip
    return env


def go(work: Path, src: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cp = subprocess.run(
        ["go", *args], cwd=src, env=go_env(work), capture_output=True, text=True, timeout=300
    )
    assert cp.returncode == 0, f"go {' '.join(args)} -> {cp.returncode}\n{cp.stdout}{cp.stderr}"
    return cp


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """examples/go copied beside a copy of the interface (as in the checkout), its
    bindings generated and the program built: (work dir, source dir, binary)."""
    work = tmp_path_factory.mktemp("go")
    src = work / "examples" / "go"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("kreld-profiler", "iokreld.go"))
    (work / "kreld").mkdir()
    shutil.copy(IDL, work / "kreld" / IDL.name)
    go(work, src, "generate")
    go(work, src, "build", "-o", "kreld-profiler", ".")
    return work, src, src / "kreld-profiler"


@needs_go
def test_go_generate_makes_bindings_of_this_interface_that_build_and_vet_clean(
    built: tuple[Path, Path, Path],
) -> None:
    """``go generate`` runs varlink/go's own generator on the checkout's interface
    (its errors as Go types, InternalError among them), and the package it writes
    builds and passes ``go vet`` with nothing to say."""
    work, src, binary = built
    generated = (src / "iokreld" / "iokreld.go").read_text()
    assert generated.startswith("// Code generated by github.com/varlink/go/cmd/")
    for e in IO_KRELD.errors:
        assert f"\ntype {e} struct" in generated
    assert "func (c *VarlinkCall) ReplyInternalError(ctx context.Context, message_ string)" in (
        generated
    )
    assert binary.is_file()
    vet = go(work, src, "vet", "./...")
    assert vet.stdout == vet.stderr == ""


# -- examples/go against kreld -----------------------------------------------------------------


class Lines:
    """The JSON lines a running program prints, each read when it comes."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.proc, self.fd, self.buf = proc, proc.stdout.fileno(), b""

    def next(self, timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            assert left > 0, f"no line in {timeout} s: {self.buf[-500:]!r}"
            if select.select([self.fd], [], [], left)[0]:
                chunk = os.read(self.fd, 65536)
                assert chunk, f"the program exited {self.proc.wait()} with {self.buf!r}"
                self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)


def without_nulls(v: Any) -> Any:
    """*v* with every null member dropped (the generated Go types omit them)."""
    if isinstance(v, dict):
        return {k: without_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [without_nulls(x) for x in v]
    return v


@pytest.fixture
def profiler(
    built: tuple[Path, Path, Path], daemon_factory: Any, tree: FakeTree, state_dir: Path,
    sockdir: Path,
) -> Iterator[tuple[Path, FakeTree, Path]]:  # fmt: skip
    """The built program, and kreld serving a fake tree on which dummy was loaded."""
    tree.add_module("dummy", MODULE_BASE)
    sock = sockdir / "kreld.sock"
    d: Daemon = start(daemon_factory, tree, state_dir, sock)
    yield built[2], tree, sock
    assert d.stop() == 0


def modules(sock: Path, *args: str) -> list[dict[str, Any]]:
    mods = ctl_json("modules", "--socket", str(sock), *args)
    assert isinstance(mods, list)
    return mods


def resolved_by_kreldctl(sock: Path, addrs: list[str], at: int) -> list[dict[str, Any]]:
    cp = kreldctl("resolve", *addrs, "--at", str(at), "--socket", str(sock), "--json", check=False)
    assert cp.returncode in (0, 1), cp.stderr  # 1: an address no image held
    out = json.loads(cp.stdout)
    assert isinstance(out, list)
    return out


@needs_go
def test_go_profiler_answers_as_kreldctl_and_follows_a_module_load(
    profiler: tuple[Path, FakeTree, Path],
) -> None:
    """The Go program's GetBoot is kreldctl show's boot; its Resolve of a batch at the
    time dummy was loaded (since unloaded) is kreldctl resolve --at's, dummy included;
    its Subscribe prints the snapshot, then the load of a module made while it runs,
    as kreldctl modules then lists it, and it stops after -events 1."""
    binary, tree, sock = profiler
    dummy = wait_until("dummy recorded", lambda: modules(sock))[0]
    assert dummy["name"] == "dummy"
    tree.remove_module("dummy")
    wait_until("dummy unloaded", lambda: modules(sock) == [])
    at = dummy["loaded"]["monotonic"] + 1
    addrs = [f"{tree.text + 0x1010:#x}", f"{tree.text + 0x2000:#x}", f"{MODULE_BASE + 0x10:#x}"]
    addrs.append("0x1234")
    expected = wait_until(
        "kernel symbols cached",
        lambda: (r := resolved_by_kreldctl(sock, addrs, at))[0].get("symbol") and r,
    )
    assert (expected[0]["symbol"], expected[0]["symbol_offset"]) == ("start_kernel", "0x10")
    assert (expected[2]["image"], expected[2]["offset"]) == ("dummy", "0x10")
    assert expected[3] == {"address": "0x1234"}

    argv = [str(binary), "-socket", str(sock), "-at", str(at), "-events", "1", "-timeout", "60s"]
    proc = subprocess.Popen([*argv, *addrs], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        lines = Lines(proc)
        assert lines.next() == {"boot": without_nulls(ctl_json("show", "--socket", str(sock)))}
        assert lines.next() == {"resolved": expected}
        # The fake tree has no kernel code: an empty list, not null (it was read).
        assert lines.next() == {"event": "snapshot", "modules": [], "kernel_code": []}
        tree.add_module("veth", MODULE_BASE + 0x100000)
        event = lines.next()
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, stderr
    [veth] = modules(sock)
    assert event == {"event": "load", "module": without_nulls(veth)}
    assert veth["name"] == "veth" and veth["sections"][".text"] == f"{MODULE_BASE + 0x100000:#x}"


@needs_go
def test_go_profiler_names_kreld_errors_through_the_generated_types(
    profiler: tuple[Path, FakeTree, Path],
) -> None:
    """kreld's named errors reach the Go program as the generated error types, and it
    exits as kreldctl would: 3 for a boot kreld never recorded (io.kreld.NoSuchBoot with
    its boot_id), 2 for an address that is not hex; 1 when -timeout passes before
    -events (the snapshot printed, no event came)."""
    binary, _, sock = profiler

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [str(binary), "-socket", str(sock), *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    cp = run("-boot", MISSING_BOOT)
    assert cp.returncode == 3 and cp.stdout == ""
    assert f"io.kreld.NoSuchBoot(Boot_id: {MISSING_BOOT})" in cp.stderr
    cp = run("0xffffffffzz")
    assert cp.returncode == 2 and '"0xffffffffzz": not a hex address' in cp.stderr
    cp = run("-events", "3", "-timeout", "1s")
    assert cp.returncode == 1 and "0 of 3 events in 1s" in cp.stderr, cp.stderr
    first, snapshot = (json.loads(line) for line in cp.stdout.splitlines())
    assert first["boot"]["boot_id"] == ctl_json("show", "--socket", str(sock))["boot_id"]
    assert snapshot["event"] == "snapshot"
    assert [m["name"] for m in snapshot["modules"]] == ["dummy"]
