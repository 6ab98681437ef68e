"""``kreldctl``: snapshot, inspect and query what kreld recorded."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from kreld.config import Config
from kreld.errors import ExitCode, InvalidArgument, KreldError
from kreld.kernel import Root, read_boot_id
from kreld.model import BootSnapshot, Clock, Incarnation, clock_now, hexaddr, parse_addr
from kreld.options import add_common, resolve_config
from kreld.queries import AddressMap, loaded_at
from kreld.snapshot import take_snapshot
from kreld.store import Store

EPILOG = """\
exit status:
  0  success
  1  an error (the message says which)
  2  usage: a malformed option, address or time
  3  no such boot is recorded (or a boot prefix is ambiguous)
  4  permission denied, or kernel addresses restricted
  5  the store is unusable: missing, corrupt, foreign or from a newer kreld
  6  the configuration is invalid
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kreldctl",
        description="Inspect kernel and module relocations recorded by kreld.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def cmd(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        add_common(sp, suppress=True)
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
            help="the clock --at is on (default monotonic, as perf uses)",
        )

    sp = cmd("modules", "list module incarnations loaded at a time")
    at_options(sp)
    sp.add_argument("--all", action="store_true", help="the boot's whole module history")
    sp = cmd("resolve", "say which image and section holds each address")
    sp.add_argument("addresses", nargs="+", metavar="ADDR", help="hex address (0x optional)")
    at_options(sp)
    return p


def parse_time(text: str, clock: Clock) -> int:
    """``--at`` as nanoseconds on *clock*."""
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


def fmt_realtime(ns: int) -> str:
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
    for name, value in snap.anchors.to_json().items():
        rows.append((name, value or ("restricted" if snap.restricted else "unknown")))
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


class Ctl:
    def __init__(self, cfg: Config, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
        self.cfg = cfg
        self.args = args
        self.out = out
        self.err = err
        self.root = Root(Path(cfg.root))

    def emit_json(self, obj: Any) -> None:
        json.dump(obj, self.out, indent=2)
        self.out.write("\n")

    def ro_store(self) -> Store:
        return Store(self.cfg.state_dir, readonly=True)

    def boot_id(self, store: Store, given: str | None) -> str:
        if given:
            return store.resolve_boot(given)
        return read_boot_id(self.root)

    # -- commands ----------------------------------------------------------------

    def snapshot(self) -> int:
        snap, _notes = take_snapshot(self.root, self.cfg.debuginfo_dirs)
        with Store(self.cfg.state_dir) as store:
            stored, added, changed = store.record_boot(snap)
        warn_restricted(stored, self.err)
        if self.args.json:
            self.emit_json({"boot": stored.to_json(), "new": added, "updated": changed})
        else:
            state = "recorded" if added else ("updated" if changed else "already recorded")
            print(f"Boot {stored.boot_id} {state}.", file=self.out)
            render_boot(stored, self.out)
        return 0

    def show(self) -> int:
        with self.ro_store() as store:
            snap = store.get_boot(self.boot_id(store, self.args.boot))
        warn_restricted(snap, self.err)
        if self.args.json:
            self.emit_json(snap.to_json())
        else:
            render_boot(snap, self.out)
        return 0

    def boots(self) -> int:
        with self.ro_store() as store:
            boots = store.list_boots()
        if self.args.json:
            self.emit_json([b.to_json() for b in boots])
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

    def _at(self) -> tuple[Clock, int | None]:
        clock = Clock(self.args.clock)
        return clock, None if self.args.at is None else parse_time(self.args.at, clock)

    def _boot_incs(self) -> tuple[BootSnapshot, list[Incarnation]]:
        with self.ro_store() as store:
            boot = store.get_boot(self.boot_id(store, self.args.boot))
            return boot, store.incarnations(boot.boot_id)

    def modules(self) -> int:
        clock, t = self._at()
        _boot, incs = self._boot_incs()
        chosen = incs if self.args.all else loaded_at(incs, clock, t)
        if self.args.json:
            self.emit_json([i.to_json() for i in chosen])
            return 0
        rows = []
        for i in chosen:
            s = i.state
            rows.append(
                (
                    s.name,
                    str(i.seq),
                    hexaddr(s.sections.get(".text")) or ("restricted" if s.restricted else "-"),
                    str(len(s.sections)),
                    (s.build_id or "-")[:16],
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
            addrs = [parse_addr(a) for a in self.args.addresses]
        except ValueError as e:
            raise InvalidArgument("ADDR", str(e)) from e
        clock, t = self._at()
        boot, incs = self._boot_incs()
        if t is None and boot.boot_id == self._current_boot():
            t = clock_now(clock)
        amap = AddressMap(boot, incs, clock, t)
        results = [amap.resolve(a) for a in addrs]
        if self.args.json:
            self.emit_json([r.to_json() for r in results])
            return 0
        rows = []
        for r in results:
            if r.region is None:
                rows.append((hexaddr(r.address) or "", "?", "", "", ""))
                continue
            g = r.region
            image = g.image if g.inc is None else f"{g.image} (seq {g.inc.seq})"
            rows.append(
                (
                    hexaddr(r.address) or "",
                    image,
                    g.section,
                    hexaddr(g.base) or "",
                    f"+{r.address - g.base:#x}",
                )
            )
        render_table(("ADDRESS", "IMAGE", "SECTION", "BASE", "OFFSET"), rows, self.out)
        return 0 if all(r.region for r in results) else 1

    def _current_boot(self) -> str | None:
        try:
            return read_boot_id(self.root)
        except KreldError:
            return None


def main(argv: list[str] | None = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = resolve_config(args)
        ctl = Ctl(cfg, args, out, err)
        return int(getattr(ctl, args.command)())
    except KreldError as e:
        if args.debug:
            raise
        print(f"kreldctl: {e}", file=err)
        return int(e.exit_code)
    except BrokenPipeError:
        return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
