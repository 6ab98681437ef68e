"""The LMDB store: every boot, build and module incarnation kreld has seen.

Layout (named databases in one environment under ``--state-dir``):

``meta``          ``magic`` and ``schema`` records.
``boots``         boot-id (text) -> boot record (JSON).
``boot_order``    first-seen realtime (8 bytes BE) + boot-id -> ``b""``: newest-first listing.
``builds``        build-id (hex text) -> build record (JSON).
``incarnations``  boot-id (16 bytes) + seq (8 bytes BE) -> incarnation (JSON).
``open``          same key -> ``b""`` for incarnations not yet seen unloaded.
``watch``         boot-id (16 bytes) -> last time the daemon saw ``sys/module`` (JSON).
``symtabs``       table key -> packed symbol table (:mod:`kreld.symtab`): ``k:<build-id>``
                  a kernel build, ``b:<boot-id>`` a boot whose table differs from
                  its build's, ``m:<build-id>`` a module build.
``layouts``       12-byte key -> the section names an incarnation record's offsets
                  follow (:mod:`kreld.records`), JSON.
``boot_symbols``  boot-id (text) -> which kernel table the boot uses, and the
                  kallsyms lines of owners that are not modules (bpf, ftrace), JSON.

Every write is one LMDB transaction: committed and synced, or not at all,
so a killed writer never leaves half a record.  When the map is full it is
doubled and the write retried.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
import struct
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from kreld import consts, records
from kreld.errors import (
    AmbiguousBoot,
    NoSuchBoot,
    StoreCorrupt,
    StoreDamaged,
    StoreError,
    StoreFull,
    StoreTooNew,
)
from kreld.lmdbcheck import check_datafile
from kreld.model import BootSnapshot, Incarnation, Timestamp, hexaddr, merge_boot
from kreld.symtab import SymbolTable, module_symbol_key

T = TypeVar("T")

_DBS = (
    b"meta",
    b"boots",
    b"boot_order",
    b"builds",
    b"incarnations",
    b"open",
    b"watch",
    b"symtabs",
    b"boot_symbols",
    b"layouts",
    b"absolutes",
)
# Free space under which an EIO from LMDB is taken for a full disk.
_NEARLY_FULL = 4 << 20
_SEQ = struct.Struct(">Q")


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def boot_record(snap: BootSnapshot) -> bytes:
    """A boot as stored: its wire form, but with the anchors keyed by the kernel's
    symbol names (``_text``), as every store has kept them since schema 1."""
    d = snap.to_json()
    d["anchors"] = {k: hexaddr(v) for k, v in snap.anchors.to_ints().items()}
    return _dumps(d)


def boot_from_record(raw: bytes) -> BootSnapshot:
    d = json.loads(raw)
    d["anchors"] = {k.removeprefix("_"): v for k, v in d["anchors"].items()}
    return BootSnapshot.from_json(d)


_UNREADABLE = (ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error)


def _decoded(path: Path, what: str, fn: Callable[[], T]) -> T:
    """*fn*'s decode of a stored record; a damaged record is StoreCorrupt."""
    try:
        return fn()
    except _UNREADABLE as e:
        raise StoreCorrupt(str(path), f"unreadable {what}: {e!r}") from e


def boot_key(boot_id: str) -> bytes:
    return uuid.UUID(boot_id).bytes


def inc_key(boot_id: str, seq: int) -> bytes:
    return boot_key(boot_id) + _SEQ.pack(seq)


def check_owner(path: Path) -> None:
    """Refuse a state directory someone else controls (or a symlink to one).

    Whoever owns the directory, or may write to it, can swap data.mdb under
    the daemon; kreld writes only into a directory of its own user (or root).
    """
    try:
        st = os.lstat(path)
    except OSError as e:
        raise StoreError(str(path), f"cannot stat: {e.strerror}") from e
    if stat.S_ISLNK(st.st_mode):
        raise StoreError(str(path), "is a symlink; refusing to follow it")
    if st.st_uid not in (0, os.geteuid()):
        raise StoreError(str(path), f"owned by uid {st.st_uid}, not by kreld's uid {os.geteuid()}")
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        raise StoreError(str(path), "is writable by every user")
    for name in ("data.mdb", "lock.mdb"):
        try:
            fst = os.lstat(path / name)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(fst.st_mode) or fst.st_uid not in (0, os.geteuid()):
            raise StoreError(str(path / name), "a symlink or another user's file; refusing it")


