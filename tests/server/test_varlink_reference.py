"""kreld through the reference varlink implementation (PyPI ``varlink``), as a new user
would try it: its scanner loads ``io.kreld``, and its command-line client and its library
call every method of kreld running as a real subprocess on a fake tree.

The reference client (varlink 31) has quirks on Python 3.11 that this harness works
around, here and nowhere in kreld:

* ``python -m varlink.cli call`` prints an error reply to stderr as a Python dict
  (``{'error': ..., 'parameters': {...}}``) and still exits 0: errors are read from
  stderr with :func:`ast.literal_eval`, not from the exit status.
* Its stdout to a pipe is block-buffered, so a streaming ``call --more`` runs with
  ``python -u`` to show each reply when it comes.
* Its library sockets block without a timeout: the streaming test hands it a socket
  with one, so that a missing event fails the test instead of hanging it.

``call`` sends ``"more": false`` explicitly on every call without ``--more``.
"""

from __future__ import annotations

import ast
import json
import os
import re
import select
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import varlink
from varlink import scanner

from kreld.client import resolutions
from kreld.core import consts
from kreld.varlink.interface import SERVICE_DESCRIPTION

from support.faketree import FakeTree
from support.run import Daemon, raw_exchange, start

REPO = Path(__file__).resolve().parents[2]
IDL = REPO / "kreld" / "io.kreld.varlink"

# The grammar of https://varlink.org/Interface-Definition, for names.
FIELD_NAME = re.compile(r"[A-Za-z](_?[A-Za-z0-9])*")
MEMBER_NAME = re.compile(r"[A-Z][A-Za-z0-9]*")
INTERFACE_NAME = re.compile(r"[a-z]([-]*[a-z0-9])*(\.[a-z0-9]([-]*[a-z0-9])*)+")

MISSING_BOOT = "00000000-0000-4000-8000-000000000000"
MODULE_BASE = 0xFFFFFFFFC0000000


def interface(text: str) -> scanner.Interface:
    return varlink.Interface(text)


def grammar_faults(iface: scanner.Interface) -> list[str]:
    """Every name in *iface* that the varlink grammar refuses, and every type it uses
    but does not declare (the reference scanner itself lets some of these through)."""
    faults: list[str] = []
    if not INTERFACE_NAME.fullmatch(iface.name):
        faults.append(f"interface name {iface.name!r}")

    def walk(t: Any, where: str, maybe: bool = False) -> None:
        if isinstance(t, scanner._Maybe):
            if maybe:
                faults.append(f"{where}: '??'")
            walk(t.element_type, where, maybe=True)
        elif isinstance(t, scanner._Array | scanner._Dict):
            walk(t.element_type, where)
        elif isinstance(t, scanner._Struct):
            for name, ft in t.fields.items():
                if not FIELD_NAME.fullmatch(name):
                    faults.append(f"{where}: field {name!r}")
                walk(ft, f"{where}.{name}")
        elif isinstance(t, scanner._Enum):
            faults.extend(f"{where}: enum {v!r}" for v in t.fields if not FIELD_NAME.fullmatch(v))
        elif isinstance(t, scanner._CustomType) and not isinstance(
            iface.members.get(t.name), scanner._Alias
        ):
            faults.append(f"{where}: undeclared type {t.name!r}")

    for name, m in iface.members.items():
        if not MEMBER_NAME.fullmatch(name):
            faults.append(f"member name {name!r}")
        if isinstance(m, scanner._Method):
            walk(m.in_type, f"{name}(in)")
            walk(m.out_type, f"{name}(out)")
        else:
            walk(m.type, name)
    return faults


def methods(iface: scanner.Interface) -> set[str]:
    return {n for n, m in iface.members.items() if isinstance(m, scanner._Method)}


