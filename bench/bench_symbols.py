"""The symbol cache against parsing symbols again, and what a boot costs.

* Opening a cached kernel table: a read transaction on an existing store,
  a :class:`kreld.core.symtab.SymbolTable` over the buffer and one lookup
  (``Store.with_tables``), against (a) reading the same symbols with
  pyelftools from an ELF file that holds them (built here: an assembly file
  with every core-kernel symbol name of ``/proc/kallsyms`` as a label,
  assembled with ``gcc -c``; the first of each name is global, the repeats,
  in files of their own, local, joined with ``ld -r``) into ``(value, name)``
  pairs, and (b) reading and parsing ``/proc/kallsyms`` with
  :func:`kreld.kernel.kallsyms.parse_kallsyms`.  Goal: >= 500x faster than pyelftools.
* Addresses symbolized per second in batch: in-process
  (``Service.resolve`` on a store whose kernel table is cached) and
  over the socket (a ``kreld --root /`` of the bench's own, once ``Resolve``
  returns symbols), for 10,000 random kernel text addresses and for a
  realistic profile (10,000 samples drawn from 500 hot addresses).  Baseline:
  a plain Python bisect over an in-memory sorted list of the same symbols
  (built once from ``/proc/kallsyms``) doing the same lookups, parsing the
  same hex strings.  Goals: 1,000,000/s in-process, 500,000/s over the socket.
* Bytes stored per additional boot of a known build with 100 modules: a fake
  tree (``tests/support/faketree.py``) whose kallsyms is the real core kernel's
  (shifted to the fake ``_text``) plus 100 modules; ``kreld`` run once, then
  the same build rebooted with another KASLR slide and the modules at other
  addresses, ``kreld`` run again.  Bytes = pages of every named LMDB
  database (branch + leaf + overflow) * page size.  Goal: boot 2 adds < 32 KiB.

Run alone: ``.venv/bin/python bench/bench_symbols.py [--quick]``.
"""

from __future__ import annotations

import bisect
import json
import random
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import orjson
from common import (
    Kreld,
    Result,
    bench_main,
    interleaved,
    load_faketree,
    log,
    median,
    now_ns,
    percentile,
    run_quiet,
)
from elftools.elf.elffile import ELFFile

from kreld.client import Client
from kreld.kernel.info import Root
from kreld.kernel.kallsyms import KallsymsText, parse_kallsyms
from kreld.kernel.snapshot import take_snapshot
from kreld.server import methods
from kreld.server.service import Service
from kreld.store import Store
from kreld.symbols.table_sources import TableSources
from kreld.varlink.requests import Resolve, parse

ELF_GOAL = 500
INPROC_GOAL = 1_000_000
SOCKET_GOAL = 500_000
BOOT_GOAL = 32 * 1024
BATCH = 10_000
HOT = 500
N_MODULES = 100
FAKE_TEXT_1 = 0xFFFFFFFF9D000000
FAKE_TEXT_2 = 0xFFFFFFFFA3400000
MOD_BASE_1 = 0xFFFFFFFFC0000000
MOD_BASE_2 = 0xFFFFFFFFD0000000
MOD_STRIDE = 0x200000  # FakeTree's .init.text lies at base + 0x100000
# A few symbols per module, inside FakeTree.add_module's default sections:
# .text at base (0x1800 bytes up to .exit.text), .data at base + 0x2000.
MOD_SYMS = (
    (0x0, "t", "{m}_probe"),
    (0x140, "T", "{m}_open"),
    (0x600, "t", "{m}_irq_handler"),
    (0x1200, "t", "{m}_cleanup"),
    (0x2000, "d", "{m}_ops"),
    (0x2180, "D", "{m}_debug"),
)
_ASM_SAFE = re.compile(rb"[A-Za-z0-9_.$@]+")
_HOST_WARNINGS = frozenset({"allowed_group_missing", "socket_group_missing"})

Core = list[tuple[int, bytes, bytes]]


# -- the kernel's own symbols ----------------------------------------------------------


def read_kallsyms() -> tuple[bytes, Core, int, int]:
    """/proc/kallsyms: raw text, core-kernel lines, _text and _etext."""
    data = Path("/proc/kallsyms").read_bytes()
    core = parse_kallsyms(data).core
    first = {n: v for v, _t, n in reversed(core)}
    text, etext = first.get(b"_text", 0), first.get(b"_etext", 0)
    if not text or not etext:
        raise RuntimeError("/proc/kallsyms shows no _text/_etext (not root, or restricted)")
    return data, core, text, etext


