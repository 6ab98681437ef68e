"""Publishing the store to the fleet bucket, on a thread of its own (docs/FLEET.md).

Recording never waits for it: the publisher only reads the store (plus its own small
cursor table, :mod:`kreld.store.pubstate`), so a slow or absent bucket costs the recorder
nothing; what was not published yet is simply still in the store, and is the backlog.

Each round, for every boot not yet wholly published (the current one always):

1. *plan* (pure, from the store and the cursor): the incarnations whose published form
   changed, as one batch; the symbol tables they and the kernel use; the new manifest;
   the index entry;
2. save the plan in the store, then *apply* it: tables (each checked with HEAD first:
   another host of the same build may have put it there), the batch, the manifest
   (the pointer readers follow, written after everything it names), the index entry,
   then deletions of what the manifest no longer names;
3. commit the cursor and drop the saved plan in one transaction.

A kill between 2 and 3 leaves the plan saved: the next start applies that same plan,
checking each object with HEAD before putting it, so nothing is uploaded twice.  On
failure the round is retried with exponential backoff (capped, jittered); the bucket
is consistent at every step because readers only follow manifests.
"""

from __future__ import annotations

import base64
import hashlib
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kreld.config.settings import Config
from kreld.core import consts
from kreld.core.errors import KernelReadError, KreldError
from kreld.core.model import BootSnapshot, BootSymbols, Incarnation
from kreld.core.record import field, fields, record
from kreld.core.supervise import supervisor
from kreld.core.symtab import module_symbol_key
from kreld.fleet import objects as fleet
from kreld.fleet.kernel_code_objects import CodeDelta
from kreld.fleet.s3 import Bucket, open_bucket, require_fleet
from kreld.kernel.info import Root
from kreld.store import Store
from kreld.store.pubstate import PubState, table_bytes

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

__all__ = [
    "BACKOFF_INTERVALS",
    "Plan",
    "Publisher",
    "Target",
    "check_config",
    "configure",
    "plan_boot",
    "read_host",
]

# The longest wait between failed rounds, in publishing intervals (and at most 5 min).
BACKOFF_INTERVALS = 30


@record
class Target:
    url: str
    endpoint: str
    interval: float

    @classmethod
    def of(cls, cfg: Config) -> Target | None:
        if not cfg.publish_url:
            return None
        return cls(cfg.publish_url, cfg.publish_endpoint, cfg.publish_interval)

    def ident(self) -> str:
        return f"{self.url} {self.endpoint}"


def check_config(cfg: Config) -> None:
    """Refuse ``[publish]`` (a ConfigError) when the fleet extra is missing."""
    if cfg.publish_url:
        require_fleet(", ".join(cfg.sources) or consts.DEFAULT_CONFIG)


def read_host(root: Root) -> fleet.Host:
    machine_id = root.read_text(consts.MACHINE_ID)
    if not fleet.machine_id_ok(machine_id):
        raise KernelReadError(str(root / consts.MACHINE_ID), "not a 32-hex-digit machine-id")
    return fleet.Host(machine_id, root.read_text(consts.HOSTNAME))