def conforms(iface: scanner.Interface, t: Any, value: Any, where: str = "") -> None:
    """Assert that *value* is what type *t* of *iface* declares: every field declared,
    every field that is not optional present, each of its type."""
    if isinstance(t, scanner._Maybe):
        if value is not None:
            conforms(iface, t.element_type, value, where)
        return
    assert value is not None, f"{where}: null where the type is not optional"
    if isinstance(t, scanner._CustomType):
        conforms(iface, iface.members[t.name].type, value, where)
    elif isinstance(t, scanner._Struct):
        assert isinstance(value, dict), f"{where}: {value!r} is not an object"
        assert set(value) <= set(t.fields), f"{where}: undeclared {set(value) - set(t.fields)}"
        for name, ft in t.fields.items():
            if name in value:
                conforms(iface, ft, value[name], f"{where}.{name}")
            else:
                assert isinstance(ft, scanner._Maybe), f"{where}.{name} is missing"
    elif isinstance(t, scanner._Array):
        assert isinstance(value, list), f"{where}: {value!r} is not an array"
        for i, v in enumerate(value):
            conforms(iface, t.element_type, v, f"{where}[{i}]")
    elif isinstance(t, scanner._Dict):
        assert isinstance(value, dict), f"{where}: {value!r} is not a map"
        for k, v in value.items():
            conforms(iface, t.element_type, v, f"{where}[{k}]")
    elif isinstance(t, scanner._Enum):
        assert value in t.fields, f"{where}: {value!r} is not one of {list(t.fields)}"
    elif isinstance(t, bool):  # before int: the scanner's bool type is False
        assert isinstance(value, bool), f"{where}: {value!r} is not a bool"
    elif isinstance(t, int):
        assert isinstance(value, int) and not isinstance(value, bool), f"{where}: {value!r}"
    elif isinstance(t, float):
        assert isinstance(value, int | float) and not isinstance(value, bool), f"{where}"
    elif isinstance(t, str):
        assert isinstance(value, str), f"{where}: {value!r} is not a string"


def reply_conforms(iface: scanner.Interface, method: str, params: dict[str, Any]) -> None:
    conforms(iface, iface.get_method(method).out_type, params, f"{method}()")


def error_conforms(iface: scanner.Interface, error: str, params: dict[str, Any]) -> None:
    conforms(iface, iface.members[error.rpartition(".")[2]].type, params, error)


# -- the interface, parsed by the reference scanner ---------------------------------------------


def test_reference_scanner_loads_io_kreld_and_every_name_follows_the_grammar() -> None:
    """The reference scanner parses kreld/io.kreld.varlink (it refused the old Anchors
    fields _text, ...), and a walk of what it parsed finds no name the grammar forbids
    and no undeclared type; the same for kreld's org.varlink.service description."""
    iface = interface(IDL.read_text())
    assert iface.name == "io.kreld"
    assert grammar_faults(iface) == []
    assert list(iface.members["Anchors"].type.fields) == [
        "text", "stext", "etext", "sinittext", "einittext",
    ]  # fmt: skip
    service = interface(SERVICE_DESCRIPTION)
    assert grammar_faults(service) == []
    assert methods(service) == {"GetInfo", "GetInterfaceDescription"}


def test_the_scanner_walk_catches_what_the_grammar_forbids() -> None:
    """The walk above is no rubber stamp: a field with a leading underscore is refused
    by the scanner, and the names it lets through but the grammar does not are caught."""
    with pytest.raises(SyntaxError, match="expected 'identifier'"):
        interface("interface io.kreld\ntype Anchors (_text: ?string)\n")
    lax = interface("interface Io.Kreld\ntype T (a: ?Missing)\nmethod M() -> ()\n")
    assert grammar_faults(lax) == ["interface name 'Io.Kreld'", "T.a: undeclared type 'Missing'"]


