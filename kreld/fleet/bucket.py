"""Reading the fleet bucket: ``kreldctl --from s3://BUCKET/PREFIX`` (read-only).

:class:`BucketStore` is a :class:`~kreld.store.bootsource.BootSource`: the same read methods
the local store offers, answered from the bucket's objects (:mod:`kreld.fleet.layout`), so the
CLI's commands run the daemon's own :class:`~kreld.server.service.Service` code on it.  It only
follows manifests, which are written after everything they name: it never sees a boot
half published.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from kreld.core.errors import AmbiguousBoot, FleetObjectInvalid, InvalidArgument, NoSuchBoot
from kreld.core.model import BootSnapshot, Incarnation
from kreld.core.symtab import SymbolTable, SymbolTables
from kreld.fleet import layout as fleet
from kreld.fleet.s3 import Bucket, open_bucket

__all__ = ["BucketBackend", "BucketStore", "T", "summary_of"]

T = TypeVar("T")
_BOOT_PREFIX = re.compile(r"[0-9a-f-]{1,36}")


class _Tables:
    """Symbol tables fetched as a query first asks for each, kept for the next."""

    def __init__(self, owner: BucketStore, keys: set[str]) -> None:
        self._owner = owner
        self._keys = keys

    def get(self, key: str) -> SymbolTable | None:
        return self._owner.table(key) if key in self._keys else None


class BucketStore:
    """The recorded boots of every host that publishes to one bucket."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self._manifests: dict[str, fleet.Manifest] = {}
        self._history: dict[str, tuple[list[Incarnation], dict[int, list[int]]]] = {}
        self._tables: dict[str, SymbolTable | None] = {}

    @classmethod
    def open(cls, url: str, endpoint: str = "") -> BucketStore:
        return cls(open_bucket(url, endpoint))

    # -- the listing ---------------------------------------------------------------------

    def index(self, prefix: str = "") -> list[fleet.IndexEntry]:
        """Index entries (the newest of each boot) whose boot-id starts with *prefix*,
        newest boot first: LIST requests only, a thousand boots a page."""
        best: dict[str, fleet.IndexEntry] = {}
        for name in self.bucket.list("index/" + prefix):
            e = fleet.parse_index(name)
            old = best.get(e.boot_id)
            if old is None or e.gen > old.gen:
                best[e.boot_id] = e
        missing = [e for e in best.values() if e.first_seen is None]
        if missing:  # summaries too long for a name: read from their manifests
            self.prefetch([e.boot_id for e in missing])
            for e in missing:
                m = self.manifest(e.boot_id)
                best[e.boot_id] = summary_of(m, e.gen)
        return sorted(best.values(), key=lambda e: (e.first_seen or 0, e.boot_id), reverse=True)

    def resolve_boot(self, prefix: str) -> str:
        p = prefix.strip().lower()
        if not _BOOT_PREFIX.fullmatch(p):
            raise InvalidArgument("BOOT", f"not a boot-id or a prefix of one: {prefix!r}")
        ids = sorted({e.boot_id for e in self.index(p)})
        if not ids:
            raise NoSuchBoot(prefix)
        if len(ids) > 1:
            raise AmbiguousBoot(prefix, ids)
        return ids[0]

    # -- one boot ------------------------------------------------------------------------

    def prefetch(self, boot_ids: Iterable[str]) -> None:
        """Fetch the manifests of many boots at once (concurrent GETs)."""
        want = [b for b in boot_ids if b not in self._manifests]
        names = {fleet.manifest_object(b): b for b in want}
        for name, data in self.bucket.get_many(list(names)).items():
            if data is not None:
                self._manifests[names[name]] = fleet.decode_manifest(name, data)

    def manifest(self, boot_id: str, fresh: bool = False) -> fleet.Manifest:
        m = None if fresh else self._manifests.get(boot_id)
        if m is None:
            name = fleet.manifest_object(boot_id)
            data = self.bucket.get(name)
            if data is None:
                raise NoSuchBoot(boot_id)
            m = self._manifests[boot_id] = fleet.decode_manifest(name, data)
        return m

    def host(self, boot_id: str) -> fleet.Host:
        return self.manifest(boot_id).host

    def hostname(self, boot_id: str) -> str | None:
        return self.host(boot_id).hostname

    def get_boot(self, boot_id: str) -> BootSnapshot:
        return self.manifest(boot_id).boot

    def list_boots(self) -> list[BootSnapshot]:
        entries = self.index()
        self.prefetch([e.boot_id for e in entries])
        return [self.manifest(e.boot_id).boot for e in entries]

    def _load(self, boot_id: str) -> tuple[list[Incarnation], dict[int, list[int]]]:
        got = self._history.get(boot_id)
        if got is not None:
            return got
        for attempt in range(2):
            m = self.manifest(boot_id, fresh=attempt > 0)
            names = [fleet.batch_object(boot_id, b) for b in m.batches]
            data = self.bucket.get_many(names)
            absent = [n for n in names if data.get(n) is None]
            if not absent:
                break
            # A round compacted the boot after this manifest was read: read it again.
        else:
            raise FleetObjectInvalid(absent[0], "named by its boot's manifest but absent")
        batches = [fleet.decode_batch(n, data[n] or b"", boot_id) for n in names]
        got = self._history[boot_id] = fleet.merge_batches(batches)
        return got

    def incarnations(self, boot_id: str) -> list[Incarnation]:
        return self._load(boot_id)[0]

    def absolutes(self, boot_id: str) -> dict[int, list[int]]:
        return self._load(boot_id)[1]

    def boot_symbols(self, boot_id: str) -> dict[str, Any] | None:
        return self.manifest(boot_id).symbols

    def table(self, key: str) -> SymbolTable | None:
        if key not in self._tables:
            name = fleet.table_object(key)
            data = self.bucket.get(name)
            table = None
            if data is not None:
                try:
                    table = SymbolTable(fleet.decode_table(name, data))
                except ValueError as e:
                    raise FleetObjectInvalid(name, f"malformed symbol table: {e}") from e
            self._tables[key] = table
        return self._tables[key]

    def with_tables(self, keys: Iterable[str], fn: Callable[[SymbolTables], T]) -> T:
        return fn(_Tables(self, set(keys)))

    def last_txnid(self) -> int:
        return 0  # a reader's view lasts one command


