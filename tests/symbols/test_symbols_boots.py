"""The symbol cache over boots of one build, kreld a real subprocess on fake trees:
one kernel table shared by the boots whose kallsyms agree, a table of its own for
a boot whose kallsyms differs, and gc of the tables no boot uses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kreld.core.model import BootSymbols
from kreld.store import Store

from support.run import Daemon, kreldctl
from support.symanswers import (
    assert_same_but_module_order,
    assert_same_lines,
    by_owner,
    shift_line,
    sym,
    symtab_keys,
)
from support.symbols import (
    BASE_A,
    BASE_B,
    BASE_C,
    BUILD_ID,
    CORE,
    LINK,
    SLIDES,
    CoreSym,
    Machine,
    core_lines,
    mod_build_id,
)
from support.symbols import daemons as daemons
from support.symbols import sock_dir as sock_dir

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