def test_getinfo_url_is_the_project_address_from_pyproject_or_empty() -> None:
    """GetInfo's url is never an invented address: the one pyproject.toml names, and
    empty while it names none (today)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    urls = project.get("urls", {})
    assert next(iter(urls.values()), "") == consts.PROJECT_URL
    assert consts.PROJECT_URL == ""


# -- kreld as a real subprocess ----------------------------------------------------------------


@pytest.fixture
def served(daemon_factory: Any, tree: FakeTree, state_dir: Path, sockdir: Path) -> Any:
    tree.add_module("dummy", MODULE_BASE)
    sock = sockdir / "kreld.sock"
    d: Daemon = start(daemon_factory, tree, state_dir, sock)
    return d, tree, sock


def varlink_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "varlink.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )


def cli_call(sock: Path, method: str, params: dict[str, Any]) -> dict[str, Any]:
    """One ``varlink.cli call``: the reply's parameters, or the error as the client shows
    it (``{"error": ..., "parameters": ...}``)."""
    cp = varlink_cli("call", f"unix:{sock}/{method}", json.dumps(params))
    if cp.stderr.strip():
        err = ast.literal_eval(cp.stderr.strip())
        assert cp.stdout == "" and isinstance(err, dict) and "error" in err, cp.stderr
        return err
    out = json.loads(cp.stdout)
    assert isinstance(out, dict)
    return out


def test_varlink_cli_help_calls_every_method_and_shows_named_errors(served: Any) -> None:
    """``python -m varlink.cli``: help prints kreld's interface, and call answers every
    method the interface declares (each reply as its type declares), GetInfo and
    GetInterfaceDescription, and io.kreld.NoSuchBoot with its boot_id."""
    _, tree, sock = served
    text = varlink_cli("help", f"unix:{sock}/io.kreld").stdout
    assert text.rstrip("\n") == IDL.read_text().rstrip("\n")
    iface = interface(text)

    boot_id = tree.boot_id
    params = {
        "GetBoot": {},
        "ListBoots": {},
        "Snapshot": {},
        "GetModules": {"boot_id": boot_id[:8], "all": True},
        "Resolve": {"addresses": [f"{MODULE_BASE + 0x10:#x}", f"{tree.text + 0x20:#x}"]},
        "ExportKallsyms": {"boot_id": boot_id},
        "Status": {},
        "GetKernelCode": {"all": True},
    }
    assert set(params) | {"Subscribe"} == methods(iface)  # Subscribe: the next test
    got = {}
    for method, p in params.items():
        got[method] = out = cli_call(sock, f"io.kreld.{method}", p)
        assert "error" not in out, (method, out)
        reply_conforms(iface, method, out)
    assert got["GetBoot"]["boot"]["boot_id"] == boot_id
    assert got["GetBoot"]["boot"]["anchors"]["text"] == f"{tree.text:#x}"
    assert [b["boot_id"] for b in got["ListBoots"]["boots"]] == [boot_id]
    assert got["Snapshot"]["new"] is False
    assert [m["name"] for m in got["GetModules"]["modules"]] == ["dummy"]
    module, kernel = resolutions(params["Resolve"]["addresses"], got["Resolve"])
    assert (module["image"], module["offset"]) == ("dummy", "0x10")
    assert (kernel["image"], kernel["offset"]) == ("kernel", "0x20")
    assert f"{tree.text:016x} T _text" in got["ExportKallsyms"]["kallsyms"]
    assert got["Status"]["boot_id"] == boot_id
    assert got["Status"]["kernel_code"]["state"] == "unavailable"  # a fake root: not followed
    assert isinstance(got["GetKernelCode"]["code"], list)

    info = cli_call(sock, "org.varlink.service.GetInfo", {})
    service = interface(SERVICE_DESCRIPTION)
    reply_conforms(service, "GetInfo", info)
    assert info["interfaces"] == ["org.varlink.service", "io.kreld"]
    assert info["url"] == consts.PROJECT_URL == ""
    desc = cli_call(sock, "org.varlink.service.GetInterfaceDescription", {"interface": "io.kreld"})
    assert desc == {"description": text.rstrip("\n") + "\n"}

    err = cli_call(sock, "io.kreld.GetBoot", {"boot_id": MISSING_BOOT})
    assert err == {"error": "io.kreld.NoSuchBoot", "parameters": {"boot_id": MISSING_BOOT}}
    error_conforms(iface, err["error"], err["parameters"])
    err = cli_call(sock, "io.kreld.Subscribe", {})  # without --more
    assert err == {"error": "org.varlink.service.ExpectedMore", "parameters": {}}


class Stream:
    """The replies a ``varlink.cli call --more`` prints, read as they come."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.proc, self.fd, self.buf = proc, proc.stdout.fileno(), ""
        self.decoder = json.JSONDecoder()

    def next(self, timeout: float = 20) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            text = self.buf.lstrip()
            if text:
                try:
                    obj, end = self.decoder.raw_decode(text)
                except ValueError:
                    pass  # a reply still coming
                else:
                    self.buf = text[end:]
                    assert isinstance(obj, dict)
                    return obj
            left = deadline - time.monotonic()
            assert left > 0, f"no reply from varlink.cli in {timeout}s: {self.buf[-500:]!r}"
            if select.select([self.fd], [], [], left)[0]:
                chunk = os.read(self.fd, 65536)
                assert chunk, f"varlink.cli exited {self.proc.wait()}"
                self.buf += chunk.decode()


