"""Issue 4: the varlink server against the limit and against life without kreld.

Figures: GetBoot and Resolve (1 and 10,000 addresses) p50/p99 and
throughput over the socket.  Baselines, measured in the same run:
(a) a bare varlink echo round trip on the same kind of socket (an asyncio
server that parses the call and answers its parameters back: the floor any
Python varlink service has); (b) what a profiler does without kreld: parse
/proc/kallsyms and /proc/modules and read every module's sections.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (
    Result,
    bench_main,
    interleaved,
    median,
    percentile,
    venv_python,
    venv_tool,
)

from kreld.client import Client

ECHO_SERVER = r"""
import asyncio, json, sys
async def handle(r, w):
    try:
        while True:
            raw = await r.readuntil(b"\0")
            call = json.loads(raw[:-1])
            w.write(json.dumps({"parameters": call.get("parameters", {})}).encode() + b"\0")
            await w.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        w.close()
async def main():
    server = await asyncio.start_unix_server(handle, path=sys.argv[1], limit=1 << 24)
    print("ready", flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


def profiler_scan() -> int:
    """What a profiler does without kreld: every symbol, every module section."""
    n = 0
    with open("/proc/kallsyms", "rb") as f:
        for line in f:
            addr, _typ, _name = line.split(b" ", 2)
            int(addr, 16)
            n += 1
    try:
        mods = Path("/proc/modules").read_text().splitlines()
    except OSError:
        mods = []
    for m in mods:
        name = m.split()[0]
        sec = Path("/sys/module") / name / "sections"
        for s in sec.iterdir() if sec.is_dir() else []:
            int(s.read_text(), 16)
            n += 1
    return n


def _wait_socket(path: Path, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            try:
                Client(str(path), timeout=2).close()
                return
            except Exception:
                pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"{path} never answered")


def run(quick: bool) -> list[Result]:
    """GetBoot and Resolve over the socket vs a bare echo and a profiler's own scan."""
    tmp = Path(tempfile.mkdtemp(prefix="kreld-bench-srv-", dir="/tmp"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        echo_sock, kreld_sock = tmp / "echo.sock", tmp / "kreld.sock"
        procs.append(
            subprocess.Popen(
                [venv_python(), "-c", ECHO_SERVER, str(echo_sock)], stdout=subprocess.PIPE
            )
        )
        procs.append(
            subprocess.Popen(
                [venv_tool("kreld"), "--root", "/", "--state-dir", str(tmp / "state"),
                 "--socket", str(kreld_sock), "--log-format", "json", "--log-level", "warning"],
                stderr=subprocess.DEVNULL,
            )
        )  # fmt: skip
        _wait_socket(echo_sock, procs[0])
        _wait_socket(kreld_sock, procs[1])
        return _run(quick, echo_sock, kreld_sock)
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


def _run(quick: bool, echo_sock: Path, kreld_sock: Path) -> list[Result]:
    n_calls = 300 if quick else 3000
    n_big = 5 if quick else 30
    echo = Client(str(echo_sock))
    kreld = Client(str(kreld_sock), timeout=120)
    boot = kreld.call("GetBoot")["boot"]
    restricted = boot["anchors"]["_text"] is None
    text = int(boot["anchors"]["_text"] or "0", 16)
    etext = int(boot["anchors"]["_etext"] or "0", 16)
    # Wait until the symbol table is captured, so Resolve includes symbols.
    deadline = time.monotonic() + 60
    while not restricted and time.monotonic() < deadline:
        r = kreld.call("Resolve", addresses=[hex(text + 0x10)])["results"][0]
        if r.get("symbol"):
            break
        time.sleep(0.2)
    rng = random.Random(4)
    one = [hex(text + rng.randrange(max(etext - text, 1)))]
    big = [hex(text + rng.randrange(max(etext - text, 1))) for _ in range(10_000)]

    samples = interleaved(
        {
            "echo": lambda: echo.call("x.Echo", a="b"),
            "getboot": lambda: kreld.call("GetBoot"),
            "resolve1": lambda: kreld.call("Resolve", addresses=one),
        },
        n_calls,
        warmup=50,
    )
    big_s = interleaved(
        {
            "echo10k": lambda: echo.call("x.Echo", addresses=big),
            "resolve10k": lambda: kreld.call("Resolve", addresses=big),
        },
        n_big,
    )
    scan = interleaved({"scan": profiler_scan}, 3 if quick else 10)["scan"]
    echo_tag, echo_desc = "echo", "bare varlink echo round trip (asyncio, same socket type)"
    scan_tag, scan_desc = (
        "no-kreld",
        "a profiler's own scan: parse /proc/kallsyms + /proc/modules + module sections",
    )
    res: list[Result] = []
    e50, e99 = median(samples["echo"]), percentile(samples["echo"], 99)
    g50, g99 = median(samples["getboot"]), percentile(samples["getboot"], 99)
    res.append(
        Result("GetBoot p50", g50, "ns", e50, echo_tag, echo_desc, "<= 3x echo", g50 <= 3 * e50)
    )
    res.append(Result("GetBoot p99", g99, "ns", e99, echo_tag, echo_desc))
    s50 = median(scan)
    res.append(
        Result(
            "GetBoot p50 vs a profiler's own scan",
            g50,
            "ns",
            s50,
            scan_tag,
            scan_desc,
            ">= 1000x faster (ratio <= 0.001)",
            g50 * 1000 <= s50,
        )
    )
    r50, r99 = median(samples["resolve1"]), percentile(samples["resolve1"], 99)
    res.append(Result("Resolve 1 address p50", r50, "ns", e50, echo_tag, echo_desc))
    res.append(Result("Resolve 1 address p99", r99, "ns", e99, echo_tag, echo_desc))
    b50, b99 = median(big_s["resolve10k"]), percentile(big_s["resolve10k"], 99)
    eb50 = median(big_s["echo10k"])
    res.append(
        Result("Resolve 10,000 addresses p50", b50, "ns", eb50, "echo10k",
               "bare echo of the same 10,000-address request", "", None)
    )  # fmt: skip
    res.append(
        Result(
            "Resolve 10,000 addresses p99", b99, "ns", percentile(big_s["echo10k"], 99), "echo10k"
        )
    )
    rate = 10_000 / (b50 / 1e9)
    res.append(
        Result(
            "Resolve throughput over the socket (addresses/s, with symbols)",
            rate,
            "",
            10_000 / (s50 / 1e9),
            "no-kreld",
            scan_desc,
            ">= 500,000/s",
            rate >= 500_000,
        )
    )
    res.append(
        Result(
            "GetBoot calls/s on one connection",
            1e9 / g50,
            "",
            1e9 / e50,
            echo_tag,
            echo_desc,
        )
    )
    res[0].notes = [
        f"issue 4: {n_calls} small calls and {n_big} 10,000-address calls per figure, interleaved "
        f"with their baselines; kernel symbols: {'restricted' if restricted else 'cached'}; "
        f"CPUs {os.cpu_count()}"
    ]
    for r in res:
        r.bench = "server"
    return res


if __name__ == "__main__":
    sys.exit(bench_main("server", run))
