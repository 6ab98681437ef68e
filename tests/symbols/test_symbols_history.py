"""The symbol cache over a module's incarnations, kreld a real subprocess on a fake
tree: each load symbolized and exported at its own times, per-cpu offsets, init
text while init was live, and symbolize's input forms."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support.run import Daemon, kreldctl
from support.symanswers import (
    assert_same_lines,
    call,
    ns,
    ok,
    resolved,
    sym,
    symtab_keys,
)
from support.symbols import (
    BASE_A,
    BASE_B,
    BASE_C,
    INIT,
    LINK,
    SLIDES,
    Machine,
    core_lines,
    mod_build_id,
    mod_lines,
)
from support.symbols import daemons as daemons
from support.symbols import sock_dir as sock_dir
from support.wait import wait_until

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
