"""Hostile input: whatever bytes a peer sends, kreld answers with a named
error or closes that one connection, and keeps serving everyone else."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kreld.client import Client, resolutions

from support.run import raw_exchange, start

METHODS = [
    "io.kreld.GetBoot", "io.kreld.ListBoots", "io.kreld.GetModules", "io.kreld.Resolve",
    "io.kreld.Status", "io.kreld.Subscribe", "io.kreld.ExportKallsyms", "io.kreld.Nope",
    "org.varlink.service.GetInfo", "org.varlink.service.GetInterfaceDescription", "x", "",
]  # fmt: skip

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=20,
)
calls = st.fixed_dictionaries(
    {"method": st.sampled_from(METHODS)},
    optional={
        "parameters": st.dictionaries(
            st.sampled_from(["boot_id", "addresses", "at", "clock", "all", "interface", "zz"]),
            json_values,
            max_size=4,
        ),
        "more": json_values,
        "oneway": st.booleans(),
    },
)


def messages() -> st.SearchStrategy[bytes]:
    structured = calls.map(lambda c: json.dumps(c).encode() + b"\0")
    truncated = st.tuples(structured, st.integers(min_value=0, max_value=200)).map(
        lambda t: t[0][: t[1]]
    )
    deep = st.integers(min_value=1, max_value=200_000).map(
        lambda n: b'{"method":"io.kreld.GetBoot","parameters":{"a":' + b"[" * n + b"]" * n + b"}}\0"
    )
    return st.one_of(st.binary(max_size=300), structured, truncated, deep)


def check_replies(replies: list[dict[str, Any]]) -> None:
    for r in replies:
        assert isinstance(r, dict)
        if "error" in r:
            assert isinstance(r["error"], str) and "." in r["error"]
            assert isinstance(r.get("parameters", {}), dict)
        else:
            assert isinstance(r["parameters"], dict)


def test_fuzzed_messages_never_take_kreld_down(
    daemon_factory: Any,
    tree: Any,
    state_dir: Path,
    sockdir: Path,
    tmp_path: Path,
) -> None:
    cfg = tmp_path / "kreld.toml"
    cfg.write_text("[limits]\nmax_message_bytes = 65536\nidle_timeout = 2.0\n")
    tree.add_module("dummy", 0xFFFFFFFFC0000000)
    sock = sockdir / "k.sock"
    d = start(daemon_factory, tree, state_dir, sock, "--config", str(cfg))

    @settings(
        max_examples=400,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(st.lists(messages(), min_size=1, max_size=4))
    def one_connection(batch: list[bytes]) -> None:
        payload = b"".join(batch)
        try:
            replies = raw_exchange(sock, payload, timeout=10)
        except ValueError as e:  # a reply that is not JSON would be kreld's bug
            raise AssertionError(f"unparsable reply to {payload[:80]!r}") from e
        check_replies(replies)

    one_connection()
    # Oversized: named error, then a close.
    big = b'{"method":"io.kreld.GetBoot","x":"' + b"a" * 100_000 + b'"}\0'
    assert raw_exchange(sock, big)[0]["error"] == "io.kreld.MessageTooLarge"
    # A normal client is still answered correctly.
    assert d.proc.poll() is None
    with Client(str(sock)) as c:
        assert c.call("GetBoot")["boot"]["boot_id"] == tree.boot_id
        asked = ["0xffffffffc0000008"]
        [r] = resolutions(asked, c.call("Resolve", addresses=asked))
        assert (r["image"], r["section"], r["offset"]) == ("dummy", ".text", "0x8")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(sock))
    s.close()
