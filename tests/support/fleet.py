"""The fleet's test bucket: a SeaweedFS S3 server's bucket, a host publishing to it."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from kreld.fleet.s3 import open_bucket

from support.faketree import FakeTree
from support.run import Daemon, kreldctl
from support.s3server import S3Server
from support.wait import wait_for_symbols_done, wait_for_turns, wait_until

BUCKET = "fleet"


def create_bucket(server: S3Server) -> None:
    """The bucket (weed creates one on its first upload)."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in server.env().items():
            mp.setenv(k, v)
        open_bucket(f"s3://{BUCKET}/created").put("by-the-test", b"")


def config(tmp: Path, url: str, interval: float = 0.1) -> Path:
    p = tmp / f"kreld-{uuid.uuid4().hex[:6]}.toml"
    # A heartbeat each second: wait_for_symbols_done waits on the idle checks it brings.
    p.write_text(
        f'[publish]\nurl = "{url}"\ninterval = {interval}\n[modules]\nheartbeat_interval = 1.0\n'
    )
    return p


class Host:
    """One fake machine: a tree, a store, a socket and its kreld."""

    def __init__(self, base: Path, factory: Any, sockdir: Path, url: str, **tree: Any) -> None:
        base.mkdir(parents=True, exist_ok=True)
        self.tree = FakeTree(base / "root", **tree)
        self.state = base / "state"
        self.sock = sockdir / f"{base.name}.sock"
        self.cfg = config(base, url)
        self.factory = factory
        self.log_name = f"{base.name}.log"
        self.daemon: Daemon | None = None

    def start(self) -> Daemon:
        self.daemon = self.factory(
            "--root", str(self.tree.root), "--state-dir", str(self.state),
            "--socket", str(self.sock), "--config", str(self.cfg), log_name=self.log_name,
        )  # fmt: skip
        return self.daemon.start()

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(
            kreldctl("--socket", str(self.sock), "status", "--json").stdout
        )
        return out

    def published(self, timeout: float = 60) -> dict[str, Any]:
        """Wait until a round has published everything, and return the health:
        a round that began after the symbol worker was done, for the boot's symbols
        record (the backlog counts the tables the store holds from the moment they
        are stored, but a record only once a round plans it)."""
        wait_for_symbols_done(str(self.sock), timeout)
        wait_for_turns(str(self.sock), "publish_rounds", 2, timeout)

        def done() -> dict[str, Any] | None:
            p = self.status()["publish"]
            ok = p and p["healthy"] and p["backlog"] == 0 and p["last_success_ns"]
            return p if ok else None

        result: dict[str, Any] = wait_until("publishing caught up", done, timeout=timeout)
        return result

    def local(self, *args: str) -> Any:
        return json.loads(kreldctl("--state-dir", str(self.state), *args, "--json").stdout)
