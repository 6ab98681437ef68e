"""Where recorded boots are read from: the local LMDB store, or the fleet bucket.

:class:`~kreld.server.service.Service` answers the ``io.kreld`` read methods from any
:class:`BootSource`; :class:`~kreld.store.Store` is one, :class:`~kreld.fleet.bucket.BucketStore`
(``kreldctl --from s3://...``) another, so both give the same answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol, TypeVar

from kreld.core.model import BootSnapshot, BootSymbols, Incarnation

if TYPE_CHECKING:
    from kreld.core.kernel_code import KernelCode, LossWindow
    from kreld.core.symtab import SymbolTables

__all__ = ["BootSource", "CodeRecords", "T"]

T = TypeVar("T")


class CodeRecords(Protocol):
    """A boot's kernel code: the store's kernel-code table, or a fleet
    bucket's batches."""

    def codes(
        self, boot_id: str, seqs: Iterable[int] = (), since: int | None = None
    ) -> list[KernelCode]:
        """The boot's records in seq order: every one, or with *since* those of
        *seqs* and those from seq *since* on."""
        ...

    def losses(self, boot_id: str) -> list[LossWindow]:
        """The boot's loss windows, oldest start first."""
        ...


class BootSource(Protocol):
    def resolve_boot(self, prefix: str) -> str: ...

    def get_boot(self, boot_id: str) -> BootSnapshot: ...

    def list_boots(self) -> list[BootSnapshot]: ...

    def incarnations(self, boot_id: str) -> list[Incarnation]: ...

    def absolutes(self, boot_id: str) -> dict[int, list[int]]: ...

    def boot_symbols(self, boot_id: str) -> BootSymbols | None: ...

    @property
    def kernel_code(self) -> CodeRecords: ...

    def with_tables(self, keys: Iterable[str], fn: Callable[[SymbolTables], T]) -> T: ...

    def hostname(self, boot_id: str) -> str | None:
        """The name of the host the boot ran on, where the source holds many hosts
        (a fleet bucket); None for a host's own store."""
        ...

    def last_txnid(self) -> int:
        """Changes whenever what the source holds does (a cache key)."""
        ...
