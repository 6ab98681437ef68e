"""Runs inside the VM (tests/vm/guest.sh): a profiler's view of kreld, a
client of ``kreld.client`` subscribed with ``Subscribe``.

    python guest_subscribe.py SOCKET OUT

Started before kreld (so its own start-up, slow under emulation, overlaps
kreld's): waits up to 180 s for SOCKET to answer, subscribes, and writes
every reply as one JSON line to OUT (flushed at once), until the stream ends
or it is killed (SIGTERM).  Errors go to stderr, exit status 1.
"""

from __future__ import annotations

import json
import sys
import time

from kreld.client import Client, ConnectError


def main() -> int:
    path, out = sys.argv[1], sys.argv[2]
    deadline = time.monotonic() + 180
    while True:
        try:
            client = Client(path, timeout=None)  # an idle subscription may last
            break
        except ConnectError as e:
            if time.monotonic() > deadline:
                print(f"guest_subscribe: {e}", file=sys.stderr)
                return 1
            time.sleep(0.1)
    with client, open(out, "w") as f:
        for msg in client.stream("Subscribe"):
            f.write(json.dumps(msg) + "\n")
            f.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
