"""kreld's memory with 500 clients that Subscribe and never read.

kreld runs on a fake tree of 150 modules of 60 sections each, so the first reply of
a subscription is some 400 kB, more than a socket buffer takes.  500 raw sockets
send Subscribe and never read.  Figures, against kreld's resting RSS measured in the
same run just before (after a first Subscribe read whole, so the reply's encoding is
in the resting figure):

* its peak RSS (VmHWM) while the 500 wait, as growth over resting (goal < 16 MiB);
* the clients dropped (Status ``dropped``; goal: all 500).

Run as root with ``[limits] cap_root = false`` and the per-uid cap above 500, so
every client is admitted and only the write deadline (1 s here) ends it; with the
defaults, root's 64th connection on would be refused at once and cost nothing.

Run alone: ``.venv/bin/python bench/bench_unread.py``.
"""

from __future__ import annotations

import contextlib
import json
import socket
import tempfile
import time
from pathlib import Path

from common import Kreld, Result, bench_main, load_faketree, log, proc_memory

from kreld.client import Client

CLIENTS = 500
MODULES, SECTIONS = 150, 60
BASE = 0xFFFFFFFFC0000000
SUBSCRIBE = json.dumps({"method": "io.kreld.Subscribe", "parameters": {}, "more": True})


def _status(sock: Path) -> dict[str, int]:
    with Client(str(sock)) as c:
        return dict(c.call("Status"))


def _wait(what: str, fn: object, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not fn():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def run(quick: bool) -> list[Result]:
    """kreld's memory with 500 Subscribe clients that never read."""
    faketree = load_faketree()
    with tempfile.TemporaryDirectory(prefix="kreld-bench-unread-", dir="/dev/shm") as tmp:
        t = Path(tmp)
        tree = faketree.FakeTree(t / "root")
        for m in range(MODULES):
            base = BASE + m * 0x100000
            secs = {".text": base} | {f".t{k:03d}": base + 16 * (k + 1) for k in range(SECTIONS)}
            tree.add_module(f"mod{m:03d}", base, sections=secs)
        cfg = t / "kreld.toml"
        cfg.write_text(
            "[limits]\nwrite_timeout = 1.0\ncap_root = false\nmax_connections_per_uid = 1024\n"
        )
        sock = t / "kreld.sock"
        args = ["--root", str(tree.root), "--state-dir", str(t / "state"), "--socket", str(sock)]
        d = Kreld([*args, "--config", str(cfg)], t / "kreld.log")
        try:
            d.wait_for("ready", timeout=60)
            _wait("the modules", lambda: _status(sock)["loaded_modules"] == MODULES)
            with Client(str(sock)) as c:  # one subscriber read whole: the resting state
                c.send("Subscribe", {}, more=True)
                first = len(json.dumps(c.receive()))
            assert d.proc is not None
            rest = proc_memory(d.proc.pid)["VmRSS"]
            held = []
            for _ in range(CLIENTS):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(str(sock))
                s.sendall(SUBSCRIBE.encode() + b"\0")
                held.append(s)
            _wait("every client dropped", lambda: _status(sock)["dropped"] >= CLIENTS)
            peak = proc_memory(d.proc.pid)["VmHWM"]
            dropped = _status(sock)["dropped"]
            for s in held:
                with contextlib.suppress(OSError):
                    s.close()
        finally:
            d.stop()
    growth = peak - rest
    log(f"first reply {first} B, rest {rest >> 20} MiB, peak {peak >> 20} MiB, dropped {dropped}")
    return [
        Result(
            f"kreld peak RSS with {CLIENTS} subscribers that never read",
            peak,
            "B",
            rest,
            "resting",
            "kreld's RSS just before, with one subscriber served whole",
            goal="< resting + 16 MiB",
            met=growth < 16 << 20,
            notes=[f"first reply {first} bytes; growth {growth / (1 << 20):.1f} MiB"],
        ),
        Result(
            f"clients dropped (Status dropped) of {CLIENTS}",
            dropped,
            "",
            goal=f"= {CLIENTS}",
            met=dropped == CLIENTS,
        ),
    ]


if __name__ == "__main__":
    raise SystemExit(bench_main("bench_unread", run))