@record
class Plan:
    """One boot's step of a round; JSON-able so that it can wait in the store."""

    boot_id: str
    tables: list[str]
    batch: str | None
    batch_data: str  # base64 of the batch object
    manifest: str
    index: str
    old_index: str | None
    put_index: bool
    drop: list[str]
    cursor: dict[str, Any]
    digests: dict[str, str]  # seq -> hex digest
    size: int = 0  # incarnations and boot records it carries (the backlog it clears)
    # seq -> hex digest of each kernel-code record published, None for one dropped
    code_digests: dict[str, str | None] = field(default_factory=dict)
    resumed: bool = field(default=False, compare=False)

    def pending(self) -> dict[str, Any]:
        """The plan as it waits in the store (JSON), to be resumed after a crash."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"resumed": False}


def _new_cursor() -> dict[str, Any]:
    """The publishing cursor of a boot nothing of was published yet."""
    return {
        "batches": [],
        "next": 0,
        "boot": "",
        "index": None,
        "gen": 0,
        "done": False,
        "losses": "",
    }


def _changed(
    incs: list[Incarnation], absolutes: dict[int, list[int]], old: dict[int, bytes]
) -> tuple[list[Incarnation], dict[str, str]]:
    """The incarnations whose record differs from what was published, and their
    new digests (hex, by seq)."""
    changed, digests = [], {}
    for i in incs:
        d = fleet.digest([i.to_json(), absolutes.get(i.seq)])
        if old.get(i.seq) != d:
            changed.append(i)
            digests[str(i.seq)] = d.hex()
    return changed, digests


def _code_changes(
    store: Store, state: PubState, boot_id: str, cur: dict[str, Any], quiet: bool
) -> tuple[CodeDelta, Callable[[], CodeDelta], dict[str, str | None], str]:
    """The boot's kernel code (kreld/fleet/kernel_code_objects.py): what changed since the
    last round (records, seqs retention dropped from the store, the loss windows
    when they changed), all of it (read when a round compacts), the digests to keep
    (hex by seq, None: forget), and the loss windows' digest.  A record's digest is
    of its stored bytes, so that a round with nothing new decodes nothing (50,000
    records: 1.1 s of CPU a round decoded, against 0.13 s of reading them); *quiet*:
    the store has not changed since a round that found nothing new (nothing read)."""
    tables = store.kernel_code

    def whole() -> CodeDelta:
        return CodeDelta(tuple(tables.codes(boot_id)), (), tuple(tables.losses(boot_id)))

    if quiet:
        return CodeDelta(), whole, {}, str(cur.get("losses", ""))
    rows = tables.raw_codes(boot_id)
    old = state.digests(boot_id, b"c")
    changed, digests = [], dict[str, str | None]()
    for seq, raw in rows:
        d = hashlib.blake2b(raw, digest_size=8).digest()
        if old.get(seq) != d:
            changed.append(tables.decode(raw))
            digests[str(seq)] = d.hex()
    present = {seq for seq, _ in rows}
    dropped = tuple(sorted(s for s in old if s not in present))
    digests |= {str(s): None for s in dropped}
    losses = tuple(tables.losses(boot_id))
    # None yet is "" as in a new cursor: a boot without kernel code publishes as before
    loss_digest = fleet.digest([w.to_json() for w in losses]).hex() if losses else ""
    new_losses = None if loss_digest == cur.get("losses", "") else losses
    return CodeDelta(tuple(changed), dropped, new_losses), whole, digests, loss_digest


def _tables_to_send(
    store: Store, state: PubState, symbols: BootSymbols | None, incs: list[Incarnation]
) -> list[str]:
    """The symbol tables the boot's records name, held here, not yet in the bucket."""
    wanted = {symbols.kernel} if symbols else set()
    wanted |= {
        k for i in incs if (k := module_symbol_key(i.state.build_id, i.name, i.state.srcversion))
    }
    return sorted(k for k in wanted if not state.has_table(k) and table_bytes(store, k) is not None)


def _index_entry(
    boot: BootSnapshot, host: fleet.Host, cur: dict[str, Any]
) -> tuple[int, str, str | None]:
    """The boot's index entry's generation and name, and the entry it replaces."""
    gen = int(cur["gen"])
    index = fleet.index_object(boot, host, gen)
    if cur["index"] is None or index == cur["index"]:
        return gen, index, None
    return gen + 1, fleet.index_object(boot, host, gen + 1), cur["index"]


def plan_boot(
    store: Store,
    state: PubState,
    boot: BootSnapshot,
    host: fleet.Host,
    current: bool,
    code_quiet: bool = False,
) -> Plan | None:
    """What to upload for *boot*, or None when the bucket already has it all
    (*code_quiet*: its kernel code is known unchanged since the last round)."""
    cur = state.cursor(boot.boot_id) or _new_cursor()
    if cur["done"] and not current:
        return None
    incs = store.incarnations(boot.boot_id)
    absolutes = store.absolutes(boot.boot_id)
    symbols = store.boot_symbols(boot.boot_id)
    changed, digests = _changed(incs, absolutes, state.digests(boot.boot_id))
    code, whole, code_digests, loss_digest = _code_changes(
        store, state, boot.boot_id, cur, code_quiet
    )
    sym_json = symbols.to_json() if symbols else None
    boot_digest = fleet.digest([boot.to_json(), sym_json, host.to_json()]).hex()
    tables = _tables_to_send(store, state, symbols, incs)
    if not changed and code.empty() and boot_digest == cur["boot"] and not tables:
        return None
    batches, n, drop = list(cur["batches"]), int(cur["next"]), []
    batch, data, size = None, b"", len(changed) + len(code.codes) + len(code.dropped)
    if changed or not code.empty():
        if len(batches) >= fleet.COMPACT_AFTER:
            drop, batches, changed, code = batches, [], incs, whole()
        batch = fleet.batch_name(n)
        n += 1
        batches.append(batch)
        seqs = {i.seq for i in changed}
        absolute = {s: v for s, v in absolutes.items() if s in seqs}
        data = fleet.encode_batch(boot.boot_id, changed, absolute, code)
    gen, index, old_index = _index_entry(boot, host, cur)
    # The manifest names its index entry's generation: a reader believes the entry
    # that agrees with it, not one whose generation someone raised.
    manifest = fleet.encode_manifest(fleet.Manifest(host, boot, symbols, tuple(batches), gen))
    cursor = {"batches": batches, "next": n, "boot": boot_digest, "index": index}
    cursor |= {"gen": gen, "done": not current, "losses": loss_digest}
    return Plan(
        boot.boot_id,
        tables,
        batch,
        base64.b64encode(data).decode(),
        manifest.decode(),
        index,
        old_index,
        index != cur["index"],
        drop,
        cursor,
        digests,
        size=size + (boot_digest != cur["boot"]),
        code_digests=code_digests,
    )


