"""Fuzzing the configuration reader: whatever the bytes, ``load_bytes`` and
``load_config`` give a :class:`Config` within its bounds or a :class:`ConfigError`,
never another exception (RecursionError, a ValueError of tomllib's, ...).

The corpus is seeded from etc/kreld/kreld.toml with every key uncommented (each at its
default), kreld.toml(5)'s example drop-in and the configurations the tests write;
hypothesis mutates them (bit flips, cuts, TOML's own punctuation spliced in, runs of
bytes repeated into deep nesting and long dotted keys).  A second target builds
documents whose nesting depth and key length are known, with strings of every TOML
kind holding brackets, quotes and dots, and checks that the scan before parsing
(kreld.config.shape) refuses exactly those past its caps.  Bounded: a few hundred
examples, some seconds in all.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kreld.config import shape
from kreld.config.settings import Config, load_bytes, load_config
from kreld.core import consts
from kreld.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SETTINGS = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


def seeds() -> list[bytes]:
    every_key = re.sub(
        r"^#(\w+ = )", r"\1", (REPO / "etc/kreld/kreld.toml").read_text(), flags=re.M
    )
    page = (REPO / "man/kreld.toml.5").read_text()
    example = re.findall(r"^\.EX\n(.*?)^\.EE", page, re.M | re.S)[0].replace("\\-", "-")
    written = [
        "[limits]\nmax_connections = 2048\nidle_timeout = 5.0\nmax_message_bytes = 1048576\n",
        '[access]\nsocket_group = "nogroup"\nallowed_groups = []\nallowed_uids = [65534]\n',
        '[publish]\nurl = "s3://fleet/x"\nendpoint_url = "http://127.0.0.1:9000"\n',
        "[modules]\nwatch = 'inotify'\n[retention]\nkeep_boots = 3\nkeep_days = 0.5\n",
        'a = """x""""\nb = \'\'\'y\'\'\'\'\nc = [{d.e = [1, 2.5]}, "]"]\n',
    ]
    return [every_key.encode(), example.encode(), *(w.encode() for w in written)]


SEEDS = seeds()
PUNCTUATION = [b"[", b"]", b"{", b"}", b'"', b"'", b'"""', b"'''", b".", b"=", b",", b"#",
               b"\n", b"\\", b"\\u0000", b"\x00", b"\xff", b"\xc3", b"[[", b"]]"]  # fmt: skip


def bounded(cfg: Config) -> None:
    """What every Config kreld accepts holds, whatever it was read from."""
    for name in ("state_dir", "socket", "root", "socket_group", "publish_url", "publish_endpoint"):
        value = getattr(cfg, name)
        assert isinstance(value, str) and "\0" not in value, name
    assert len(os.fsencode(cfg.socket)) <= consts.MAX_SOCKET_PATH
    for seq in (cfg.debuginfo_dirs, cfg.allowed_groups, cfg.allowed_uids):
        assert isinstance(seq, tuple) and len(seq) <= 1024
    assert 1 <= cfg.max_connections_per_uid <= 65536 and 1 <= cfg.max_connections <= 65536
    assert 0.05 <= cfg.poll_interval <= 3600 and 0 <= cfg.keep_days <= 100_000


def config_or_named_error(raw: bytes) -> Config | ConfigError:
    """The property: a Config within its bounds, or a ConfigError naming the file."""
    try:
        cfg = load_bytes(raw, "fuzz.toml")
    except ConfigError as e:
        assert str(e).startswith("fuzz.toml"), e
        return e
    bounded(cfg)
    return cfg


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 5))):
        n = len(data)
        at = draw(st.integers(0, max(n - 1, 0)))
        kind = draw(st.sampled_from(["flip", "cut", "punct", "bytes", "repeat", "number"]))
        if kind == "flip" and n:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "cut":
            del data[at:]
        elif kind == "punct":
            data[at:at] = draw(st.sampled_from(PUNCTUATION)) * draw(st.integers(1, 3))
        elif kind == "bytes":
            data[at:at] = draw(st.binary(min_size=1, max_size=32))
        elif kind == "repeat":  # deep nesting, long dotted keys, many tables
            run = draw(st.sampled_from([b"[", b"{a=", b"a.", b'"k".', b"[t]\n", b"[[t]]\n"]))
            data[at:at] = run * draw(st.integers(2, 2000))
        else:
            edge = draw(st.sampled_from(["1" + "0" * 5000, "1e400", "-0", "inf", "nan", "0x"]))
            data[at:at] = edge.encode()
    return bytes(data)


