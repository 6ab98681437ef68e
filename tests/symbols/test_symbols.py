"""The symbol cache: tables per build-id, symbolization at a time, kallsyms export, gc.

Against the live machine (root, unrestricted kallsyms) the exported kallsyms must be
/proc/kallsyms line for line and Resolve must agree with a plain lookup in it.  On fake
trees kreld runs as a real subprocess: kallsyms files are written here, module loads are
sysfs directories, and the .ko and vmlinux files are built with gcc and ld in the test.
"""

from __future__ import annotations

import bisect
import io
import json
import lzma
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from kreld.client import resolutions
from kreld.core.model import BootSymbols, Incarnation, SeenBy, Timestamp
from kreld.kernel.info import Root
from kreld.kernel.modules_sysfs import read_module
from kreld.kernel.snapshot import take_snapshot
from kreld.store import Store
from kreld.tracker.modules_plan import new_incarnation

from support.faketree import FakeTree, kcore, link_vmlinux
from support.run import Daemon, kreldctl, raw_exchange
from support.symbols import (
    BASE_A,
    BASE_B,
    BASE_C,
    BUILD_ID,
    CORE,
    INIT,
    LINK,
    RELEASE,
    SLIDES,
    CoreSym,
    Machine,
    core_lines,
    mod_build_id,
    mod_lines,
    symbol_worker,
)
from support.symbols import daemons as daemons
from support.symbols import sock_dir as sock_dir
from support.wait import wait_until

OTHER_ID = "0badc0de0badc0de0badc0de0badc0de0badc0de"


def shift_line(line: str, delta: int) -> str:
    """A kallsyms line of another slide: relocated symbols move, absolute ones stay."""
    addr, typ, rest = line.split(" ", 2)
    if typ in ("A", "a"):
        return line
    return f"{int(addr, 16) + delta:016x} {typ} {rest}"


def first_difference(got: list[str], want: list[str]) -> str:
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            return f"line {i + 1}: got {g!r}, want {w!r}"
    return f"lengths differ: got {len(got)} lines, want {len(want)}"


def assert_same_lines(got: str, want: str) -> None:
    g, w = got.splitlines(), want.splitlines()
    assert g == w, first_difference(g, w)