def parse_proc_kallsyms() -> int:
    return len(parse_kallsyms(Path("/proc/kallsyms").read_bytes()).core)


# -- (a) the same symbols in an ELF file, read with pyelftools ----------------------------


def _asm(entries: list[tuple[int, bytes]], glob: bool) -> str:
    """Labels at their offsets from _text in a NOBITS section (no file bytes)."""
    out = ['.section .bss,"aw",@nobits']
    pos = 0
    for rel, name in sorted(entries):
        if rel > pos:
            out.append(f".skip {rel - pos}")
            pos = rel
        n = name.decode()
        if glob:
            out.append(f'.globl "{n}"')
        out.append(f'"{n}":')
    return "\n".join(out) + "\n"


def build_elf(tmp: Path, core: Core, text: int) -> tuple[Path, int]:
    """An ELF relocatable whose .symtab holds every core-kernel name of kallsyms."""
    layers: list[list[tuple[int, bytes]]] = []
    seen: dict[bytes, int] = {}
    for value, _typ, name in core:
        if not _ASM_SAFE.fullmatch(name):
            continue
        k = seen.get(name, 0)
        seen[name] = k + 1
        if k == len(layers):
            layers.append([])
        layers[k].append((max(value - text, 0), name))
    objs = []
    for k, entries in enumerate(layers):
        src = tmp / f"syms{k}.s"
        src.write_text(_asm(entries, glob=k == 0))
        obj = tmp / f"syms{k}.o"
        run_quiet(["gcc", "-c", str(src), "-o", str(obj)])
        objs.append(obj)
    out = tmp / "syms.o"
    if len(objs) == 1:
        shutil.copy(objs[0], out)
    else:
        run_quiet(["ld", "-r", "--discard-none", "-o", str(out), *map(str, objs)])
    return out, sum(len(x) for x in layers)


def pyelftools_parse(path: Path) -> list[tuple[int, str]]:
    """Every named symbol of .symtab as (value, name), as a profiler reading ELF does."""
    with open(path, "rb") as f:
        symtab = ELFFile(f).get_section_by_name(".symtab")
        assert symtab is not None
        return [(s["st_value"], s.name) for s in symtab.iter_symbols() if s.name]


# -- the plain baseline lookup ------------------------------------------------------------


class PlainBisect:
    """Sorted addresses and names in Python lists; of symbols sharing an
    address, the one perf names: the last in file order of the types perf
    keeps (T, W, D, B either case)."""

    def __init__(self, core: Core) -> None:
        named: dict[int, str] = {}
        kept: set[int] = set()
        for value, typ, name in core:
            if typ.upper() in (b"T", b"W", b"D", b"B"):
                named[value] = name.decode()  # a later one at the same address wins
                kept.add(value)
            elif value not in kept:
                named[value] = name.decode()
        self.addrs = sorted(named)
        self.names = [named[a] for a in self.addrs]

    def batch(self, hexes: list[str]) -> list[tuple[str, int] | None]:
        addrs, names, find = self.addrs, self.names, bisect.bisect_right
        out: list[tuple[str, int] | None] = []
        for h in hexes:
            a = int(h, 16)
            i = find(addrs, a) - 1
            out.append((names[i], a - addrs[i]) if i >= 0 else None)
        return out


def disagreements(reply: dict[str, Any], expect: list[tuple[str, int] | None]) -> int:
    """Answers of a Resolve reply that differ from the plain lookup's."""
    bad = 0
    names = reply["symbols"]
    for i, o, e in zip(reply["symbol"], reply["symbol_offset"], expect, strict=True):
        if e is None or i < 0 or (names[i], o) != e:
            bad += 1
    return bad


# -- kreld as a subprocess --------------------------------------------------------------------


def count_events(events: list[dict[str, Any]], name: str, **match: Any) -> int:
    return sum(
        1 for e in events if e.get("event") == name and all(e.get(k) == v for k, v in match.items())
    )


# -- 1 and 2: the live kernel's table ---------------------------------------------------------


