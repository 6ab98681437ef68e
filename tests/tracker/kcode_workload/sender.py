"""The recorded workload: asks DIR's loader for its filtered port, then sends
UDP datagrams to it for a second (the filter runs in this task's context)."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path


def main() -> None:
    d = Path(sys.argv[1])
    time.sleep(0.2)  # samples before the load
    (d / "go").touch()
    end = time.monotonic() + 60
    while not (d / "port").exists():
        if time.monotonic() > end:
            sys.exit("the loader gave no port")
        time.sleep(0.01)
    port = int((d / "port").read_text())
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        tx.sendto(b"x" * 64, ("127.0.0.1", port))
    (d / "done").touch()
    time.sleep(0.3)  # samples after the unload


if __name__ == "__main__":
    main()
