"""The ``io.kreld`` methods, independent of any transport.

The daemon serves them on its socket (:mod:`kreld.server.listener`); ``kreldctl``
runs the same code on the store directly when no daemon answers, so both
give the same answers.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kreld.core.errors import (
    AddressesRestricted,
    KreldError,
    MethodNotImplemented,
    SymbolsUnavailable,
)
from kreld.core.model import BootSnapshot, Clock, Incarnation, clock_now
from kreld.store.bootsource import BootSource
from kreld.varlink import requests

if TYPE_CHECKING:
    from kreld.core.kernel_code import KernelCode
    from kreld.server.linebuild import LineBuilder

    # Imported by the methods that ask about addresses and times, when they do:
    # kreldctl show, boots and status need neither.
    from kreld.symbols.kernel_code import CodeHistory
    from kreld.symbols.linequery import TableSource
    from kreld.symbols.queries import AddressMap

__all__ = ["MAP_CACHE", "Reply", "Service"]

# A method's answer: its reply parameters, as plain data or already encoded
# as a JSON object (the answers built once and served many times).
Reply = dict[str, Any] | bytes
# Address maps of other times and boots kept for the next Resolve (a profiler
# symbolizing an old recording asks about the same boot and time many times).
MAP_CACHE = 8


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
        line_tables: LineBuilder | None = None,
        drop_pages: Callable[[], object] | None = None,
    ) -> None:
        self.store = store
        # What lets the store's pages that calls read leave the resident set
        # once they stop (kreld.server.heapback): the daemon's Store.drop_pages.
        self.drop_pages = drop_pages
        # Resolve's lines: the daemon's builder, whose source_for is the
        # build-id -> line table (or why not) function for the builds of a
        # boot; None: lines are not served, and say so.
        self._line_tables = line_tables
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
        self._code: dict[str, CodeHistory] = {}
        self._code_stale: set[str] = set()
        self._kernel_tables: dict[str, str] = {}
        self._boots: tuple[int, bytes] | None = None

    def loaded(self) -> list[Incarnation]:
        return self._loaded()

    # Caches are dropped on every recorded event (called on the loop thread).
    def invalidate(self) -> None:
        self._now_map = None
        with self._cache_lock:
            self._generation += 1
            self._maps.clear()
            self._history.clear()
            self._code_stale = set(self._code)  # read again, only what can have changed

    def _boot(self, boot_id: str | None) -> tuple[BootSnapshot, bool]:
        """The boot asked for, and whether it is the one running here.

        A boot named by id is looked up by itself: the store may come from
        another machine, whose boots are not this one's.
        """
        if boot_id is None:
            return self._current(), True
        boot = self.store.get_boot(self.store.resolve_boot(boot_id))
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

    def _code_history(self, boot_id: str) -> CodeHistory:
        """The boot's kernel code (kreld/symbols/kernel_code.py), cached like its loads."""
        from kreld.symbols.kernel_code import code_history

        hist = self._code.get(boot_id)
        if hist is None or boot_id in self._code_stale:
            generation = self._generation
            hist = code_history(self.store, boot_id, hist)
            with self._cache_lock:
                if generation == self._generation:
                    if len(self._code) > 8:
                        self._code.clear()
                    self._code[boot_id] = hist
                    self._code_stale.discard(boot_id)
        return hist

    def live_code(self) -> list[KernelCode] | None:
        """The kernel code of the running boot live now, as recorded (Subscribe's
        first reply); None where it cannot be read (its table damaged)."""
        boot_id = self._current_id()
        if boot_id is None:
            return []
        try:
            return self._code_history(boot_id).candidates(Clock.MONOTONIC, None)
        except KreldError:
            return None

    def get_kernel_code(self, req: requests.GetKernelCode) -> Reply:
        boot, is_current = self._boot(req.boot_id)
        hist = self._code_history(boot.boot_id)
        t = None if req.at is None else self._at(req.clock, req.at, is_current)
        codes = hist.codes if req.all else hist.candidates(req.clock, t)
        return {"code": [c.to_json() for c in codes], "losses": [w.to_json() for w in hist.losses]}

    def get_boot(self, req: requests.GetBoot) -> Reply:
        """GetBoot; the current boot's answer is encoded once."""
        if req.boot_id is None:
            if self._boot_reply is None:
                self._boot_reply = _encode({"boot": self._current().to_json()})
            return self._boot_reply
        return {"boot": self._boot(req.boot_id)[0].to_json()}

    def list_boots(self, _req: requests.ListBoots) -> Reply:
        """Every boot, encoded again only after the store has changed (a fleet
        of profilers polling it costs a txn-id read a call)."""
        txnid = self.store.last_txnid()
        cached = self._boots
        if cached is None or cached[0] != txnid:
            boots = [b.to_json() for b in self.store.list_boots()]
            cached = self._boots = (txnid, _encode({"boots": boots}))
        return cached[1]

    def snapshot(self, _req: requests.Snapshot) -> Reply:
        if self._snapshot is None:
            raise MethodNotImplemented("Snapshot")
        stored, added, changed = self._snapshot()
        self._boot_reply = None
        return {"boot": stored.to_json(), "new": added, "updated": changed}

    def _at(self, clock: Clock, at: int | None, is_current: bool) -> int | None:
        """The time asked about; "now" on the current boot, the end of record on others."""
        if at is None and is_current:
            return clock_now(clock)
        return at

    def get_modules(self, req: requests.GetModules) -> Reply:
        from kreld.symbols.queries import loaded_at

        boot, is_current = self._boot(req.boot_id)
        if req.all:
            return {"modules": [i.to_json() for i in self._incarnations(boot.boot_id)]}
        if is_current and req.at is None:
            return {"modules": [i.to_json() for i in self._loaded()]}
        t = self._at(req.clock, req.at, is_current)
        incs = loaded_at(self._incarnations(boot.boot_id), req.clock, t)
        return {"modules": [i.to_json() for i in incs]}

    def resolve(self, req: requests.Resolve) -> Reply:
        """Resolve's reply parameters as JSON (the server splices them into its reply)."""
        from kreld.symbols.queries import AddressMap

        boot, is_current = self._boot(req.boot_id)
        if boot.restricted and not boot.anchors.known():
            raise AddressesRestricted(boot.restricted_reason or "")
        kernel_key = self._kernel_table(boot.boot_id)
        if is_current and req.at is None:
            if self._now_map is None or self._now_map.kernel_table != kernel_key:
                code = self._code_history(boot.boot_id)
                self._now_map = AddressMap(
                    boot, self._loaded(), Clock.MONOTONIC, None, kernel_key, code
                )
            amap = self._now_map
        else:
            t = self._at(req.clock, req.at, is_current)
            amap = self._map_at(boot, req.clock, t, kernel_key)
        resolved = self.store.with_tables(
            amap.table_keys(), lambda tables: amap.resolve(req.addresses, tables)
        )
        if not req.lines:
            return resolved.to_json()
        # Joined once: the lines of 100,000 addresses are megabytes, and each
        # concatenation would copy them again.
        symbols = resolved.to_json()
        lines = self._lines(boot, amap, req)
        return b"".join((memoryview(symbols)[:-1], b',"lines":', lines, b"}"))

    def _lines(self, boot: BootSnapshot, amap: AddressMap, req: requests.Resolve) -> bytes:
        """Resolve's ``lines`` member as JSON (see ResolveLines in io.kreld.varlink)."""
        from kreld.symbols.linereply import line_columns
        from kreld.symbols.linetables import wanted_of

        if self._line_tables is None:
            source: TableSource = lambda _b: "source lines are not served here"  # noqa: E731
            return line_columns(amap, req.addresses, source).to_json()
        with self._line_tables.answering():
            source = self._line_tables.source_for(wanted_of(amap, boot.release))
            return line_columns(amap, req.addresses, source).to_json()

    def _map_at(
        self, boot: BootSnapshot, clock: Clock, t: int | None, kernel_key: str | None
    ) -> AddressMap:
        """The address map of *boot* at *t*, from the cache when the same
        incarnations (and init sections) were live then; the cache is dropped
        with every recorded event, so a record updated since is never stale."""
        from kreld.symbols.kernel_code import in_loss
        from kreld.symbols.late_loads import possibly_loaded_at
        from kreld.symbols.queries import AddressMap, init_live_at, loaded_at

        generation = self._generation
        incs = self._incarnations(boot.boot_id)
        live = tuple((i.seq, init_live_at(i, clock, t)) for i in loaded_at(incs, clock, t))
        maybe = tuple(i.seq for i in incs if possibly_loaded_at(i, clock, t))
        code = self._code_history(boot.boot_id)
        code_live = tuple((c.seq, c.certain_at(clock, t)) for c in code.candidates(clock, t))
        lost = in_loss(code.losses, clock, t)
        key = (boot.boot_id, boot.anchors, kernel_key, live, maybe, code_live, lost)
        with self._cache_lock:  # Resolve runs on the loop and on the worker thread
            amap = self._maps.get(key)
            if amap is not None:
                self._maps.move_to_end(key)
                return amap
        amap = AddressMap(boot, incs, clock, t, kernel_key, code)
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
                key = self._kernel_tables[boot_id] = rec.kernel
        return key

    def export_kallsyms(self, req: requests.ExportKallsyms) -> Reply:
        from kreld.symbols.export import module_key, render_kallsyms
        from kreld.symbols.kernel_code import kallsyms_lines
        from kreld.symbols.queries import loaded_at

        boot, is_current = self._boot(req.boot_id)
        clock = req.clock
        t = self._at(clock, req.at, is_current)
        if boot.restricted and not boot.anchors.known():
            raise AddressesRestricted(boot.restricted_reason or "")
        rec = self.store.boot_symbols(boot.boot_id)
        if rec is None or boot.anchors.text is None:
            why = "not captured yet" if is_current else "kallsyms was not captured for it"
            raise SymbolsUnavailable(boot.boot_id, why)
        incs = loaded_at(self._incarnations(boot.boot_id), clock, t)
        # The kernel lists modules newest first (each load goes to the list head).
        incs.sort(key=lambda i: (i.loaded.monotonic, i.seq), reverse=True)
        keys = {rec.kernel}
        keys |= {k for i in incs if (k := module_key(i)) is not None}
        absolutes = self.store.absolutes(boot.boot_id)
        extras = kallsyms_lines(self._code_history(boot.boot_id), rec.extras, clock, t)
        text = self.store.with_tables(
            keys,
            lambda tables: render_kallsyms(
                boot.anchors.text or 0,
                tables,
                rec.kernel,
                incs,
                extras,
                clock,
                t,
                absolutes,
            ),
        )
        return {"kallsyms": text}

    def status(self, _req: requests.Status) -> Reply:
        if self._status is None:
            raise MethodNotImplemented("Status")
        return self._status()


def _encode(params: dict[str, Any]) -> bytes:
    """Reply parameters as compact JSON, as the wire carries them."""
    return json.dumps(params, separators=(",", ":")).encode()
