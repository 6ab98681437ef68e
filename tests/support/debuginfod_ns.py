"""Run inside a network namespace of its own (``unshare -n``), by
tests/debuginfo/test_debuginfod.py: brings up loopback, starts a real debuginfod over a
directory of gcc-built files and a small misbehaving HTTP server of its own,
both on 127.0.0.1 of this namespace, asks them through kreld's client, and
prints one JSON object: each scenario's outcome and what the cache held after.

Usage: debuginfod_ns.py WORKDIR (WORKDIR/served holds the files debuginfod
serves; WORKDIR/info.json names the build-ids)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kreld.core.errors import KreldError
from kreld.debuginfo.cache import DebugCache
from kreld.debuginfo.fetch import FetchLimits, download
from kreld.debuginfo.finder import DebuginfoFinder
from kreld.debuginfo.places import Kind, Wanted

RELEASE = "6.1.0-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_served(url: str, deadline: float) -> None:
    """Until debuginfod has indexed the directory and serves *url*."""
    while time.monotonic() < deadline:
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(url, timeout=2) as r,
        ):
            if r.status == 200:
                return
        time.sleep(0.1)  # polling a condition, with a deadline
    raise SystemExit(f"debuginfod did not serve {url} in time")


class Misbehaving(http.server.BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}
    release = threading.Event()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        how = self.path.split("/")[1]
        body = self.files["wrong"]
        if how == "slow":
            self.release.wait(20)
            return
        if how == "wrong":
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif how == "truncated":
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.close_connection = True
        elif how == "oversize":
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 40))
            self.end_headers()
        elif how == "endless":  # no length: counted as read
            self.send_response(200)
            self.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(64):
                    self.wfile.write(b"\0" * 65536)
            self.close_connection = True


def cache_listing(cache: DebugCache) -> list[str]:
    return sorted(os.listdir(cache.directory)) if cache.directory.exists() else []


def main() -> None:
    work = Path(sys.argv[1])
    info = json.loads((work / "info.json").read_text())
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    port = free_port()
    daemon = subprocess.Popen(
        ["debuginfod", "-d", ":memory:", "-p", str(port), "-F", str(work / "served")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    Misbehaving.files = {"wrong": (work / "wrong.debug").read_bytes()}
    own = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
    own.daemon_threads = True
    threading.Thread(target=own.serve_forever, daemon=True).start()
    out: dict[str, Any] = {}
    try:
        server = f"http://127.0.0.1:{port}"
        wait_served(f"{server}/buildid/{info['good']}/debuginfo", time.monotonic() + 60)
        limits = FetchLimits(timeout=1.0, max_time=30.0, max_bytes=1 << 20)
        cache = DebugCache(work / "state" / "debuginfo", 1 << 30)
        got = DebuginfoFinder([], servers=[server], cache=cache, limits=limits).find(
            Wanted(info["good"], Kind.IMAGE, RELEASE)
        )
        out["found"] = {
            "origin": str(got.origin),
            "source": got.source,
            "path": str(got.path),
            "cache": cache_listing(cache),
        }
        own_url = f"http://127.0.0.1:{own.server_address[1]}"
        cases = {
            "missing": (server, info["absent"]),
            "timeout": (f"{own_url}/slow", info["absent"]),
            "truncated": (f"{own_url}/truncated", info["absent"]),
            "oversize": (f"{own_url}/oversize", info["absent"]),
            "endless": (f"{own_url}/endless", info["absent"]),
            "wrong": (f"{own_url}/wrong", info["absent"]),
        }
        for name, (url, bid) in cases.items():
            try:
                cache.store(bid, url, lambda fd, u=url, b=bid: _ignore(download(u, b, fd, limits)))
                out[name] = {"error": None}
            except KreldError as e:
                out[name] = {"error": type(e).__name__, "message": str(e)}
            out[name]["cache"] = cache_listing(cache)
        Misbehaving.release.set()
        try:
            DebuginfoFinder([], servers=[server], cache=cache, limits=limits).find(
                Wanted(info["absent"], Kind.IMAGE, RELEASE)
            )
        except KreldError as e:
            out["not_found"] = {"error": type(e).__name__, "message": str(e)}
    finally:
        daemon.terminate()
        daemon.wait(30)
        own.shutdown()
    print(json.dumps(out))


def _ignore(_url: str) -> None:
    return None


if __name__ == "__main__":
    main()
