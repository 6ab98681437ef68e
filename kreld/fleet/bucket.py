"""Reading the fleet bucket: ``kreldctl --from s3://BUCKET/PREFIX`` (read-only).

:class:`BucketStore` is a :class:`~kreld.store.bootsource.BootSource`: the same read methods
the local store offers, answered from the bucket's objects (:mod:`kreld.fleet.objects`), so the
CLI's commands run the daemon's own :class:`~kreld.server.service.Service` code on it.  It only
follows manifests, which are written after everything they name: it never sees a boot
half published.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from kreld.core.errors import AmbiguousBoot, FleetObjectInvalid, InvalidArgument, NoSuchBoot
from kreld.core.kernel_code import KernelCode, LossWindow
from kreld.core.model import BootSnapshot, BootSymbols, Incarnation
from kreld.core.symtab import SymbolTable, SymbolTables
from kreld.fleet import objects as fleet
from kreld.fleet.kernel_code_objects import merge_code
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


class _KernelCode:
    """A boot's kernel-code records and loss windows as its batches carry them,
    read as :class:`~kreld.store.kernel_code.KernelCodeTables` reads the store's."""

    def __init__(self, owner: BucketStore) -> None:
        self._owner = owner

    def codes(
        self, boot_id: str, seqs: Iterable[int] = (), since: int | None = None
    ) -> list[KernelCode]:
        codes = self._owner.code(boot_id)[0]
        if since is None:
            return codes
        wanted = set(seqs)
        return [c for c in codes if c.seq in wanted or c.seq >= since]

    def losses(self, boot_id: str) -> list[LossWindow]:
        return self._owner.code(boot_id)[1]


