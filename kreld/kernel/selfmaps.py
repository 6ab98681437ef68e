"""Where a file is mapped in this process, from ``/proc/self/maps``.

Each line is ``start-end perms offset major:minor inode path``, addresses and
device numbers in hex (``show_map_vma()`` in fs/proc/task_mmu.c).  A mapping
is told by its device and inode, not its path: the path may hold spaces, or
end in `` (deleted)``.
"""

from __future__ import annotations

import os
from pathlib import Path

from kreld.kernel.files import read_bounded

__all__ = ["MAX_SELF_MAPS", "mapped_ranges"]

# A daemon's maps run to a few hundred lines; a bound far above them.
MAX_SELF_MAPS = 1 << 22


def mapped_ranges(path: Path, maps: Path = Path("/proc/self/maps")) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each mapping of file *path* in this process."""
    st = os.stat(path)
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    out = []
    for line in read_bounded(maps, MAX_SELF_MAPS).splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue  # anonymous
        span, _perms, _offset, dev, inode = fields[:5]
        major, _, minor = dev.partition(b":")
        try:
            if (int(major, 16), int(minor, 16), int(inode)) != want:
                continue
            start, _, end = span.partition(b"-")
            out.append((int(start, 16), int(end, 16)))
        except ValueError:
            continue
    return out
