"""``kreldctl``: snapshot, inspect and query what kreld recorded.

A command imports what it uses, when it uses it: the store (lmdb) only when
it reads the store, the client only when it talks to the daemon, the
snapshot's readers only for ``snapshot``.  ``kreldctl --help`` loads none of
them (tests/ctl/test_cli.py checks which modules each loads).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, cast

from kreld.config.options import leave, resolve_config
from kreld.config.settings import Config
from kreld.core.errors import ExitCode, InvalidArgument, KreldError
from kreld.core.model import BootSnapshot, Clock, Incarnation, parse_addr
from kreld.ctl.args import FROM_COMMANDS, build_parser, parse_time
from kreld.ctl.lines import print_line_tables
from kreld.ctl.render import (
    event_line,
    fmt_realtime,
    render_boot,
    render_code,
    render_modules,
    render_resolved,
    render_status,
    render_table,
    warn_restricted,
)
from kreld.kernel.info import Root, read_boot_id

if TYPE_CHECKING:
    from kreld.client import Client
    from kreld.ctl.lines import LineSession
    from kreld.fleet.bucket import BucketBackend
    from kreld.perf.reader import PerfHeader
    from kreld.server.service import Service
    from kreld.store import Store
    from kreld.store.bootsource import BootSource


__all__ = ["Ctl", "LocalBackend", "main"]


class LocalBackend:
    """Answers from the store itself, with the daemon's own method code."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.root = Root(Path(cfg.root))
        self._service: Service | None = None
        # A store this process has open already (LMDB allows one open per
        # process): ``--lines`` opens it first, to keep line tables in it.
        self.shared_store: Store | None = None

    def _current_id(self) -> str:
        return read_boot_id(self.root)

    def _current_id_or_none(self) -> str | None:
        try:
            return self._current_id()
        except KreldError:
            return None

    def service(self) -> Service:
        if self._service is None:
            from kreld.server.service import Service
            from kreld.store import Store
            from kreld.store.lock import damaged_stores

            store = self.shared_store or Store(self.cfg.state_dir, readonly=True)

            def current() -> BootSnapshot:
                return store.get_boot(self._current_id())

            def loaded() -> list[Incarnation]:
                from kreld.symbols.queries import loaded_at  # not for show, boots

                return loaded_at(store.incarnations(self._current_id()), Clock.MONOTONIC, None)

            def status() -> dict[str, Any]:
                counts = store.boots.counts()
                return {
                    "daemon": False,
                    "boot_id": self._current_id(),
                    "loaded_modules": len(loaded()),
                    "store_bytes": store.env.size_bytes(),
                    **counts,
                    "damaged_stores": damaged_stores(self.cfg.state_dir),
                    "damaged_databases": sorted(store.env.lost),
                }

            self._service = Service(
                store,
                current_boot=current,
                current_id=self._current_id_or_none,
                loaded=loaded,
                status=status,
            )
        return self._service

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        if method == "Snapshot":
            from kreld.kernel.kallsyms import KallsymsText  # only when scanning
            from kreld.kernel.snapshot import take_snapshot
            from kreld.store import Store
            from kreld.symbols.table_sources import TableSources

            try:  # one read, for the snapshot and the kernel's table
                ks: KallsymsText | None = KallsymsText.read(self.root)
            except KreldError:
                ks = None  # the snapshot reads it again and says why
            snap, _notes = take_snapshot(
                self.root, self.cfg.debuginfo_dirs, ks.data if ks else None
            )
            from kreld.store.lock import writer_lock

            # No daemon answered: write as one, under its lock (StoreLocked if one runs).
            with writer_lock(self.cfg.state_dir), Store(self.cfg.state_dir) as store:
                stored, added, changed = store.boots.record_boot(snap)
                if ks and not stored.restricted and store.boot_symbols(stored.boot_id) is None:
                    TableSources(store, self.root, stored, None).capture_kernel(ks)
            return {"boot": stored.to_json(), "new": added, "updated": changed}
        from kreld.server import methods

        return methods.call(self.service(), method, params)

    def stream(self, method: str, **params: Any) -> Iterator[dict[str, Any]]:
        from kreld.client import ConnectError

        raise ConnectError(f"{self.cfg.socket}: {method} needs a running kreld")


