"""The configuration's records: each setting named and defaulted once."""

from __future__ import annotations

from kreld.config.settings import SCHEMA, Config, Limits, load_bytes
from kreld.core.record import fields
from kreld.server.listener import limits_of


def test_the_limits_section_is_the_one_record_the_server_takes() -> None:
    assert [attr for attr, _check in SCHEMA["limits"].values()] == [f.name for f in fields(Limits)]
    cfg = load_bytes(b"[limits]\nmax_message_bytes = 8192\nsubscribe_queue = 7\n", "t.toml")
    limits = limits_of(cfg)
    assert type(limits) is Limits
    assert limits.max_message_bytes == 8192 and limits.subscribe_queue == 7
    assert Limits.of(Config()) == Limits()
