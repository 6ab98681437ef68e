"""The ``io.kreld`` methods, independent of any transport.

The daemon serves them on its socket (:mod:`kreld.server`); ``kreldctl``
runs the same code on the store directly when no daemon answers, so both
give the same answers.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kreld.bootsource import BootSource
from kreld.errors import KreldError, SymbolsUnavailable
from kreld.kallsyms import module_key, render_kallsyms
from kreld.model import BootSnapshot, Clock, Incarnation, clock_now
from kreld.queries import AddressMap, init_live_at, loaded_at
from kreld.varlink import (
    INTERFACE,
    SERVICE,
    VarlinkError,
    check_known,
    invalid_parameter,
    opt_bool,
    opt_int,
    opt_str,
    reply,
)

# Addresses one Resolve may ask about: its reply (some 30 bytes an address)
# is built in memory, so this bounds what one call can make the daemon hold.
MAX_RESOLVE_ADDRESSES = 100_000
# Address maps of other times and boots kept for the next Resolve (a profiler
# symbolizing an old recording asks about the same boot and time many times).
MAP_CACHE = 8


def parse_addresses(raw: object) -> list[int]:
    """Resolve's ``addresses``: at most :data:`MAX_RESOLVE_ADDRESSES` hex
    strings (``0x`` optional), each below 2**64."""
    if not isinstance(raw, list) or len(raw) > MAX_RESOLVE_ADDRESSES:
        raise invalid_parameter("addresses")
    try:
        # int() in one pass, then what parse_addr() checks, for all at once:
        # int() took only strings; no "_" digit separators; no value past 64 bits.
        addrs = [int(a, 16) for a in raw]
        if "_" in "".join(raw) or (addrs and not 0 <= min(addrs) <= max(addrs) < 1 << 64):
            raise ValueError("not 64-bit hex addresses")
    except (ValueError, TypeError) as e:
        raise invalid_parameter("addresses") from e
    return addrs


def parse_clock(params: dict[str, Any]) -> Clock:
    c = opt_str(params, "clock")
    if c is None:
        return Clock.MONOTONIC
    try:
        return Clock(c)
    except ValueError as e:
        raise invalid_parameter("clock") from e


class Service:
    """The ``io.kreld`` methods over a store and the current boot."""

    def __init__(
        self,
        store: BootSource,
        *,
        current_boot: Callable[[], BootSnapshot],
        current_id: Callable[[], str | None],
        loaded: Callable[[], list[Incarnation]],
        snapshot: Callable[[], tuple[BootSnapshot, bool, bool]] | None = None,
        status: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.store = store
        self._current = current_boot
        self._current_id = current_id
        self._loaded = loaded
        self._snapshot = snapshot
        self._status = status
        self._boot_reply: bytes | None = None
        self._now_map: AddressMap | None = None
        self._maps: OrderedDict[tuple[Any, ...], AddressMap] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._generation = 0  # of recorded events, for the caches
        self._history: dict[str, list[Incarnation]] = {}
        self._kernel_tables: dict[str, str] = {}
        self._boots: tuple[int, dict[str, Any], bytes | None] | None = None
        self.handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "GetBoot": self.get_boot,
            "ListBoots": self.list_boots,
            "Snapshot": self.snapshot,
            "GetModules": self.get_modules,
            "Resolve": self.resolve,
            "ExportKallsyms": self.export_kallsyms,
            "Status": self.status,
        }

    def handle(self, name: str, params: dict[str, Any]) -> dict[str, Any]:
        """Call method *name* of ``io.kreld``; errors are raised, not returned."""
        h = self.handlers.get(name)
        if h is None:
            raise VarlinkError(f"{SERVICE}.MethodNotFound", {"method": f"{INTERFACE}.{name}"})
        try:
            return h(params)
        except KreldError as e:
            raise VarlinkError.from_kreld(e) from e

    def loaded(self) -> list[Incarnation]:
        return self._loaded()

    # Caches are dropped on every recorded event (called on the loop thread).
    def invalidate(self) -> None:
        self._now_map = None
        with self._cache_lock:
            self._generation += 1
            self._maps.clear()
            self._history.clear()

    def _boot(self, params: dict[str, Any]) -> tuple[BootSnapshot, bool]:
        """The boot asked for, and whether it is the one running here.

        A boot named by id is looked up by itself: the store may come from
        another machine, whose boots are not this one's.
        """
        given = opt_str(params, "boot_id")
        if given is None:
            return self._current(), True
        boot = self.store.get_boot(self.store.resolve_boot(given))
        return boot, boot.boot_id == self._current_id()

    def _incarnations(self, boot_id: str) -> list[Incarnation]:
        incs = self._history.get(boot_id)
        if incs is None:
            generation = self._generation
            incs = self.store.incarnations(boot_id)
            with self._cache_lock:
                if generation == self._generation:  # else an event came meanwhile
                    if len(self._history) > 8:
                        self._history.clear()
                    self._history[boot_id] = incs
        return incs

    def get_boot_reply(self, params: dict[str, Any]) -> bytes:
        """GetBoot as wire bytes; the current boot's answer is built once."""
        if not params:
            if self._boot_reply is None:
                self._boot_reply = reply(self.get_boot(params))
            return self._boot_reply
        return reply(self.get_boot(params))

    def get_boot(self, params: dict[str, Any]) -> dict[str, Any]:
        check_known(params, {"boot_id"})
        return {"boot": self._boot(params)[0].to_json()}

    def list_boots(self, params: dict[str, Any]) -> dict[str, Any]:
        """Every boot; decoded again only after the store has changed."""
        return self._list_boots(params)[1]

    def list_boots_reply(self, params: dict[str, Any]) -> bytes:
        """ListBoots as wire bytes, encoded again only after the store has
        changed (a fleet of profilers polling it costs a txn-id read a call)."""
        txnid, result, wire = self._list_boots(params)
        if wire is None:
            wire = reply(result)
            self._boots = (txnid, result, wire)
        return wire

    def _list_boots(self, params: dict[str, Any]) -> tuple[int, dict[str, Any], bytes | None]:
        check_known(params, set())
        txnid = self.store.last_txnid()
        cached = self._boots
        if cached is None or cached[0] != txnid:
            boots = [b.to_json() for b in self.store.list_boots()]
            cached = self._boots = (txnid, {"boots": boots}, None)
        return cached

    def snapshot(self, params: dict[str, Any]) -> dict[str, Any]:
        check_known(params, set())
        if self._snapshot is None:
            raise VarlinkError(f"{SERVICE}.MethodNotImplemented", {"method": "Snapshot"})
        stored, added, changed = self._snapshot()
        self._boot_reply = None
        return {"boot": stored.to_json(), "new": added, "updated": changed}

    def _at(self, params: dict[str, Any], is_current: bool) -> tuple[Clock, int | None]:
        """The time asked about; "now" on the current boot, the end of record on others."""
        clock = parse_clock(params)
        t = opt_int(params, "at")
        if t is None and is_current:
            t = clock_now(clock)
        return clock, t

    def get_modules(self, params: dict[str, Any]) -> dict[str, Any]:
        check_known(params, {"boot_id", "at", "clock", "all"})
        boot, is_current = self._boot(params)
        if opt_bool(params, "all"):
            return {"modules": [i.to_json() for i in self._incarnations(boot.boot_id)]}
        if is_current and params.get("at") is None:
            parse_clock(params)
            return {"modules": [i.to_json() for i in self._loaded()]}
        clock, t = self._at(params, is_current)
        incs = loaded_at(self._incarnations(boot.boot_id), clock, t)
        return {"modules": [i.to_json() for i in incs]}

    def resolve(self, params: dict[str, Any]) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.resolve_results(params))
        return parsed

    def resolve_results(self, params: dict[str, Any]) -> bytes:
        """Resolve's reply parameters as JSON (the server splices them into its reply)."""
        check_known(params, {"addresses", "boot_id", "at", "clock"})
        addrs = parse_addresses(params.get("addresses"))
        boot, is_current = self._boot(params)
        if boot.restricted and not boot.anchors.known():
            raise VarlinkError(
                f"{INTERFACE}.AddressesRestricted", {"reason": boot.restricted_reason or ""}
            )
        kernel_key = self._kernel_table(boot.boot_id)
        if is_current and params.get("at") is None:
            parse_clock(params)
            if self._now_map is None or self._now_map.kernel_table != kernel_key:
                self._now_map = AddressMap(boot, self._loaded(), Clock.MONOTONIC, None, kernel_key)
            amap = self._now_map
        else:
            clock, t = self._at(params, is_current)
            amap = self._map_at(boot, clock, t, kernel_key)
        resolved = self.store.with_tables(
            amap.table_keys(), lambda tables: amap.resolve(addrs, tables)
        )
        return resolved.to_json()

    def _map_at(
        self, boot: BootSnapshot, clock: Clock, t: int | None, kernel_key: str | None
    ) -> AddressMap:
        """The address map of *boot* at *t*, from the cache when the same
        incarnations (and init sections) were live then; the cache is dropped
        with every recorded event, so a record updated since is never stale."""
        generation = self._generation
        incs = self._incarnations(boot.boot_id)
        live = tuple((i.seq, init_live_at(i, clock, t)) for i in loaded_at(incs, clock, t))
        key = (boot.boot_id, boot.anchors, kernel_key, live)
        with self._cache_lock:  # Resolve runs on the loop and on the worker thread
            amap = self._maps.get(key)
            if amap is not None:
                self._maps.move_to_end(key)
                return amap
        amap = AddressMap(boot, incs, clock, t, kernel_key)
        with self._cache_lock:
            if generation != self._generation:
                return amap  # built from records an event has since changed
            self._maps[key] = amap
            while len(self._maps) > MAP_CACHE:
                self._maps.popitem(last=False)
        return amap

    def _kernel_table(self, boot_id: str) -> str | None:
        key = self._kernel_tables.get(boot_id)
        if key is None:
            rec = self.store.boot_symbols(boot_id)
            if rec is not None:
                key = self._kernel_tables[boot_id] = str(rec["kernel"])
        return key

    def export_kallsyms(self, params: dict[str, Any]) -> dict[str, Any]:
        check_known(params, {"boot_id", "at", "clock"})
        boot, is_current = self._boot(params)
        clock, t = self._at(params, is_current)
        if boot.restricted and not boot.anchors.known():
            raise VarlinkError(
                f"{INTERFACE}.AddressesRestricted", {"reason": boot.restricted_reason or ""}
            )
        rec = self.store.boot_symbols(boot.boot_id)
        if rec is None or boot.anchors.text is None:
            why = "not captured yet" if is_current else "kallsyms was not captured for it"
            raise SymbolsUnavailable(boot.boot_id, why)
        incs = loaded_at(self._incarnations(boot.boot_id), clock, t)
        # The kernel lists modules newest first (each load goes to the list head).
        incs.sort(key=lambda i: (i.loaded.monotonic, i.seq), reverse=True)
        keys = {str(rec["kernel"])}
        keys |= {k for i in incs if (k := module_key(i)) is not None}
        absolutes = self.store.absolutes(boot.boot_id)
        text = self.store.with_tables(
            keys,
            lambda tables: render_kallsyms(
                boot.anchors.text or 0,
                tables,
                str(rec["kernel"]),
                incs,
                rec["extras"],
                clock,
                t,
                absolutes,
            ),
        )
        return {"kallsyms": text}

    def status(self, params: dict[str, Any]) -> dict[str, Any]:
        check_known(params, set())
        if self._status is None:
            raise VarlinkError(f"{SERVICE}.MethodNotImplemented", {"method": "Status"})
        return self._status()