class Publisher:
    """The publishing thread and its health, as ``Status`` shows it."""

    def __init__(
        self,
        store: Store,
        root: Root,
        target: Target | None,
        current_id: Callable[[], str],
        log: FilteringBoundLogger,
        opener: Callable[[str, str], Bucket] = open_bucket,
    ) -> None:
        self.store = store
        self.root = root
        self.target = target
        self.current_id = current_id
        self.log = log
        self.opener = opener
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._state: tuple[Target, PubState, Bucket] | None = None
        # boot-id -> the store's txn-id of a round that found it all published
        self._quiet: dict[str, int] = {}
        # (the publishing state, the store's txn-id) -> tables_behind's count then
        self._behind: tuple[PubState, int, int] | None = None
        self.last_success: int | None = None
        self.last_error: str | None = None
        self.backlog = 0
        self.objects = 0
        self.bytes = 0
        self.failures = 0
        self.rounds = 0  # rounds that ended with everything published

    # -- control (loop thread) ------------------------------------------------------

    def start(self, stop: threading.Event) -> None:
        self._thread = supervisor().thread("publisher", self.run, stop)

    def retarget(self, target: Target | None) -> None:
        """SIGHUP: publish to *target* from the next round on (None: stop publishing)."""
        if target != self.target:
            self.log.info(
                "publish_target",
                url=target.url if target else None,
                endpoint=target.endpoint if target else None,
            )
            self.target = target
            self.last_error = None
            self.failures = 0
        self._wake.set()

    def stop(self) -> None:
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def health(self) -> dict[str, Any] | None:
        if self.target is None:
            return None
        return {
            "url": self.target.url,
            "healthy": self.last_error is None,
            "last_success_ns": self.last_success,
            "backlog": self.backlog + self.tables_behind(),
            "last_error": self.last_error,
            "objects": self.objects,
            "bytes": self.bytes,
        }

    def tables_behind(self) -> int:
        """The symbol tables the boots still publishing name, held in the store and
        not yet put in the bucket from here, counted now: the symbol worker stores a
        table after its records, so a round may publish every record while the table
        waits for the next round (or fails to go up) and the backlog must not read 0.

        Counted again only once the store has had a write since the last count
        (a table stored, a round's progress: both commit to the store), so a
        Status at rest (the status line's every 10 s) reads the number kept."""
        opened = self._state
        if opened is None:
            return 0
        state, txnid = opened[1], self.store.last_txnid()
        kept = self._behind
        if kept is not None and kept[0] is state and kept[1] == txnid:
            return kept[2]
        behind = 0
        for boot in self.store.list_boots():
            cur = state.cursor(boot.boot_id)
            if cur is None or not cur["done"]:
                symbols = self.store.boot_symbols(boot.boot_id)
                incs = self.store.incarnations(boot.boot_id)
                behind += len(_tables_to_send(self.store, state, symbols, incs))
        self._behind = (state, txnid, behind)
        return behind

    # -- the thread -------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            target = self.target
            delay = target.interval if target else 3600.0
            if target is not None:
                try:
                    self.publish_round(target)
                    self.failures = 0
                except KreldError as e:
                    delay = self._failed(target, str(e))
                except Exception as e:  # a bug must not end publishing for good
                    delay = self._failed(target, f"{type(e).__name__}: {e}")
            self._wake.wait(delay)
            self._wake.clear()

    def _failed(self, target: Target, error: str) -> float:
        self.failures += 1
        cap = min(300.0, target.interval * BACKOFF_INTERVALS)
        delay = min(cap, target.interval * 2.0 ** min(self.failures, 30))
        delay *= random.uniform(0.8, 1.2)
        self.last_error = error
        self.log.error(
            "publish_failed",
            url=target.url,
            error=error,
            backlog=self.backlog,
            retry_in_s=round(delay, 2),
        )
        return delay

    def _open(self, target: Target) -> tuple[PubState, Bucket]:
        if self._state is None or self._state[0] != target:
            bucket = self.opener(target.url, target.endpoint)
            self._state = (target, PubState(self.store, target.ident()), bucket)
            self._quiet.clear()
        return self._state[1], self._state[2]

    def publish_round(self, target: Target) -> None:
        state, bucket = self._open(target)
        pending = state.pending()
        if pending is not None:
            resumed = Plan(**{**pending, "resumed": True})
            self.log.info("publish_resume", boot_id=resumed.boot_id, batch=resumed.batch)
            self._apply(bucket, state, resumed)
        host = read_host(self.root)
        current = self.current_id()
        txnid = self.store.last_txnid()
        plans: list[Plan] = []
        for boot in reversed(self.store.list_boots()):  # oldest first
            is_current = boot.boot_id == current
            quiet = self._quiet.get(boot.boot_id) == txnid
            step = plan_boot(self.store, state, boot, host, is_current, quiet)
            if step is not None:
                plans.append(step)
                continue
            self._quiet[boot.boot_id] = txnid  # nothing new: its code not read till a write
            if not is_current:
                state.mark_done(boot.boot_id)  # over, and all in the bucket: not read again
        self.backlog = sum(p.size for p in plans)
        before = (self.objects, self.bytes)
        for plan in plans:
            state.save_pending(
                {f.name: getattr(plan, f.name) for f in fields(plan)} | {"resumed": False}
            )
            self._apply(bucket, state, plan)
            self.backlog -= plan.size
        self.backlog = 0
        self.last_success = time.time_ns()
        self.rounds += 1
        if self.last_error is not None:
            self.log.info("publish_recovered", url=target.url)
        self.last_error = None
        if plans:
            self.log.info(
                "published",
                url=target.url,
                boots=len(plans),
                objects=self.objects - before[0],
                bytes=self.bytes - before[1],
            )

    def _put(self, bucket: Bucket, key: str, data: bytes) -> None:
        bucket.put(key, data)
        self.objects += 1
        self.bytes += len(data)

    def _apply(self, bucket: Bucket, state: PubState, plan: Plan) -> None:
        for key in plan.tables:
            name = fleet.table_object(key)
            if bucket.exists(name):
                self.log.debug("table_present", table=key)
                continue
            packed = table_bytes(self.store, key)
            if packed is None:  # gone since the plan (gc): its boot is gone too
                continue
            self._put(bucket, name, fleet.encode_table(packed))
            self.log.info("table_uploaded", table=key, bytes=len(packed))
        if plan.batch is not None:
            name = fleet.batch_object(plan.boot_id, plan.batch)
            if not (plan.resumed and bucket.exists(name)):
                self._put(bucket, name, base64.b64decode(plan.batch_data))
        self._put(bucket, fleet.manifest_object(plan.boot_id), plan.manifest.encode())
        if plan.put_index and not (plan.resumed and bucket.exists(plan.index)):
            self._put(bucket, plan.index, b"")
        gone = [fleet.batch_object(plan.boot_id, b) for b in plan.drop]
        if plan.old_index is not None:
            gone.append(plan.old_index)
        if gone:
            bucket.delete(gone)
        state.commit(
            plan.boot_id,
            plan.cursor,
            {int(s): bytes.fromhex(d) for s, d in plan.digests.items()},
            plan.tables,
            {int(s): None if d is None else bytes.fromhex(d) for s, d in plan.code_digests.items()},
        )


def configure(
    publisher: Publisher | None,
    cfg: Config,
    store: Store,
    root: Root,
    current_id: Callable[[], str],
    log: FilteringBoundLogger,
    stop: threading.Event,
) -> Publisher | None:
    """Start publishing when *cfg* asks for it, or point a running publisher at the
    target *cfg* names (SIGHUP)."""
    target = Target.of(cfg)
    if publisher is not None:
        publisher.retarget(target)
        return publisher
    if target is None:
        return None
    publisher = Publisher(store, root, target, current_id, log)
    log.info("publish_target", url=target.url, endpoint=target.endpoint or None)
    publisher.start(stop)
    return publisher
