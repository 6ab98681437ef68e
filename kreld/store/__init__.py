"""The LMDB store: every boot, build and module incarnation kreld has seen.

The state directory (``--state-dir``) holds ``data.mdb`` and ``lock.mdb``
(one LMDB environment), ``kreld.lock`` (the writer's ``flock``,
:mod:`kreld.storelock`) and any ``damaged-<UTC>/`` store set aside.  Named
databases (:class:`Table`), each kept by one part of this package:

``meta`` (:mod:`.env`)
    ``magic`` and ``schema`` records.
``boots`` (:mod:`.boots`)
    boot-id (text) -> boot record (JSON).
``boot_order`` (:mod:`.boots`)
    first-seen realtime (8 bytes BE) + boot-id -> ``b""``: newest-first listing.
``builds`` (:mod:`.boots`)
    build-id (hex text) -> build record (JSON).
``incarnations`` (:mod:`.incarnations`)
    boot-id (16 bytes) + seq (8 bytes BE) -> incarnation (:mod:`kreld.records`).
``open`` (:mod:`.incarnations`)
    same key -> ``b""`` for incarnations not yet seen unloaded.
``watch`` (:mod:`.incarnations`)
    boot-id (16 bytes) -> last time the daemon saw ``sys/module`` (JSON).
``layouts`` (:mod:`.incarnations`)
    12-byte key -> the section names an incarnation record's offsets
    follow (:mod:`kreld.records`), JSON.
``symtabs`` (:mod:`.symtabs`)
    table key -> packed symbol table (:mod:`kreld.symtab`): ``k:<build-id>``
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
``kcode`` (:mod:`.kcode`)
    boot-id (16 bytes) + a letter + seq: BPF programs, trampolines, ftrace
    and kprobe pages, one record per appearance, which are open, the loss
    windows and the last watch time (issue 21), with their retention.
``published`` (:mod:`kreld.pubstate`)
    what has been published to the fleet bucket, per target; made by the
    first publishing round.

Every write is one LMDB transaction: committed and synced, or not at all,
so a killed writer never leaves half a record.  When the map is full it is
doubled and the write retried (:mod:`.env`).  :mod:`.gc` applies retention.
"""

from __future__ import annotations

from functools import cached_property

from kreld.store.boots import BootTables
from kreld.store.env import Table, boot_key, inc_key
from kreld.store.gc import Retention
from kreld.store.kcode import KernelCodeTables
from kreld.store.symtabs import KernelTable, SymbolTableStore, TableViews

__all__ = ["KernelTable", "Store", "Table", "TableViews", "boot_key", "inc_key"]


class Store(BootTables, SymbolTableStore, Retention):
    """A kreld store opened for writing (the daemon) or reading (kreldctl):
    the table families of this package over one LMDB environment."""

    @cached_property
    def kernel_code(self) -> KernelCodeTables:
        return KernelCodeTables(self)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
