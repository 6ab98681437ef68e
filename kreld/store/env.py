"""The store's environment: opening it safely, transactions, map growth, retries.

Every other part of :mod:`kreld.store` reaches LMDB through :meth:`StoreEnv.read`
and :meth:`StoreEnv.write` and its tables through :attr:`StoreEnv.dbs`, keyed by
:class:`Table`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import struct
import threading
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from kreld.core import consts, heap, uuids
from kreld.core.errors import (
    KernelReadError,
    StoreCorrupt,
    StoreDamaged,
    StoreError,
    StoreFull,
    StoreTooNew,
)
from kreld.kernel.selfmaps import mapped_ranges
from kreld.store.lmdbcheck import check_datafile
from kreld.store.ownership import check_owner

__all__ = [
    "OPENED",
    "SEQ",
    "UNREADABLE",
    "StoreEnv",
    "T",
    "Table",
    "boot_key",
    "decoded",
    "dumps",
    "inc_key",
]

T = TypeVar("T")


class Table(bytes, Enum):
    """The named databases of a store: a handle's name is its LMDB name.

    A member is bytes, so ``env.dbs[Table.BOOTS]`` and ``env.dbs[b"boots"]``
    are the same handle.  The layout of each is in :mod:`kreld.store`.
    """

    META = b"meta"
    BOOTS = b"boots"
    BOOT_ORDER = b"boot_order"
    BUILDS = b"builds"
    INCARNATIONS = b"incarnations"
    OPEN = b"open"
    WATCH = b"watch"
    SYMTABS = b"symtabs"
    BOOT_SYMBOLS = b"boot_symbols"
    LAYOUTS = b"layouts"
    ABSOLUTES = b"absolutes"
    # Kernel code, kept by kreld.store.kernel_code.  The on-disk name stays "kcode":
    # stores written before the rename open under it.
    KERNEL_CODE = b"kcode"
    LINETABS = b"linetabs"  # source line tables by build-id: kept by kreld.store.linetabs
    PUBLISHED = b"published"  # opened by kreld.store.pubstate, only when publishing

    @property
    def label(self) -> str:
        return self.value.decode()


# The tables every open of a store opens (creating them when writing).
OPENED = tuple(t for t in Table if t is not Table.PUBLISHED)
# Free space under which an EIO from LMDB is taken for a full disk.
_NEARLY_FULL = 4 << 20
SEQ = struct.Struct(">Q")
# Reader slots of the environment, and the size its lock file is given up front:
# LMDB asks for (readers - 1) slots of a cache line each plus a header of a few
# lines, and takes a bigger file as it is (more slots), never shrinking it.
_MAX_READERS = 1024
_LOCK_FILE_BYTES = _MAX_READERS * 64 + 4096
# What a damaged record raises when decoded.
UNREADABLE = (ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error)


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def decoded(path: Path, what: str, fn: Callable[[], T]) -> T:
    """*fn*'s decode of a stored record; a damaged record is StoreCorrupt."""
    try:
        return fn()
    except UNREADABLE as e:
        raise StoreCorrupt(str(path), f"unreadable {what}: {e!r}") from e


def boot_key(boot_id: str) -> bytes:
    return uuids.to_bytes(boot_id)


def inc_key(boot_id: str, seq: int) -> bytes:
    return boot_key(boot_id) + SEQ.pack(seq)


class _ResizeGate:
    """Many transactions at once, or one map resize alone (LMDB's rule)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._resizing = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


class _Databases(dict[bytes, Any]):
    """The named database handles; one a damaged store lost (a reader's open
    of a damaged store) is StoreCorrupt when used, never read."""

    def __init__(self, path: str, lost: frozenset[str]) -> None:
        super().__init__()
        self._path = path
        self._lost = lost

    def __missing__(self, name: bytes) -> Any:
        if name.decode() in self._lost:
            raise StoreCorrupt(self._path, f"data.mdb is truncated or damaged in {name.decode()}")
        raise KeyError(name)


def _reserve_lock_file(path: Path) -> None:
    """Give LMDB's lock file its blocks before LMDB maps it.

    LMDB writes its reader table through a shared mapping of ``lock.mdb``; where the
    file is sparse (as LMDB makes it) and the disk full, touching a new page of it is
    SIGBUS, not an error.  Allocated here with posix_fallocate, a full disk is a
    StoreFull naming the file.  An existing file keeps its size (another process may
    have it mapped and counts its reader slots from it); a new one gets
    ``_LOCK_FILE_BYTES`` at once.  Where the file cannot be opened for writing (a
    reader without the right), LMDB's own open says why.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError:
        return
    try:
        size = os.fstat(fd).st_size
        os.posix_fallocate(fd, 0, size or _LOCK_FILE_BYTES)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            if not size:  # ours, and unusable: leave no empty lock file behind
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise StoreFull(str(path), f"no room for LMDB's lock file: {e.strerror}") from e
        # EOPNOTSUPP and kin: a filesystem without fallocate; LMDB goes on as before.
    finally:
        os.close(fd)


