"""Retention: forgetting old boots, then the symbol tables no boot refers to."""

from __future__ import annotations

from typing import Any

from kreld.core.symtab import module_symbol_key
from kreld.store.env import SEQ, StoreEnv, Table, boot_key
from kreld.store.modules import ModuleTables

__all__ = ["Retention"]

# What a boot leaves in tables keyed by boot-id (16 bytes) + seq.
_PER_LOAD = (Table.INCARNATIONS, Table.OPEN, Table.ABSOLUTES)


class Retention:
    """The retention policy applied to every table family of one store."""

    def __init__(self, env: StoreEnv, modules: ModuleTables) -> None:
        self.env = env
        self.modules = modules

    def gc(
        self, keep_boots: int, keep_days: float, protect: str | None, now_realtime: int
    ) -> dict[str, int]:
        """Forget boots beyond the retention policy, then every symbol table no
        remaining boot refers to.  *keep_boots*/*keep_days* of 0 mean no limit;
        the *protect*-ed boot (the current one) is always kept."""
        cutoff = now_realtime - int(keep_days * 86400e9) if keep_days else None

        def fn(txn: Any) -> dict[str, int]:
            order = self.env.dbs[Table.BOOT_ORDER]
            doomed = []
            for rank, k in enumerate(txn.cursor(db=order).iterprev(values=False)):
                boot_id = k[8:].decode()
                first_seen = int(SEQ.unpack(k[:8])[0])
                too_many = keep_boots and rank >= keep_boots
                too_old = cutoff is not None and first_seen < cutoff
                if (too_many or too_old) and boot_id != protect:
                    doomed.append((k, boot_id))
            removed_incs = sum(self._forget_boot(txn, k, boot_id) for k, boot_id in doomed)
            dropped = self._drop_unused_tables(txn)
            return {"boots": len(doomed), "incarnations": removed_incs, "tables": dropped}

        return self.env.write(fn)

    def _forget_boot(self, txn: Any, order_key: bytes, boot_id: str) -> int:
        """Delete one boot everywhere; returns how many incarnations it had."""
        prefix = boot_key(boot_id)
        removed = 0
        for table in _PER_LOAD:
            cur = txn.cursor(db=self.env.dbs[table])
            if cur.set_range(prefix):
                while cur.key()[:16] == prefix:
                    removed += table is Table.INCARNATIONS
                    if not cur.delete():
                        break
        txn.delete(prefix, db=self.env.dbs[Table.WATCH])
        txn.delete(boot_id.encode(), db=self.env.dbs[Table.BOOTS])
        txn.delete(boot_id.encode(), db=self.env.dbs[Table.BOOT_SYMBOLS])
        txn.delete(order_key, db=self.env.dbs[Table.BOOT_ORDER])
        return removed

    def _drop_unused_tables(self, txn: Any) -> int:
        """Delete the symbol tables no boot and no incarnation refers to."""
        used: set[bytes] = set()
        for _, v in txn.cursor(db=self.env.dbs[Table.BOOT_SYMBOLS]):
            used.add(str(self.env.json_record(v, "boot symbols record")["kernel"]).encode())
        for k, v in txn.cursor(db=self.env.dbs[Table.INCARNATIONS]):
            st = self.modules.decode_incarnation(txn, bytes(k), v).state
            key = module_symbol_key(st.build_id, st.name, st.srcversion)
            if key:
                used.add(key.encode())
        symtabs = self.env.dbs[Table.SYMTABS]
        tables = list(txn.cursor(db=symtabs).iternext(values=False))
        dropped = 0
        for k in tables:
            if bytes(k) not in used:
                txn.delete(k, db=symtabs)
                dropped += 1
        return dropped
