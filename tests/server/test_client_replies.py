"""The client's reading of large replies, on a real Unix socket.

A reply from 64 KiB on is parsed by orjson (a Resolve with lines of 100,000
addresses is megabytes of integers); what orjson refuses and json takes (a
lone surrogate escaped) must read as json reads it, and so must every 64-bit
integer (varlink's).
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from kreld.client import Client


def _serve_once(path: Path, reply: bytes) -> threading.Thread:
    """A server answering one call on *path* with *reply* (NUL added)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def run() -> None:
        with srv:
            conn, _ = srv.accept()
            with conn:
                got = b""
                while not got.endswith(b"\0"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    got += chunk
                conn.sendall(reply + b"\0")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _big(extra: Any) -> dict[str, Any]:
    return {"parameters": {"line": list(range(40_000)), "names": ["é", 'a"b'], "x": extra}}


@pytest.mark.parametrize(
    ("extra", "raw"),
    [
        (12, None),
        (None, '"\\ud800"'),  # a lone surrogate, escaped: json takes it, orjson does not
        ((1 << 64) - 1, None),
        (-(1 << 63), None),
    ],
)
def test_a_large_reply_reads_as_json_reads_it_whatever_orjson_refuses(
    sockdir: Path, extra: Any, raw: str | None
) -> None:
    text = json.dumps(_big(extra))
    if raw is not None:
        text = text.replace('"x": null', f'"x": {raw}')
    assert len(text) > 64 << 10
    sock = sockdir / "one.sock"
    t = _serve_once(sock, text.encode())
    with Client(str(sock), timeout=30) as c:
        got = c.call("Ping")
    t.join(30)
    want = json.loads(text)["parameters"]
    assert got == want and type(got["x"]) is type(want["x"])
