"""What has been published to the fleet bucket, kept in the store (table ``published``).

The local store is the publishing queue; this table is its cursor, per target (a hash
of the URL and endpoint, so a new target starts from the beginning).  Keys, after the
8-byte target hash:

``b`` + boot-id    the boot's cursor (JSON): its batches, the next batch number, the
                   digest of what its manifest says, its index entry, whether it is done
``i`` + 24 bytes   (boot-id, seq) -> the digest of the incarnation as published
``c`` + 24 bytes   (boot-id, seq) -> the digest of the kernel-code record as published
``t`` + key        a symbol table known to be in the bucket
``p``              the round in flight (JSON, :class:`~kreld.fleet.publish.Plan`): written before
                   its first upload, removed in the transaction that commits the cursor,
                   so a restart finishes it instead of planning (and uploading) again
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kreld.store import Store, Table, boot_key, inc_key
from kreld.store.env import SEQ

__all__ = ["PubState", "table_bytes"]

_DB = Table.PUBLISHED.value


def table_bytes(store: Store, key: str) -> bytes | None:
    """A symbol table's packed bytes as the store holds them, or None."""

    def fn(txn: Any) -> bytes | None:
        db = store.env.dbs[Table.SYMTABS]
        raw = None if db is None else txn.get(key.encode(), db=db)
        return None if raw is None else bytes(raw)

    return store.env.read(fn)


class PubState:
    def __init__(self, store: Store, target: str) -> None:
        """The cursor of *target* (publish.Target.ident()); on a store opened read-only,
        to look at it (the table must exist then)."""
        self.store = store
        self.tid = hashlib.blake2b(target.encode(), digest_size=8).digest()
        if store.readonly:
            self.db = store.env.lmdb.open_db(_DB, create=False)
        else:
            self.db = store.env.write(lambda txn: store.env.lmdb.open_db(_DB, txn=txn, create=True))

    def _get(self, key: bytes) -> bytes | None:
        raw = self.store.env.read(lambda txn: txn.get(self.tid + key, db=self.db))
        return None if raw is None else bytes(raw)

    def cursor(self, boot_id: str) -> dict[str, Any] | None:
        raw = self._get(b"b" + boot_id.encode())
        return None if raw is None else dict(json.loads(raw))

    def digests(self, boot_id: str, kind: bytes = b"i") -> dict[int, bytes]:
        """The published digests of the boot's incarnations (*kind* ``i``) or
        kernel-code records (``c``), by seq."""
        prefix = self.tid + kind + boot_key(boot_id)

        def fn(txn: Any) -> dict[int, bytes]:
            out: dict[int, bytes] = {}
            cur = txn.cursor(db=self.db)
            if cur.set_range(prefix):
                for k, v in cur:
                    if not k.startswith(prefix):
                        break
                    out[int(SEQ.unpack(k[len(prefix) :])[0])] = bytes(v)
            return out

        return self.store.env.read(fn)

    def has_table(self, key: str) -> bool:
        return self._get(b"t" + key.encode()) is not None

    def pending(self) -> dict[str, Any] | None:
        raw = self._get(b"p")
        return None if raw is None else dict(json.loads(raw))

    def save_pending(self, plan: dict[str, Any]) -> None:
        data = json.dumps(plan, separators=(",", ":")).encode()
        self.store.env.write(lambda txn: txn.put(self.tid + b"p", data, db=self.db))

    def mark_done(self, boot_id: str) -> None:
        """A boot that is over and wholly published (its cursor, if any, says so)."""
        cur = self.cursor(boot_id)
        if cur is not None and not cur.get("done"):
            self.commit(boot_id, {**cur, "done": True}, {}, [])

    def commit(
        self,
        boot_id: str,
        cursor: dict[str, Any],
        digests: dict[int, bytes],
        tables: list[str],
        code: dict[int, bytes | None] | None = None,
    ) -> None:
        """The round is in the bucket: advance the cursor and forget the pending round.
        *code*: the kernel-code digests published (None: a seq dropped from the bucket)."""

        def fn(txn: Any) -> None:
            txn.put(self.tid + b"b" + boot_id.encode(), json.dumps(cursor).encode(), db=self.db)
            for seq, d in digests.items():
                txn.put(self.tid + b"i" + inc_key(boot_id, seq), d, db=self.db)
            for seq, cd in (code or {}).items():
                if cd is None:
                    txn.delete(self.tid + b"c" + inc_key(boot_id, seq), db=self.db)
                else:
                    txn.put(self.tid + b"c" + inc_key(boot_id, seq), cd, db=self.db)
            for key in tables:
                txn.put(self.tid + b"t" + key.encode(), b"", db=self.db)
            txn.delete(self.tid + b"p", db=self.db)

        self.store.env.write(fn)
