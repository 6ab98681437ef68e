"""A BPF socket filter loaded by a process perf does not follow: waits for DIR/go,
loads the filter, attaches it to a UDP socket, writes its port to DIR/port,
waits for DIR/done, then closes both (the program is unloaded)."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from support.bpfprog import load_socket_filter

SO_ATTACH_BPF = 50


def wait(path: Path) -> None:
    end = time.monotonic() + 60
    while not path.exists():
        if time.monotonic() > end:
            sys.exit(f"{path} never came")
        time.sleep(0.01)


def main() -> None:
    d = Path(sys.argv[1])
    wait(d / "go")
    fd = load_socket_filter(sys.argv[2])
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setsockopt(socket.SOL_SOCKET, SO_ATTACH_BPF, fd.to_bytes(4, sys.byteorder))
    (d / "port.tmp").write_text(str(rx.getsockname()[1]))
    (d / "port.tmp").rename(d / "port")
    wait(d / "done")
    rx.close()
    os.close(fd)


if __name__ == "__main__":
    main()
