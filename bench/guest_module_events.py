"""Runs inside the QEMU guest that ``bench/bench_module_events.py --vm`` boots
(the Debian cloud kernel, with module tracepoints): how soon a real module
load is visible over kreld's socket, for each way kreld can learn of it.

    python guest_module_events.py OUT LOADS

For each mode (tracepoints alone, uevents alone, the look at sys/module
alone), a kreld of its own (``--root /``, its own store and socket, the
mode's ``[modules]`` settings) is started; once it has started, a client
subscribes (``Subscribe``) on a thread that stamps each reply as it arrives
(CLOCK_MONOTONIC).  Then LOADS times: a pause of a random 0-1 poll interval
(so that loads fall evenly over the look's phases), ``modprobe dummy``
(stamped before it starts and when it returns), the wait for its ``load``
reply, ``rmmod dummy`` and the wait for its ``unload``.  kreld's Status
(its sources) is kept per mode, to show which followed.  Everything goes to
OUT/results.json; errors to stderr, exit status 1.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kreld.client import Client, ConnectError

MODULE = "dummy"  # systemd's modprobe config: numdummies=0, no network device
POLL = 1.0  # [modules] poll_interval: the look's interval where nothing else tells
MODES = {
    "tracepoints": {"tracepoints": True, "uevents": False, "watch": "poll"},
    "uevents": {"tracepoints": False, "uevents": True, "watch": "poll"},
    "poll": {"tracepoints": False, "uevents": False, "watch": "poll"},
}
START_WAIT = 300.0  # seconds for a kreld to start under emulation
EVENT_WAIT = 10 + 3 * POLL


def toml(mode: dict[str, Any]) -> str:
    flags = "".join(
        f"{k} = {json.dumps(v) if isinstance(v, str) else str(v).lower()}\n"
        for k, v in mode.items()
    )
    return f"[kernel]\nfollow_code = false\n\n[modules]\npoll_interval = {POLL}\n{flags}"


class Subscribed:
    """Subscribe's replies for one module, stamped on arrival, by event."""

    def __init__(self, sock: str) -> None:
        self.events: queue.Queue[tuple[str, int, dict[str, Any]]] = queue.Queue()
        self.client = Client(sock, timeout=None)
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for msg in self.client.stream("Subscribe"):
            self.first.set()
            inc = msg.get("module")
            if inc and inc.get("name") == MODULE:
                self.events.put((msg["event"], time.monotonic_ns(), inc))

    def wait(self, event: str) -> tuple[int, dict[str, Any]]:
        deadline = time.monotonic() + EVENT_WAIT
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {event} of {MODULE} in {EVENT_WAIT:g} s")
            try:
                got, at, inc = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if got == event:
                return at, inc


def started(sock: str, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """kreld's Status once it has started (nothing left in ``starting``)."""
    deadline = time.monotonic() + START_WAIT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kreld exited with {proc.returncode} while starting")
        try:
            with Client(sock, timeout=30) as c:
                status: dict[str, Any] = c.call("Status")
            if not status.get("starting"):
                return status
        except (ConnectError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"kreld did not start in {START_WAIT:g} s")


def measure(out: Path, name: str, mode: dict[str, Any], loads: int, seed: int) -> dict[str, Any]:
    cfg = out / f"{name}.toml"
    cfg.write_text(toml(mode))
    sock = f"/run/kreld-bench-{name}.sock"
    kreld = Path(sys.executable).parent / "kreld"
    argv = [str(kreld), "--config", str(cfg), "--root", "/", "--state-dir",
            str(out / f"state-{name}"), "--socket", sock, "--log-format", "json"]  # fmt: skip
    with open(out / f"kreld-{name}.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        status = started(sock, proc)
        sub = Subscribed(sock)
        if not sub.first.wait(60):
            raise TimeoutError("no first Subscribe reply in 60 s")
        rng = random.Random(seed)
        rows = []
        for _ in range(loads):
            time.sleep(rng.uniform(0, POLL))
            t0 = time.monotonic_ns()
            subprocess.run(["modprobe", MODULE], check=True)
            t1 = time.monotonic_ns()
            seen, inc = sub.wait("load")
            recorded = (inc.get("loaded") or {}).get("monotonic")
            rows.append({"start": t0, "returned": t1, "visible": seen, "recorded": recorded,
                         "seen_by": inc.get("seen_by")})  # fmt: skip
            subprocess.run(["rmmod", MODULE], check=True)
            sub.wait("unload")
        return {"loads": rows, "sources": status.get("sources"), "config": mode}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main() -> int:
    out, loads = Path(sys.argv[1]), int(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tracefs", "nodev", "/sys/kernel/tracing"], check=False)
    subprocess.run(["rmmod", MODULE], capture_output=True, check=False)
    facts: dict[str, Any] = {
        "release": os.uname().release,
        "tracepoints": os.path.exists("/sys/kernel/tracing/events/module/module_load/id"),
        "poll_interval": POLL,
        "modes": {},
    }
    try:
        for k, (name, mode) in enumerate(MODES.items()):
            facts["modes"][name] = measure(out, name, mode, loads, 41 + k)
    except (OSError, RuntimeError, TimeoutError, subprocess.CalledProcessError) as e:
        print(f"guest_module_events: {e}", file=sys.stderr)
        return 1
    finally:
        (out / "results.json").write_text(json.dumps(facts, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