class Ctl:
    def __init__(self, cfg: Config, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
        self.cfg = cfg
        self.args = args
        self.out = out
        self.err = err
        self._backend: Client | LocalBackend | BucketBackend | None = None
        self._lines: LineSession | None = None
        self.closing = contextlib.ExitStack()  # what a command opened, closed after it

    def backend(self) -> Client | LocalBackend | BucketBackend:
        """The daemon if one answers, else the store read directly.

        A ``--state-dir`` given without ``--socket`` names a store: it is read
        directly, whatever daemon runs on the default socket.
        """
        if self._backend is None and self.args.source:
            from kreld.fleet.bucket import BucketBackend  # obstore: only for a bucket

            self._backend = BucketBackend(self.args.source)
        if self._backend is None:
            if self.args.state_dir is not None and self.args.socket is None:
                self._backend = LocalBackend(self.cfg)
            else:
                from kreld.client import Client, ConnectError

                try:
                    self._backend = Client(self.cfg.socket, timeout=60)
                except ConnectError:
                    print(
                        f"kreldctl: no kreld answers on {self.cfg.socket}; "
                        f"reading the store in {self.cfg.state_dir} directly",
                        file=self.err,
                    )
                    self._backend = LocalBackend(self.cfg)
            if isinstance(self._backend, LocalBackend) and self._lines is not None:
                self._backend.shared_store = self._lines.store
        return self._backend

    def lines(self) -> LineSession:
        """``--lines``: opened before any backend reads the store (one open per process)."""
        if self._lines is None:
            from kreld.ctl.lines import LineSession

            self._lines = LineSession(self.cfg, self.args, self.backend, self.out, self.err)
            self.closing.callback(self._lines.close)
        return self._lines

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        return self.backend().call(method, **{k: v for k, v in params.items() if v is not None})

    def emit_json(self, obj: Any) -> None:
        json.dump(obj, self.out, indent=2)
        self.out.write("\n")

    # -- commands ----------------------------------------------------------------

    def snapshot(self) -> int:
        res = self.call("Snapshot")
        stored = BootSnapshot.from_json(res["boot"])
        warn_restricted(stored, self.err)
        if self.args.json:
            self.emit_json(res)
        else:
            added, changed = res["new"], res["updated"]
            state = "recorded" if added else ("updated" if changed else "already recorded")
            print(f"Boot {stored.boot_id} {state}.", file=self.out)
            render_boot(stored, self.out)
        return 0

    def show(self) -> int:
        rec = self.call("GetBoot", boot_id=self.args.boot)["boot"]
        snap = BootSnapshot.from_json(rec)
        warn_restricted(snap, self.err)
        host = rec.get("host")
        if self.args.json:
            self.emit_json(snap.to_json() | ({"host": host} if host else {}))
        else:
            if host:
                print(f"Host          {host['hostname']} ({host['machine_id']})", file=self.out)
            render_boot(snap, self.out)
        return 0

    def boots(self) -> int:
        backend = self.backend()
        if not self.args.json and self.args.source:
            return self.fleet_boots(cast("BucketBackend", backend))
        recs = self.call("ListBoots")["boots"]
        boots = [BootSnapshot.from_json(b) for b in recs]
        if self.args.json:
            listed: list[dict[str, Any]] = [
                b.to_json() | {"host": r["host"]} if "host" in r else b.to_json()
                for b, r in zip(boots, recs, strict=True)
            ]
            self.emit_json(listed + self.skipped_json())
            return 0
        rows = [
            (
                b.boot_id,
                fmt_realtime(b.first_seen.realtime),
                b.release,
                b.build_id or "-",
                f"{b.kaslr.value:#x}" if b.kaslr else ("restricted" if b.restricted else "-"),
            )
            for b in boots
        ]
        render_table(("BOOT-ID", "FIRST-SEEN", "RELEASE", "BUILD-ID", "OFFSET"), rows, self.out)
        return 0

    def skipped_json(self) -> list[dict[str, Any]]:
        """The bucket objects a --from listing left out, as items of its --json list."""
        store = getattr(self._backend, "store", None)
        skipped = getattr(store, "skipped", {})
        return [{"skipped": {"object": k, "reason": e.reason}} for k, e in skipped.items()]

    def report_skipped(self) -> None:
        """On stderr, each bucket object a --from command did not believe."""
        for item in self.skipped_json():
            sk = item["skipped"]
            print(f"kreldctl: skipped {sk['object']}: {sk['reason']}", file=self.err)

    def fleet_boots(self, backend: BucketBackend) -> int:
        """The fleet's boots from the bucket's listing alone (no object read)."""
        rows = [
            (
                e.boot_id,
                e.host.hostname,
                fmt_realtime(e.first_seen or 0),
                e.release,
                e.build_id or "-",
                e.offset or ("restricted" if e.restricted else "-"),
            )
            for e in backend.rows()
        ]
        headers = ("BOOT-ID", "HOST", "FIRST-SEEN", "RELEASE", "BUILD-ID", "OFFSET")
        render_table(headers, rows, self.out)
        return 0

    def _at(self) -> dict[str, Any]:
        clock = Clock(self.args.clock)
        at = None if self.args.at is None else parse_time(self.args.at, clock)
        return {"boot_id": self.args.boot, "at": at, "clock": clock.value}

    def modules(self) -> int:
        params = self._at()
        mods = self.call("GetModules", all=self.args.all or None, **params)["modules"]
        if self.args.json:
            self.emit_json(mods)
            return 0
        render_modules(mods, Clock(params["clock"]), self.out)
        return 0

    def kernel_code(self) -> int:
        params = self._at()
        reply = self.call("GetKernelCode", all=self.args.all or None, **params)
        if self.args.json:
            self.emit_json(reply)
            return 0
        render_code(reply, Clock(params["clock"]), self.out)
        return 0

    def resolve(self) -> int:
        try:
            addrs = [hex(parse_addr(a)) for a in self.args.addresses]
        except ValueError as e:
            raise InvalidArgument("ADDR", str(e)) from e
        from kreld.client import resolutions

        lines = self.lines() if self.args.lines else None
        results = resolutions(addrs, self.call("Resolve", addresses=addrs, **self._at()))
        if lines is not None:
            results = lines.add(results)
        if self.args.json:
            self.emit_json(results)
        else:
            (render_resolved if lines is None else lines.render)(results, self.out)
        return 0 if all("image" in r for r in results) else 1

    def symbolize(self) -> int:
        from kreld.core.textin import stdin_lines, transparent

        lines = stdin_lines()
        if self.args.for_perf:
            header = self.perf_header(stdin_taken=True)  # a bad file is told first
            from kreld.ctl.perflines import lines_hook
            from kreld.perf.commands import symbolize_for

            session = self.lines() if self.args.lines else None  # its store serves the records
            store = self.perf_store() if session is None else session.records()
            hook = lines_hook(session, self.args.json)
            return symbolize_for(store, header, lines, transparent(self.out), self.err, hook)
        from kreld.client import resolutions
        from kreld.ctl.stream import symbolize_stream

        session = self.lines() if self.args.lines else None
        at = self._at()

        def resolve(batch: list[str]) -> list[dict[str, Any]]:
            return resolutions(batch, self.call("Resolve", addresses=batch, **at))

        return symbolize_stream(resolve, lines, session, self.args.json, self.out)

    def perf_header(self, stdin_taken: bool = False) -> PerfHeader:
        if self.args.boot is not None or self.args.at is not None:
            raise InvalidArgument(
                "--for", "the recording names its boot and times: no --boot, --at"
            )
        from kreld.perf.reader import read_perf_header

        return read_perf_header(self.args.for_perf, stdin_taken=stdin_taken)

    def perf_store(self) -> BootSource:
        """--for reads the store (or with --from, the bucket) directly: it needs the
        symbol tables."""
        if self.args.source:
            return cast("BucketBackend", self.backend()).store
        from kreld.store import Store

        return Store(self.cfg.state_dir, readonly=True)

    def export(self) -> int:
        if self.args.for_perf:
            header = self.perf_header()  # a bad file is told first
            from kreld.perf import commands as perfctl

            res = {"kallsyms": perfctl.export_for(self.perf_store(), header, self.err)}
        else:
            res = self.call("ExportKallsyms", **self._at())
        text = res["kallsyms"]
        if self.args.json:
            text = json.dumps(res) + "\n"
        if self.args.output:
            from kreld.core.safeout import write_output

            write_output(self.args.output, text.encode())
        else:
            self.out.write(text)
        return 0

    def inject(self) -> int:
        from kreld.perf.inject import code_ksyms, inject

        store = self.perf_store()
        code = code_ksyms(store, self.err)
        res = inject(store, self.args.input, self.args.output, self.err, code)
        if self.args.json:  # stdout carries the perf.data with -o -: the summary goes to stderr
            summary = self.err if self.args.output == "-" else self.out
            json.dump(res, summary, indent=2)
            summary.write("\n")
        return 0

    def gc(self) -> int:
        keep_boots = self.cfg.keep_boots if self.args.keep_boots is None else self.args.keep_boots
        keep_days = self.cfg.keep_days if self.args.keep_days is None else self.args.keep_days
        if keep_boots < 0 or keep_days < 0:
            raise InvalidArgument("--keep-boots/--keep-days", "must not be negative")
        try:
            current: str | None = read_boot_id(Root(Path(self.cfg.root)))
        except KreldError:
            current = None
        from kreld.store import Store
        from kreld.store.lock import writer_lock

        with writer_lock(self.cfg.state_dir), Store(self.cfg.state_dir) as store:
            before = store.env.size_bytes()
            removed = store.retention.gc(keep_boots, keep_days, current, time.time_ns())
        removed["store_bytes"] = before
        if self.args.json:
            self.emit_json(removed)
        else:
            print(
                f"removed {removed['boots']} boots, {removed['incarnations']} module "
                f"incarnations and {removed['tables']} symbol tables",
                file=self.out,
            )
        return 0

    def status(self) -> int:
        st = self.call("Status")
        st.setdefault("daemon", not isinstance(self.backend(), LocalBackend))
        if self.args.json:
            self.emit_json(st)
            return 0
        render_status(st, self.out)
        return 0

    def line_tables(self) -> int:
        return print_line_tables(self.cfg, self.args.json, self.out)

    def watch(self) -> int:
        backend = self.backend()
        if not isinstance(backend, LocalBackend):
            cast("Client", backend).sock.settimeout(None)  # events may be hours apart
        for msg in backend.stream("Subscribe"):
            if self.args.json:
                self.out.write(json.dumps(msg) + "\n")
            else:
                print(event_line(msg), file=self.out)
            self.out.flush()
        return 0


def main(argv: list[str] | None = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.source and args.command not in FROM_COMMANDS:
        parser.error(
            f"--from: {args.command} does not read a bucket (only {', '.join(FROM_COMMANDS)})"
        )
    try:
        cfg = resolve_config(args)
        ctl = Ctl(cfg, args, out, err)
        with ctl.closing:
            rc = int(getattr(ctl, args.command.replace("-", "_"))())
        ctl.report_skipped()
        return leave(rc)
    except KreldError as e:
        if args.debug:
            raise
        print(f"kreldctl: {e}", file=err)
        return leave(int(e.exit_code))
    except BrokenPipeError:
        return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