def summary_of(m: fleet.Manifest, gen: int) -> fleet.IndexEntry:
    b = m.boot
    return fleet.IndexEntry(
        b.boot_id,
        m.host,
        gen,
        b.first_seen.realtime,
        b.release,
        b.build_id,
        f"{b.kaslr.value:#x}" if b.kaslr else None,
        b.restricted,
    )


def _no_current() -> BootSnapshot:
    raise InvalidArgument(
        "BOOT", "with --from, name the boot (kreldctl --from URL boots lists them)"
    )


class BucketBackend:
    """``kreldctl --from``: the read methods of ``io.kreld`` over a :class:`BucketStore`,
    each boot's record carrying its host."""

    METHODS = ("GetBoot", "ListBoots", "GetModules", "Resolve", "ExportKallsyms")

    def __init__(self, url: str, endpoint: str = "") -> None:
        from kreld.server.service import Service

        self.url = url
        self.store = BucketStore.open(url, endpoint)
        self.service = Service(
            self.store, current_boot=_no_current, current_id=lambda: None, loaded=list
        )

    def rows(self) -> list[fleet.IndexEntry]:
        """The boots table, from the listing alone."""
        return self.store.index()

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        from kreld.server import methods

        if method not in self.METHODS:
            raise InvalidArgument(
                "--from", f"{method} needs a daemon or a local store; the bucket is read-only"
            )
        res = methods.call(self.service, method, params)
        if method == "ListBoots":
            for b in res["boots"]:
                b["host"] = self.store.host(b["boot_id"]).to_json()
            return res
        boot_id = self.store.resolve_boot(params["boot_id"]) if params.get("boot_id") else None
        host = None if boot_id is None else self.store.host(boot_id).to_json()
        if method == "GetBoot":
            res["boot"]["host"] = host
        for key in ("modules", "regions"):  # Resolve: each region, so each address it held
            for rec in res.get(key, ()):
                rec["host"] = host
        if method == "ExportKallsyms":
            res["host"] = host
        return res

    def stream(self, method: str, **params: Any) -> Iterator[dict[str, Any]]:
        raise InvalidArgument("--from", f"{method} needs a running kreld; a bucket has no events")
