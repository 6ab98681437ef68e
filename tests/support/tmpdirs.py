"""Scratch directories for bursts of file operations."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def fast_tmpdir() -> Iterator[Path]:
    """A directory on tmpfs when there is one: bursts of thousands of file operations and
    the daemon's syncs stay quick, and tmpfs, like kernfs, does not reuse inode numbers."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        d = Path(tempfile.mkdtemp(prefix="kreld-test-", dir=shm))
    else:
        d = Path(tempfile.mkdtemp(prefix="kreld-test-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