def test_varlink_cli_call_more_streams_subscribe_events(served: Any) -> None:
    """``varlink.cli call --more io.kreld.Subscribe``: the snapshot, then a load event
    when a module appears in the tree, each reply as Subscribe declares."""
    _, tree, sock = served
    iface = interface(IDL.read_text())
    argv = ["call", "--more", f"unix:{sock}/io.kreld.Subscribe", "{}"]
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "varlink.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        stream = Stream(proc)
        first = stream.next()
        reply_conforms(iface, "Subscribe", first)
        assert first["event"] == "snapshot"
        assert [m["name"] for m in first["modules"]] == ["dummy"]
        tree.add_module("veth", MODULE_BASE + 0x100000)
        event = stream.next()
        reply_conforms(iface, "Subscribe", event)
        assert event["event"] == "load" and event["module"]["name"] == "veth"
        assert event["module"]["sections"][".text"] == f"{MODULE_BASE + 0x100000:#x}"
    finally:
        proc.kill()
        proc.wait()


def test_varlink_library_calls_in_process(served: Any) -> None:
    """The reference library (varlink.Client): calls, a named error with its parameters,
    a oneway call that gets no reply (the next call on the connection reads its own),
    and Subscribe with _more."""
    _, tree, sock = served
    with varlink.Client.new_with_address(f"unix:{sock}") as client:
        with client.open("io.kreld") as con:
            assert con.GetBoot()["boot"]["anchors"]["text"] == f"{tree.text:#x}"
            asked = [f"{MODULE_BASE + 8:#x}"]
            res = resolutions(asked, con.Resolve(addresses=asked))
            assert (res[0]["image"], res[0]["offset"]) == ("dummy", "0x8")
            # With lines: the reply conforms with its ResolveLines; no debuginfo here.
            lined = con.Resolve(addresses=asked, lines=True)
            reply_conforms(interface(IDL.read_text()), "Resolve", lined)
            (res,) = resolutions(asked, lined)
            assert res["frames"] == [] and "dummy" in res["no_lines"]
            with pytest.raises(varlink.VarlinkError) as e:
                con.GetBoot(boot_id=MISSING_BOOT)
            assert e.value.error() == "io.kreld.NoSuchBoot"
            assert e.value.parameters() == {"boot_id": MISSING_BOOT}
            assert con.GetBoot(boot_id=MISSING_BOOT, _oneway=True) is None
            assert con.Status()["boot_id"] == tree.boot_id
        info = client.open("org.varlink.service")
        assert info.GetInfo()["url"] == ""
        info.close()

        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(20)
        s.connect(str(sock))
        with client.open("io.kreld", connection=s) as sub:
            events = sub.Subscribe(_more=True)
            assert next(events)["event"] == "snapshot"
            tree.add_module("loop", MODULE_BASE + 0x200000)
            event = next(events)
            assert event["event"] == "load" and event["module"]["name"] == "loop"


def test_more_false_and_oneway_on_the_wire(served: Any) -> None:
    """Sent as raw bytes: "more": false is an ordinary call; a "oneway": true call gets no
    reply at all (a method, a Subscribe, an unknown method, a bad parameter), and the
    connection goes on to answer the next call."""
    _, tree, sock = served
    calls = [
        {"method": "io.kreld.GetBoot", "parameters": {}, "more": False},
        {"method": "io.kreld.GetBoot", "parameters": {}, "oneway": True},
        {"method": "io.kreld.Subscribe", "parameters": {}, "oneway": True},
        {"method": "io.kreld.Subscribe", "more": True, "oneway": True},
        {"method": "io.kreld.Nope", "oneway": True},
        {"method": "io.kreld.GetBoot", "parameters": {"boot_id": MISSING_BOOT}, "oneway": True},
        {"method": "io.kreld.GetBoot", "parameters": {"bogus": 1}, "oneway": True},
        {"method": "io.kreld.GetBoot", "upgrade": True, "oneway": True},
        {"method": "io.kreld.Status", "more": False},
    ]
    replies = raw_exchange(sock, b"".join(json.dumps(c).encode() + b"\0" for c in calls))
    assert len(replies) == 2, replies
    assert replies[0]["parameters"]["boot"]["boot_id"] == tree.boot_id
    assert "continues" not in replies[0]
    assert replies[1]["parameters"]["boot_id"] == tree.boot_id
