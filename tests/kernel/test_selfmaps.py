"""Where a file is mapped in this process (kreld.kernel.selfmaps)."""

from __future__ import annotations

import mmap
from pathlib import Path

from kreld.kernel.selfmaps import mapped_ranges


def test_a_mapped_file_is_found_by_its_inode_whatever_its_name(tmp_path: Path) -> None:
    """Each mapping of the file is found, told by device and inode: a name
    with spaces, and a file renamed after it was mapped, are found the same;
    another file, and a file no longer mapped, are not."""
    odd = tmp_path / "a name with spaces"
    odd.write_bytes(b"\0" * (3 * mmap.PAGESIZE))
    other = tmp_path / "other"
    other.write_bytes(b"\0" * mmap.PAGESIZE)
    with open(odd, "rb") as f, open(other, "rb") as g:
        one = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        two = mmap.mmap(f.fileno(), mmap.PAGESIZE, access=mmap.ACCESS_READ, offset=mmap.PAGESIZE)
        three = mmap.mmap(g.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        ranges = mapped_ranges(odd)
        assert sorted(end - start for start, end in ranges) == [mmap.PAGESIZE, 3 * mmap.PAGESIZE]
        moved = tmp_path / "moved"
        odd.rename(moved)
        assert mapped_ranges(moved) == ranges
        assert len(mapped_ranges(other)) == 1 and mapped_ranges(other)[0] not in ranges
    finally:
        one.close()
        two.close()
        three.close()
    assert mapped_ranges(moved) == []
