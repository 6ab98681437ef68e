"""In the guest: load and unload N short-lived BPF programs, kreld (PID) stopped
with SIGSTOP from the first third of the burst to its end; writes the programs'
names and the burst's CLOCK_MONOTONIC span (JSON) to OUT."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from support.bpfprog import load_socket_filter


def main() -> None:
    pid, n, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    names = []
    start = time.monotonic_ns()
    stopped = resumed = 0
    for i in range(n):
        if i == n // 3:
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic_ns()
        name = f"kburst{i}"
        os.close(load_socket_filter(name))
        names.append(name)
    time.sleep(0.2)  # the last unloads run from a work queue
    os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic_ns()
    span = {"start": start, "stopped": stopped, "resumed": resumed, "end": time.monotonic_ns()}
    with open(out, "w") as f:
        json.dump({"names": names, **span}, f)


if __name__ == "__main__":
    main()