def by_owner(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """A kallsyms split: the kernel's lines in order, and each module's lines in order."""
    core: list[str] = []
    mods: dict[str, list[str]] = {}
    for line in text.splitlines():
        _, tab, owner = line.partition("\t")
        if tab:
            mods.setdefault(owner, []).append(line)
        else:
            core.append(line)
    return core, mods


def assert_same_but_module_order(got: str, want: str) -> None:
    """The same lines, each module's in order, whatever the order of the modules."""
    (gc, gm), (wc, wm) = by_owner(got), by_owner(want)
    assert gc == wc, first_difference(gc, wc)
    assert gm == wm


def ok(reply: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in reply, reply
    return dict(reply["parameters"])


def call(sock: Path, method: str, **params: Any) -> dict[str, Any]:
    """One varlink call on a fresh connection: the raw reply (parameters or error)."""
    msg = json.dumps({"method": f"io.kreld.{method}", "parameters": params}).encode() + b"\0"
    [reply] = raw_exchange(sock, msg, timeout=60)
    return reply


def resolved(sock: Path, addresses: list[str], **params: Any) -> list[dict[str, Any]]:
    """A Resolve on the socket, spelt out per address (kreld.client.resolutions)."""
    return resolutions(addresses, ok(call(sock, "Resolve", addresses=addresses, **params)))


def symtab_keys(state: Path) -> list[str]:
    """The keys of the symtabs database, read from LMDB directly."""
    with Store(state, readonly=True) as store:
        db = store.env.dbs[b"symtabs"]
        if db is None:
            return []
        return store.env.read(
            lambda txn: sorted(bytes(k).decode() for k in txn.cursor(db=db).iternext(values=False))
        )


def ns(inc: dict[str, Any], key: str) -> int:
    return int(inc[key]["monotonic"])


def sym(r: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
    """(image, symbol, offset into it) of one resolution."""
    return r.get("image"), r.get("symbol"), r.get("symbol_offset")


# -- the live machine ------------------------------------------------------------------


def _live_kallsyms() -> bytes:
    if os.geteuid() != 0:
        pytest.skip("not root: /proc/kallsyms shows zeros to this user")
    try:
        data = Path("/proc/kallsyms").read_bytes()
    except OSError as e:
        pytest.skip(f"/proc/kallsyms unreadable: {e}")
    first = data.split(b" ", 1)[0]
    if not first.strip(b"0"):
        pytest.skip("/proc/kallsyms shows zero addresses (kernel.kptr_restrict)")
    return data


def test_live_snapshot_then_export_equals_proc_kallsyms(tmp_path: Path) -> None:
    _live_kallsyms()
    state = str(tmp_path / "st")
    out = tmp_path / "kallsyms"
    kreldctl("--state-dir", state, "snapshot")
    kreldctl("--state-dir", state, "export", "kallsyms", "-o", str(out))
    live = Path("/proc/kallsyms").read_text()
    assert_same_lines(out.read_text(), live)


def test_live_daemon_exports_and_resolves_like_proc_kallsyms(
    tmp_path: Path, sock_dir: Path, daemons: list[Daemon]
) -> None:
    _live_kallsyms()
    sock = sock_dir / "live.sock"
    d = Daemon(
        ["--root", "/", "--state-dir", str(tmp_path / "st"), "--socket", str(sock)],
        tmp_path / "kreld.log",
    )
    daemons.append(d)
    d.start(timeout=30)
    d.wait_for("kernel_symbols", timeout=60)
    text = ok(call(sock, "ExportKallsyms"))["kallsyms"]
    live = Path("/proc/kallsyms").read_text()
    assert_same_lines(text, live)

    # The straightforward lookup: the greatest core address <= A; of several names
    # at one address, the one perf names: the last in file order of a type perf
    # keeps (T, W, D, B).
    first: dict[int, str] = {}
    kept: set[int] = set()
    named: dict[str, int] = {}
    for line in live.splitlines():
        addr, typ, name = line.split(" ", 2)
        if "\t" not in name:
            a = int(addr, 16)
            if typ.upper() in "TWDB":
                first[a] = name
                kept.add(a)
            elif a not in kept:
                first[a] = name
            named.setdefault(name, a)
    addrs = sorted(first)
    text_start, etext = named["_text"], named["_etext"]
    assert text_start < etext
    rng = random.Random(0x5EED)
    sample = [rng.randrange(text_start, etext) for _ in range(10_000)]
    results = resolved(sock, [f"{a:#x}" for a in sample])
    assert len(results) == len(sample)
    wrong = []
    for a, r in zip(sample, results, strict=True):
        at = addrs[bisect.bisect_right(addrs, a) - 1]
        want = ("kernel", first[at], f"{a - at:#x}")
        if sym(r) != want or r["address"] != f"{a:#x}":
            wrong.append((f"{a:#x}", sym(r), want))
    assert not wrong, f"{len(wrong)} of 10000 differ, e.g. {wrong[:5]}"
    assert d.stop() == 0


# -- boots of one build: shared, differing, and gc ---------------------------------------


class Boots:
    """Four boots of one kernel build on one fake machine, each recorded by a kreld run.

    A: slide 0, module mx.            -> the build's table is stored
    B: slide 1, module mz.            -> the stored table is shared
    C: slide 2, an extra symbol, mz+my -> its own table (differs)
    D: slide 3, two lines reordered (the current boot, mz+my still loaded) -> its own
    """

    def __init__(self, m: Machine) -> None:
        self.m = m
        self.ids: dict[str, str] = {}
        self.kallsyms: dict[str, str] = {}
        self.logs: dict[str, list[dict[str, Any]]] = {}

    def run(self, label: str, *waits: tuple[str, dict[str, Any]]) -> None:
        self.ids[label] = self.m.tree.boot_id
        self.kallsyms[label] = self.m.kallsyms()
        d = self.m.start()
        for event, match in waits:
            d.wait_for(event, **match)
        assert d.stop() == 0
        self.logs[label] = d.events()


EXTRA_CORE = [*CORE[:9], (0x2C00, False, "t", "livepatch_shim"), *CORE[9:]]
REORDERED_CORE = [*CORE[:7], CORE[8], CORE[7], *CORE[9:]]


@pytest.fixture(scope="module")
def boots(tmp_path_factory: pytest.TempPathFactory, sock_dir: Path, daemons: list[Daemon]) -> Boots:
    m = Machine(tmp_path_factory.mktemp("boots"), sock_dir / "boots.sock", daemons)
    b = Boots(m)
    m.load("mx", BASE_A)
    b.run(
        "A",
        ("kernel_symbols", {"action": "stored"}),
        ("module_symbols", {"module": "mx", "source": "kallsyms"}),
    )
    m.unload("mx")  # before the reboot: a new boot starts with no modules
    m.new_boot(SLIDES[1])
    m.load("mz", BASE_B)
    b.run(
        "B",
        ("kernel_symbols", {"action": "shared"}),
        ("module_symbols", {"module": "mz", "source": "kallsyms"}),
    )
    m.new_boot(SLIDES[2], EXTRA_CORE)
    m.load("my", BASE_C)
    b.run(
        "C",
        ("kernel_symbols_differ_from_build", {}),
        ("module_symbols", {"module": "my", "source": "kallsyms"}),
        ("modules_startup", {"opened": 2}),
    )
    m.new_boot(SLIDES[3], REORDERED_CORE)
    b.run(
        "D",
        ("kernel_symbols_differ_from_build", {}),
        ("modules_startup", {"opened": 2}),
    )
    return b


def events(log: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in log if e.get("event") == name]


def test_second_boot_of_a_build_shares_the_table_and_exports_shifted(boots: Boots) -> None:
    m, ids = boots.m, boots.ids
    [stored] = events(boots.logs["A"], "kernel_symbols")
    [shared] = events(boots.logs["B"], "kernel_symbols")
    assert (stored["action"], stored["table"]) == ("stored", f"k:{BUILD_ID}")
    assert (shared["action"], shared["table"]) == ("shared", f"k:{BUILD_ID}")
    keys = symtab_keys(m.state)
    assert [k for k in keys if k.startswith(("k:", "v:"))] == [f"k:{BUILD_ID}"]
    with Store(m.state, readonly=True) as store:
        assert store.boot_symbols(ids["A"]) == BootSymbols(f"k:{BUILD_ID}")
        assert store.boot_symbols(ids["B"]) == BootSymbols(f"k:{BUILD_ID}")

    a = m.export("--boot", ids["A"])
    b = m.export("--boot", ids["B"])
    # Each boot exactly as its kernel printed it (modules seen loaded until its end).
    assert_same_lines(a, boots.kallsyms["A"])
    assert_same_lines(b, boots.kallsyms["B"])
    # ... and B's kernel lines are A's moved by the difference of the slides.
    delta = SLIDES[1] - SLIDES[0]
    a_core = [ln for ln in a.splitlines() if "\t" not in ln]
    b_core = [ln for ln in b.splitlines() if "\t" not in ln]
    assert len(a_core) == len(CORE)
    assert b_core == [shift_line(ln, delta) for ln in a_core]
    assert b_core != a_core
    # One table, two slides: each boot's addresses resolve against its own _text.
    for label, slide in (("A", SLIDES[0]), ("B", SLIDES[1])):
        text = LINK + slide
        res = m.resolve(None, text, text + 0x10004, text + 0x3000010, boot=ids[label])
        assert [sym(r) for r in res] == [
            # Of the names at one address, the last printed (perf's choice).
            ("kernel", "_text", "0x0"),
            ("kernel", "schedule_alias", "0x4"),
            ("kernel", "start_kernel", "0x10"),
        ]
        assert res[2]["section"] == ".init.text"


@pytest.mark.parametrize(("label", "core"), [("C", EXTRA_CORE), ("D", REORDERED_CORE)])
def test_boot_whose_kallsyms_differs_gets_its_own_table(
    boots: Boots, label: str, core: list[CoreSym]
) -> None:
    m, boot = boots.m, boots.ids[label]
    [warned] = events(boots.logs[label], "kernel_symbols_differ_from_build")
    assert warned["table"] == f"b:{boot}"
    assert warned["build_id"] == BUILD_ID
    assert f"b:{boot}" in symtab_keys(m.state)
    with Store(m.state, readonly=True) as store:
        assert store.boot_symbols(boot) == BootSymbols(f"b:{boot}")
    out = m.export("--boot", boot)
    assert_same_but_module_order(out, boots.kallsyms[label])
    kernel = [ln for ln in out.splitlines() if "\t" not in ln]
    slide = SLIDES["ABCD".index(label)]
    assert kernel == core_lines(LINK + slide, core)
    # The build's own table still gives the other boots their lines.
    assert_same_lines(m.export("--boot", boots.ids["A"]), boots.kallsyms["A"])


@pytest.mark.parametrize("label", ["C", "D"])
def test_modules_loaded_before_kreld_started_are_exported_in_the_kernels_order(
    boots: Boots, label: str
) -> None:
    """C and D start with mz (loaded on B) and my (loaded later) present: my first."""
    out = boots.m.export("--boot", boots.ids[label])
    assert list(by_owner(out)[1]) == ["[my]", "[mz]"]
    assert_same_lines(out, boots.kallsyms[label])


GC_CASES = {
    # id: (args, current boot, boots kept, incarnations removed, tables removed)
    "keep-1": (["--keep-boots", "1"], "D", ["D"], 4, ["b:C", "k:", "m:mx"]),
    "keep-1-current-is-older": (["--keep-boots", "1"], "B", ["D", "B"], 3, ["b:C", "m:mx"]),
    "config-keep-2": ([], "D", ["D", "C"], 2, ["k:", "m:mx"]),
}


@pytest.mark.parametrize("case", list(GC_CASES))
def test_gc_removes_old_boots_and_tables_no_boot_uses(
    boots: Boots, tmp_path: Path, case: str
) -> None:
    args, current, kept, incs_removed, tables_removed = GC_CASES[case]
    ids = boots.ids
    full = {
        "k:": f"k:{BUILD_ID}",
        "b:C": f"b:{ids['C']}",
        "b:D": f"b:{ids['D']}",
        "m:mx": f"m:{mod_build_id('mx')}",
        "m:my": f"m:{mod_build_id('my')}",
        "m:mz": f"m:{mod_build_id('mz')}",
    }
    state = tmp_path / "state"
    shutil.copytree(boots.m.state, state)
    assert sorted(symtab_keys(state)) == sorted(full.values())
    # A root whose boot-id is the "current" one (the store may come from elsewhere).
    root = tmp_path / "root"
    (root / "proc/sys/kernel/random").mkdir(parents=True)
    (root / "proc/sys/kernel/random/boot_id").write_text(ids[current] + "\n")
    cfg = tmp_path / "kreld.toml"
    cfg.write_text("[retention]\nkeep_boots = 2\n")
    common = ["--root", str(root), "--state-dir", str(state), "--config", str(cfg)]
    with Store(state, readonly=True) as store:
        before = store.boots.counts()["incarnations"]
        per_boot = {k: len(store.incarnations(v)) for k, v in ids.items()}
    assert per_boot == {"A": 1, "B": 1, "C": 2, "D": 2}

    out = json.loads(kreldctl("gc", *args, *common, "--json").stdout)
    assert out["boots"] == 4 - len(kept)
    assert out["incarnations"] == incs_removed
    assert out["tables"] == len(tables_removed)
    assert out["store_bytes"] > 0

    listed = json.loads(kreldctl("boots", *common, "--json").stdout)
    assert [b["boot_id"] for b in listed] == [ids[k] for k in sorted(kept, reverse=True)]
    assert sorted(symtab_keys(state)) == sorted(
        v for k, v in full.items() if k not in tables_removed
    )
    with Store(state, readonly=True) as store:
        assert store.boots.counts()["incarnations"] == before - incs_removed
        for label, boot in ids.items():
            assert len(store.incarnations(boot)) == (per_boot[label] if label in kept else 0)
            assert (store.boot_symbols(boot) is not None) == (label in kept)
    for label in kept:
        got = kreldctl("export", "kallsyms", "--boot", ids[label], *common).stdout
        assert_same_but_module_order(got, boots.kallsyms[label])
    gone = next(label for label in "ABCD" if label not in kept)
    cp = kreldctl("show", ids[gone], *common, check=False)
    assert cp.returncode == 3 and ids[gone] in cp.stderr, cp.stderr
    # Nothing more to do the second time.
    again = json.loads(kreldctl("gc", *args, *common, "--json").stdout)
    assert (again["boots"], again["incarnations"], again["tables"]) == (0, 0, 0)


# -- module incarnations at their times --------------------------------------------------


# A BPF program's line: the kernel prints these after the modules' lines.
BPF = ["ffffffffc0001a4c t bpf_prog_6deef7357e7b4530_sd_fw_ingress\t[bpf]"]


class History:
    """alpha loaded at A, beta (first seen in its init) at C, alpha unloaded and
    reloaded at B; beta's init returns in between."""

    def __init__(self, m: Machine, d: Daemon) -> None:
        self.m = m
        self.daemon = d
        incs = m.history()
        self.alpha0, self.beta, self.alpha1 = (
            next(i for i in incs if (i["name"], i["seq"]) == key)
            for key in (("alpha", 0), ("beta", 1), ("alpha", 2))
        )
        self.text = LINK + SLIDES[0]


@pytest.fixture(scope="module")
def hist(
    tmp_path_factory: pytest.TempPathFactory, sock_dir: Path, daemons: list[Daemon]
) -> History:
    m = Machine(tmp_path_factory.mktemp("hist"), sock_dir / "hist.sock", daemons)
    m.extras = BPF
    m.write_kallsyms()
    d = m.start()
    d.wait_for("kernel_symbols", action="stored")
    m.load("alpha", BASE_A)
    d.wait_for("module_symbols", module="alpha", source="kallsyms")
    # Fill the daemon's caches of this boot's history: later loads must reach them.
    [early] = resolved(m.sock, [f"{BASE_A:#x}"], at=1)
    assert "image" not in early
    assert len(ok(call(m.sock, "GetModules", all=True))["modules"]) == 1
    m.load("beta", BASE_C, initstate="coming", initsize=0x2000)
    d.wait_for("module_loaded", module="beta", initstate="coming")
    d.wait_for("module_symbols", module="beta", source="kallsyms")
    # beta's init returns: the kernel frees its init sections and says "live".
    m.init_done("beta")
    wait_until("beta's init_done", lambda: any(i["init_done"] for i in m.history()))
    m.unload("alpha")
    d.wait_for("module_unloaded", module="alpha")
    m.load("alpha", BASE_B)
    d.wait_for("module_loaded", module="alpha", count=2)
    wait_until(
        "the daemon's history to show alpha's reload",
        lambda: len(ok(call(m.sock, "GetModules", all=True))["modules"]) == 3,
        10,
    )
    return History(m, d)


def test_two_incarnations_of_a_module_symbolize_at_their_times(hist: History) -> None:
    m = hist.m
    a0, a1 = hist.alpha0, hist.alpha1
    assert a0["build_id"] == a1["build_id"] == mod_build_id("alpha")
    assert a0["sections"][".text"] == f"{BASE_A:#x}"
    assert a1["sections"][".text"] == f"{BASE_B:#x}"
    t0, t1 = ns(a0, "loaded") + 1, ns(a1, "loaded") + 1
    assert t0 < ns(a0, "unloaded") <= t1

    def addrs(base: int) -> list[int]:
        return [base + 0x80 + 5, base + 0x1C0, base + 0x1800 + 0x12, base + 0x2000 + 8]

    want = [
        ("alpha", "alpha_read", "0x5"),
        ("alpha", "alpha_ioctl", "0x0"),
        ("alpha", "alpha_exit", "0x12"),
        ("alpha", "alpha_state", "0x8"),
    ]
    kernel = hist.text + 0x2000 + 0x33
    for t, here, gone, seq in ((t0, BASE_A, BASE_B, 0), (t1, BASE_B, BASE_A, 2)):
        # kreldctl reading the store, and the daemon on its socket: the same answers.
        for res in (
            m.resolve(t, *addrs(here), *addrs(gone), kernel),
            resolved(
                m.sock,
                [f"{a:#x}" for a in [*addrs(here), *addrs(gone), kernel]],
                at=t,
                clock="monotonic",
            ),
        ):
            assert [sym(r) for r in res[:4]] == want
            assert {r["seq"] for r in res[:4]} == {seq}
            assert [r["section"] for r in res[:4]] == [".text", ".text", ".exit.text", ".data"]
            assert [r.get("image") for r in res[4:8]] == [None] * 4
            assert sym(res[8]) == ("kernel", "do_one_initcall", "0x33")
    # The table is stored once, under the module's build-id, and captured once.
    keys = symtab_keys(m.state)
    assert [k for k in keys if k.startswith("m:")] == sorted(
        [f"m:{mod_build_id('alpha')}", f"m:{mod_build_id('beta')}"]
    )
    captured = [e for e in hist.daemon.events() if e.get("event") == "module_symbols"]
    assert [e["module"] for e in captured].count("alpha") == 1


def test_a_reloaded_module_exports_the_per_cpu_offsets_of_each_load(
    tmp_path: Path, sock_dir: Path, daemons: list[Daemon]
) -> None:
    """The table of a module build is stored once, from its first load; a later load
    prints its per-cpu variables at that load's per-cpu offsets, and the export for a
    time of either load shows that load's, as its kallsyms did."""
    m = Machine(tmp_path / "pcpu", sock_dir / "pcpu.sock", daemons)
    d = m.start()
    d.wait_for("kernel_symbols", action="stored")
    m.percpu["pcpu"] = 0x34000
    m.load("pcpu", BASE_A)
    d.wait_for("module_symbols", module="pcpu", source="kallsyms")
    first = m.kallsyms()
    m.unload("pcpu")
    d.wait_for("module_unloaded", module="pcpu")
    m.percpu["pcpu"] = 0x3C040
    m.load("pcpu", BASE_B)
    kept = d.wait_for("module_absolute_values", module="pcpu")
    assert (kept["seq"], kept["count"]) == (1, 3)
    second = m.kallsyms()
    a0, a1 = m.history()
    for inc, want in ((a0, first), (a1, second)):
        at = str(ns(inc, "loaded") + 1)
        assert_same_lines(m.export("--at", at), want)
        assert f"{m.percpu['pcpu'] if inc is a1 else 0x34000:016x} a pcpu_pcpu0" in want
    assert d.stop() == 0


def test_status_reports_the_store_size(hist: History) -> None:
    st = ok(call(hist.m.sock, "Status"))
    # The LMDB file only grows: read after the reply, it is at least as large.
    assert 0 < st["store_bytes"] <= (hist.m.state / "data.mdb").stat().st_size


def test_resolve_without_time_uses_what_is_loaded_now(hist: History) -> None:
    res = resolved(hist.m.sock, [f"{BASE_B + 0x85:#x}", f"{BASE_A + 0x85:#x}"])
    assert sym(res[0]) == ("alpha", "alpha_read", "0x5")
    assert res[0]["seq"] == 2
    assert "image" not in res[1]
    table = kreldctl("resolve", f"{BASE_B + 0x85:#x}", *hist.m.opts).stdout
    assert "alpha_read+0x5" in table


def test_module_init_text_has_symbols_only_while_init_was_live(hist: History) -> None:
    b = hist.beta
    assert (b["init_live"], b["initstate"]) == (True, "live")
    assert b["sections"][".init.text"] == f"{BASE_C + INIT:#x}"
    during, after = ns(b, "loaded") + 1, ns(b, "init_done")
    init_addr, text_addr = BASE_C + INIT + 0x2A, BASE_C + 0x1C4
    r = hist.m.resolve(during, init_addr, text_addr)
    assert [sym(x) for x in r] == [("beta", "beta_init", "0x2a"), ("beta", "beta_ioctl", "0x4")]
    assert r[0]["section"] == ".init.text"
    r = hist.m.resolve(after, init_addr, text_addr)
    assert "image" not in r[0] and "symbol" not in r[0]
    assert sym(r[1]) == ("beta", "beta_ioctl", "0x4")
    # Over the socket, on another clock: the same.
    for at, want in (
        (int(b["loaded"]["boottime"]) + 1, "beta_init"),
        (int(b["init_done"]["boottime"]), None),
    ):
        [x] = resolved(hist.m.sock, [f"{init_addr:#x}"], at=at, clock="boottime")
        assert x.get("symbol") == want, x


def test_export_at_a_time_lists_the_modules_loaded_then_newest_first(hist: History) -> None:
    m, a0, b, a1 = hist.m, hist.alpha0, hist.beta, hist.alpha1
    core = core_lines(hist.text)

    def expect(*mods: tuple[str, int], init: bool) -> str:
        lines = list(core)
        for name, base in mods:
            lines += mod_lines(name, base, init=init and name == "beta")
        return "".join(ln + "\n" for ln in [*lines, *BPF])

    # Only alpha, first load.
    assert_same_lines(
        m.export("--at", str(ns(a0, "loaded") + 1)), expect(("alpha", BASE_A), init=False)
    )
    # beta in its init, alpha's first load: beta (newer) first, with its init symbol.
    at = ns(b, "loaded") + 1
    assert at < ns(a0, "unloaded")
    assert_same_lines(
        m.export("--at", str(at)), expect(("beta", BASE_C), ("alpha", BASE_A), init=True)
    )
    # After alpha's reload: alpha at its new addresses, now the newest; beta's init gone.
    # The same moment on the boottime clock, written to a file.
    at = ns(a1, "loaded") + 1
    assert_same_lines(
        m.export("--at", str(at)), expect(("alpha", BASE_B), ("beta", BASE_C), init=False)
    )
    out = m.base / "exported"
    at = int(a1["loaded"]["boottime"]) + 1
    assert m.export("--at", str(at), "--clock", "boottime", "-o", str(out)) == ""
    assert_same_lines(out.read_text(), expect(("alpha", BASE_B), ("beta", BASE_C), init=False))
    # ExportKallsyms on the socket, now: the same as the kernel prints now.
    now = ok(call(m.sock, "ExportKallsyms"))["kallsyms"]
    assert_same_lines(now, expect(("alpha", BASE_B), ("beta", BASE_C), init=False))
    assert_same_lines(now, (m.tree.root / "proc/kallsyms").read_text())
    # Before anything was loaded: the kernel alone.
    early = ok(call(m.sock, "ExportKallsyms", at=ns(a0, "loaded") - 1))["kallsyms"]
    assert_same_lines(early, expect(init=False))


def test_symbolize_reads_addresses_and_perf_script_lines(hist: History) -> None:
    text = hist.text
    stdin = "\n".join(
        [
            f"{text + 0x10480 + 0x21:#x}",
            f"{BASE_A + 0x85:x}",
            "",
            "not an address",
            f"  swapper     0 [002]  4711.123456:     250000 cpu-clock:  "
            f"{text + 0x2004:x} do_one_initcall+0x4 ([kernel.kallsyms])",
            f"\t{BASE_A + 0x1C3:016x} [unknown] ([alpha])",
            "\t    7f12a4b3c2d1 __libc_start_main+0x80 (/usr/lib/libc.so.6)",
            f"\t{0xFFFFFFFFDEAD0000:x} [unknown] ([unknown])",
        ]
    )
    cp = subprocess.run(
        [
            str(Path(sys.executable).parent / "kreldctl"),
            "symbolize",
            "--at",
            str(ns(hist.alpha0, "loaded") + 1),
            *hist.m.opts,
        ],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.splitlines() == [
        f"{text + 0x104A1:#x} __schedule+0x21",
        f"{BASE_A + 0x85:#x} alpha_read+0x5 [alpha]",
        f"{text + 0x2004:#x} do_one_initcall+0x4",
        f"{BASE_A + 0x1C3:#x} alpha_ioctl+0x3 [alpha]",
        f"{0xFFFFFFFFDEAD0000:#x} ?",
    ]


# -- ELF sources: .ko files and vmlinux built here --------------------------------------------


MODULE_C = """\
int kofake_counter = 7;
const char kofake_banner[] = "kofake";
__attribute__((noinline)) static int kofake_helper(int x) { return x * 3 + kofake_counter; }
__attribute__((noinline)) int kofake_func_a(int x) { return kofake_helper(x) + 1; }
__attribute__((noinline)) int kofake_func_b(int x)
{
    return kofake_func_a(x) * 2 + kofake_banner[x & 3];
}
__attribute__((section(".init.text"), noinline)) int kofake_init(void) { return kofake_func_b(1); }
"""


def ko_symbols(ko: Path) -> dict[str, tuple[str, int]]:
    """name -> (section, value) of the defined symbols of a relocatable object."""
    out = {}
    with open(ko, "rb") as f:
        elf = ELFFile(f)
        symtab = elf.get_section_by_name(".symtab")
        assert isinstance(symtab, SymbolTableSection)
        for s in symtab.iter_symbols():
            if s["st_info"]["type"] in ("STT_FUNC", "STT_OBJECT") and s.name:
                out[s.name] = (elf.get_section(s["st_shndx"]).name, int(s["st_value"]))
    return out


class Kos:
    def __init__(self, m: Machine, d: Daemon, symbols: dict[str, tuple[str, int]]) -> None:
        self.m = m
        self.daemon = d
        self.symbols = symbols
        self.missing: dict[str, str] = {}  # case -> why its file could not be made


KO_CASES = {"plain": ".ko", "xz": ".ko.xz", "zst": ".ko.zst"}
UPGRADE_BASE = BASE_A + 0x2000000
SECTION_OFFSETS = {".text": 0, ".data": 0x2000, ".rodata": 0x3000, ".init.text": INIT}


@pytest.fixture(scope="module")
def kos(tmp_path_factory: pytest.TempPathFactory, sock_dir: Path, daemons: list[Daemon]) -> Kos:
    gcc, ld = shutil.which("gcc"), shutil.which("ld")
    if gcc is None or ld is None:
        pytest.skip("gcc/ld not installed: cannot build a .ko")
    base = tmp_path_factory.mktemp("kos")
    src = base / "kofake.c"
    src.write_text(MODULE_C)
    obj = base / "kofake.o"
    subprocess.run(
        [gcc, "-c", "-O2", "-fno-pic", "-fno-asynchronous-unwind-tables", "-o", obj, src],
        check=True,
        capture_output=True,
    )

    def link(build_id: str) -> bytes:
        out = base / f"{build_id}.ko"
        subprocess.run(
            [ld, "-r", f"--build-id=0x{build_id}", "-o", out, obj], check=True, capture_output=True
        )
        return out.read_bytes()

    m = Machine(base / "machine", sock_dir / "kos.sock", daemons)
    misc = m.tree.root / f"lib/modules/{RELEASE}/kernel/drivers/misc"
    misc.mkdir(parents=True)
    missing = {}
    for case, suffix in KO_CASES.items():
        data = link(mod_build_id(f"ko_{case}"))
        if suffix == ".ko.xz":
            data = lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32)
        elif suffix == ".ko.zst":
            try:
                import zstandard
            except ImportError:
                missing[case] = "the zstandard module is not installed"
                continue
            data = zstandard.ZstdCompressor().compress(data)
        # The file name uses '-', the module name '_' (as modprobe maps them).
        (misc / f"ko-{case}{suffix}").write_bytes(data)
    # Right name, right place, another build: never used.
    (misc / "ko-wrong.ko").write_bytes(link(OTHER_ID))
    # Its table from the .ko first, then from kallsyms (test_a_table_from_a_ko_...).
    (misc / "ko-upgrade.ko").write_bytes(link(mod_build_id("ko_upgrade")))
    symbols = ko_symbols(base / f"{OTHER_ID}.ko")

    # The modules are loaded with no lines in kallsyms: the .ko is the only source.
    d = m.start()
    d.wait_for("kernel_symbols", action="stored")
    for i, case in enumerate([*KO_CASES, "wrong"]):
        m.tree.add_module(f"ko_{case}", BASE_A + i * 0x400000, build_id=mod_build_id(f"ko_{case}"))
    for case in KO_CASES:
        if case not in missing:
            d.wait_for("module_symbols", module=f"ko_{case}")
    d.wait_for("module_symbols_unavailable", module="ko_wrong")
    m.tree.add_module("ko_upgrade", UPGRADE_BASE, build_id=mod_build_id("ko_upgrade"))
    d.wait_for("module_symbols", module="ko_upgrade", source="ko")
    kos = Kos(m, d, symbols)
    kos.missing = missing
    return kos


@pytest.mark.parametrize("case", list(KO_CASES))
def test_ko_with_matching_build_id_gives_the_module_symbols(kos: Kos, case: str) -> None:
    if case in kos.missing:
        pytest.skip(kos.missing[case])
    name = f"ko_{case}"
    [ev] = [
        e
        for e in kos.daemon.events()
        if e.get("event") == "module_symbols" and e.get("module") == name
    ]
    assert (ev["source"], ev["build_id"]) == ("ko", mod_build_id(name))
    assert f"m:{mod_build_id(name)}" in symtab_keys(kos.m.state)
    base = BASE_A + list(KO_CASES).index(case) * 0x400000
    wanted = ["kofake_helper", "kofake_func_a", "kofake_func_b", "kofake_counter", "kofake_banner"]
    addrs, expect = [], []
    for n in wanted:
        section, value = kos.symbols[n]
        for k in (0, 3):
            addrs.append(base + SECTION_OFFSETS[section] + value + k)
            expect.append((name, n, f"{k:#x}"))
    res = resolved(kos.m.sock, [f"{a:#x}" for a in addrs])
    assert [sym(r) for r in res] == expect
    assert {r["section"] for r in res} == {".text", ".data", ".rodata"}


def test_ko_with_another_build_id_is_refused(kos: Kos) -> None:
    [ev] = [
        e
        for e in kos.daemon.events()
        if e.get("event") == "module_symbols_unavailable" and e.get("module") == "ko_wrong"
    ]
    assert ev["build_id"] == mod_build_id("ko_wrong")
    assert f"m:{mod_build_id('ko_wrong')}" not in symtab_keys(kos.m.state)
    assert not any(
        e.get("event") == "module_symbols" and e.get("module") == "ko_wrong"
        for e in kos.daemon.events()
    )
    base = BASE_A + len(KO_CASES) * 0x400000
    _, value = kos.symbols["kofake_func_b"]
    [r] = resolved(kos.m.sock, [f"{base + value + 3:#x}"])
    # Still placed in its section, but with no symbol.
    assert (r["image"], r["section"], r["offset"]) == ("ko_wrong", ".text", f"{value + 3:#x}")
    assert "symbol" not in r


def test_a_table_from_a_ko_is_replaced_once_kallsyms_shows_the_module(kos: Kos) -> None:
    """ko_upgrade's table came from its .ko (kallsyms did not show it): the kernel
    prints symbols a .ko lacks, so its next load that kallsyms shows replaces the
    table, once, and Resolve (past its cached accelerator) names the kernel's."""
    m, d, name = kos.m, kos.daemon, "ko_upgrade"
    section, value = kos.symbols["kofake_func_b"]
    before = f"{UPGRADE_BASE + SECTION_OFFSETS[section] + value + 3:#x}"
    [r] = resolved(m.sock, [before])
    assert sym(r) == (name, "kofake_func_b", "0x3")
    m.tree.remove_module(name)
    d.wait_for("module_unloaded", module=name)
    m.load(name, BASE_B)  # now with its lines in kallsyms
    ev = d.wait_for("module_symbols", module=name, source="kallsyms")
    assert ev["replaced"] == "ko"
    [r] = resolved(m.sock, [f"{BASE_B + 0x85:#x}"])
    assert sym(r) == (name, f"{name}_read", "0x5")
    lines = [ln for ln in m.export().splitlines() if ln.endswith(f"\t[{name}]")]
    assert lines == mod_lines(name, BASE_B)
    m.unload(name)
    d.wait_for("module_unloaded", module=name, count=2)
    m.load(name, BASE_B + 0x100000)  # a later load changes nothing more
    d.wait_for("module_loaded", module=name, count=3)
    # The symbol worker takes loads in order: once it has the table of a module
    # loaded after, it has handled this load too.
    m.load("ko_after", BASE_C)
    d.wait_for("module_symbols", module="ko_after", source="kallsyms")
    replaced = [e for e in d.events() if e.get("event") == "module_symbols" and e["module"] == name]
    assert [e["source"] for e in replaced] == ["ko", "kallsyms"]


VMLINUX_ASM = """\
    .text
    .globl _text, _stext, startup_64, _etext, _sinittext, _einittext
    .globl vm_func_one, vm_func_two
_text:
_stext:
startup_64:
    nop
    ret
    .balign 0x40
    .type vm_func_one, @function
vm_func_one:
    .fill 0x30, 1, 0x90
    ret
    .size vm_func_one, . - vm_func_one
    .balign 0x40
    .type vm_helper, @function
vm_helper:
    .fill 0x20, 1, 0x90
    ret
    .size vm_helper, . - vm_helper
    .balign 0x40
    .type vm_func_two, @function
vm_func_two:
    .fill 0x10, 1, 0x90
    ret
    .size vm_func_two, . - vm_func_two
    .set _etext, _text + 0x1000000
    .set _sinittext, _text + 0x3000000
    .set _einittext, _text + 0x3100000
"""


def build_vmlinux(work: Path, build_id: str) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed: cannot build a vmlinux")
    return link_vmlinux(gcc, VMLINUX_ASM, work / f"vmlinux-{build_id[:8]}", LINK, build_id)


def nm_symbols(path: Path) -> dict[str, int]:
    out = subprocess.run(["nm", str(path)], check=True, capture_output=True, text=True).stdout
    return {p[2]: int(p[0], 16) for p in (ln.split() for ln in out.splitlines()) if len(p) == 3}


def restricted_machine(tmp_path: Path, sock: Path, started: list[Daemon], vm_id: str) -> Machine:
    """kallsyms all zeros, VMCOREINFO readable in kcore, a vmlinux of build *vm_id*."""
    m = Machine(tmp_path / "m", sock, started, kptr_restrict=2)
    m.tree.set_text(LINK + SLIDES[0], zero=True)
    m.tree.write("proc/kcore", kcore(f"OSRELEASE={RELEASE}\nKERNELOFFSET={SLIDES[0]:x}\n".encode()))
    vmlinux = build_vmlinux(tmp_path, vm_id)
    dest = m.tree.root / f"boot/vmlinux-{RELEASE}"
    dest.parent.mkdir(parents=True)
    shutil.copyfile(vmlinux, dest)
    return m


def test_matching_vmlinux_gives_symbols_when_kallsyms_is_restricted(
    tmp_path: Path, sock_dir: Path, daemons: list[Daemon]
) -> None:
    m = restricted_machine(tmp_path, sock_dir / "vm.sock", daemons, BUILD_ID)
    d = m.start()
    d.wait_for("kernel_symbols_from_vmlinux", path=str(m.tree.root / f"boot/vmlinux-{RELEASE}"))
    ev = d.wait_for("kernel_symbols", action="stored")
    assert ev["table"] == f"v:{BUILD_ID}"
    boot = ok(call(m.sock, "GetBoot"))["boot"]
    assert boot["restricted"] is True
    assert (boot["kaslr_offset"], boot["kaslr_source"]) == (f"{SLIDES[0]:#x}", "vmcoreinfo")
    text = LINK + SLIDES[0]
    assert boot["anchors"]["text"] == f"{text:#x}"
    assert boot["anchors"]["etext"] == f"{text + 0x1000000:#x}"

    nm = nm_symbols(build_vmlinux(tmp_path, BUILD_ID))
    addrs, want = [], []
    for name in ("vm_func_one", "vm_helper", "vm_func_two"):
        for k in (0, 0x7, 0x10):
            addrs.append(nm[name] - LINK + text + k)
            want.append(("kernel", name, f"{k:#x}"))
    res = resolved(m.sock, [f"{a:#x}" for a in addrs])
    assert [sym(r) for r in res] == want
    assert symtab_keys(m.state) == [f"v:{BUILD_ID}"]
    # kreldctl on the store alone says the same.
    assert [sym(r) for r in m.resolve(None, *addrs)] == want
    assert d.stop() == 0


def test_vmlinux_with_another_build_id_gives_no_symbols(
    tmp_path: Path, sock_dir: Path, daemons: list[Daemon]
) -> None:
    m = restricted_machine(tmp_path, sock_dir / "vmx.sock", daemons, OTHER_ID)
    d = m.start()
    d.wait_for("kernel_symbols_unavailable", restricted=True)
    assert not any(e.get("event") == "kernel_symbols_from_vmlinux" for e in d.events())
    boot = ok(call(m.sock, "GetBoot"))["boot"]
    # The slide is known from VMCOREINFO, but without the image no address is.
    assert boot["kaslr_offset"] == f"{SLIDES[0]:#x}"
    assert boot["anchors"]["text"] is None
    assert symtab_keys(m.state) == []
    text = LINK + SLIDES[0]
    for method, params in (
        ("ExportKallsyms", {}),
        ("Resolve", {"addresses": [f"{text + 0x47:#x}"]}),
    ):
        reply = call(m.sock, method, **params)
        assert reply.get("error") == "io.kreld.AddressesRestricted", reply
        assert "kptr_restrict=2" in reply["parameters"]["reason"]
    cp = kreldctl("export", "kallsyms", *m.opts, check=False)
    assert cp.returncode == 4 and cp.stdout == "", cp.stderr
    assert d.stop() == 0


def test_export_of_a_boot_recorded_without_symbols_is_symbols_unavailable(
    tmp_path: Path, sock_dir: Path, daemons: list[Daemon]
) -> None:
    """A boot recorded before the symbol cache existed (or before its capture ran)."""
    m = Machine(tmp_path / "m", sock_dir / "nosym.sock", daemons)
    snap, _notes = take_snapshot(Root(m.tree.root))
    m.state.mkdir()
    with Store(m.state) as store:
        store.boots.record_boot(snap)
    cp = kreldctl("export", "kallsyms", *m.opts, check=False)
    assert cp.returncode == 1, cp.stderr
    assert "no kernel symbols recorded for boot" in cp.stderr and cp.stdout == ""
    # Resolve still places addresses, without symbols.
    [r] = m.resolve(None, LINK + SLIDES[0] + 0x2010)
    assert (r["image"], r["section"], r["offset"]) == ("kernel", ".text", "0x2010")
    assert "symbol" not in r
    # A daemon started on the boot captures the table; the export then works.
    d = m.start()
    d.wait_for("kernel_symbols", action="stored")
    reply = call(m.sock, "ExportKallsyms", boot_id=m.tree.boot_id)
    assert_same_lines(ok(reply)["kallsyms"], m.kallsyms())
    assert d.stop(signal.SIGTERM) == 0


def test_a_load_gone_before_its_batch_costs_no_read_of_kallsyms(
    tree: FakeTree, tmp_path: Path
) -> None:
    """The kernel drops an unloaded module's lines from kallsyms with its sysfs
    directory, so the worker reads kallsyms only for a load still there: with
    kallsyms unreadable after the start, a load gone before its batch is
    captured (from its .ko, here none) without a try, one still loaded tries."""
    root = Root(tree.root)
    buf = io.StringIO()
    log = structlog.wrap_logger(
        structlog.PrintLogger(buf),
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
    )

    def events(name: str) -> list[dict[str, Any]]:
        lines = [json.loads(ln) for ln in buf.getvalue().splitlines() if ln.strip()]
        return [e for e in lines if e["event"] == name]

    def load(name: str, base: int) -> Incarnation:
        tree.add_module(name, base)
        state = read_module(root, name)
        assert state is not None
        return new_incarnation(state, Timestamp.now(), SeenBy.INOTIFY)

    with symbol_worker(tree, tmp_path / "state", log) as (store, stored, capture):
        assert store.boot_symbols(stored.boot_id) is not None
        (tree.root / "proc/kallsyms").unlink()
        (tree.root / "proc/kallsyms").mkdir()  # a read now fails, and says so
        gone = load("gone", 0xFFFFFFFFC1000000)
        tree.remove_module("gone")
        capture.on_event("load", gone)
        assert capture.idle.wait(30)
        assert [e["module"] for e in events("module_symbols_unavailable")] == ["gone"]
        assert events("kallsyms_unreadable") == []
        capture.on_event("load", load("here", 0xFFFFFFFFC2000000))
        assert capture.idle.wait(30)
        assert [e["module"] for e in events("module_symbols_unavailable")] == ["gone", "here"]
        assert len(events("kallsyms_unreadable")) == 1
