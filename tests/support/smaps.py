"""What a process holds resident of a file it maps, from /proc/PID/smaps."""

from __future__ import annotations

import os
from pathlib import Path


def file_rss(path: Path, pid: int | str = "self") -> int:
    """Bytes of *path*'s mappings resident in process *pid* (its ``Rss:`` lines)."""
    st = os.stat(path)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x} {st.st_ino} "
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line
            fields = line.split()
            inside = len(fields) >= 5 and f"{fields[3]} {fields[4]} " == want
        elif inside and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total
