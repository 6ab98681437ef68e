"""Line tables (``linetabs``): a build's source lines, kept by build-id.

A table is the bytes :meth:`kreld.debuginfo.lines.LineTable.to_bytes` wrote,
tens of MiB for a kernel.  It is stored in chunks of at most :data:`CHUNK`
bytes, so that no LMDB value is larger than the store's other big values by
orders of magnitude and the map grows in steps :mod:`.env` already takes:

* ``<build-id>`` -> a manifest (JSON): chunk count, total size, SHA-256 of the
  whole, where the debug file came from;
* ``<build-id>/`` + chunk number (4 bytes BE) -> the chunk.

Manifest and chunks go in one write transaction, so a reader sees a table
whole or not at all; on read the size and digest are checked, and a table that
fails them is :class:`~kreld.core.errors.StoreCorrupt`.
"""

from __future__ import annotations

import struct
from typing import Any

from kreld.core.errors import InvalidArgument, StoreCorrupt
from kreld.store.env import StoreEnv, Table, dumps

__all__ = ["CHUNK", "MAX_TABLE", "LineTableStore", "StoredLineTable"]

CHUNK = 4 << 20
# A larger table is refused: the kernel's is ~40 MiB; this bounds what one
# build may take of the store.
MAX_TABLE = 1 << 30
_CHUNK_NO = struct.Struct(">I")
_BUILD_ID_MAX = 128


def _bid(build_id: str) -> bytes:
    if (
        not build_id
        or len(build_id) > _BUILD_ID_MAX
        or not all(c in "0123456789abcdef" for c in build_id)
    ):
        raise InvalidArgument("build_id", f"not a build-id: {build_id[:_BUILD_ID_MAX]!r}")
    return build_id.encode()


class StoredLineTable:
    """A table's manifest and bytes as read back."""

    def __init__(self, build_id: str, manifest: dict[str, Any], data: bytes) -> None:
        self.build_id = build_id
        self.manifest = manifest
        self.data = data


class LineTableStore:
    """The ``linetabs`` table over one store environment."""

    def __init__(self, env: StoreEnv) -> None:
        self.env = env

    def put(self, build_id: str, data: bytes, source: str, what: str = "") -> None:
        """Keep *data* as *build_id*'s line table, replacing any before it;
        *source* says where its debug file came from, *what* which build it
        is (the kernel image or a module of a release), for listings."""
        key = _bid(build_id)
        if len(data) > MAX_TABLE:
            raise InvalidArgument("data", f"a line table of {len(data)} bytes is over {MAX_TABLE}")
        chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
        import hashlib  # here: a store opened for anything else never needs it

        digest = hashlib.sha256(data).hexdigest()
        manifest = {"chunks": len(chunks), "size": len(data), "sha256": digest, "source": source}
        if what:
            manifest["what"] = what

        def fn(txn: Any) -> None:
            db = self.env.dbs[Table.LINETABS]
            _drop(txn, db, key)
            txn.put(key, dumps(manifest), db=db)
            for n, chunk in enumerate(chunks):
                txn.put(key + b"/" + _CHUNK_NO.pack(n), chunk, db=db)

        self.env.write(fn)

    def get(self, build_id: str) -> StoredLineTable | None:
        """*build_id*'s table, or None if none is kept."""
        key = _bid(build_id)

        def fn(txn: Any) -> tuple[bytes, list[bytes]] | None:
            db = self.env.dbs[Table.LINETABS]
            if db is None:
                return None
            raw = txn.get(key, db=db)
            if raw is None:
                return None
            rec = self.env.json_record(raw, f"line table manifest {build_id}")
            n = rec.get("chunks")
            if not isinstance(n, int) or not 0 < n <= MAX_TABLE // CHUNK + 1:
                raise StoreCorrupt(
                    str(self.env.path), f"line table manifest {build_id}: chunks {n!r}"
                )
            parts = [txn.get(key + b"/" + _CHUNK_NO.pack(i), db=db) for i in range(n)]
            if any(p is None for p in parts):
                raise StoreCorrupt(str(self.env.path), f"line table {build_id}: a chunk is missing")
            return bytes(raw), [bytes(p) for p in parts]

        got = self.env.read(fn)
        if got is None:
            return None
        import hashlib

        manifest = self.env.json_record(got[0], f"line table manifest {build_id}")
        data = b"".join(got[1])
        if len(data) != manifest.get("size") or hashlib.sha256(data).hexdigest() != manifest.get(
            "sha256"
        ):
            raise StoreCorrupt(str(self.env.path), f"line table {build_id}: size or digest differs")
        return StoredLineTable(build_id, manifest, data)

    def listing(self) -> dict[str, dict[str, Any]]:
        """Every kept table's manifest, by build-id (what status shows)."""

        def fn(txn: Any) -> dict[str, dict[str, Any]]:
            db = self.env.dbs[Table.LINETABS]
            out: dict[str, dict[str, Any]] = {}
            if db is None:
                return out
            # Manifests only: a table's chunks ("BID/N", megabytes in all) are
            # stepped over, never read ("/" sorts just before "0").
            cur = txn.cursor(db=db)
            more = cur.first()
            while more:
                key = bytes(cur.key())
                bid = key.split(b"/", 1)[0]
                if bid == key:
                    out[key.decode()] = self.env.json_record(cur.value(), "line table manifest")
                more = cur.set_range(bid + b"0")
            return out

        return self.env.read(fn)

    def delete(self, build_id: str) -> bool:
        key = _bid(build_id)

        def fn(txn: Any) -> bool:
            return _drop(txn, self.env.dbs[Table.LINETABS], key)

        return self.env.write(fn)


def _drop(txn: Any, db: Any, key: bytes) -> bool:
    found = bool(txn.delete(key, db=db))
    cur = txn.cursor(db=db)
    prefix = key + b"/"
    if cur.set_range(prefix):
        while bytes(cur.key()).startswith(prefix):
            found = True
            if not cur.delete():
                break
    return found
