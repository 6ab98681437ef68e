"""Boots and builds: ``boots``, ``boot_order`` and ``builds``."""

from __future__ import annotations

import json
from typing import Any

from kreld.core.errors import AmbiguousBoot, NoSuchBoot, RecordRefused
from kreld.core.model import BootSnapshot, hexaddr, merge_boot
from kreld.store.env import SEQ, StoreEnv, Table, decoded, dumps

__all__ = ["BootTables", "boot_from_record", "boot_record"]


def boot_record(snap: BootSnapshot, path: str = "<store>") -> bytes:
    """A boot as stored: its wire form, but with the anchors keyed by the kernel's
    symbol names (``_text``), as every store has kept them since schema 1.

    A boot its readers would refuse (an address past 64 bits, a negative
    offset) is :class:`RecordRefused`, never written."""
    d = snap.to_json()
    d["anchors"] = {k: hexaddr(v) for k, v in snap.anchors.to_ints().items()}
    raw = dumps(d)
    try:
        boot_from_record(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise RecordRefused(path, f"boot {snap.boot_id} would not read back: {e}") from e
    return raw


def boot_from_record(raw: bytes) -> BootSnapshot:
    d = json.loads(raw)
    d["anchors"] = {k.removeprefix("_"): v for k, v in d["anchors"].items()}
    return BootSnapshot.from_json(d)


class BootTables:
    """Every boot recorded, newest first, and what kreld knows of each build."""

    def __init__(self, env: StoreEnv) -> None:
        self.env = env

    def _boot(self, raw: bytes) -> BootSnapshot:
        return decoded(self.env.path, "boot record", lambda: boot_from_record(raw))

    def record_boot(self, snap: BootSnapshot) -> tuple[BootSnapshot, bool, bool]:
        """Record *snap*; returns the stored record, whether it was new, and
        whether an existing record learnt something."""
        key = snap.boot_id.encode()
        boots = self.env.dbs[Table.BOOTS]

        def txn_fn(txn: Any) -> tuple[BootSnapshot, bool, bool]:
            raw = txn.get(key, db=boots)
            if raw is not None:
                old = self._boot(raw)
                merged = merge_boot(old, snap)
                if merged == old:
                    return old, False, False
                txn.put(key, boot_record(merged, str(self.env.path)), db=boots)
                self._put_build(txn, merged)
                return merged, False, True
            txn.put(key, boot_record(snap, str(self.env.path)), db=boots)
            order = SEQ.pack(snap.first_seen.realtime) + key
            txn.put(order, b"", db=self.env.dbs[Table.BOOT_ORDER])
            self._put_build(txn, snap)
            return snap, True, False

        return self.env.write(txn_fn)

    def _put_build(self, txn: Any, snap: BootSnapshot) -> None:
        if not snap.build_id:
            return
        key = snap.build_id.encode()
        db = self.env.dbs[Table.BUILDS]
        raw = txn.get(key, db=db)
        rec = decoded(self.env.path, "build record", lambda: json.loads(raw)) if raw else None
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
        txn.put(key, dumps(rec), db=db)

    def get_boot(self, boot_id: str) -> BootSnapshot:
        def fn(txn: Any) -> bytes | None:
            db = self.env.dbs[Table.BOOTS]
            return None if db is None else txn.get(boot_id.encode(), db=db)

        raw = self.env.read(fn)
        if raw is None:
            raise NoSuchBoot(boot_id)
        return self._boot(raw)

    def resolve_boot(self, prefix: str) -> str:
        """The full boot-id for a unique prefix (as ``git`` does with hashes)."""
        p = prefix.strip().lower()
        if not p:
            raise NoSuchBoot(prefix)

        def fn(txn: Any) -> list[str]:
            db = self.env.dbs[Table.BOOTS]
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

        matches = self.env.read(fn)
        if not matches:
            raise NoSuchBoot(prefix)
        if len(matches) > 1:
            raise AmbiguousBoot(prefix, matches)
        return matches[0]

    def list_boots(self) -> list[BootSnapshot]:
        """Every recorded boot, newest first."""

        def fn(txn: Any) -> list[BootSnapshot]:
            order, boots = self.env.dbs[Table.BOOT_ORDER], self.env.dbs[Table.BOOTS]
            if order is None or boots is None:
                return []
            out = []
            for k in txn.cursor(db=order).iterprev(values=False):
                raw = txn.get(k[8:], db=boots)
                if raw is not None:
                    out.append(self._boot(raw))
            return out

        return self.env.read(fn)

    def get_build(self, build_id: str) -> dict[str, Any] | None:
        def fn(txn: Any) -> bytes | None:
            db = self.env.dbs[Table.BUILDS]
            return None if db is None else txn.get(build_id.encode(), db=db)

        raw = self.env.read(fn)
        return None if raw is None else self.env.json_record(raw, "build record")

    def counts(self) -> dict[str, int]:
        def fn(txn: Any) -> dict[str, int]:
            out = {}
            for table in (Table.BOOTS, Table.BUILDS, Table.INCARNATIONS, Table.OPEN):
                if table.label in self.env.lost:  # a damaged store read as far as it is whole
                    continue
                db = self.env.dbs[table]
                out[table.label] = 0 if db is None else txn.stat(db)["entries"]
            return out

        return self.env.read(fn)