@SETTINGS
@given(mutated())
def test_mutated_configurations_give_a_config_or_a_config_error(raw: bytes) -> None:
    config_or_named_error(raw)


@SETTINGS
@given(st.binary(max_size=512))
def test_any_bytes_give_a_config_or_a_config_error(raw: bytes) -> None:
    config_or_named_error(raw)


def test_the_seeds_themselves_are_read() -> None:
    every_key, example = SEEDS[0], SEEDS[1]
    assert load_bytes(every_key, "f") == Config()
    assert load_bytes(example, "f").keep_days == 90


@settings(max_examples=60, deadline=None, database=None)
@given(mutated(), mutated())
def test_a_file_and_its_drop_in_give_a_config_or_a_config_error(
    tmp_path_factory: pytest.TempPathFactory, main: bytes, drop: bytes
) -> None:
    d = tmp_path_factory.mktemp("cfg")
    (d / "kreld.toml").write_bytes(main)
    (d / "kreld.toml.d").mkdir()
    (d / "kreld.toml.d" / "50-x.toml").write_bytes(drop)
    try:
        bounded(load_config(str(d / "kreld.toml")))
    except ConfigError as e:
        assert str(e).startswith(str(d)), e


# -- documents of known depth: the scan before parsing against tomllib ----------------------

TRICKY = st.text(alphabet="[]{}#.=,\"'\\ \tab\n\u00e9", max_size=10)


@st.composite
def toml_string(draw: st.DrawFn, one_line: bool = False) -> str:
    """A TOML string in one of the four kinds (a key's: one of the two one-line
    kinds), brackets, quotes and dots inside."""
    content = draw(TRICKY)
    kinds = ["basic", "literal"] + ([] if one_line else ["ml-basic", "ml-literal"])
    kind = draw(st.sampled_from(kinds))
    if kind == "literal" and "'" not in content and "\n" not in content:
        return f"'{content}'"
    if kind == "ml-literal" and "'''" not in content + "'" and not content.startswith("\n"):
        return f"'''{content}'''"
    if kind == "ml-basic":
        # Quotes escaped but for up to two at the end, which close with the delimiter.
        body = content.rstrip('"')
        tail = '"' * min(2, len(content) - len(body))
        body = body.replace("\\", "\\\\").replace('"', '\\"').replace("\t", "\\t")
        return f'"""{body}{tail}"""'
    return json.dumps(content)


@st.composite
def nested(draw: st.DrawFn, depth: int) -> str:
    """A value *depth* arrays or inline tables deep, strings beside each level."""
    value = draw(st.sampled_from(["1", "1.5", "true", "1979-05-27T07:32:00.5Z"]))
    for _ in range(depth):
        sibling = draw(toml_string())
        if draw(st.booleans()):
            value = f"[{sibling}, {value}]" if draw(st.booleans()) else f"[{value},{sibling}]"
        else:
            value = f"{{ {draw(toml_string(one_line=True))} = {sibling}, k.v = {value} }}"
    return value


@SETTINGS
@given(st.integers(0, 40).flatmap(lambda d: st.tuples(st.just(d), nested(d))))
def test_the_scan_refuses_exactly_the_documents_nested_past_the_cap(case: tuple[int, str]) -> None:
    depth, value = case
    comment = value.replace("\n", " ")
    raw = f"# {comment}\n[kernel]\ndebuginfo_dirs = {value}\n".encode()
    got = config_or_named_error(raw)
    refused = isinstance(got, ConfigError) and "nested deeper" in str(got)
    assert refused == (depth > shape.MAX_NESTING), (depth, str(got))
    assert "not valid TOML" not in str(got), "the document made here is TOML"


@SETTINGS
@given(st.lists(st.one_of(st.from_regex(r"[a-z0-9_-]{1,4}", fullmatch=True),
                          toml_string(one_line=True)), min_size=1, max_size=40))  # fmt: skip
def test_the_scan_refuses_exactly_the_keys_past_the_cap(keys: list[str]) -> None:
    raw = f"[kernel]\n{' . '.join(keys)} = 2.5 # a.b.c\n".encode()
    got = config_or_named_error(raw)
    refused = isinstance(got, ConfigError) and "parts" in str(got)
    assert refused == (len(keys) > shape.MAX_KEY_DOTS + 1), (keys, str(got))
    assert "not valid TOML" not in str(got), "the document made here is TOML"
