"""One peer holding connections does not lock the others out: past
``[limits] max_connections_per_uid`` a uid gets ``io.kreld.TooManyConnectionsPerUid``
and is closed, while another uid and root go on being served, and kreld goes on.
Root is held to the same cap unless ``cap_root`` is off.

The peers are real processes of other uids (``setpriv`` to nobody, 65534, and to
65533), speaking varlink with the standard library alone, against kreld as a real
subprocess.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kreld.client import Client

from support.faketree import FakeTree
from support.faultlib import NOBODY, write_config
from support.run import start

pytestmark = [
    pytest.mark.faults,
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run peers as other uids"),
]

CAP = 8  # [limits] max_connections_per_uid
EXTRA = 5  # connections the hog opens past it
OTHER = 65533  # a second unprivileged uid (in group nogroup, as nobody is)

# Opens CAP connections and has each answer GetBoot (so kreld has counted them), then
# EXTRA more, printing what each of those gets; holds all until stdin closes.
HOG = r"""
import json, socket, sys
path, cap, extra = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
CALL = json.dumps({"method": "io.kreld.GetBoot", "parameters": {}}).encode() + b"\0"
def conn():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(path)
    return s
def reply(s):
    buf = b""
    while not buf.endswith(b"\0"):
        chunk = s.recv(65536)
        if not chunk:
            return {"closed": True, "partial": buf.decode(errors="replace")}
        buf += chunk
    return json.loads(buf[:-1])
held = []
for _ in range(cap):
    s = conn()
    s.sendall(CALL)
    r = reply(s)
    assert "parameters" in r, r
    held.append(s)
print(json.dumps({"held": len(held)}), flush=True)
for _ in range(extra):
    s = conn()
    r = reply(s)
    r["closed_after"] = s.recv(1) == b""
    print(json.dumps(r), flush=True)
    s.close()
sys.stdin.read()
"""

# One GetBoot; prints its reply (or error) as one JSON line.
ONE_CALL = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(20)
s.connect(sys.argv[1])
try:
    s.sendall(json.dumps({"method": "io.kreld.GetBoot", "parameters": {}}).encode() + b"\0")
except BrokenPipeError:
    pass  # refused at accept: kreld wrote its error and closed before the call went out
buf = b""
while not buf.endswith(b"\0"):
    chunk = s.recv(65536)
    if not chunk:
        break
    buf += chunk
print(buf[:-1].decode())
"""


def python_for_others() -> str:
    """An interpreter other uids may run (the venv's may sit under /root)."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable):
        if os.path.exists(cand) and os.stat(os.path.realpath(cand)).st_mode & 0o001:
            return cand
    pytest.skip("no Python interpreter that another uid may execute")


def as_uid(uid: int, *argv: str) -> list[str]:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    return [setpriv, f"--reuid={uid}", f"--regid={NOBODY}", "--clear-groups", *argv]


def one_call(python: str, sock: Path, uid: int | None) -> dict[str, Any]:
    argv = [python, "-c", ONE_CALL, str(sock)]
    cp = subprocess.run(
        argv if uid is None else as_uid(uid, *argv), capture_output=True, text=True, timeout=30
    )
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


@pytest.fixture
def daemon(daemon_factory: Any, tmp_path: Path, sockdir: Path) -> Any:
    tree = FakeTree(tmp_path / "root")
    nogroup = grp.getgrgid(NOBODY).gr_name
    cfg = write_config(
        tmp_path / "kreld.toml",
        access={"socket_group": nogroup, "allowed_groups": [], "allowed_uids": [NOBODY, OTHER]},
        limits={"max_connections_per_uid": CAP, "idle_timeout": 60.0},
    )
    sock = sockdir / "kreld.sock"
    d = start(daemon_factory, tree, tmp_path / "state", sock, "--config", str(cfg))
    yield d, tree, sock
    if d.proc.poll() is None:
        assert d.stop() == 0


def test_one_uid_over_its_cap_gets_the_named_error_while_others_are_served(daemon: Any) -> None:
    d, tree, sock = daemon
    python = python_for_others()
    hog = subprocess.Popen(
        as_uid(NOBODY, python, "-c", HOG, str(sock), str(CAP), str(EXTRA)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert hog.stdout is not None
        first = hog.stdout.readline()
        assert json.loads(first or "{}") == {"held": CAP}, hog.stderr.read() if hog.stderr else ""
        refused = [json.loads(hog.stdout.readline()) for _ in range(EXTRA)]
        for r in refused:
            assert r["error"] == "io.kreld.TooManyConnectionsPerUid", r
            assert r["parameters"] == {"uid": NOBODY, "limit": CAP}, r
            assert r["closed_after"], "the refused connection is closed"
        # nobody holds its CAP connections: another uid, and root, are served.
        other = one_call(python, sock, OTHER)
        assert other["parameters"]["boot"]["boot_id"] == tree.boot_id, other
        with Client(str(sock)) as c:
            status = c.call("Status")
            assert status["connections"] >= CAP + 1, status
        # nobody itself stays refused while it holds them.
        again = one_call(python, sock, NOBODY)
        assert again["error"] == "io.kreld.TooManyConnectionsPerUid", again
    finally:
        hog.communicate(input="", timeout=30)
    assert hog.returncode == 0, hog.stderr
    # Logged once for the whole episode, not once per refused connection.
    limited = [e for e in d.events() if e.get("event") == "peer_connection_limit"]
    assert len(limited) == 1 and limited[0]["uid"] == NOBODY and limited[0]["limit"] == CAP
    # Its connections closed, nobody is served again, and kreld went on throughout.
    served = one_call(python, sock, NOBODY)
    assert served["parameters"]["boot"]["boot_id"] == tree.boot_id, served
    assert d.proc.poll() is None
    with Client(str(sock)) as c:
        assert c.call("GetBoot")["boot"]["boot_id"] == tree.boot_id


@pytest.mark.parametrize("cap_root", [False, True])
def test_root_is_counted_against_the_per_uid_cap_unless_cap_root_is_off(
    daemon_factory: Any, tmp_path: Path, sockdir: Path, cap_root: bool
) -> None:
    """Root (here also kreld's own uid) is admitted whatever the policy, but a root
    client that never reads costs memory like any other: by default it is capped per
    uid too.  With ``cap_root = false``, CAP + 4 connections of root are all served
    (the global cap holds)."""
    tree = FakeTree(tmp_path / "root")
    cfg = write_config(
        tmp_path / "kreld.toml", limits={"max_connections_per_uid": CAP, "cap_root": cap_root}
    )
    sock = sockdir / "kreld.sock"
    d = start(daemon_factory, tree, tmp_path / "state", sock, "--config", str(cfg))
    held = [Client(str(sock)) for _ in range(CAP)]
    try:
        for c in held:
            assert c.call("GetBoot")["boot"]["boot_id"] == tree.boot_id
        extra = [Client(str(sock)) for _ in range(4)]
        held += extra
        for c in extra:
            c.send("GetBoot", {})
            r = c.receive()
            if cap_root:
                assert r["error"] == "io.kreld.TooManyConnectionsPerUid", r
                assert r["parameters"] == {"uid": 0, "limit": CAP}, r
            else:
                assert r["parameters"]["boot"]["boot_id"] == tree.boot_id, r
    finally:
        for c in held:
            c.close()
    limited = [e for e in d.events() if e.get("event") == "peer_connection_limit"]
    assert len(limited) == (1 if cap_root else 0)
    with Client(str(sock)) as c:  # its connections closed, root is served again
        assert c.call("GetBoot")["boot"]["boot_id"] == tree.boot_id
    assert d.stop() == 0
