"""``kreldctl``: snapshot, inspect and query what kreld recorded.

A command imports what it uses, when it uses it: the store (lmdb) only when
it reads the store, the client only when it talks to the daemon, the
snapshot's readers only for ``snapshot``.  ``kreldctl --help`` loads none of
them (tests/test_cli.py checks which modules each loads).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, cast

from kreld.config import Config
from kreld.errors import ExitCode, InvalidArgument, KreldError
from kreld.kernel import Root, read_boot_id
from kreld.model import BootSnapshot, Clock, Incarnation, hexaddr, parse_addr
from kreld.options import add_common, resolve_config

if TYPE_CHECKING:
    from kreld.bootsource import BootSource
    from kreld.bucket import BucketBackend
    from kreld.client import Client
    from kreld.perfdata import PerfHeader
    from kreld.service import Service

EPILOG = """\
exit status:
  0  success
  1  an error (the message says which)
  2  usage: a malformed option, address or time
  3  no such boot is recorded (or a boot prefix is ambiguous)
  4  permission denied, or kernel addresses restricted
  5  the store is unusable: missing, corrupt, foreign or from a newer kreld
  6  the configuration is invalid
  7  snapshot without a daemon, or gc: another kreld writes to the store (holds its lock)
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kreldctl",
        description="Inspect kernel and module relocations recorded by kreld.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common(p)
    add_from(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def cmd(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        add_common(sp, suppress=True)
        add_from(sp, suppress=True)
        sp.add_argument("--json", action="store_true", help="print JSON (addresses as 0x strings)")
        return sp

    cmd("snapshot", "scan the running kernel now, record it, print it")
    sp = cmd("show", "show one recorded boot (default: the current one)")
    sp.add_argument("boot", nargs="?", metavar="BOOT", help="boot-id or a unique prefix of one")
    cmd("boots", "list recorded boots, newest first")

    def at_options(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--boot", metavar="BOOT", help="boot-id or prefix (default: current)")
        sp.add_argument(
            "--at",
            metavar="T",
            help="a time on --clock: nanoseconds, seconds with an 's' suffix, "
            "or (realtime) an ISO-8601 date; default: now",
        )
        sp.add_argument(
            "--clock",
            choices=[c.value for c in Clock],
            default=Clock.MONOTONIC.value,
            help="the clock --at is on (default monotonic; perf samples on it only "
            "with perf record -k monotonic, its default clock is local_clock())",
        )

    sp = cmd("modules", "list module incarnations loaded at a time")
    at_options(sp)
    sp.add_argument("--all", action="store_true", help="the boot's whole module history")
    sp = cmd(
        "symbolize", "symbolize addresses read from stdin (one per line, or perf script output)"
    )
    at_options(sp)
    for_option(sp, "name the [unknown] kernel frames of its perf script output on stdin")
    sp = cmd("export", "export a recorded boot's symbols for other tools")
    sp.add_argument("what", choices=["kallsyms"], help="kallsyms: a file as /proc/kallsyms")
    at_options(sp)
    for_option(sp, "the boot and module loads it was recorded on (no --boot needed)")
    sp.add_argument("-o", "--output", metavar="FILE", help="write to FILE (default: stdout)")
    sp = cmd("gc", "remove boots beyond the retention policy and unused symbol tables")
    sp.add_argument("--keep-boots", type=int, metavar="N", help="keep the N newest boots")
    sp.add_argument("--keep-days", type=float, metavar="D", help="keep boots first seen in D days")
    cmd("status", "the daemon's health, or the store's counts when no daemon runs")
    cmd("watch", "print module loads and unloads as kreld records them (needs the daemon)")
    sp = cmd("resolve", "say which image and section holds each address")
    sp.add_argument("addresses", nargs="+", metavar="ADDR", help="hex address (0x optional)")
    at_options(sp)
    return p


def for_option(sp: argparse.ArgumentParser, what: str) -> None:
    sp.add_argument("--for", dest="for_perf", metavar="PERF.DATA", help=f"a perf.data: {what}")


def add_from(p: argparse.ArgumentParser, suppress: bool = False) -> None:
    p.add_argument(
        "--from",
        dest="source",
        metavar="s3://BUCKET/PREFIX",
        default=argparse.SUPPRESS if suppress else None,
        help="read the fleet bucket kreld hosts publish to (read-only; docs/FLEET.md): "
        "boots, show, modules, resolve, symbolize, export",
    )


def parse_time(text: str, clock: Clock) -> int:
    """``--at`` as nanoseconds on *clock*."""
    import datetime as dt

    s = text.strip()
    try:
        if s.endswith("s"):
            return int(float(s[:-1]) * 1e9)
        return int(s)
    except ValueError:
        pass
    if clock is Clock.REALTIME:
        try:
            when = dt.datetime.fromisoformat(s.replace("Z", "+00:00"))
        except ValueError:
            pass
        else:
            if when.tzinfo is None:
                when = when.replace(tzinfo=dt.UTC)
            return int(when.timestamp() * 1e9)
    raise InvalidArgument("--at", f"not a time: {text!r}")


_HEX_TOKEN = re.compile(r"(?<![0-9A-Za-z_])(?:0x)?([0-9a-fA-F]{8,16})(?![0-9A-Za-z_])")


def addresses_in(line: str) -> list[str]:
    """Addresses in a line: the line itself, or hex words of ``perf script`` output."""
    s = line.strip()
    if not s:
        return []
    try:
        return [hexaddr(parse_addr(s)) or ""]
    except ValueError:
        pass
    out = []
    for m in _HEX_TOKEN.finditer(s):
        value = int(m.group(1), 16)
        if value >= 1 << 47:  # kernel half of the address space
            out.append(f"{value:#x}")
    return out


def symbol_of(r: dict[str, Any]) -> str:
    if "symbol" not in r:
        return ""
    return f"{r['symbol']}+{r['symbol_offset']}"


def fmt_realtime(ns: int) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ns / 1e9, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def warn_restricted(snap: BootSnapshot, err: TextIO) -> None:
    if snap.restricted:
        print(
            f"warning: kernel addresses were restricted when boot {snap.boot_id} was recorded: "
            f"{snap.restricted_reason}. No address is shown for them; run kreld with CAP_SYSLOG "
            "(as root) and kernel.kptr_restrict < 2 to record them.",
            file=err,
        )


def render_boot(snap: BootSnapshot, out: TextIO) -> None:
    rows: list[tuple[str, str]] = [
        ("Boot", snap.boot_id),
        ("First seen", fmt_realtime(snap.first_seen.realtime)),
        ("Release", snap.release),
        ("Version", snap.version),
        ("Build-id", snap.build_id or "unknown"),
    ]
    # Labelled with the kernel's symbol names; --json has the wire names (text, ...).
    for name, value in snap.anchors.to_ints().items():
        rows.append((name, hexaddr(value) or ("restricted" if snap.restricted else "unknown")))
    if snap.kaslr is not None:
        rows.append(("KASLR offset", f"{snap.kaslr.value:#x} (from {snap.kaslr.source.value})"))
        rows.append(("  source", snap.kaslr.path))
    else:
        rows.append(("KASLR offset", "unknown (no vmcoreinfo, matching vmlinux or System.map)"))
    if snap.restricted:
        rows.append(("Restricted", snap.restricted_reason or "yes"))
    for fault in snap.faults:
        rows.append(("Fault", fault))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}", file=out)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], out: TextIO) -> None:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(), file=out)
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip(), file=out)


class LocalBackend:
    """Answers from the store itself, with the daemon's own method code."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.root = Root(Path(cfg.root))
        self._service: Service | None = None

    def _current_id(self) -> str:
        return read_boot_id(self.root)

    def _current_id_or_none(self) -> str | None:
        try:
            return self._current_id()
        except KreldError:
            return None

    def service(self) -> Service:
        if self._service is None:
            from kreld.queries import loaded_at
            from kreld.service import Service
            from kreld.store import Store
            from kreld.storelock import damaged_stores

            store = Store(self.cfg.state_dir, readonly=True)

            def current() -> BootSnapshot:
                return store.get_boot(self._current_id())

            def loaded() -> list[Incarnation]:
                return loaded_at(store.incarnations(self._current_id()), Clock.MONOTONIC, None)

            def status() -> dict[str, Any]:
                counts = store.counts()
                return {
                    "daemon": False,
                    "boot_id": self._current_id(),
                    "loaded_modules": len(loaded()),
                    "store_bytes": store.size_bytes(),
                    **counts,
                    "damaged_stores": damaged_stores(self.cfg.state_dir),
                    "damaged_databases": sorted(store.lost),
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
            from kreld.kallsyms import KallsymsText  # only when scanning
            from kreld.snapshot import take_snapshot
            from kreld.store import Store
            from kreld.symbols import SymbolCapture

            try:  # one read, for the snapshot and the kernel's table
                ks: KallsymsText | None = KallsymsText.read(self.root)
            except KreldError:
                ks = None  # the snapshot reads it again and says why
            snap, _notes = take_snapshot(
                self.root, self.cfg.debuginfo_dirs, ks.data if ks else None
            )
            from kreld.storelock import writer_lock

            # No daemon answered: write as one, under its lock (StoreLocked if one runs).
            with writer_lock(self.cfg.state_dir), Store(self.cfg.state_dir) as store:
                stored, added, changed = store.record_boot(snap)
                if ks and not stored.restricted and store.boot_symbols(stored.boot_id) is None:
                    SymbolCapture(store, self.root, stored, None).capture_kernel(ks)
            return {"boot": stored.to_json(), "new": added, "updated": changed}
        from kreld.varlink import VarlinkError

        try:
            return self.service().handle(method, params)
        except VarlinkError as e:
            from kreld.client import error_from_reply

            raise error_from_reply(e.name, e.parameters) from e

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

    def backend(self) -> Client | LocalBackend | BucketBackend:
        """The daemon if one answers, else the store read directly.

        A ``--state-dir`` given without ``--socket`` names a store: it is read
        directly, whatever daemon runs on the default socket.
        """
        if self._backend is None and self.args.source:
            from kreld.bucket import BucketBackend  # obstore: only for a bucket

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
        return self._backend

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
            self.emit_json(
                [
                    b.to_json() | {"host": r["host"]} if "host" in r else b.to_json()
                    for b, r in zip(boots, recs, strict=True)
                ]
            )
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
        clock = Clock(params["clock"])
        rows = []
        for i in map(Incarnation.from_json, mods):
            st = i.state
            rows.append(
                (
                    st.name,
                    str(i.seq),
                    hexaddr(st.sections.get(".text")) or ("restricted" if st.restricted else "-"),
                    str(len(st.sections)),
                    (st.build_id or "-")[:16],
                    f"{i.loaded.on(clock)}",
                    "-" if i.unloaded is None else f"{i.unloaded.on(clock)}",
                    i.seen_by.value,
                )
            )
        render_table(
            (
                "MODULE",
                "SEQ",
                ".TEXT",
                "SECTIONS",
                "BUILD-ID",
                f"LOADED({clock.value})",
                f"UNLOADED({clock.value})",
                "SEEN-BY",
            ),
            rows,
            self.out,
        )
        return 0

    def resolve(self) -> int:
        try:
            addrs = [hex(parse_addr(a)) for a in self.args.addresses]
        except ValueError as e:
            raise InvalidArgument("ADDR", str(e)) from e
        from kreld.client import resolutions

        results = resolutions(addrs, self.call("Resolve", addresses=addrs, **self._at()))
        if self.args.json:
            self.emit_json(results)
        else:
            rows = []
            for r in results:
                if "image" not in r:
                    rows.append((r["address"], "?", "", "", "", ""))
                    continue
                image = r["image"] if r.get("seq") is None else f"{r['image']} (seq {r['seq']})"
                rows.append(
                    (r["address"], image, r["section"], r["base"], "+" + r["offset"], symbol_of(r))
                )
            render_table(
                ("ADDRESS", "IMAGE", "SECTION", "BASE", "OFFSET", "SYMBOL"), rows, self.out
            )
        return 0 if all("image" in r for r in results) else 1

    def symbolize(self) -> int:
        if self.args.for_perf:
            header = self.perf_header()  # a bad file is told first
            from kreld import perfctl

            return perfctl.symbolize_for(self.perf_store(), header, sys.stdin, self.out, self.err)
        addrs: list[str] = []
        for line in sys.stdin:
            addrs.extend(addresses_in(line))
        at = self._at()
        results: list[dict[str, Any]] = []
        from kreld.client import resolutions
        from kreld.service import MAX_RESOLVE_ADDRESSES

        step = MAX_RESOLVE_ADDRESSES
        for i in range(0, len(addrs), step):
            batch = addrs[i : i + step]
            results += resolutions(batch, self.call("Resolve", addresses=batch, **at))
        if self.args.json:
            self.emit_json(results)
            return 0
        for r in results:
            where = "" if r.get("image", "kernel") == "kernel" else f" [{r['image']}]"
            print(f"{r['address']} {symbol_of(r) or '?'}{where}", file=self.out)
        return 0

    def perf_header(self) -> PerfHeader:
        if self.args.boot is not None or self.args.at is not None:
            raise InvalidArgument(
                "--for", "the recording names its boot and times: no --boot, --at"
            )
        from kreld.perfdata import read_perf_header

        return read_perf_header(self.args.for_perf)

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
            from kreld import perfctl

            res = {"kallsyms": perfctl.export_for(self.perf_store(), header, self.err)}
        else:
            res = self.call("ExportKallsyms", **self._at())
        text = res["kallsyms"]
        if self.args.json:
            text = json.dumps(res) + "\n"
        if self.args.output:
            tmp = Path(self.args.output + ".tmp")
            tmp.write_text(text)
            tmp.replace(self.args.output)
        else:
            self.out.write(text)
        return 0

    def gc(self) -> int:
        if self.args.source:
            raise InvalidArgument("--from", "gc works on a local store; the bucket is read-only")
        keep_boots = self.cfg.keep_boots if self.args.keep_boots is None else self.args.keep_boots
        keep_days = self.cfg.keep_days if self.args.keep_days is None else self.args.keep_days
        if keep_boots < 0 or keep_days < 0:
            raise InvalidArgument("--keep-boots/--keep-days", "must not be negative")
        try:
            current: str | None = read_boot_id(Root(Path(self.cfg.root)))
        except KreldError:
            current = None
        from kreld.store import Store
        from kreld.storelock import writer_lock

        with writer_lock(self.cfg.state_dir), Store(self.cfg.state_dir) as store:
            before = store.size_bytes()
            removed = store.gc(keep_boots, keep_days, current, time.time_ns())
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
        width = max(len(k) for k in st)
        for k, v in st.items():
            if v is None:  # restricted_reason when not restricted
                continue
            if k == "publish":
                state = "ok" if v["healthy"] else f"FAILED: {v['last_error']}"
                last = (
                    "never" if v["last_success_ns"] is None else fmt_realtime(v["last_success_ns"])
                )
                print(
                    f"{'publish':<{width}}  {v['url']}: {state}, last success {last}, "
                    f"backlog {v['backlog']}, {v['objects']} objects ({v['bytes']} bytes) uploaded",
                    file=self.out,
                )
            elif k == "sources":
                for src in v:
                    state = "ok" if src["healthy"] else f"FAILED: {src['last_error']}"
                    print(
                        f"{'source':<{width}}  {src['name']}: {state}, {src['events']} events",
                        file=self.out,
                    )
            elif isinstance(v, list):  # damaged_stores: one line each, none when empty
                for item in v:
                    print(f"{k:<{width}}  {item}", file=self.out)
            else:
                print(f"{k:<{width}}  {v}", file=self.out)
        return 0

    def watch(self) -> int:
        backend = self.backend()
        if not isinstance(backend, LocalBackend) and not self.args.source:
            cast("Client", backend).sock.settimeout(None)  # events may be hours apart
        for msg in backend.stream("Subscribe"):
            if self.args.json:
                self.out.write(json.dumps(msg) + "\n")
            elif msg.get("event") == "snapshot":
                print(f"{len(msg.get('modules') or [])} modules loaded; watching", file=self.out)
            else:
                m = msg.get("module") or {}
                text = (m.get("sections") or {}).get(".text", "-")
                print(
                    f"{msg.get('event'):<7} {m.get('name')} seq {m.get('seq')} .text {text}",
                    file=self.out,
                )
            self.out.flush()
        return 0


def leave(rc: int) -> int:
    """*rc*, or an exit at once where obstore was used (see :func:`kreld.s3.leave`)."""
    if "kreld.s3" not in sys.modules:
        return rc
    from kreld.s3 import leave as leave_s3

    return leave_s3(rc)


def main(argv: list[str] | None = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = resolve_config(args)
        ctl = Ctl(cfg, args, out, err)
        return leave(int(getattr(ctl, args.command)()))
    except KreldError as e:
        if args.debug:
            raise
        print(f"kreldctl: {e}", file=err)
        return leave(int(e.exit_code))
    except BrokenPipeError:
        return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
