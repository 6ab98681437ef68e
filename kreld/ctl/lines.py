"""``kreldctl resolve --lines`` and ``symbolize --lines``: source lines with
their inline chains, computed by kreldctl itself from a build's line table.

The boot's layout at the time asked comes from where its records are (the
store, or with ``--from`` the bucket); each build's table from the local
store if it keeps one, else from its debug file found by build-id
(``--debuginfo-dir`` first, then the configured places and debuginfod), built
here and kept in the store when no daemon holds it for writing.

Each answer gains ``frames`` (innermost first: ``function``, ``file``,
``line``, ``column``, ``inlined``) and, where it has none, ``no_lines``: why
(no debug file of the build, and where it was looked for; an address in no
function of the DWARF; ...).  The function+offset Resolve gave is kept.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, cast

from kreld.core.errors import KreldError
from kreld.core.model import Clock, clock_now
from kreld.ctl.args import parse_time

if TYPE_CHECKING:
    from kreld.config.settings import Config
    from kreld.debuginfo.lines import Frame
    from kreld.store import Store
    from kreld.store.bootsource import BootSource
    from kreld.symbols.linequery import LineAnswer
    from kreld.symbols.linetables import LineTableProvider
    from kreld.symbols.queries import AddressMap

__all__ = ["LineSession", "frame_text", "print_line_tables", "render_lines", "with_lines"]


class LineSession:
    """The store (read), the line-table provider, and the source of boot
    records.  Tables built here are kept when the command is done, after its
    answers are written out (completing a table, the rest of its debug file's
    reading, is work its user does not wait on), under kreld's writer lock,
    which is held only for that write: a daemon starting meanwhile is never
    refused, and one running keeps them itself."""

    def __init__(
        self,
        cfg: Config,
        args: argparse.Namespace,
        backend: Callable[[], object],
        out: TextIO,
        err: TextIO,
    ) -> None:
        """*backend* gives kreldctl's backend: with ``--from`` a bucket's, whose
        records are read; without, a local backend made after this is told to
        read the store opened here."""
        from kreld.symbols.linetables import provider_for

        self.cfg = cfg
        self.args = args
        self.out = out
        self.err = err
        self.stack = contextlib.ExitStack()
        self.store = self._open_store()
        self.pending: list[tuple[str, bytes, str, str]] = []
        self.provider: LineTableProvider = provider_for(
            cfg,
            args.debuginfo_dirs,
            None if self.store is None else self.store.line_tables,
            None if self.store is None else lambda *kept: self.pending.append(kept),
            keep_later=True,
        )
        self.source: BootSource | None = self.store
        if args.source:
            self.source = cast("BootSource", getattr(backend(), "store"))  # noqa: B009
        self._amap: tuple[AddressMap, str] | None = None

    def _open_store(self) -> Store | None:
        from kreld.store import Store

        state = Path(self.cfg.state_dir)
        if not (state / "data.mdb").is_file():
            return None  # no store here: none is made just to keep tables in
        try:
            return self.stack.enter_context(Store(state, readonly=True))
        except KreldError:
            return None

    def close(self) -> None:
        """Write the answers out, complete the tables built, close the store,
        then keep the tables (LMDB allows one open of a store per process, so
        the read-only one goes first)."""
        if self.provider.has_pending:
            with contextlib.suppress(OSError, ValueError):  # a reader gone: keep anyway
                self.out.flush()
            self.provider.keep_pending()
            self.report_unkept()
        self.stack.close()
        if self.pending:
            self._keep()

    def _keep(self) -> None:
        from kreld.store import Store
        from kreld.store.lock import writer_lock

        try:
            with writer_lock(self.cfg.state_dir), Store(self.cfg.state_dir) as store:
                for build_id, data, source, what in self.pending:
                    store.line_tables.put(build_id, data, source, what)
        except KreldError as e:
            builds = ", ".join(b for b, *_ in self.pending)
            print(f"kreldctl: line tables of {builds} not kept: {e}", file=self.err)
        self.pending.clear()

    def records(self) -> BootSource:
        """Where the boots' records are read: the store, or the bucket."""
        from kreld.core.errors import StoreError

        if self.source is None:
            raise StoreError(str(self.cfg.state_dir), "no store to read the boot's records from")
        return self.source

    def address_map(self) -> tuple[AddressMap, str]:
        """The boot's layout at ``--at`` (default: now on the running boot, the
        end of its record on another), and the boot's release."""
        from kreld.kernel.info import Root, read_boot_id
        from kreld.symbols.queries import AddressMap

        src = self.records()
        current = None
        with contextlib.suppress(KreldError):
            current = read_boot_id(Root(Path(self.cfg.root)))
        boot_id = src.resolve_boot(self.args.boot) if self.args.boot else current
        if boot_id is None:
            boot_id = read_boot_id(Root(Path(self.cfg.root)))  # says why it cannot
        boot = src.get_boot(boot_id)
        clock = Clock(self.args.clock)
        t = None if self.args.at is None else parse_time(self.args.at, clock)
        if t is None and boot_id == current:
            t = clock_now(clock)
        return AddressMap(boot, src.incarnations(boot_id), clock, t), boot.release

    def add(self, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Resolve's *results* (``resolutions``), each with its lines."""
        if self._amap is None:
            self._amap = self.address_map()
        addresses = [int(r["address"], 16) for r in results]
        answers = self.answers(*self._amap, addresses)
        return [with_lines(r, a) for r, a in zip(results, answers, strict=True)]

    def render(self, results: list[dict[str, Any]], out: TextIO) -> None:
        for r in results:
            render_lines(r, out)

    def answers(self, amap: AddressMap, release: str, addresses: list[int]) -> list[LineAnswer]:
        from kreld.symbols.linequery import lines_at
        from kreld.symbols.linetables import wanted_of

        got = lines_at(amap, addresses, self.provider.source_for(wanted_of(amap, release)))
        self.report_unkept()
        return got

    def report_unkept(self) -> None:
        """On stderr, each table built that could not be kept, once."""
        for bid, why in self.provider.unkept.items():
            print(f"kreldctl: the line table of build {bid} was not kept: {why}", file=self.err)
        self.provider.unkept.clear()


def with_lines(result: dict[str, Any], answer: LineAnswer) -> dict[str, Any]:
    """*result* (one address's Resolve answer) with its ``frames`` and, where
    there are none, ``no_lines``."""
    result["frames"] = [f.to_json() for f in answer.frames]
    if not answer.frames:
        result["no_lines"] = answer.why_not or "no line known"
    return result


def frame_text(f: Frame) -> str:
    """One frame as text: ``function at file:line[:column]``, `` (inlined)`` when
    it was inlined into the next."""
    where = f.file or "??"
    if f.line:
        where += f":{f.line}"
    if f.column:
        where += f":{f.column}"
    return f"{f.function} at {where}" + (" (inlined)" if f.inlined else "")


def render_lines(result: dict[str, Any], out: TextIO) -> None:
    """An address with lines as text: ``ADDRESS IMAGE SECTION+OFFSET SYMBOL``,
    then its frames, indented, innermost first, or why it has none."""
    from kreld.ctl.render import symbol_of
    from kreld.debuginfo.lines import Frame

    if "image" in result:
        image = (
            result["image"]
            if result.get("seq") is None
            else f"{result['image']} (seq {result['seq']})"
        )
        head = f"{image} {result['section']}+{result['offset']} {symbol_of(result) or '?'}"
    else:
        head = "?"
    print(f"{result['address']} {head}", file=out)
    frames = result.get("frames") or []
    for fr in frames:
        print("    " + frame_text(Frame(**fr)), file=out)
    if not frames:
        print(f"    (no lines: {result.get('no_lines', 'unknown')})", file=out)


def print_line_tables(cfg: Config, as_json: bool, out: TextIO) -> int:
    """``kreldctl line-tables``: the store's tables, read from the store directly."""
    import json

    from kreld.ctl.render import render_table
    from kreld.store import Store
    from kreld.symbols.linetables import table_listing

    with Store(cfg.state_dir, readonly=True) as store:
        listed = table_listing(store.line_tables)
    if as_json:
        json.dump([t.to_json() for t in listed], out, indent=2)
        out.write("\n")
        return 0
    rows = [(t.build_id, str(t.size), t.what or "-", t.source or "-") for t in listed]
    render_table(("BUILD-ID", "BYTES", "BUILD", "DEBUGINFO FROM"), rows, out)
    return 0
