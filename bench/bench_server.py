"""The varlink server against the limit and against life without kreld.

Figures: GetBoot and Resolve (1 and 10,000 addresses) p50/p99 and
throughput over the socket.  Baselines, measured in the same run:
(a) a bare varlink echo round trip on the same kind of socket (an asyncio
server that parses the call and answers its parameters back: the floor any
Python varlink service has); (b) what a profiler does without kreld: parse
/proc/kallsyms and /proc/modules and read every module's sections.
Under concurrency, 4 client processes each pipelining 8 calls give GetBoot's
total calls/s and the daemon's CPU time per call (utime+stime from
/proc/<pid>/stat), both against the echo server under the same load.
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

# One load client: a raw AF_UNIX socket, DEPTH calls sent at once, then read
# until DEPTH NUL-terminated replies arrived, again and again for DURATION
# seconds after "go" on stdin.  Prints the calls made and the seconds taken.
LOAD_CLIENT = r"""
import socket, sys, time
path, msg, depth, duration = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
batch = (msg.encode() + b"\0") * depth
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
print("ready", flush=True)
sys.stdin.readline()
calls, first = 0, True
t0 = time.perf_counter()
end = t0 + duration
while time.perf_counter() < end:
    s.sendall(batch)
    got = 0
    while got < depth:
        chunk = s.recv(1 << 16)
        if not chunk:
            sys.exit("server closed the connection")
        if first and b'"error"' in chunk:
            sys.exit(f"error reply: {chunk[:500]!r}")
        got += chunk.count(b"\0")
    first = False
    calls += depth
print(calls, time.perf_counter() - t0, flush=True)
"""
LOAD_CLIENTS, LOAD_DEPTH = 4, 8


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


def _cpu_ticks(pid: int) -> int:
    """utime + stime of process *pid*, all its threads, in clock ticks."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # fields[0] is field 3 (state)
    return int(fields[14 - 3]) + int(fields[15 - 3])


def _load(sock: Path, msg: str, pid: int, duration: float) -> tuple[float, float]:
    """LOAD_CLIENTS processes pipelining LOAD_DEPTH calls of *msg* on *sock*
    for *duration* s.  Returns (total calls/s, server *pid*'s CPU us per call)."""
    argv = [venv_python(), "-c", LOAD_CLIENT, str(sock), msg, str(LOAD_DEPTH), str(duration)]
    clients = [
        subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for _ in range(LOAD_CLIENTS)
    ]
    try:
        for c in clients:
            assert c.stdout is not None
            if c.stdout.readline() != b"ready\n":
                raise RuntimeError(f"load client exited {c.wait()} before connecting")
        cpu0 = _cpu_ticks(pid)
        for c in clients:
            assert c.stdin is not None
            c.stdin.write(b"go\n")
            c.stdin.flush()
        outs = [c.communicate(timeout=duration + 60)[0] for c in clients]
        cpu1 = _cpu_ticks(pid)
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
                c.wait()
    rate, calls = 0.0, 0
    for c, out in zip(clients, outs, strict=True):
        if c.returncode != 0:
            raise RuntimeError(f"load client exited {c.returncode}")
        n, secs = out.split()
        calls += int(n)
        rate += int(n) / float(secs)
    return rate, (cpu1 - cpu0) / os.sysconf("SC_CLK_TCK") * 1e6 / calls


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
        return _run(quick, echo_sock, kreld_sock, procs[0].pid, procs[1].pid)
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


def _run(
    quick: bool, echo_sock: Path, kreld_sock: Path, echo_pid: int, kreld_pid: int
) -> list[Result]:
    n_calls = 300 if quick else 3000
    n_big = 5 if quick else 30
    echo = Client(str(echo_sock))
    kreld = Client(str(kreld_sock), timeout=120)
    boot = kreld.call("GetBoot")["boot"]
    restricted = boot["anchors"]["text"] is None
    text = int(boot["anchors"]["text"] or "0", 16)
    etext = int(boot["anchors"]["etext"] or "0", 16)
    # Wait until the symbol table is captured, so Resolve includes symbols.
    deadline = time.monotonic() + 60
    while not restricted and time.monotonic() < deadline:
        if kreld.call("Resolve", addresses=[hex(text + 0x10)])["symbols"]:
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
    # Under load: kreld and echo alternately, the order swapped every round.
    duration, rounds = (1.5, 2) if quick else (3.0, 3)
    loads: dict[str, list[tuple[float, float]]] = {"echo": [], "kreld": []}
    runs = {
        "echo": (echo_sock, '{"method":"x.Echo","parameters":{"a":"b"}}', echo_pid),
        "kreld": (kreld_sock, '{"method":"io.kreld.GetBoot"}', kreld_pid),
    }
    for i in range(rounds):
        for k in ("kreld", "echo") if i % 2 == 0 else ("echo", "kreld"):
            sock, msg, pid = runs[k]
            loads[k].append(_load(sock, msg, pid, duration))
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
    load_tag, load_desc = (
        "echo-load",
        f"the echo server under the same load ({LOAD_CLIENTS} clients x {LOAD_DEPTH} calls)",
    )
    res.append(
        Result(
            f"GetBoot calls/s, {LOAD_CLIENTS} client processes pipelining {LOAD_DEPTH} calls each",
            median(r for r, _ in loads["kreld"]),
            "",
            median(r for r, _ in loads["echo"]),
            load_tag,
            load_desc,
            notes=[
                f"under load: {LOAD_CLIENTS} client processes (raw AF_UNIX socket, "
                f"{LOAD_DEPTH} calls pipelined) for {duration:g} s, kreld and echo alternately, "
                f"median of {rounds} runs each; daemon CPU is utime+stime of the whole "
                "process (all threads) from /proc/<pid>/stat, in clock ticks "
                f"({os.sysconf('SC_CLK_TCK')}/s)"
            ],
        )
    )
    res.append(
        Result(
            "daemon CPU per GetBoot under that load",
            median(c for _, c in loads["kreld"]) * 1000,
            "ns",
            median(c for _, c in loads["echo"]) * 1000,
            load_tag,
            load_desc,
        )
    )
    res[0].notes = [
        f"server: {n_calls} small calls and {n_big} 10,000-address calls per figure, interleaved "
        f"with their baselines; kernel symbols: {'restricted' if restricted else 'cached'}; "
        f"CPUs {os.cpu_count()}"
    ]
    for r in res:
        r.bench = "server"
    return res


if __name__ == "__main__":
    sys.exit(bench_main("server", run))
