"""Module incarnations: ``incarnations``, ``open``, ``watch`` and ``layouts``."""

from __future__ import annotations

import json
import struct
from typing import Any

from kreld.core import uuids
from kreld.core.errors import RecordRefused, StoreCorrupt
from kreld.core.model import Incarnation, Timestamp
from kreld.core.record import replace
from kreld.store import encoding
from kreld.store.env import (
    SEQ,
    UNREADABLE,
    StoreEnv,
    Table,
    boot_key,
    decoded,
    dumps,
    inc_key,
)

__all__ = ["ModuleTables"]


class ModuleTables:
    """Every load of a module per boot, which are still open, and when
    ``sys/module`` was last looked at."""

    def __init__(self, env: StoreEnv) -> None:
        self.env = env
        # Layout key -> section names, decoded once (layouts never change).
        self._layouts: dict[bytes, list[str]] = {}

    def _next_seq(self, txn: Any, boot_id: str) -> int:
        prefix = boot_key(boot_id)
        cur = txn.cursor(db=self.env.dbs[Table.INCARNATIONS])
        # Position past the last key of this boot, then step back.
        if cur.set_range(prefix + b"\xff" * 8):
            if cur.key()[:16] == prefix:
                return int(SEQ.unpack(cur.key()[16:])[0]) + 1
            if not cur.prev():
                return 0
        elif not cur.last():
            return 0
        k = cur.key()
        return int(SEQ.unpack(k[16:])[0]) + 1 if k[:16] == prefix else 0

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
        db, open_db = self.env.dbs[Table.INCARNATIONS], self.env.dbs[Table.OPEN]

        def fn(txn: Any) -> list[Incarnation]:
            seq = self._next_seq(txn, boot_id)
            out = []
            for inc in opened:
                rec = replace(inc, boot_id=boot_id, seq=seq)
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
                txn.put(boot_key(boot_id), dumps(watched.to_json()), db=self.env.dbs[Table.WATCH])
            return out

        return self.env.write(fn)

    def close_other_boots(self, boot_id: str) -> int:
        """Drop the open-index entries of every other boot: those boots are over.

        Their incarnations keep ``unloaded`` null (their clocks ended with the
        boot: no time of this boot can close them); queries on an old boot
        treat them as loaded to the end of its record.
        """
        prefix = boot_key(boot_id)

        def fn(txn: Any) -> int:
            cur = txn.cursor(db=self.env.dbs[Table.OPEN])
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

        return self.env.write(fn)

    def _encode(self, txn: Any, inc: Incarnation) -> bytes:
        try:
            raw, key, names = encoding.encode(inc)
        except (ValueError, IndexError, OverflowError, struct.error) as e:
            raise RecordRefused(
                str(self.env.path), f"incarnation of {inc.name} would not read back: {e}"
            ) from e
        txn.put(key, dumps(names), db=self.env.dbs[Table.LAYOUTS], overwrite=False)
        return raw

    def decode_incarnation(self, txn: Any, key: bytes, raw: bytes) -> Incarnation:
        """An incarnation from its key and stored record, in a read transaction."""

        def layout(k: bytes) -> list[str]:
            names = self._layouts.get(k)
            if names is None:
                stored = txn.get(k, db=self.env.dbs[Table.LAYOUTS])
                if stored is None:
                    raise StoreCorrupt(str(self.env.path), f"section layout {k.hex()} is missing")
                names = self._layouts[k] = decoded(
                    self.env.path, "section layout", lambda: list(json.loads(bytes(stored)))
                )
            return names

        boot_id = uuids.to_text(bytes(key[:16]))
        try:
            return encoding.decode(raw, boot_id, int(SEQ.unpack(key[16:24])[0]), layout)
        except UNREADABLE as e:
            raise StoreCorrupt(
                str(self.env.path), f"unreadable incarnation record {bytes(key).hex()}: {e}"
            ) from e

    def heartbeat(self, boot_id: str, when: Timestamp) -> None:
        self.apply_module_changes(boot_id, [], [], [], when)

    def last_watched(self, boot_id: str) -> Timestamp | None:
        def fn(txn: Any) -> bytes | None:
            db = self.env.dbs[Table.WATCH]
            return None if db is None else txn.get(boot_key(boot_id), db=db)

        raw = self.env.read(fn)
        if raw is None:
            return None
        return decoded(self.env.path, "watch time", lambda: Timestamp.from_json(json.loads(raw)))

    def open_incarnations(self, boot_id: str) -> list[Incarnation]:
        prefix = boot_key(boot_id)

        def fn(txn: Any) -> list[Incarnation]:
            open_db, db = self.env.dbs[Table.OPEN], self.env.dbs[Table.INCARNATIONS]
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

        return self.env.read(fn)

    def incarnations(self, boot_id: str) -> list[Incarnation]:
        """Every incarnation of the boot, in the order they were recorded."""
        prefix = boot_key(boot_id)

        def fn(txn: Any) -> list[Incarnation]:
            db = self.env.dbs[Table.INCARNATIONS]
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

        return self.env.read(fn)
