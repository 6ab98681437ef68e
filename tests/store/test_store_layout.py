"""The store's layout description is true: every table it has is named, and
:meth:`Store.record_kernel_table` says each of its four outcomes."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import kreld.store
from kreld.core.model import BootSymbols, Incarnation, ModuleState, SeenBy, Timestamp
from kreld.core.symtab import pack
from kreld.store import KernelTable, Store, Table
from kreld.store.pubstate import PubState

NOW = Timestamp(1_000, 2_000, 3_000)


def table(name: bytes) -> bytes:
    return pack([(0, 0x10, ord("T"), name)], [".text"])


def one_load(name: str) -> Incarnation:
    state = ModuleState(name, None, {".text": 0xFFFFFFFFC0000000}, 4096, 0, "live", "S", "",
                        None, False, 7)  # fmt: skip
    return Incarnation("", -1, state, NOW, SeenBy.POLL, False)


def named_databases(store: Store) -> set[bytes]:
    return set(store.env.read(lambda txn: [bytes(k) for k, _ in txn.cursor()]))


def test_every_table_a_store_holds_is_a_named_handle_and_described(tmp_path: Path) -> None:
    """A store written through every family (and a publishing cursor) holds
    the tables :class:`Table` names, and the package docstring describes each."""
    boot_id = str(uuid.uuid4())
    with Store(tmp_path / "st") as store:
        store.modules.apply_module_changes(boot_id, [one_load("m")], [], [], NOW)
        store.symbols.record_kernel_table(boot_id, "k:ab", table(b"f"), [])
        store.symbols.put_absolutes(boot_id, 0, [1, 2])
        PubState(store, "s3://bucket/prefix")
        held = named_databases(store)
    assert held == {t.value for t in Table}
    doc = kreld.store.__doc__ or ""
    described = set(re.findall(r"^``(\w+)`` \(", doc, re.M))
    assert described == {t.label for t in Table}
    assert "``v:<build-id>``" in doc and "kreld.lock" in doc


def test_record_kernel_table_stores_shares_differs_and_knows(tmp_path: Path) -> None:
    a, b, c = (str(uuid.uuid4()) for _ in range(3))
    with Store(tmp_path / "st") as store:
        assert store.symbols.record_kernel_table(a, "k:ab", table(b"f"), []) == ("k:ab", "stored")
        assert store.symbols.record_kernel_table(b, "k:ab", table(b"f"), []) == ("k:ab", "shared")
        used, action = store.symbols.record_kernel_table(c, "k:ab", table(b"g"), [])
        assert (used, action) == (f"b:{c}", KernelTable.DIFFERS)
        # The boot already has its table: nothing is written, its key comes back.
        again = store.symbols.record_kernel_table(c, "k:ab", table(b"h"), [])
        assert again == (f"b:{c}", KernelTable.KNOWN)
        assert store.boot_symbols(c) == BootSymbols(f"b:{c}")