def figures_live(quick: bool, tmp: Path) -> list[Result]:
    data, core, text, etext = read_kallsyms()
    log(f"symbols: /proc/kallsyms {len(core)} core symbols; building the store and the ELF")
    root = Root(Path("/"))
    state = tmp / "live-state"
    store = Store(state)
    snap, _notes = take_snapshot(root)
    stored, _, _ = store.boots.record_boot(snap)
    TableSources(store, root, stored, None).capture_kernel(KallsymsText.of(data))
    rec = store.boot_symbols(stored.boot_id)
    if rec is None:
        raise RuntimeError("kreld did not cache the kernel table for this boot")
    key = rec.kernel
    table_bytes = store.env.read(
        lambda txn: len(txn.get(key.encode(), db=store.env.dbs[b"symtabs"]))
    )
    store.close()

    t0 = now_ns()
    elf, elf_count = build_elf(tmp, core, text)
    build_s = (now_ns() - t0) / 1e9
    parsed = pyelftools_parse(elf)
    log(f"symbols: ELF of {elf_count} labels built in {build_s:.1f} s; {len(parsed)} read back")

    # -- 1: opening the cached table ----------------------------------------------
    probe = 0x1234  # a value relative to _text, inside .text

    def cached_lookup(s: Store) -> Callable[[], object]:
        return lambda: s.with_tables([key], lambda t: t[key].lookup(0, probe))

    def cold_lookup() -> object:
        with Store(state, readonly=True) as s:
            return s.with_tables([key], lambda t: t[key].lookup(0, probe))

    rounds = 1 if quick else 3
    warm_n = 300 if quick else 1000
    warm: list[int] = []
    cold: list[int] = []
    elf_s: list[int] = []
    ks_s: list[int] = []
    answer = None
    for _ in range(rounds):
        with Store(state, readonly=True) as s:
            fn = cached_lookup(s)
            answer = fn()
            warm += interleaved({"w": fn}, warm_n, warmup=20)["w"]
        cold += interleaved({"c": cold_lookup}, warm_n // 10, warmup=2)["c"]
        ks_s += interleaved({"k": parse_proc_kallsyms}, 2, warmup=0)["k"]
        elf_s += interleaved({"e": lambda: pyelftools_parse(elf)}, 1, warmup=0)["e"]
        log(f"symbols: open-table round done (pyelftools {elf_s[-1] / 1e9:.2f} s)")

    w50, w99 = median(warm), percentile(warm, 99)
    c50 = median(cold)
    e50, k50 = median(elf_s), median(ks_s)
    elf_tag, elf_desc = (
        "pyelftools",
        f"pyelftools reading an ELF .symtab of the same {elf_count} kernel symbol names "
        "(open, ELFFile, iterate .symtab into (value, name) pairs)",
    )
    ks_tag, ks_desc = (
        "kallsyms",
        "read /proc/kallsyms and parse it with kreld.kernel.kallsyms.parse_kallsyms",
    )
    res = [
        Result(
            "open cached kernel table (read txn + SymbolTable + 1 lookup) p50",
            w50, "ns", e50, elf_tag, elf_desc,
            f">= {ELF_GOAL}x faster (ratio <= {1 / ELF_GOAL:g})", w50 * ELF_GOAL <= e50,
        ),
        Result("open cached kernel table p50, vs kallsyms", w50, "ns", k50, ks_tag, ks_desc),
        Result("open cached kernel table p99", w99, "ns", e50, elf_tag),
        Result(
            "  same, Store opened read-only and closed around it (kreldctl cold) p50",
            c50, "ns", e50, elf_tag,
        ),
        Result("  pyelftools parse vs kallsyms parse (baselines' own ratio)", e50, "ns", k50,
               ks_tag),
    ]  # fmt: skip
    res[0].notes.append(
        f"open table: {len(warm)} timed opens in {rounds} round(s), each round with 2 kallsyms "
        f"parses and 1 pyelftools parse; cached table {key[:14]}... {table_bytes} bytes for "
        f"{len(core)} symbols; lookup answered {answer}; ELF {elf.stat().st_size} bytes, "
        f"{len(parsed)} named symbols read back ({elf_count} labels, repeats of a name local), "
        f"built in {build_s:.1f} s; the cached open is {e50 / w50:,.0f}x faster than "
        f"pyelftools and {k50 / w50:,.0f}x faster than parsing kallsyms (p50s)"
    )

    # -- 2: symbolization throughput --------------------------------------------------------
    res += throughput(quick, tmp, state, stored, core, text, etext)
    return res


def throughput(
    quick: bool, tmp: Path, state: Path, boot: Any, core: Core, text: int, etext: int
) -> list[Result]:
    rng = random.Random(5)
    rand = [hex(text + rng.randrange(etext - text)) for _ in range(BATCH)]
    hot_set = [hex(text + rng.randrange(etext - text)) for _ in range(HOT)]
    hot = rng.choices(hot_set, k=BATCH)
    plain = PlainBisect(core)
    store = Store(state, readonly=True)
    svc = Service(
        store, current_boot=lambda: boot, current_id=lambda: boot.boot_id, loaded=lambda: []
    )
    sock = tmp / "kreld.sock"
    daemon = Kreld(
        ["--root", "/", "--state-dir", str(tmp / "daemon-state"), "--socket", str(sock),
         "--log-level", "warning"],
        tmp / "daemon.log",
    )  # fmt: skip
    try:
        t0 = time.monotonic()
        client = wait_symbols(daemon, sock, rand[0])
        ready_s = time.monotonic() - t0
        log(f"symbols: kreld --root / answers Resolve with symbols after {ready_s:.1f} s")
        # Correctness first: both paths must name what the plain lookup names.
        want_r, want_h = plain.batch(rand), plain.batch(hot)
        svc_reply = methods.call(svc, "Resolve", {"addresses": rand})
        inproc_bad = disagreements(svc_reply, want_r)
        inproc_bad += disagreements(methods.call(svc, "Resolve", {"addresses": hot}), want_h)
        sock_bad = disagreements(client.call("Resolve", addresses=rand), want_r)
        sock_bad += disagreements(client.call("Resolve", addresses=hot), want_h)
        n = 8 if quick else 30
        s = interleaved(
            {
                "in-rand": lambda: svc.resolve(parse(Resolve, {"addresses": rand})),
                "in-hot": lambda: svc.resolve(parse(Resolve, {"addresses": hot})),
                "sock-rand": lambda: client.call("Resolve", addresses=rand),
                "sock-hot": lambda: client.call("Resolve", addresses=hot),
                "plain-rand": lambda: plain.batch(rand),
                "plain-hot": lambda: plain.batch(hot),
            },
            n,
            warmup=2,
        )
        client.close()
        faults = _faults(daemon.events())
    finally:
        rc = daemon.stop()
        store.close()

    def rate(k: str) -> float:
        return BATCH / (median(s[k]) / 1e9)

    tag, desc = (
        "bisect",
        "plain Python bisect over in-memory sorted lists of the same kallsyms symbols "
        "(int(hex) + bisect + name + offset per address, no cache of repeats), same addresses",
    )
    res = []
    for label, k, goal in (
        ("in-process (Service.resolve), 10,000 random text addresses", "in-rand",
         INPROC_GOAL),
        ("in-process, 10,000 samples of 500 hot addresses", "in-hot", INPROC_GOAL),
        ("over the socket (Client Resolve), 10,000 random text addresses", "sock-rand",
         SOCKET_GOAL),
        ("over the socket, 10,000 samples of 500 hot addresses", "sock-hot", SOCKET_GOAL),
    ):  # fmt: skip
        base = "plain-hot" if k.endswith("hot") else "plain-rand"
        r = rate(k)
        res.append(
            Result(f"addresses/s symbolized {label}", r, "", rate(base), tag, desc,
                   f">= {goal:,}/s", r >= goal)
        )  # fmt: skip
    res.append(encoding(svc_reply, 10 * n))
    p99 = {k: percentile(v, 99) for k, v in s.items()}
    res[0].notes.append(
        f"throughput: {n} batches of {BATCH} per variant, interleaved; addresses/s from the "
        f"median batch (p99 batch: in-process {p99['in-rand'] / 1e6:.1f} ms random, "
        f"{p99['in-hot'] / 1e6:.1f} ms hot; socket {p99['sock-rand'] / 1e6:.1f} ms random, "
        f"{p99['sock-hot'] / 1e6:.1f} ms hot); answers that differ from the plain lookup: "
        f"in-process {inproc_bad}/{2 * BATCH}, socket {sock_bad}/{2 * BATCH}; the daemon "
        f"answered with symbols {ready_s:.1f} s after start, exit {rc}"
        + (f"; daemon warnings: {', '.join(faults)}" if faults else "")
    )
    return res


def encoding(reply: dict[str, Any], n: int) -> Result:
    """What orjson is for: a reply's per-address arrays written as JSON, by
    orjson straight from numpy arrays, against stdlib json from Python lists."""
    keys = ("symbol", "symbol_offset")
    arrays = [np.array(reply[k], dtype=np.int64) for k in keys]
    lists = [reply[k] for k in keys]
    opt = orjson.OPT_SERIALIZE_NUMPY
    s = interleaved(
        {
            "orjson": lambda: [orjson.dumps(a, option=opt) for a in arrays],
            "json": lambda: [json.dumps(x, separators=(",", ":")) for x in lists],
        },
        n,
        warmup=2,
    )
    return Result(
        "  Resolve reply of 10,000 addresses: its 2 per-address arrays to JSON, orjson p50",
        median(s["orjson"]), "ns", median(s["json"]), "stdlib-json",
        "stdlib json.dumps of the same arrays as Python lists",
    )  # fmt: skip


def wait_symbols(daemon: Kreld, sock: Path, addr: str, timeout: float = 90) -> Client:
    deadline = time.monotonic() + timeout
    client: Client | None = None
    while time.monotonic() < deadline:
        if daemon.proc.poll() is not None:
            raise RuntimeError(f"kreld exited {daemon.proc.returncode}: {daemon.tail()}")
        try:
            if client is None and sock.exists():
                client = Client(str(sock), timeout=120)
            if client is not None and client.call("Resolve", addresses=[addr])["symbols"]:
                return client
        except Exception:
            if client is not None:
                client.close()
            client = None
        time.sleep(0.1)
    raise RuntimeError(f"kreld never answered Resolve with symbols: {daemon.tail()}")


# -- 3: bytes per additional boot ------------------------------------------------------------


def db_usage(path: Path) -> tuple[dict[str, dict[str, int]], int]:
    """Per named database: bytes in pages, entries, key+value payload; file size."""
    env = lmdb.open(str(path), readonly=True, max_dbs=16, subdir=True, lock=False)
    out: dict[str, dict[str, int]] = {}
    try:
        with env.begin() as txn:
            names = [bytes(k) for k, _ in txn.cursor()]
        for name in names:
            db = env.open_db(name, create=False)
            with env.begin() as txn:
                st = txn.stat(db)
                payload = sum(len(k) + len(v) for k, v in txn.cursor(db=db))
            pages = st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
            out[name.decode()] = {
                "bytes": pages * st["psize"],
                "pages": pages,
                "entries": st["entries"],
                "payload": payload,
            }
    finally:
        env.close()
    return out, (path / "data.mdb").stat().st_size


def fake_kallsyms(core: Core, real_text: int, text: int, mods: dict[str, int]) -> str:
    """The real core lines moved to *text*, then each module's lines (newest first)."""
    shift = text - real_text
    lines = [
        f"{(v + shift) & 0xFFFFFFFFFFFFFFFF:016x} {t.decode()} {n.decode()}" for v, t, n in core
    ]
    for m, base in reversed(list(mods.items())):
        lines += [f"{base + off:016x} {t} {n.format(m=m)}\t[{m}]" for off, t, n in MOD_SYMS]
    return "\n".join(lines) + "\n"


def figure_boot_bytes(quick: bool, tmp: Path) -> list[Result]:
    ft = load_faketree()
    _data, core, real_text, _etext = read_kallsyms()
    work = tmp / "fake"
    work.mkdir()
    tree = ft.FakeTree(work / "root", text=FAKE_TEXT_1)
    names = [f"mod{i:02d}" for i in range(N_MODULES)]
    mods1 = {m: MOD_BASE_1 + i * MOD_STRIDE for i, m in enumerate(names)}
    for m, base in mods1.items():
        tree.add_module(m, base)
    tree.write("proc/kallsyms", fake_kallsyms(core, real_text, FAKE_TEXT_1, mods1))
    state = work / "state"
    args = ["--root", str(tree.root), "--state-dir", str(state), "--socket", str(work / "s.sock")]
    notes: list[str] = []

    t0 = time.monotonic()
    d1 = Kreld(args, work / "run1.log")
    try:
        d1.wait_until(
            lambda ev: (
                count_events(ev, "kernel_symbols") >= 1
                and count_events(ev, "module_symbols") >= N_MODULES
            ),
            "kernel_symbols and 100 module_symbols",
        )
        ev1 = d1.events()
    finally:
        rc1 = d1.stop()
    run1_s = time.monotonic() - t0
    k1 = next(e for e in ev1 if e.get("event") == "kernel_symbols")
    use1, file1 = db_usage(state)
    log(f"symbols: boot 1 recorded in {run1_s:.1f} s (kernel table {k1.get('action')})")

    # The same build boots again: another slide, the modules elsewhere, in another order.
    tree.new_boot(text=FAKE_TEXT_2)
    order = names[:]
    random.Random(7).shuffle(order)
    mods2 = {m: MOD_BASE_2 + i * MOD_STRIDE for i, m in enumerate(order)}
    for m in names:
        tree.remove_module(m)
    for m, base in mods2.items():
        tree.add_module(m, base)
    tree.write("proc/kallsyms", fake_kallsyms(core, real_text, FAKE_TEXT_2, mods2))

    t0 = time.monotonic()
    d2 = Kreld(args, work / "run2.log")
    try:
        d2.wait_until(
            lambda ev: (
                count_events(ev, "kernel_symbols") >= 1
                and any(
                    e.get("event") == "modules_startup" and e.get("opened") == N_MODULES for e in ev
                )
            ),
            "kernel_symbols and modules_startup with 100 opened",
        )
        # The symbol worker checks each module's table after the kernel's.
        time.sleep(0.5)
        ev2 = d2.events()
    finally:
        rc2 = d2.stop()
    run2_s = time.monotonic() - t0
    k2 = next(e for e in ev2 if e.get("event") == "kernel_symbols")
    use2, file2 = db_usage(state)
    log(f"symbols: boot 2 recorded in {run2_s:.1f} s (kernel table {k2.get('action')})")

    total1 = sum(u["bytes"] for u in use1.values())
    total2 = sum(u["bytes"] for u in use2.values())
    delta = total2 - total1
    split = []
    for name in sorted(set(use1) | set(use2), key=lambda n: -_delta(use1, use2, n, "bytes")):
        db = _delta(use1, use2, name, "bytes")
        ent = _delta(use1, use2, name, "entries")
        pay = _delta(use1, use2, name, "payload")
        if db or ent or pay:
            each = f", {pay / ent:.0f} B each" if ent > 0 else ""
            split.append(f"{name} {db:+d} B ({ent:+d} entries, {pay:+d} B of keys+values{each})")
    tables1 = use1.get("symtabs", {}).get("payload", 0)
    mod_tables = sum(1 for e in ev2 if e.get("event") == "module_symbols")
    notes.append(
        f"boot 2 of the same build ({N_MODULES} modules, kernel table "
        f"'{k2.get('action')}', {mod_tables} module tables stored again) adds per LMDB "
        f"database (pages * {_psize(state)} B): " + "; ".join(split)
    )
    notes.append(
        f"boot bytes: boot 1 {total1} B in named databases ({tables1} B of it table "
        f"payload), data.mdb {file1} -> {file2} B; run 1 {run1_s:.1f} s "
        f"(exit {rc1}), run 2 {run2_s:.1f} s (exit {rc2}); kallsyms {len(core)} core + "
        f"{len(MOD_SYMS)} per module"
        + (f"; daemon warnings: {', '.join(_faults(ev1 + ev2))}" if _faults(ev1 + ev2) else "")
    )
    tag, desc = "boot1", "the store after boot 1 (first boot of the build, with its tables)"
    res = [
        Result("bytes stored, boot 1 (kernel + 100 module tables, 100 incarnations)",
               total1, "B"),
        Result("bytes added by boot 2 of the same build (100 modules moved)", delta, "B",
               total1, tag, desc, f"< {BOOT_GOAL // 1024} KiB", delta < BOOT_GOAL),
    ]  # fmt: skip
    res[0].notes = notes
    return res


def _delta(a: dict[str, dict[str, int]], b: dict[str, dict[str, int]], n: str, k: str) -> int:
    return b.get(n, {}).get(k, 0) - a.get(n, {}).get(k, 0)


def _psize(path: Path) -> int:
    env = lmdb.open(str(path), readonly=True, max_dbs=16, subdir=True, lock=False)
    try:
        return int(env.stat()["psize"])
    finally:
        env.close()


def _faults(events: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in events:
        ev = str(e.get("event"))
        if e.get("level") in ("error", "warning", "critical") and ev not in _HOST_WARNINGS:
            out.append(f"{ev} {e.get('fault') or e.get('error') or ''}".strip())
    return sorted(set(out))


# -- the bench ----------------------------------------------------------------------------------


def run(quick: bool) -> list[Result]:
    """Cached symbol tables vs pyelftools/kallsyms; symbolization rate; bytes per boot."""
    tmp = Path(tempfile.mkdtemp(prefix="kreld-bench-sym-", dir="/tmp"))
    try:
        res = figures_live(quick, tmp)
        res += figure_boot_bytes(quick, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for r in res:
        r.bench = "symbols"
    return res


if __name__ == "__main__":
    sys.exit(bench_main("symbols", run))
