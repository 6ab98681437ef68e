"""Symbol tables: ``symtabs``, ``boot_symbols`` and ``absolutes``."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from enum import StrEnum
from typing import Any, TypeVar

from kreld.core.errors import StoreCorrupt
from kreld.core.model import BootSymbols
from kreld.core.symtab import SymbolTable
from kreld.store.env import SEQ, StoreEnv, Table, boot_key, decoded, dumps, inc_key

__all__ = ["KernelTable", "SymbolTableStore", "T", "TableViews"]

T = TypeVar("T")


class KernelTable(StrEnum):
    """What :meth:`SymbolTableStore.record_kernel_table` did."""

    STORED = "stored"  # the build had no table: this one is stored as the build's
    SHARED = "shared"  # the build's table was there, byte for byte: the boot uses it
    DIFFERS = "differs"  # the boot's symbols differ from its build's (function-granular
    # KASLR): the boot gets a table of its own, ``b:<boot-id>``
    KNOWN = "known"  # the boot already had a kernel table: nothing written, its key returned


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


class SymbolTableStore:
    """Packed symbol tables, which one each boot uses, and per-load absolutes."""

    def __init__(self, env: StoreEnv) -> None:
        self.env = env

    def boot_symbols(self, boot_id: str) -> BootSymbols | None:
        def fn(txn: Any) -> bytes | None:
            db = self.env.dbs[Table.BOOT_SYMBOLS]
            return None if db is None else txn.get(boot_id.encode(), db=db)

        raw = self.env.read(fn)
        if raw is None:
            return None
        rec = self.env.json_record(raw, "boot symbols record")
        return decoded(self.env.path, "boot symbols record", lambda: BootSymbols.from_json(rec))

    def put_absolutes(self, boot_id: str, seq: int, values: list[int]) -> None:
        """The values one incarnation printed for its table's absolute entries
        (per-cpu variables), where they differ from the load the table came from."""
        packed = struct.pack(f"<{len(values)}q", *values)

        def fn(txn: Any) -> None:
            txn.put(inc_key(boot_id, seq), packed, db=self.env.dbs[Table.ABSOLUTES])

        self.env.write(fn)

    def absolutes(self, boot_id: str) -> dict[int, list[int]]:
        """:meth:`put_absolutes` of every incarnation of *boot_id*, by seq."""
        prefix = boot_key(boot_id)

        def fn(txn: Any) -> dict[int, list[int]]:
            db = self.env.dbs[Table.ABSOLUTES]
            out: dict[int, list[int]] = {}
            if db is None:
                return out
            cur = txn.cursor(db=db)
            if cur.set_range(prefix):
                for k, v in cur:
                    if k[:16] != prefix:
                        break
                    if len(v) % 8:
                        raise StoreCorrupt(str(self.env.path), f"absolutes {bytes(k).hex()}")
                    out[int(SEQ.unpack(k[16:24])[0])] = list(struct.unpack(f"<{len(v) // 8}q", v))
            return out

        return self.env.read(fn)

    def record_kernel_table(
        self, boot_id: str, key: str, packed: bytes, extras: list[str]
    ) -> tuple[str, KernelTable]:
        """Attach the boot to its build's table, storing it only if new.

        Returns the key the boot uses and what happened (:class:`KernelTable`):
        the table was stored, shared with the build, stored apart because it
        differs, or the boot was already known (nothing written).
        """
        db, bdb = self.env.dbs[Table.SYMTABS], self.env.dbs[Table.BOOT_SYMBOLS]

        def fn(txn: Any) -> tuple[str, KernelTable]:
            done = txn.get(boot_id.encode(), db=bdb)
            if done is not None:
                return str(
                    self.env.json_record(done, "boot symbols record")["kernel"]
                ), KernelTable.KNOWN
            used, action = key, KernelTable.SHARED
            existing = txn.get(key.encode(), db=db)
            if existing is None:
                txn.put(key.encode(), packed, db=db)
                action = KernelTable.STORED
            elif existing != packed:
                used, action = f"b:{boot_id}", KernelTable.DIFFERS
                txn.put(used.encode(), packed, db=db)
            txn.put(boot_id.encode(), dumps({"kernel": used, "extras": extras}), db=bdb)
            return used, action

        return self.env.write(fn)

    def put_table(self, key: str, packed: bytes, replace: bool = False) -> bool:
        """Store a table under *key* unless one is there (or *replace*); True if stored."""
        db = self.env.dbs[Table.SYMTABS]
        return bool(
            self.env.write(lambda txn: txn.put(key.encode(), packed, db=db, overwrite=replace))
        )

    def table_source(self, key: str) -> int | None:
        """Where the table under *key* came from (``symtab.FROM_*``); None if absent."""

        def fn(txn: Any) -> int | None:
            db = self.env.dbs[Table.SYMTABS]
            buf = None if db is None else txn.get(key.encode(), db=db)
            return None if buf is None else SymbolTable(buf).source

        try:
            return self.env.read(fn)
        except ValueError as e:
            raise StoreCorrupt(str(self.env.path), f"symbol table {key}: {e}") from e

    def with_tables(self, keys: Iterable[str], fn: Callable[[TableViews], T]) -> T:
        """Run *fn* with :class:`~kreld.core.symtab.SymbolTable` views of the named
        tables (absent ones left out), straight from the map and opened as
        *fn* asks for them; the views are valid only inside *fn*."""
        wanted = set(keys)
        db = self.env.dbs[Table.SYMTABS]
        return self.env.read(lambda txn: fn(TableViews(txn, db, wanted)), buffers=True)
