"""The line table of a build, on demand: kept in the store, else built from
its debug file found by build-id, else the reason none can be had.

:class:`LineTableProvider` is what answers ``resolve --lines`` (and the
daemon's Resolve with lines): :meth:`~LineTableProvider.table` takes a
:class:`~kreld.debuginfo.places.Wanted` (a build-id and what the build is:
the kernel image of a release, or a module by its recorded name), and
answers

1. the table the store keeps for the build-id, if any;
2. else the debug file the finder finds (``--debuginfo-dir`` directories,
   ``/usr/lib/debug`` under ``--root``, ``[kernel] debuginfo_dirs``, the
   cache, then debuginfod), read into a table, kept in the store when a
   keeper is given, and answered (with ``keep_later``, as the daemon's
   builder has it, kept by :meth:`~LineTableProvider.keep_pending` once the
   callers waiting for it are answered);
3. else the reason, as a string: where it looked and what each server said.

One build at a time (a lock), so two askers never read the same DWARF twice
at once and memory holds one build's reading; a table already held (or an
absence remembered, :meth:`~LineTableProvider.cached`) is answered without
waiting for a build under way.  Tables read back are kept in
memory up to a byte bound, least recently used dropped first.  A build with
no debug file costs the look-up only (a few ``open`` calls, and one request
per debuginfod server); its reason is remembered for ``retry_after`` seconds
so that a stream of addresses does not ask the servers again and again.

:func:`wanted_of` says what each build of an :class:`AddressMap` is, so
that :meth:`LineTableProvider.source_for` hands ``lines_at`` the
build-id -> table function it takes.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kreld.core import consts
from kreld.core.errors import DebuginfoError, InvalidArgument, KreldError, LineTableError
from kreld.debuginfo.places import Kind, Wanted
from kreld.symbols.absences import DEFAULT_RETRY_AFTER, Absences

if TYPE_CHECKING:
    from kreld.config.settings import Config
    from kreld.core.model import Incarnation
    from kreld.debuginfo.finder import DebuginfoFinder
    from kreld.debuginfo.lines import LineTable
    from kreld.store.linetabs import LineTableStore
    from kreld.symbols.linequery import TableSource
    from kreld.symbols.queries import AddressMap

__all__ = [
    "Keeper",
    "LineTableProvider",
    "TableInfo",
    "provider_for",
    "table_listing",
    "table_source",
    "wanted_for",
    "wanted_of",
]

#: Keeps a built table: ``keep(build_id, table_bytes, source, what)`` (*source*
#: where the debug file came from, *what* the build: "module brd of 6.1.0-57");
#: may raise a KreldError (a store that cannot be written), which only costs
#: the keeping.  :meth:`LineTableStore.put` is one.
Keeper = Callable[[str, bytes, str, str], None]

# Tables read back kept in memory at most (a kernel's is ~40 MiB).
DEFAULT_MEMORY = 256 << 20


@dataclass(frozen=True)
class TableInfo:
    """A kept table as listed: its build, size on disk and where its debug
    file came from."""

    build_id: str
    size: int
    source: str
    what: str

    def to_json(self) -> dict[str, Any]:
        return {"build_id": self.build_id, "size": self.size, "source": self.source,
                "what": self.what}  # fmt: skip


def table_listing(kept: LineTableStore) -> list[TableInfo]:
    """Every table the store keeps, by build-id."""
    out = []
    for build_id, m in sorted(kept.listing().items()):
        size = m.get("size")
        source = m.get("source")
        what = m.get("what")
        out.append(
            TableInfo(
                build_id,
                size if isinstance(size, int) else 0,
                source if isinstance(source, str) else "",
                what if isinstance(what, str) else "",
            )
        )
    return out


def wanted_of(amap: AddressMap, release: str) -> dict[str, Wanted]:
    """What each build of *amap* is, by build-id (see :func:`wanted_for`)."""
    incs = (r.inc for r in amap.regions if r.inc is not None)
    return wanted_for(amap.kernel_build_id, incs, release)


def wanted_for(
    kernel_build_id: str | None, incs: Iterable[Incarnation], release: str
) -> dict[str, Wanted]:
    """What each build is, by build-id: the kernel image of *release* (the
    boot's) and each module incarnation's build by the name recorded for it."""
    out: dict[str, Wanted] = {}
    if kernel_build_id:
        out[kernel_build_id] = Wanted(kernel_build_id, Kind.IMAGE, release)
    for inc in incs:
        bid = inc.state.build_id
        if bid and bid not in out:
            out[bid] = Wanted(bid, Kind.MODULE, release, name=inc.state.name)
    return out


class LineTableProvider:
    """Line tables by build: from the store, or built from debuginfo found by
    build-id; see the module's docstring."""

    def __init__(
        self,
        finder: DebuginfoFinder,
        kept: LineTableStore | None = None,
        keep: Keeper | None = None,
        *,
        memory: int = DEFAULT_MEMORY,
        retry_after: float = DEFAULT_RETRY_AFTER,
        scratch: Path | None = None,
        build_memory: int = consts.DEFAULT_LINE_BUILD_MEMORY,
        keep_later: bool = False,
        clock: Callable[[], float] = time.monotonic,
        absences: Absences | None = None,
    ) -> None:
        self.finder = finder
        self.kept = kept
        self.keep = keep
        self.memory = memory
        self.scratch = scratch
        #: The address space of a build's DWARF reader (its own process).
        self.build_memory = build_memory
        #: Builds found without debuginfo (*retry_after*, *clock*: unless given).
        self.absences = absences if absences is not None else Absences(retry_after, clock)
        self._building = threading.Lock()  # one build read or built at a time
        self._state = threading.Lock()  # the dicts below, never held while building
        self._tables: OrderedDict[str, tuple[LineTable, int]] = OrderedDict()
        self._held = 0
        #: What this provider built, by build-id: where its debug file came from.
        self.built: dict[str, str] = {}
        #: Why a built table could not be kept (the store not writable), by build-id.
        self.unkept: dict[str, str] = {}
        # With keep_later, the tables built but not yet kept: keep_pending keeps them.
        self.keep_later = keep_later
        self._pending: list[tuple[Wanted, LineTable, str]] = []

    def table(self, want: Wanted) -> LineTable | str:
        """*want*'s line table, or why none can be had.  A table held in
        memory (or an absence remembered) is answered at once, also while
        another build is being read."""
        from kreld.debuginfo.places import checked

        try:
            want = checked(want)
        except InvalidArgument as e:
            return f"no line table for build {want.build_id[:130]}: {e}"
        bid = want.build_id
        hit = self.cached(bid)
        if hit is not None:
            return hit
        with self._building:
            hit = self.cached(bid)  # built by another asker meanwhile
            if hit is not None:
                return hit
            try:
                table, size = self._current(want)
            except (KreldError, OSError) as e:
                why = _reason(bid, e)
                self.absences.remember(bid, why)
                return why
            self.absences.forget([bid])
            with self._state:
                self._hold(bid, table, size)
            return table

    def cached(self, build_id: str) -> LineTable | str | None:
        """What :meth:`table` would answer without reading anything: the table
        held in memory, the reason remembered for a build found without
        debuginfo, or None (the store or the debug file must be read)."""
        with self._state:
            hit = self._tables.get(build_id)
            if hit is not None:
                self._tables.move_to_end(build_id)
                return hit[0]
        return self.absences.why(build_id)

    def source_for(self, wanted: dict[str, Wanted]) -> TableSource:
        """The build-id -> table function :func:`~kreld.symbols.linequery.lines_at`
        takes, for the builds *wanted* describes (:func:`wanted_of`)."""
        return table_source(self.table, wanted)

    def listing(self) -> list[TableInfo]:
        """The tables the store keeps (empty without a store)."""
        return [] if self.kept is None else table_listing(self.kept)

    # -- the two ways to a table ----------------------------------------------------
    def _current(self, want: Wanted) -> tuple[LineTable, int]:
        """The kept table where this builder made it; else a new build (kept
        in its place), or the older kept table where none can be made."""
        from kreld.debuginfo.lines import BUILDER

        stored = self._stored(want.build_id)
        if stored is not None and stored[0].meta.get("builder") == BUILDER:
            return stored
        try:
            return self._build(want)
        except (KreldError, OSError):
            if stored is None:
                raise
            return stored

    def _stored(self, build_id: str) -> tuple[LineTable, int] | None:
        if self.kept is None:
            return None
        got = self.kept.get(build_id)
        if got is None:
            return None
        from kreld.debuginfo.lines import LineTable

        return LineTable.from_bytes(got.data, f"the kept line table of {build_id}"), len(got.data)

    def _build(self, want: Wanted) -> tuple[LineTable, int]:
        from kreld.debuginfo.lines_build import build_line_table

        found = self.finder.find(want)
        table = build_line_table(found.path, want.build_id, self.scratch, self.build_memory)
        source = found.describe()
        self.built[want.build_id] = source
        if self.keep_later:
            self._pending.append((want, table, source))
        else:
            self._keep(want, table, source)
        return table, table.nbytes()

    @property
    def has_pending(self) -> bool:
        """Whether tables built wait for :meth:`keep_pending`."""
        return bool(self._pending)

    def keep_pending(self, pause: Callable[[], None] | None = None) -> None:
        """Keep the tables built since the last call (with ``keep_later``:
        the daemon's builder answers the calls waiting for a table first),
        each completed first (:meth:`~kreld.debuginfo.lines.LineTable.complete`;
        *pause* is called between its turns)."""
        with self._building:
            pending, self._pending = self._pending, []
            for want, table, source in pending:
                self._keep(want, table, source, pause)

    def _keep(
        self, want: Wanted, table: LineTable, source: str, pause: Callable[[], None] | None = None
    ) -> None:
        if self.keep is None:
            return
        try:
            table.complete(pause)  # a kept table is whole; its reading may fail
            self.keep(want.build_id, table.to_bytes(), source, want.describe())
        except (KreldError, OSError) as e:
            self.unkept[want.build_id] = str(e)

    def _hold(self, build_id: str, table: LineTable, size: int) -> None:
        # Within the bound only (none with memory 0: the daemon's builder
        # holds the tables its calls use itself); the table is answered anyway.
        self._tables[build_id] = (table, size)
        self._held += size
        while self._held > self.memory and self._tables:
            _, (_, dropped) = self._tables.popitem(last=False)
            self._held -= dropped


def table_source(
    table: Callable[[Wanted], LineTable | str], wanted: Mapping[str, Wanted]
) -> TableSource:
    """The build-id -> table (or why not) function a Resolve's lines take: *table*
    of the build *wanted* describes, and no build that is not of the boot."""

    def source(build_id: str) -> LineTable | str:
        want = wanted.get(build_id)
        if want is None:
            return f"build {build_id} is not of this boot's kernel or modules"
        return table(want)

    return source


def provider_for(
    cfg: Config,
    given_dirs: Iterable[str] = (),
    kept: LineTableStore | None = None,
    keep: Keeper | None = None,
    *,
    keep_later: bool = False,
) -> LineTableProvider:
    """The provider a configuration describes: *given_dirs*
    (``--debuginfo-dir``) searched first, then ``/usr/lib/debug`` under the
    configured root, ``[kernel] debuginfo_dirs``, the cache and the debuginfod
    servers (:func:`~kreld.debuginfo.finder.finder_for`); a build's DWARF
    reader bounded by ``[kernel] line_build_memory``, a module's scratch copy
    under ``$TMPDIR`` where it is not in memory; *keep_later* as the provider
    takes it."""
    from kreld.debuginfo.finder import finder_for

    finder = finder_for(cfg, cfg.root, tuple(given_dirs))
    return LineTableProvider(
        finder, kept, keep, build_memory=cfg.line_build_memory, keep_later=keep_later
    )


def _reason(build_id: str, e: KreldError | OSError) -> str:
    """An error as the answer's reason: a debuginfo error's own reason
    (it names the build), else its message with the build named."""
    if isinstance(e, DebuginfoError):
        return str(e)
    if isinstance(e, LineTableError):
        return f"debuginfo for build {build_id}: the debug file could not be read: {e}"
    if isinstance(e, OSError):
        why = e.strerror or str(e)
        return f"debuginfo for build {build_id}: the line table could not be built: {why}"
    return f"debuginfo for build {build_id}: {e}"
