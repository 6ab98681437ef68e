"""How ``kreldctl`` prints what it is told: boots, tables, modules and health."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TextIO

from kreld.core.kernel_code import KernelCode, LossWindow
from kreld.core.model import AddressSource, BootSnapshot, Clock, Incarnation, hexaddr

__all__ = [
    "event_line",
    "fmt_realtime",
    "render_boot",
    "render_code",
    "render_modules",
    "render_resolved",
    "render_status",
    "render_table",
    "status_line",
    "symbol_of",
    "warn_restricted",
]


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


_SOURCES = {
    AddressSource.KALLSYMS: "from /proc/kallsyms",
    AddressSource.VMLINUX: "from a matching vmlinux, moved by the KASLR offset",
    AddressSource.KCORE: "from kernel memory (/proc/kcore: System.map moved by VMCOREINFO)",
    AddressSource.KCORE_KALLSYMS: "from kernel memory (/proc/kcore: the kernel's kallsyms tables)",
}


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
    if snap.address_source is not None:
        rows.append(("Addresses", _SOURCES.get(snap.address_source, snap.address_source.value)))
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


def render_modules(mods: list[dict[str, Any]], clock: Clock, out: TextIO) -> None:
    """GetModules' incarnations, one row each, times on *clock*."""
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
        out,
    )


def render_code(reply: dict[str, Any], clock: Clock, out: TextIO) -> None:
    """GetKernelCode's records, one row each, then its loss windows."""
    rows = []
    for c in map(KernelCode.from_json, reply["code"]):
        rows.append(
            (
                c.name,
                c.kind.value,
                str(c.seq),
                f"{c.addr:#x}",
                "-" if c.length is None else str(c.length),
                "-" if c.prog_id is None else str(c.prog_id),
                f"{c.loaded.on(clock)}",
                "-" if c.unloaded is None else f"{c.unloaded.on(clock)}",
                c.seen_by.value,
            )
        )
    heads = ("NAME", "KIND", "SEQ", "ADDRESS", "LENGTH", "PROG-ID", f"LOADED({clock.value})")
    render_table((*heads, f"UNLOADED({clock.value})", "SEEN-BY"), rows, out)
    for w in map(LossWindow.from_json, reply["losses"]):
        lost = f", {w.lost} records lost" if w.lost else ""
        print(
            f"loss window {w.start.on(clock)}..{w.end.on(clock)}: {w.reason.value}{lost}", file=out
        )


def event_line(msg: dict[str, Any]) -> str:
    """A Subscribe reply as ``kreldctl watch`` prints it."""
    if msg.get("event") == "snapshot":
        code = msg.get("kernel_code")
        live = "" if code is None else f", {len(code)} kernel code records live"
        return f"{len(msg.get('modules') or [])} modules loaded{live}; watching"
    if (c := msg.get("code")) is not None:  # a BPF program, trampoline, ...
        return f"{msg['event']:<11} {c['name']} seq {c['seq']} at {c['address']}"
    m = msg.get("module") or {}
    text = (m.get("sections") or {}).get(".text", "-")
    return f"{msg.get('event'):<7} {m.get('name')} seq {m.get('seq')} .text {text}"


def render_resolved(results: list[dict[str, Any]], out: TextIO) -> None:
    """Resolve's answers, one row per address asked."""
    rows = []
    for r in results:
        if "image" not in r:
            rows.append((r["address"], "?", "", "", "", ""))
            continue
        image = r["image"] if r.get("seq") is None else f"{r['image']} (seq {r['seq']})"
        if r.get("uncertain"):
            image += " (uncertain)"
        rows.append((r["address"], image, r["section"], r["base"], "+" + r["offset"], symbol_of(r)))
    render_table(("ADDRESS", "IMAGE", "SECTION", "BASE", "OFFSET", "SYMBOL"), rows, out)


def _render_line_tables(v: dict[str, Any], width: int, out: TextIO) -> None:
    """Status's line_tables: each kept table, the build under way, the builds
    without debuginfo."""
    k = "line_table"
    for t in v["kept"]:
        print(f"{k:<{width}}  {t['build_id']} {t['what']}: {t['size']} bytes, from {t['source']}",
              file=out)  # fmt: skip
    if v["building"] is not None:
        print(f"{k:<{width}}  building {v['building']}, {v['queued']} more queued", file=out)
    for build_id, why in v["missing"].items():
        print(f"{k:<{width}}  {build_id}: none: {why}", file=out)


def render_status(st: dict[str, Any], out: TextIO) -> None:
    """Status, a line per member; each source and the publisher said in words."""
    width = max(len(k) for k in st)
    for k, v in st.items():
        if v is None:  # restricted_reason when not restricted
            continue
        if k == "publish":
            state = "ok" if v["healthy"] else f"FAILED: {v['last_error']}"
            last = "never" if v["last_success_ns"] is None else fmt_realtime(v["last_success_ns"])
            print(
                f"{'publish':<{width}}  {v['url']}: {state}, last success {last}, "
                f"backlog {v['backlog']}, {v['objects']} objects ({v['bytes']} bytes) uploaded",
                file=out,
            )
        elif k == "kernel_code":
            why = f": {v['reason']}" if v["reason"] else ""
            print(
                f"{k:<{width}}  {v['state']}{why}; {v['cpus']} CPUs, {v['live']} live, "
                f"{v['records']} records, {v['lost']} lost in {v['loss_windows']} windows",
                file=out,
            )
        elif k == "line_tables":
            _render_line_tables(v, width, out)
        elif k == "degraded":
            for f in v:
                print(
                    f"{k:<{width}}  {f['kind']} {f['name']} ended at "
                    f"{fmt_realtime(f['when_ns'])}: {f['reason']}",
                    file=out,
                )
        elif k == "sources":
            for src in v:
                state = "ok" if src["healthy"] else f"FAILED: {src['last_error']}"
                print(
                    f"{'source':<{width}}  {src['name']}: {state}, {src['events']} events",
                    file=out,
                )
        elif k == "module_followers":
            for f in v:
                state = "following" if f["following"] else f"off: {f['reason']}"
                every = f", every {f['interval_s']:g} s" if f.get("interval_s") else ""
                print(f"{'modules by':<{width}}  {f['name']}: {state}{every}", file=out)
        elif isinstance(v, list):  # damaged_stores: one line each, none when empty
            for item in v:
                print(f"{k:<{width}}  {item}", file=out)
        else:
            print(f"{k:<{width}}  {v}", file=out)


def status_line(st: dict[str, Any]) -> str:
    """The line systemctl status shows, from a Status answer."""
    return (
        f"boot {st['boot_id'][:8]}: {st['loaded_modules']} modules loaded, "
        f"{st['incarnations']} incarnations in {st['boots']} boots"
        + (", addresses restricted" if st["restricted"] else "")
        + (", a damaged store was set aside" if st["damaged_stores"] else "")
        + (", starting: " + ", ".join(st["starting"]) if st.get("starting") else "")
        + (
            ", DEGRADED: " + ", ".join(f"{f['name']} ({f['reason']})" for f in st["degraded"])
            if st.get("degraded")
            else ""
        )
    )