class _ResizeGate:
    """Many transactions at once, or one map resize alone (LMDB's rule)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._resizing = False

    @contextmanager
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

    @contextmanager
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


class TableViews:
    """The symbol tables of one read transaction, each opened when first asked for."""

    def __init__(self, txn: Any, db: Any, keys: set[str]) -> None:
        self._txn = txn
        self._db = db
        self._keys = keys
        self._open: dict[str, SymbolTable | None] = {}

    def get(self, key: str) -> SymbolTable | None:
        try:
            return self._open[key]
        except KeyError:
            pass
        table = None
        if key in self._keys and self._db is not None:
            buf = self._txn.get(key.encode(), db=self._db)
            if buf is not None:
                table = SymbolTable(buf)
        self._open[key] = table
        return table

    def __getitem__(self, key: str) -> SymbolTable:
        table = self.get(key)
        if table is None:
            raise KeyError(key)
        return table


class Store:
    """A kreld store opened for writing (the daemon) or reading (kreldctl)."""

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
        self._layouts: dict[bytes, list[str]] = {}
        self._write_lock = threading.Lock()
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
        if "meta" in self.lost:
            raise StoreDamaged(
                str(self.path), "data.mdb is truncated or damaged in its meta database"
            )
        try:
            self.env = lmdb.open(
                str(self.path),
                map_size=map_size,
                max_dbs=len(_DBS) + 4,
                readonly=readonly,
                create=not readonly,
                subdir=True,
                sync=True,
                metasync=True,
                max_readers=1024,
            )
        except lmdb.InvalidError as e:
            raise StoreCorrupt(str(self.path), f"not an LMDB environment ({e})") from e
        except lmdb.CorruptedError as e:
            raise StoreDamaged(str(self.path), f"LMDB finds it damaged ({e})") from e
        except lmdb.VersionMismatchError as e:
            raise StoreCorrupt(str(self.path), f"LMDB version mismatch ({e})") from e
        except lmdb.Error as e:
            raise StoreError(str(self.path), str(e)) from e
        try:
            self._init_or_check()
        except lmdb.CorruptedError as e:
            self.env.close()
            raise StoreDamaged(str(self.path), f"LMDB finds it damaged ({e})") from e
        except BaseException:
            self.env.close()
            raise
        self.dbs = _Databases(str(self.path), self.lost)
        for name in _DBS:
            if name.decode() in self.lost:
                continue
            try:
                self.dbs[name] = self.env.open_db(name, create=not readonly)
            except lmdb.NotFoundError:
                # A read-only open of a store from before this table existed.
                self.dbs[name] = None

    # -- opening -----------------------------------------------------------

    def _init_or_check(self) -> None:
        with self.env.begin() as txn:
            names = [k for k, _ in txn.cursor()]
        if not names:
            if self.readonly:
                raise StoreError(str(self.path), "the store is empty (never initialised)")
            meta = self.env.open_db(b"meta", create=True)
            with self.env.begin(write=True) as txn:
                txn.put(b"magic", consts.STORE_MAGIC, db=meta)
                txn.put(b"schema", str(consts.STORE_SCHEMA_VERSION).encode(), db=meta)
            return
        if b"meta" not in names:
            raise StoreCorrupt(str(self.path), "an LMDB environment, but not a kreld store")
        try:
            meta = self.env.open_db(b"meta", create=False)
        except lmdb.Error as e:
            # e.g. MDB_INCOMPATIBLE: "meta" is a plain key of a foreign environment.
            raise StoreCorrupt(
                str(self.path), f"an LMDB environment, but not a kreld store ({e})"
            ) from e
        with self.env.begin(db=meta) as txn:
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
            # 1 -> 2 -> 3: new incarnations are written in the newest record form
            # (records.py); older ones stay readable as they are.  The version
            # is raised so that an older kreld refuses what it cannot read.
            with self.env.begin(write=True, db=meta) as txn:
                txn.put(b"schema", str(consts.STORE_SCHEMA_VERSION).encode())

    def close(self) -> None:
        self.env.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transactions --------------------------------------------------------

    def _grow(self) -> None:
        with self._gate.exclusive():
            size = self.env.info()["map_size"]
            if size >= consts.STORE_MAX_MAP_SIZE:
                raise StoreFull(str(self.path), f"map size limit {size} bytes reached")
            self.env.set_mapsize(size * 2)

    def _adopt_size(self) -> None:
        with self._gate.exclusive():
            self.env.set_mapsize(0)

    def read(self, fn: Callable[[Any], T]) -> T:
        """Run *fn* in a read transaction (a consistent snapshot of the store)."""
        while True:
            try:
                with self._gate.shared(), self.env.begin(buffers=False) as txn:
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
            for _ in range(64):
                try:
                    with self._gate.shared(), self.env.begin(write=True) as txn:
                        return fn(txn)
                except lmdb.MapFullError:
                    self._grow()
                except lmdb.MapResizedError:
                    self._adopt_size()
                except lmdb.CorruptedError as e:
                    raise StoreCorrupt(str(self.path), str(e)) from e
                except lmdb.Error as e:
                    if "No space left" in str(e) or getattr(e, "errno", None) == errno.ENOSPC:
                        raise StoreFull(str(self.path), "no space left on device") from e
                    if "Input/output error" in str(e) and self._nearly_full():
                        # LMDB turns a short write of its pages into EIO.
                        raise StoreFull(
                            str(self.path), f"no space left on device ({e}: a short write)"
                        ) from e
                    raise StoreError(str(self.path), str(e)) from e
            raise StoreError(str(self.path), "write kept failing after growing the map")

    def _nearly_full(self) -> bool:
        """Whether the filesystem under the store has less room than a write may need."""
        try:
            st = os.statvfs(self.path)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < _NEARLY_FULL

    def last_txnid(self) -> int:
        """The id of the last committed write, by any process: a cache key."""
        return int(self.env.info()["last_txnid"])

    def size_bytes(self) -> int:
        try:
            return (self.path / "data.mdb").stat().st_size
        except OSError:
            return 0

    # -- boots ---------------------------------------------------------------

    def _boot(self, raw: bytes) -> BootSnapshot:
        return _decoded(self.path, "boot record", lambda: boot_from_record(raw))

    def _json(self, raw: bytes, what: str) -> dict[str, Any]:
        return _decoded(self.path, what, lambda: dict(json.loads(bytes(raw))))

    def record_boot(self, snap: BootSnapshot) -> tuple[BootSnapshot, bool, bool]:
        """Record *snap*; returns the stored record, whether it was new, and
        whether an existing record learnt something."""
        key = snap.boot_id.encode()

        def txn_fn(txn: Any) -> tuple[BootSnapshot, bool, bool]:
            raw = txn.get(key, db=self.dbs[b"boots"])
            if raw is not None:
                old = self._boot(raw)
                merged = merge_boot(old, snap)
                if merged == old:
                    return old, False, False
                txn.put(key, boot_record(merged), db=self.dbs[b"boots"])
                self._put_build(txn, merged)
                return merged, False, True
            txn.put(key, boot_record(snap), db=self.dbs[b"boots"])
            order = _SEQ.pack(snap.first_seen.realtime) + key
            txn.put(order, b"", db=self.dbs[b"boot_order"])
            self._put_build(txn, snap)
            return snap, True, False

        return self.write(txn_fn)

    def _put_build(self, txn: Any, snap: BootSnapshot) -> None:
        if not snap.build_id:
            return
        key = snap.build_id.encode()
        db = self.dbs[b"builds"]
        raw = txn.get(key, db=db)
        rec = _decoded(self.path, "build record", lambda: json.loads(raw)) if raw else None
        if rec is None:
            rec = {
                "build_id": snap.build_id,
                "release": snap.release,
                "version": snap.version,
                "first_boot": snap.boot_id,
                "link_text": None,
            }
        if rec["link_text"] is None and snap.kaslr and snap.anchors.text is not None:
            rec["link_text"] = f"{snap.anchors.text - snap.kaslr.value:#x}"
        elif raw is not None:
            return
        txn.put(key, _dumps(rec), db=db)

    def get_boot(self, boot_id: str) -> BootSnapshot:
        def fn(txn: Any) -> bytes | None:
            db = self.dbs[b"boots"]
            return None if db is None else txn.get(boot_id.encode(), db=db)

        raw = self.read(fn)
        if raw is None:
            raise NoSuchBoot(boot_id)
        return self._boot(raw)

    def resolve_boot(self, prefix: str) -> str:
        """The full boot-id for a unique prefix (as ``git`` does with hashes)."""
        p = prefix.strip().lower()
        if not p:
            raise NoSuchBoot(prefix)

        def fn(txn: Any) -> list[str]:
            db = self.dbs[b"boots"]
            if db is None:
                return []
            cur = txn.cursor(db=db)
            out: list[str] = []
            if cur.set_range(p.encode()):
                for k in cur.iternext(values=False):
                    s = k.decode()
                    if not s.startswith(p):
                        break
                    out.append(s)
                    if s == p:
                        return [s]
            return out

        matches = self.read(fn)
        if not matches:
            raise NoSuchBoot(prefix)
        if len(matches) > 1:
            raise AmbiguousBoot(prefix, matches)
        return matches[0]

    def list_boots(self) -> list[BootSnapshot]:
        """Every recorded boot, newest first."""

        def fn(txn: Any) -> list[BootSnapshot]:
            order, boots = self.dbs[b"boot_order"], self.dbs[b"boots"]
            if order is None or boots is None:
                return []
            out = []
            for k in txn.cursor(db=order).iterprev(values=False):
                raw = txn.get(k[8:], db=boots)
                if raw is not None:
                    out.append(self._boot(raw))
            return out

        return self.read(fn)

    def get_build(self, build_id: str) -> dict[str, Any] | None:
        def fn(txn: Any) -> bytes | None:
            db = self.dbs[b"builds"]
            return None if db is None else txn.get(build_id.encode(), db=db)

        raw = self.read(fn)
        return None if raw is None else self._json(raw, "build record")

    def counts(self) -> dict[str, int]:
        def fn(txn: Any) -> dict[str, int]:
            out = {}
            for name in (b"boots", b"builds", b"incarnations", b"open"):
                if name.decode() in self.lost:  # a damaged store read as far as it is whole
                    continue
                db = self.dbs[name]
                out[name.decode()] = 0 if db is None else txn.stat(db)["entries"]
            return out

        return self.read(fn)

    # -- module incarnations -------------------------------------------------

    def _next_seq(self, txn: Any, boot_id: str) -> int:
        prefix = boot_key(boot_id)
        cur = txn.cursor(db=self.dbs[b"incarnations"])
        # Position past the last key of this boot, then step back.
        if cur.set_range(prefix + b"\xff" * 8):
            if cur.key()[:16] == prefix:
                return int(_SEQ.unpack(cur.key()[16:])[0]) + 1
            if not cur.prev():
                return 0
        elif not cur.last():
            return 0
        k = cur.key()
        return int(_SEQ.unpack(k[16:])[0]) + 1 if k[:16] == prefix else 0

    def apply_module_changes(
        self,
        boot_id: str,
        opened: list[Incarnation],
        updated: list[Incarnation],
        closed: list[Incarnation],
        watched: Timestamp | None,
    ) -> list[Incarnation]:
        """Record new incarnations (seq assigned here), updates and unloads in
        one transaction; returns the opened ones with their seq."""
        db, open_db = self.dbs[b"incarnations"], self.dbs[b"open"]

        def fn(txn: Any) -> list[Incarnation]:
            seq = self._next_seq(txn, boot_id)
            out = []
            for inc in opened:
                rec = dataclasses.replace(inc, boot_id=boot_id, seq=seq)
                key = inc_key(boot_id, seq)
                txn.put(key, self._encode(txn, rec), db=db)
                if rec.unloaded is None:
                    txn.put(key, b"", db=open_db)
                out.append(rec)
                seq += 1
            for inc in updated:
                txn.put(inc_key(boot_id, inc.seq), self._encode(txn, inc), db=db)
            for inc in closed:
                key = inc_key(boot_id, inc.seq)
                txn.put(key, self._encode(txn, inc), db=db)
                txn.delete(key, db=open_db)
            if watched is not None:
                txn.put(boot_key(boot_id), _dumps(watched.to_json()), db=self.dbs[b"watch"])
            return out

        return self.write(fn)

    def close_other_boots(self, boot_id: str) -> int:
        """Drop the open-index entries of every other boot: those boots are over.

        Their incarnations keep ``unloaded`` null (their clocks ended with the
        boot: no time of this boot can close them); queries on an old boot
        treat them as loaded to the end of its record.
        """
        prefix = boot_key(boot_id)

        def fn(txn: Any) -> int:
            cur = txn.cursor(db=self.dbs[b"open"])
            n = 0
            if not cur.first():
                return 0
            while True:
                if cur.key()[:16] != prefix:
                    n += 1
                    if not cur.delete():
                        break
                elif not cur.next():
                    break
            return n

        return self.write(fn)

    def _encode(self, txn: Any, inc: Incarnation) -> bytes:
        raw, key, names = records.encode(inc)
        txn.put(key, _dumps(names), db=self.dbs[b"layouts"], overwrite=False)
        return raw

    def decode_incarnation(self, txn: Any, key: bytes, raw: bytes) -> Incarnation:
        """An incarnation from its key and stored record, in a read transaction."""

        def layout(k: bytes) -> list[str]:
            names = self._layouts.get(k)
            if names is None:
                stored = txn.get(k, db=self.dbs[b"layouts"])
                if stored is None:
                    raise StoreCorrupt(str(self.path), f"section layout {k.hex()} is missing")
                names = self._layouts[k] = _decoded(
                    self.path, "section layout", lambda: list(json.loads(bytes(stored)))
                )
            return names

        boot_id = str(uuid.UUID(bytes=bytes(key[:16])))
        try:
            return records.decode(raw, boot_id, int(_SEQ.unpack(key[16:24])[0]), layout)
        except _UNREADABLE as e:
            raise StoreCorrupt(
                str(self.path), f"unreadable incarnation record {bytes(key).hex()}: {e}"
            ) from e

    def heartbeat(self, boot_id: str, when: Timestamp) -> None:
        self.apply_module_changes(boot_id, [], [], [], when)

    def clear_stale_readers(self) -> int:
        """Free the reader slots of processes that died inside a read (a
        kreldctl killed mid-read): while held, they keep the pages of old
        snapshots from being reused and the file grows.  Returns how many."""
        try:
            with self._gate.shared():
                return int(self.env.reader_check())
        except lmdb.Error as e:
            raise StoreError(str(self.path), f"reader check: {e}") from e

    def last_watched(self, boot_id: str) -> Timestamp | None:
        def fn(txn: Any) -> bytes | None:
            db = self.dbs[b"watch"]
            return None if db is None else txn.get(boot_key(boot_id), db=db)

        raw = self.read(fn)
        if raw is None:
            return None
        return _decoded(self.path, "watch time", lambda: Timestamp.from_json(json.loads(raw)))

    def open_incarnations(self, boot_id: str) -> list[Incarnation]:
        prefix = boot_key(boot_id)

        def fn(txn: Any) -> list[Incarnation]:
            open_db, db = self.dbs[b"open"], self.dbs[b"incarnations"]
            if open_db is None or db is None:
                return []
            out = []
            cur = txn.cursor(db=open_db)
            if cur.set_range(prefix):
                for k in cur.iternext(values=False):
                    if k[:16] != prefix:
                        break
                    raw = txn.get(k, db=db)
                    if raw is not None:
                        out.append(self.decode_incarnation(txn, k, raw))
            return out

        return self.read(fn)

    def incarnations(self, boot_id: str) -> list[Incarnation]:
        """Every incarnation of the boot, in the order they were recorded."""
        prefix = boot_key(boot_id)

        def fn(txn: Any) -> list[Incarnation]:
            db = self.dbs[b"incarnations"]
            if db is None:
                return []
            out = []
            cur = txn.cursor(db=db)
            if cur.set_range(prefix):
                for k, v in cur.iternext():
                    if k[:16] != prefix:
                        break
                    out.append(self.decode_incarnation(txn, k, v))
            return out

        return self.read(fn)

    # -- symbol tables -----------------------------------------------------------

    def boot_symbols(self, boot_id: str) -> dict[str, Any] | None:
        def fn(txn: Any) -> bytes | None:
            db = self.dbs[b"boot_symbols"]
            return None if db is None else txn.get(boot_id.encode(), db=db)

        raw = self.read(fn)
        return None if raw is None else self._json(raw, "boot symbols record")

    def put_absolutes(self, boot_id: str, seq: int, values: list[int]) -> None:
        """The values one incarnation printed for its table's absolute entries
        (per-cpu variables), where they differ from the load the table came from."""
        packed = struct.pack(f"<{len(values)}q", *values)

        def fn(txn: Any) -> None:
            txn.put(inc_key(boot_id, seq), packed, db=self.dbs[b"absolutes"])

        self.write(fn)

    def absolutes(self, boot_id: str) -> dict[int, list[int]]:
        """:meth:`put_absolutes` of every incarnation of *boot_id*, by seq."""
        prefix = boot_key(boot_id)

        def fn(txn: Any) -> dict[int, list[int]]:
            db = self.dbs[b"absolutes"]
            out: dict[int, list[int]] = {}
            if db is None:
                return out
            cur = txn.cursor(db=db)
            if cur.set_range(prefix):
                for k, v in cur:
                    if k[:16] != prefix:
                        break
                    if len(v) % 8:
                        raise StoreCorrupt(str(self.path), f"absolutes {bytes(k).hex()}")
                    out[int(_SEQ.unpack(k[16:24])[0])] = list(struct.unpack(f"<{len(v) // 8}q", v))
            return out

        return self.read(fn)

    def record_kernel_table(
        self, boot_id: str, key: str, packed: bytes, extras: list[str]
    ) -> tuple[str, str]:
        """Attach the boot to its build's table, storing it only if new.

        Returns the key used and what happened: ``"stored"``, ``"shared"``
        (the build's table was already there, byte for byte) or ``"differs"``
        (this boot's symbols differ from its build's, as under function-granular
        KASLR: the boot gets a table of its own).
        """
        db, bdb = self.dbs[b"symtabs"], self.dbs[b"boot_symbols"]

        def fn(txn: Any) -> tuple[str, str]:
            done = txn.get(boot_id.encode(), db=bdb)
            if done is not None:
                return str(self._json(done, "boot symbols record")["kernel"]), "known"
            used, action = key, "shared"
            existing = txn.get(key.encode(), db=db)
            if existing is None:
                txn.put(key.encode(), packed, db=db)
                action = "stored"
            elif existing != packed:
                used, action = f"b:{boot_id}", "differs"
                txn.put(used.encode(), packed, db=db)
            txn.put(boot_id.encode(), _dumps({"kernel": used, "extras": extras}), db=bdb)
            return used, action

        return self.write(fn)

    def put_table(self, key: str, packed: bytes, replace: bool = False) -> bool:
        """Store a table under *key* unless one is there (or *replace*); True if stored."""
        db = self.dbs[b"symtabs"]
        return bool(self.write(lambda txn: txn.put(key.encode(), packed, db=db, overwrite=replace)))

    def table_source(self, key: str) -> int | None:
        """Where the table under *key* came from (``symtab.FROM_*``); None if absent."""

        def fn(txn: Any) -> int | None:
            db = self.dbs[b"symtabs"]
            buf = None if db is None else txn.get(key.encode(), db=db)
            return None if buf is None else SymbolTable(buf).source

        try:
            return self.read(fn)
        except ValueError as e:
            raise StoreCorrupt(str(self.path), f"symbol table {key}: {e}") from e

    def with_tables(self, keys: Iterable[str], fn: Callable[[TableViews], T]) -> T:
        """Run *fn* with :class:`~kreld.symtab.SymbolTable` views of the named
        tables (absent ones left out), straight from the map and opened as
        *fn* asks for them; the views are valid only inside *fn*."""
        wanted = set(keys)

        while True:
            try:
                with self._gate.shared(), self.env.begin(buffers=True) as txn:
                    return fn(TableViews(txn, self.dbs[b"symtabs"], wanted))
            except lmdb.MapResizedError:
                self._adopt_size()

    # -- garbage collection ------------------------------------------------------

    def gc(
        self, keep_boots: int, keep_days: float, protect: str | None, now_realtime: int
    ) -> dict[str, int]:
        """Forget boots beyond the retention policy, then every symbol table no
        remaining boot refers to.  *keep_boots*/*keep_days* of 0 mean no limit;
        the *protect*-ed boot (the current one) is always kept."""
        cutoff = now_realtime - int(keep_days * 86400e9) if keep_days else None

        def fn(txn: Any) -> dict[str, int]:
            order = self.dbs[b"boot_order"]
            newest_first = list(txn.cursor(db=order).iterprev(values=False))
            doomed = []
            for rank, k in enumerate(newest_first):
                boot_id = k[8:].decode()
                first_seen = int(_SEQ.unpack(k[:8])[0])
                too_many = keep_boots and rank >= keep_boots
                too_old = cutoff is not None and first_seen < cutoff
                if (too_many or too_old) and boot_id != protect:
                    doomed.append((k, boot_id))
            removed_incs = 0
            for k, boot_id in doomed:
                prefix = boot_key(boot_id)
                for name in (b"incarnations", b"open", b"absolutes"):
                    cur = txn.cursor(db=self.dbs[name])
                    if cur.set_range(prefix):
                        while cur.key()[:16] == prefix:
                            removed_incs += name == b"incarnations"
                            if not cur.delete():
                                break
                txn.delete(prefix, db=self.dbs[b"watch"])
                txn.delete(boot_id.encode(), db=self.dbs[b"boots"])
                txn.delete(boot_id.encode(), db=self.dbs[b"boot_symbols"])
                txn.delete(k, db=order)
            # Tables still referred to: each boot's kernel table, each module build.
            used: set[bytes] = set()
            for _, v in txn.cursor(db=self.dbs[b"boot_symbols"]):
                used.add(str(self._json(v, "boot symbols record")["kernel"]).encode())
            for k, v in txn.cursor(db=self.dbs[b"incarnations"]):
                st = self.decode_incarnation(txn, bytes(k), v).state
                key = module_symbol_key(st.build_id, st.name, st.srcversion)
                if key:
                    used.add(key.encode())
            tables = [k for k in txn.cursor(db=self.dbs[b"symtabs"]).iternext(values=False)]
            dropped = 0
            for k in tables:
                if bytes(k) not in used:
                    txn.delete(k, db=self.dbs[b"symtabs"])
                    dropped += 1
            return {"boots": len(doomed), "incarnations": removed_incs, "tables": dropped}

        return self.write(fn)