class BucketStore:
    """The recorded boots of every host that publishes to one bucket.

    Nothing read is believed unchecked (docs/FLEET.md, "What a reader checks"):
    a manifest must be of the boot its key names, an index entry must agree with
    its boot's manifest (host, generation, summary), a batch must be of its boot.
    In a listing, an object that fails is recorded in :attr:`skipped` (what and
    why, for the command to report) and left out; the other boots still list.
    Asked for by name, a boot whose objects fail is the error itself.
    """

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self._manifests: dict[str, fleet.Manifest] = {}
        self._bad: dict[str, FleetObjectInvalid] = {}  # boot-id: why its manifest failed
        self._history: dict[str, tuple[list[Incarnation], dict[int, list[int]]]] = {}
        self._code: dict[str, tuple[list[KernelCode], list[LossWindow]]] = {}
        self._tables: dict[str, SymbolTable | None] = {}
        self.skipped: dict[str, FleetObjectInvalid] = {}  # object name: why, in listings

    @classmethod
    def open(cls, url: str, endpoint: str = "") -> BucketStore:
        return cls(open_bucket(url, endpoint))

    def skip(self, e: FleetObjectInvalid) -> None:
        self.skipped.setdefault(e.key, e)

    # -- the listing ---------------------------------------------------------------------

    def index(self, prefix: str = "", verify: bool | None = None) -> list[fleet.IndexEntry]:
        """The boots whose boot-id starts with *prefix*, newest first.

        A checked row agrees with its boot's manifest (fetched concurrently): an
        entry that disagrees is skipped, the boot listed from its manifest when
        the host agrees, and left out when it does not (or the manifest fails).
        Rows are checked when *verify*, by default when a prefix narrows the
        listing; a whole-fleet listing (LIST requests alone, 1,000 boots a page)
        checks the boots whose entries conflict (more than one, or a summary too
        long for a name) and takes a single entry's word for the rest: every
        answer about a boot comes from its checked manifest, never from a name.
        """
        if verify is None:
            verify = bool(prefix)
        entries: dict[str, list[fleet.IndexEntry]] = {}
        names: dict[int, str] = {}
        for name in self.bucket.list("index/" + prefix):
            try:
                e = fleet.parse_index(name)
            except FleetObjectInvalid as bad:
                self.skip(bad)
                continue
            names[id(e)] = name
            entries.setdefault(e.boot_id, []).append(e)
        doubt = [
            b for b, es in entries.items() if verify or len(es) > 1 or es[0].first_seen is None
        ]
        self.prefetch(doubt)
        doubted = set(doubt)
        rows = [es[0] for b, es in entries.items() if b not in doubted]
        for boot_id in doubt:
            row = self._row(boot_id, entries[boot_id], names)
            if row is not None:
                rows.append(row)
        return sorted(rows, key=lambda e: (e.first_seen or 0, e.boot_id), reverse=True)

    def _row(
        self, boot_id: str, es: list[fleet.IndexEntry], names: dict[int, str]
    ) -> fleet.IndexEntry | None:
        m = self._manifests.get(boot_id)
        if m is None:
            why = self._bad.get(boot_id)
            self.skip(why or FleetObjectInvalid(names[id(es[0])], "its boot has no manifest"))
            return None
        truth = summary_of(m, m.gen if m.gen is not None else max(e.gen for e in es))
        agree = [e for e in es if _agrees(e, truth)]
        for e in es:
            if e in agree:
                continue
            if e.gen < truth.gen and e.host.machine_id == truth.host.machine_id:
                continue  # an older generation a round cut short left behind: not a lie
            what = _disagreement(e, truth)
            self.skip(FleetObjectInvalid(names[id(e)], f"disagrees with its manifest: {what}"))
        if not agree and all(e.host.machine_id != m.host.machine_id for e in es):
            name = fleet.manifest_object(boot_id)
            self.skip(FleetObjectInvalid(name, "claims another host than its index entry"))
            return None
        return truth

    def resolve_boot(self, prefix: str) -> str:
        p = prefix.strip().lower()
        if not _BOOT_PREFIX.fullmatch(p):
            raise InvalidArgument("BOOT", f"not a boot-id or a prefix of one: {prefix!r}")
        ids = sorted({e.boot_id for e in self.index(p)})
        if not ids:
            bad = self._bad.get(p)
            if bad is not None:
                raise bad
            raise NoSuchBoot(prefix)
        if len(ids) > 1:
            raise AmbiguousBoot(prefix, ids)
        return ids[0]

    # -- one boot ------------------------------------------------------------------------

    def prefetch(self, boot_ids: Iterable[str]) -> None:
        """Fetch the manifests of many boots at once (concurrent GETs); one that
        fails is kept as the reason, for a listing to skip and a query to raise."""
        want = [b for b in boot_ids if b not in self._manifests and b not in self._bad]
        names = {fleet.manifest_object(b): b for b in want}
        got = self.bucket.get_many(list(names), fleet.MAX_MANIFEST)
        for name, data in got.items():
            boot_id = names[name]
            try:
                if isinstance(data, FleetObjectInvalid):
                    raise data
                if data is not None:
                    self._manifests[boot_id] = fleet.decode_manifest(name, data, boot_id)
            except FleetObjectInvalid as e:
                self._bad[boot_id] = e

    def manifest(self, boot_id: str, fresh: bool = False) -> fleet.Manifest:
        m = None if fresh else self._manifests.get(boot_id)
        if m is None:
            if not fresh and boot_id in self._bad:
                raise self._bad[boot_id]
            name = fleet.manifest_object(boot_id)
            data = self.bucket.get(name, fleet.MAX_MANIFEST)
            if data is None:
                raise NoSuchBoot(boot_id)
            m = self._manifests[boot_id] = fleet.decode_manifest(name, data, boot_id)
        return m

    def host(self, boot_id: str) -> fleet.Host:
        return self.manifest(boot_id).host

    def hostname(self, boot_id: str) -> str | None:
        return self.host(boot_id).hostname

    def get_boot(self, boot_id: str) -> BootSnapshot:
        return self.manifest(boot_id).boot

    def list_boots(self) -> list[BootSnapshot]:
        entries = self.index(verify=True)  # the manifests are read anyway
        self.prefetch([e.boot_id for e in entries])
        return [self.manifest(e.boot_id).boot for e in entries]

    def _load(self, boot_id: str) -> tuple[list[Incarnation], dict[int, list[int]]]:
        got = self._history.get(boot_id)
        if got is not None:
            return got
        for attempt in range(2):
            m = self.manifest(boot_id, fresh=attempt > 0)
            names = [fleet.batch_object(boot_id, b) for b in m.batches]
            data = self.bucket.get_many(names, fleet.MAX_BATCH)
            absent = [n for n in names if data.get(n) is None]
            if not absent:
                break
            # A round compacted the boot after this manifest was read: read it again.
        else:
            raise FleetObjectInvalid(absent[0], "named by its boot's manifest but absent")
        batches = []
        for n in names:
            blob = data[n]
            if isinstance(blob, FleetObjectInvalid):
                raise blob
            batches.append(fleet.decode_batch(n, blob or b"", boot_id))
        self._code[boot_id] = merge_code(b.code for b in batches)
        got = self._history[boot_id] = fleet.merge_batches(batches)
        return got

    @property
    def kernel_code(self) -> _KernelCode:
        """The boots' kernel code, as the store's ``kernel_code`` answers it."""
        return _KernelCode(self)

    def code(self, boot_id: str) -> tuple[list[KernelCode], list[LossWindow]]:
        """The boot's kernel-code records (seq order) and loss windows."""
        self._load(boot_id)
        return self._code[boot_id]

    def incarnations(self, boot_id: str) -> list[Incarnation]:
        return self._load(boot_id)[0]

    def absolutes(self, boot_id: str) -> dict[int, list[int]]:
        return self._load(boot_id)[1]

    def boot_symbols(self, boot_id: str) -> BootSymbols | None:
        return self.manifest(boot_id).symbols

    def table(self, key: str) -> SymbolTable | None:
        if key not in self._tables:
            name = fleet.table_object(key)
            data = self.bucket.get(name, fleet.MAX_TABLE)
            table = None
            if data is not None:
                try:
                    table = SymbolTable(fleet.decode_table(name, data))
                    table.check()
                except (ValueError, TypeError) as e:
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


