"""The LMDB store: every boot, build and module incarnation kreld has seen.

The state directory (``--state-dir``) holds ``data.mdb`` and ``lock.mdb``
(one LMDB environment), ``kreld.lock`` (the writer's ``flock``,
:mod:`.lock`) and any ``damaged-<UTC>/`` store set aside.  Named
databases (:class:`Table`), each kept by one part of this package:

``meta`` (:mod:`.env`)
    ``magic`` and ``schema`` records.
``boots`` (:mod:`.boots`)
    boot-id (text) -> boot record (JSON).
``boot_order`` (:mod:`.boots`)
    first-seen realtime (8 bytes BE) + boot-id -> ``b""``: newest-first listing.
``builds`` (:mod:`.boots`)
    build-id (hex text) -> build record (JSON).
``incarnations`` (:mod:`.modules`)
    boot-id (16 bytes) + seq (8 bytes BE) -> incarnation (:mod:`.encoding`).
``open`` (:mod:`.modules`)
    same key -> ``b""`` for incarnations not yet seen unloaded.
``watch`` (:mod:`.modules`)
    boot-id (16 bytes) -> last time the daemon saw ``sys/module`` (JSON).
``layouts`` (:mod:`.modules`)
    12-byte key -> the section names an incarnation record's offsets
    follow (:mod:`.encoding`), JSON.
``symtabs`` (:mod:`.symtabs`)
    table key -> packed symbol table (:mod:`kreld.core.symtab`): ``k:<build-id>``
    a kernel build's from kallsyms, ``v:<build-id>`` a kernel build's from
    its vmlinux (kallsyms unusable), ``b:<boot-id>`` a boot whose table
    differs from its build's (or that has no build-id), ``m:<build-id>`` or
    ``m:<name>:<srcversion>`` a module build.
``boot_symbols`` (:mod:`.symtabs`)
    boot-id (text) -> which kernel table the boot uses, and the kallsyms
    lines of owners that are not modules (bpf, ftrace), JSON.
``absolutes`` (:mod:`.symtabs`)
    boot-id (16 bytes) + seq (8 bytes BE) -> the values (``<q`` each) one
    load printed for its table's absolute entries, where they differ from
    the load the table came from.
``kcode`` (:mod:`.kernel_code`)
    boot-id (16 bytes) + a letter + seq: BPF programs, trampolines, ftrace
    and kprobe pages, one record per appearance, which are open, the loss
    windows and the last watch time, with their retention.
``linetabs`` (:mod:`.linetabs`)
    build-id -> a line table's manifest (JSON); build-id + ``/`` + chunk number
    (4 bytes BE) -> its bytes in chunks of at most 4 MiB.
``published`` (:mod:`.pubstate`)
    what has been published to the fleet bucket, per target; made by the
    first publishing round.

Every write is one LMDB transaction: committed and synced, or not at all,
so a killed writer never leaves half a record.  When the map is full it is
doubled and the write retried (:mod:`.env`).  :mod:`.gc` applies retention.
Before LMDB maps a file, :mod:`.lmdbcheck` checks that it is whole; the state
directory must be kreld's own (:mod:`.ownership`); :mod:`.bootsource` is the
read-only protocol the store and a fleet bucket both answer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from functools import cached_property
from pathlib import Path

from kreld.core import consts
from kreld.core.model import BootSnapshot, BootSymbols, Incarnation
from kreld.store.boots import BootTables
from kreld.store.bootsource import T
from kreld.store.env import StoreEnv, Table, boot_key, inc_key
from kreld.store.gc import Retention
from kreld.store.kernel_code import KernelCodeTables
from kreld.store.linetabs import LineTableStore
from kreld.store.modules import ModuleTables
from kreld.store.symtabs import KernelTable, SymbolTableStore, TableViews

__all__ = ["KernelTable", "Store", "StoreEnv", "Table", "TableViews", "boot_key", "inc_key"]


class Store:
    """A kreld store opened for writing (the daemon) or reading (kreldctl): one
    LMDB environment (:attr:`env`) and the table families kept over it, each an
    object of its own: :attr:`boots`, :attr:`modules` (module incarnations),
    :attr:`symbols`, :attr:`kernel_code` and :attr:`retention`.  The store itself answers the
    read-only :class:`~kreld.store.bootsource.BootSource` protocol, as a fleet
    bucket does, by asking the family that keeps the answer."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        readonly: bool = False,
        map_size: int = consts.STORE_INITIAL_MAP_SIZE,
    ) -> None:
        self.env = StoreEnv(path, readonly=readonly, map_size=map_size)
        self.boots = BootTables(self.env)
        self.modules = ModuleTables(self.env)
        self.symbols = SymbolTableStore(self.env)
        self.retention = Retention(self.env, self.modules)

    @property
    def path(self) -> Path:
        return self.env.path

    @property
    def readonly(self) -> bool:
        return self.env.readonly

    def close(self) -> None:
        self.env.close()

    @cached_property
    def kernel_code(self) -> KernelCodeTables:
        """Made when first used: a store kreldctl opens for modules alone never
        looks at the kernel-code table (nor fails on it, if it is damaged)."""
        return KernelCodeTables(self.env)

    @cached_property
    def line_tables(self) -> LineTableStore:
        """Source line tables by build-id (kept only where debuginfo was had)."""
        return LineTableStore(self.env)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- BootSource ----------------------------------------------------------

    def resolve_boot(self, prefix: str) -> str:
        return self.boots.resolve_boot(prefix)

    def get_boot(self, boot_id: str) -> BootSnapshot:
        return self.boots.get_boot(boot_id)

    def list_boots(self) -> list[BootSnapshot]:
        return self.boots.list_boots()

    def incarnations(self, boot_id: str) -> list[Incarnation]:
        return self.modules.incarnations(boot_id)

    def absolutes(self, boot_id: str) -> dict[int, list[int]]:
        return self.symbols.absolutes(boot_id)

    def boot_symbols(self, boot_id: str) -> BootSymbols | None:
        return self.symbols.boot_symbols(boot_id)

    def with_tables(self, keys: Iterable[str], fn: Callable[[TableViews], T]) -> T:
        return self.symbols.with_tables(keys, fn)

    def drop_pages(self) -> bool:
        """The map's pages out of the resident set (see StoreEnv.drop_pages)."""
        return self.env.drop_pages()

    def hostname(self, boot_id: str) -> str | None:
        """A host's own store holds only its boots: no host name to tell them by."""
        return None

    def last_txnid(self) -> int:
        return self.env.last_txnid()
