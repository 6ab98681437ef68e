"""Run one command and report the kernel's figures for it, and for it alone.

    python peak.py RESULT TIMEOUT AS_LIMIT -- ARGV...

Why a launcher: a process's resident high-water mark survives ``execve`` (the kernel
carries the old mm's peak into the new one, fs/exec.c ``setmax_mm_hiwater_rss``), so a
child forked straight from a pytest process of 240 MB reports a ``ru_maxrss`` of at
least 240 MB whatever it did.  Forked from this small process instead, the command
starts from this process's ten-odd MB, and its ``wait4`` figures are its own.

The command gets this process's stdin, stdout and stderr, RLIMIT_AS of AS_LIMIT bytes,
and is killed (SIGKILL, with its process group) after TIMEOUT seconds.  RESULT receives
one JSON object: ``status`` (as ``os.waitstatus_to_exitcode``), ``maxrss_kib``,
``cpu_s`` (user + system), ``wall_s`` and ``timed_out``.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import sys
import time


def main(argv: list[str]) -> int:
    result, timeout, as_limit = argv[1], float(argv[2]), int(argv[3])
    assert argv[4] == "--", argv
    command = argv[5:]
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the measured command
        try:
            os.setpgid(0, 0)
            resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))
            os.execvp(command[0], command)
        finally:
            os._exit(127)
    timed_out = False
    while True:
        done, status, ru = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - t0 > timeout:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            done, status, ru = os.wait4(pid, 0)
            break
        time.sleep(0.01)
    figures = {
        "status": os.waitstatus_to_exitcode(status),
        "maxrss_kib": ru.ru_maxrss,
        "cpu_s": ru.ru_utime + ru.ru_stime,
        "wall_s": time.monotonic() - t0,
        "timed_out": timed_out,
    }
    with open(result, "w", encoding="utf-8") as f:
        json.dump(figures, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