_SUMMARY = ("first_seen", "release", "build_id", "offset", "restricted")


def _agrees(e: fleet.IndexEntry, truth: fleet.IndexEntry) -> bool:
    """An index entry that says what its manifest does (one whose summary did not
    fit its name says nothing beyond its host and generation)."""
    if e.host.machine_id != truth.host.machine_id or e.gen != truth.gen:
        return False
    if e.first_seen is None:
        return True
    return e.host == truth.host and all(getattr(e, k) == getattr(truth, k) for k in _SUMMARY)


def _disagreement(e: fleet.IndexEntry, truth: fleet.IndexEntry) -> str:
    if e.host.machine_id != truth.host.machine_id:
        return f"machine-id {e.host.machine_id}, the manifest's {truth.host.machine_id}"
    if e.gen != truth.gen:
        return f"generation {e.gen}, the manifest's {truth.gen}"
    if e.host != truth.host:
        return f"host {e.host.hostname!r}, the manifest's {truth.host.hostname!r}"
    k = next(k for k in _SUMMARY if getattr(e, k) != getattr(truth, k))
    return f"{k} {getattr(e, k)!r}, the manifest's {getattr(truth, k)!r}"


def _no_current() -> BootSnapshot:
    raise InvalidArgument(
        "BOOT", "with --from, name the boot (kreldctl --from URL boots lists them)"
    )


class BucketBackend:
    """``kreldctl --from``: the read methods of ``io.kreld`` over a :class:`BucketStore`,
    each boot's record carrying its host."""

    METHODS = ("GetBoot", "ListBoots", "GetModules", "GetKernelCode", "Resolve", "ExportKallsyms")

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
        if method in ("ExportKallsyms", "GetKernelCode"):
            res["host"] = host
        return res

    def stream(self, method: str, **params: Any) -> Iterator[dict[str, Any]]:
        raise InvalidArgument("--from", f"{method} needs a running kreld; a bucket has no events")