class StoreEnv:
    """The LMDB environment of a store, opened for writing (the daemon) or
    reading (kreldctl), and the transactions every table family runs in."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        readonly: bool = False,
        map_size: int = consts.STORE_INITIAL_MAP_SIZE,
    ) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self._gate = _ResizeGate()
        self._write_lock = threading.Lock()
        # Why the last write failed for want of room (disk or map), until one succeeds.
        self.full: str | None = None
        if readonly and not (self.path / "data.mdb").exists():
            raise StoreError(str(self.path), "no kreld store here (no data.mdb)")
        if not readonly:
            try:
                self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(str(self.path), f"cannot create: {e.strerror}") from e
            check_owner(self.path)
        # Named databases found damaged: a reader leaves them alone (None below).
        self.lost = check_datafile(self.path, readonly=readonly)
        if Table.META.label in self.lost:
            raise StoreDamaged(
                str(self.path), "data.mdb is truncated or damaged in its meta database"
            )
        _reserve_lock_file(self.path / "lock.mdb")
        self.lmdb = self._open_env(map_size)
        try:
            self._init_or_check()
        except lmdb.CorruptedError as e:
            self.lmdb.close()
            raise StoreDamaged(str(self.path), f"LMDB finds it damaged ({e})") from e
        except lmdb.Error as e:  # the first write of a new store, on a full disk
            self.lmdb.close()
            raise self._write_error(e) from e
        except BaseException:
            self.lmdb.close()
            raise
        self.dbs = _Databases(str(self.path), self.lost)
        for table in OPENED:
            if table.label in self.lost:
                continue
            try:
                self.dbs[table] = self.lmdb.open_db(table.value, create=not readonly)
            except lmdb.NotFoundError:
                # A read-only open of a store from before this table existed.
                self.dbs[table] = None

    # -- opening -----------------------------------------------------------

    def _open_env(self, map_size: int) -> Any:
        try:
            return lmdb.open(
                str(self.path),
                map_size=map_size,
                max_dbs=len(OPENED) + 4,
                readonly=self.readonly,
                create=not self.readonly,
                subdir=True,
                sync=True,
                metasync=True,
                max_readers=_MAX_READERS,
            )
        except lmdb.InvalidError as e:
            raise StoreCorrupt(str(self.path), f"not an LMDB environment ({e})") from e
        except lmdb.CorruptedError as e:
            raise StoreDamaged(str(self.path), f"LMDB finds it damaged ({e})") from e
        except lmdb.VersionMismatchError as e:
            raise StoreCorrupt(str(self.path), f"LMDB version mismatch ({e})") from e
        except lmdb.Error as e:
            raise StoreError(str(self.path), str(e)) from e

    def _init_or_check(self) -> None:
        with self.lmdb.begin() as txn:
            names = [k for k, _ in txn.cursor()]
        if not names:
            if self.readonly:
                raise StoreError(str(self.path), "the store is empty (never initialised)")
            meta = self.lmdb.open_db(Table.META.value, create=True)
            with self.lmdb.begin(write=True) as txn:
                txn.put(b"magic", consts.STORE_MAGIC, db=meta)
                txn.put(b"schema", str(consts.STORE_SCHEMA_VERSION).encode(), db=meta)
            return
        if Table.META.value not in names:
            raise StoreCorrupt(str(self.path), "an LMDB environment, but not a kreld store")
        try:
            meta = self.lmdb.open_db(Table.META.value, create=False)
        except lmdb.Error as e:
            # e.g. MDB_INCOMPATIBLE: "meta" is a plain key of a foreign environment.
            raise StoreCorrupt(
                str(self.path), f"an LMDB environment, but not a kreld store ({e})"
            ) from e
        with self.lmdb.begin(db=meta) as txn:
            magic = txn.get(b"magic")
            schema = txn.get(b"schema")
        if magic != consts.STORE_MAGIC or schema is None:
            raise StoreCorrupt(str(self.path), "an LMDB environment, but not a kreld store")
        try:
            version = int(schema)
        except ValueError as e:
            raise StoreCorrupt(str(self.path), f"unreadable schema version {schema!r}") from e
        if version > consts.STORE_SCHEMA_VERSION:
            raise StoreTooNew(str(self.path), version, consts.STORE_SCHEMA_VERSION)
        if version < consts.STORE_SCHEMA_VERSION and not self.readonly:
            # 1 -> 2 -> 3 -> 4: new incarnations are written in the newest record form
            # (records.py); older ones stay readable as they are.  The version
            # is raised so that an older kreld refuses what it cannot read.
            with self.lmdb.begin(write=True, db=meta) as txn:
                txn.put(b"schema", str(consts.STORE_SCHEMA_VERSION).encode())

    def close(self) -> None:
        self.lmdb.close()

    # -- transactions --------------------------------------------------------

    def _grow(self) -> None:
        with self._gate.exclusive():
            size = self.lmdb.info()["map_size"]
            if size >= consts.STORE_MAX_MAP_SIZE:
                raise StoreFull(str(self.path), f"map size limit {size} bytes reached")
            self.lmdb.set_mapsize(size * 2)

    def _adopt_size(self) -> None:
        with self._gate.exclusive():
            self.lmdb.set_mapsize(0)

    def read(self, fn: Callable[[Any], T], *, buffers: bool = False) -> T:
        """Run *fn* in a read transaction (a consistent snapshot of the store);
        with *buffers*, values are views into the map, valid only inside *fn*."""
        while True:
            try:
                with self._gate.shared(), self.lmdb.begin(buffers=buffers) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                self._adopt_size()
            except lmdb.CorruptedError as e:
                raise StoreCorrupt(str(self.path), str(e)) from e

    def write(self, fn: Callable[[Any], T]) -> T:
        """Run *fn* in a write transaction; grow the map and retry when full."""
        if self.readonly:
            raise StoreError(str(self.path), "opened read-only")
        with self._write_lock:
            try:
                done = self._write_growing(fn)
            except StoreFull as e:
                self.full = str(e)
                raise
            self.full = None
            return done

    def _write_growing(self, fn: Callable[[Any], T]) -> T:
        for _ in range(64):
            try:
                with self._gate.shared(), self.lmdb.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:  # the map, not the disk: grown (to its ceiling)
                self._grow()
            except lmdb.MapResizedError:
                self._adopt_size()
            except lmdb.CorruptedError as e:
                raise StoreCorrupt(str(self.path), str(e)) from e
            except lmdb.Error as e:
                raise self._write_error(e) from e
        raise StoreError(str(self.path), "write kept failing after growing the map")

    def _write_error(self, e: lmdb.Error) -> StoreError:
        """The named error for a failed write: a full disk is StoreFull."""
        if "No space left" in str(e) or getattr(e, "errno", None) == errno.ENOSPC:
            return StoreFull(str(self.path), "no space left on device")
        if "Input/output error" in str(e) and self._nearly_full():
            # LMDB turns a short write of its pages into EIO.
            return StoreFull(str(self.path), f"no space left on device ({e}: a short write)")
        return StoreError(str(self.path), str(e))

    def _nearly_full(self) -> bool:
        """Whether the filesystem under the store has less room than a write may need."""
        try:
            st = os.statvfs(self.path)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < _NEARLY_FULL

    def drop_pages(self) -> bool:
        """Drop the map's pages from this process's resident set (they stay
        in the page cache; the next read faults them in again): what a burst
        of reads left resident goes once it is over.  Whether it could."""
        with self._gate.shared():  # no resize moves the map meanwhile
            try:
                ranges = mapped_ranges(self.path / "data.mdb")
            except (OSError, KernelReadError):
                return False
            return heap.drop_file_pages(ranges)

    def last_txnid(self) -> int:
        """The id of the last committed write, by any process: a cache key."""
        return int(self.lmdb.info()["last_txnid"])

    def size_bytes(self) -> int:
        try:
            return (self.path / "data.mdb").stat().st_size
        except OSError:
            return 0

    def clear_stale_readers(self) -> int:
        """Free the reader slots of processes that died inside a read (a
        kreldctl killed mid-read): while held, they keep the pages of old
        snapshots from being reused and the file grows.  Returns how many."""
        try:
            with self._gate.shared():
                return int(self.lmdb.reader_check())
        except lmdb.Error as e:
            raise StoreError(str(self.path), f"reader check: {e}") from e

    def json_record(self, raw: bytes, what: str) -> dict[str, Any]:
        return decoded(self.path, what, lambda: dict(json.loads(bytes(raw))))
