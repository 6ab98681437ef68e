"""Module tracking end to end: kreld as a real subprocess on a fake tree, kreldctl reading
what it recorded.  Both watch paths run where they differ: inotify (ordinary filesystems)
and polling (what sysfs needs)."""

from __future__ import annotations

import io
import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from kreld.core.model import SeenBy
from kreld.kernel.info import Root
from kreld.store import Store
from kreld.tracker.modules import Hint, ModuleTracker

from support.faketree import FakeTree
from support.run import kreldctl
from support.tmpdirs import fast_tmpdir
from support.wait import wait_for_turns, wait_until

BASE_A = 0xFFFFFFFFC0400000
BASE_B = 0xFFFFFFFFC0900000
BUILD_ID = "8d3c1f0e9a7b6c5d4e3f2a1b0c9d8e7f6a5b4c3d"
CLOCKS = ("monotonic", "boottime", "realtime")
SECTION_NAMES = {
    ".text",
    ".data",
    ".rodata",
    ".gnu.linkonce.this_module",
    ".init.text",
    ".exit.text",
}

Events = list[dict[str, Any]]


class Env:
    """One fake machine: a tree, a store, a config; starts kreld and runs kreldctl on it."""

    def __init__(
        self, tree: FakeTree, data: Path, tmp_path: Path, factory: Any, method: str
    ) -> None:
        self.tree = tree
        self.method = method
        self.state_dir = data / "state"
        self.socket = str(tmp_path / "kreld.sock")
        self.config = tmp_path / f"kreld-{method}.toml"
        # A heartbeat each second: the idle checks tests wait on come that often.
        self.config.write_text(
            f'[modules]\nwatch = "{method}"\npoll_interval = 0.2\nheartbeat_interval = 1.0\n'
        )
        self.factory = factory
        self.runs = 0
        self.holds: list[int] = []

    @property
    def common(self) -> list[str]:
        return [
            "--root",
            str(self.tree.root),
            "--state-dir",
            str(self.state_dir),
            "--config",
            str(self.config),
        ]

    def start(self) -> Any:
        """A new kreld run, with a log of its own; returns once it is ready."""
        self.runs += 1
        d = self.factory(*self.common, "--socket", self.socket, log_name=f"kreld-{self.runs}.log")
        return d.start(timeout=30)

    def ask_daemon(self, *args: str) -> Any:
        """kreldctl answered by the running daemon (not the store)."""
        return json.loads(kreldctl(*args, *self.common, "--socket", self.socket, "--json").stdout)

    def ctl(self, *args: str) -> Any:
        return json.loads(kreldctl(*args, *self.common, "--json").stdout)

    def modules(self, *args: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.ctl("modules", *args)
        return out

    def history(self) -> list[dict[str, Any]]:
        return self.modules("--all")

    def resolve(self, at: int, *addrs: int, clock: str = "monotonic") -> list[dict[str, Any]]:
        cp = kreldctl(
            "resolve",
            *(f"{a:#x}" for a in addrs),
            "--at",
            str(at),
            "--clock",
            clock,
            *self.common,
            "--json",
            check=False,
        )
        assert cp.returncode in (0, 1), cp.stderr
        out: list[dict[str, Any]] = json.loads(cp.stdout)
        assert cp.returncode == (0 if all(r.get("image") for r in out) else 1)
        return out

    def load(self, name: str, base: int, **kw: Any) -> None:
        """Load *name* in the kernel's order: listed in /proc/modules (from the start of
        the load) before its sysfs directory appears (FakeTree.add_module does the
        reverse, so a read between the two would find no core base)."""
        self.tree.modules[name] = (base, kw.get("coresize", 0x4000))
        self.tree._write_proc_modules()
        self.tree.add_module(name, base, **kw)

    def unload(self, name: str) -> None:
        """Unload *name*, keeping its directory's inode number in use as kernfs does.

        kernfs never hands a removed directory's inode number to the next one (it
        allocates them cyclically); ext4 would reuse it at once, making a reload
        look like the same directory.  An open descriptor keeps the inode alive.
        """
        self.holds.append(os.open(self.tree.root / "sys/module" / name, os.O_RDONLY))
        self.tree.remove_module(name)

    def close(self) -> None:
        for fd in self.holds:
            os.close(fd)
        self.holds.clear()


@pytest.fixture
def fast_dir() -> Iterator[Path]:
    with fast_tmpdir() as d:
        yield d


def make_env(fast_dir: Path, tmp_path: Path, factory: Any, method: str) -> Env:
    return Env(FakeTree(fast_dir / "root"), fast_dir, tmp_path, factory, method)


@pytest.fixture(params=["inotify", "poll"])
def env(
    request: pytest.FixtureRequest, fast_dir: Path, tmp_path: Path, daemon_factory: Any
) -> Iterator[Env]:
    e = make_env(fast_dir, tmp_path, daemon_factory, request.param)
    yield e
    e.close()


@pytest.fixture
def ienv(fast_dir: Path, tmp_path: Path, daemon_factory: Any) -> Iterator[Env]:
    """The inotify path only: where a test needs every event of a fast burst seen."""
    e = make_env(fast_dir, tmp_path, daemon_factory, "inotify")
    yield e
    e.close()


def loads_of(events: Events, names: set[str] | None = None) -> Events:
    return [
        e
        for e in events
        if e.get("event") in ("module_loaded", "module_came_and_went")
        and (names is None or e.get("module") in names)
    ]


def unloads_of(events: Events, names: set[str] | None = None) -> Events:
    return [
        e
        for e in events
        if e.get("event") in ("module_unloaded", "module_came_and_went")
        and (names is None or e.get("module") in names)
    ]


def ts(inc: dict[str, Any], key: str, clock: str = "monotonic") -> int:
    v = inc[key]
    assert v is not None, f"{inc['name']} seq {inc['seq']} has no {key}"
    return int(v[clock])


GONE = "gone before it could be read"


def came_and_went(inc: dict[str, Any]) -> bool:
    """A load known only from its event: the module was gone when kreld looked."""
    return GONE in inc["faults"]


def check_history(incs: list[dict[str, Any]]) -> None:
    """Invariants of any boot's history, whatever happened."""
    seqs = [i["seq"] for i in incs]
    assert seqs == list(range(len(incs))), "seqs must be 0..n-1, in order, no duplicates"
    for a, b in itertools.pairwise(incs):
        for c in CLOCKS:
            assert ts(a, "loaded", c) <= ts(b, "loaded", c), (a["seq"], b["seq"], c)
    by_name: dict[str, list[dict[str, Any]]] = {}
    for i in incs:
        if i["unloaded"] is not None:
            for c in CLOCKS:
                assert ts(i, "loaded", c) <= ts(i, "unloaded_after", c) <= ts(i, "unloaded", c)
            assert i["unload_seen_by"] is not None
        if came_and_went(i):
            # Nothing was read, so nothing is claimed: no address, a stay of no length.
            assert i["sections"] == {} and i["build_id"] is None and i["inode"] is None
            assert i["unloaded"] is not None and i["loaded"] == i["unloaded"], i["seq"]
        else:
            by_name.setdefault(i["name"], []).append(i)
    for name, chain in by_name.items():
        # The loads of one module that were read never overlap, and their seqs follow
        # their times.  (A load that came and went may be learnt of after a later load
        # of the same module was read: watchdog holds inotify events back 0.5 s behind
        # an unpaired move, polling lags an interval.  It is recorded when learnt of.)
        for a, b in itertools.pairwise(chain):
            assert a["unloaded"] is not None, f"{name}: seq {a['seq']} open, seq {b['seq']} after"
            assert ts(a, "unloaded") <= ts(b, "loaded"), (name, a["seq"], b["seq"])
        assert len({i["inode"] for i in chain}) == len(chain), f"{name}: one load read twice"


# -- one module's life -----------------------------------------------------------------


def test_module_appears_and_is_listed_with_all_its_sections(env: Env) -> None:
    env.tree.add_builtin("printk")
    d = env.start()
    env.load("dummy", BASE_A, build_id=BUILD_ID, coresize=0x5000, initsize=0x800)
    d.wait_for("module_loaded", module="dummy")
    now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    [m] = env.modules()
    assert m["name"] == "dummy"
    assert m["seq"] == 0
    assert m["boot_id"] == env.tree.boot_id
    assert m["build_id"] == BUILD_ID
    assert set(m["sections"]) == SECTION_NAMES
    assert m["sections"][".text"] == f"{BASE_A:#x}"
    assert m["sections"][".data"] == f"{BASE_A + 0x2000:#x}"
    assert m["sections"][".init.text"] == f"{BASE_A + 0x100000:#x}"
    assert m["sections"][".exit.text"] == f"{BASE_A + 0x1800:#x}"
    assert m["core_base"] == f"{BASE_A:#x}"
    assert (m["coresize"], m["initsize"]) == (0x5000, 0x800)
    assert m["initstate"] == "live"
    assert m["seen_by"] == env.method
    assert m["init_live"] is False
    assert m["unloaded"] is None and m["unloaded_after"] is None
    assert m["faults"] == []
    assert set(m["loaded"]) == set(CLOCKS)
    assert 0 < m["loaded"]["monotonic"] <= now
    assert d.stop() == 0


def test_module_vanishes_and_gets_an_unload_time(env: Env) -> None:
    d = env.start()
    env.load("dummy", BASE_A)
    d.wait_for("module_loaded", module="dummy")
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    env.unload("dummy")
    removed = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    d.wait_for("module_unloaded", module="dummy")
    assert env.modules() == []
    [m] = env.history()
    assert m["unload_seen_by"] == env.method
    for c in CLOCKS:
        assert ts(m, "loaded", c) <= ts(m, "unloaded_after", c) <= ts(m, "unloaded", c)
    # Seen present at unloaded_after, gone at unloaded: both honest.
    assert ts(m, "unloaded_after") <= removed
    assert ts(m, "unloaded") >= before
    assert d.stop() == 0


def test_reload_at_another_address_gives_two_incarnations_each_resolved(env: Env) -> None:
    d = env.start()
    env.load("dummy", BASE_A)
    d.wait_for("module_loaded", module="dummy")
    env.unload("dummy")
    d.wait_for("module_unloaded", module="dummy")
    env.load("dummy", BASE_B)
    d.wait_for("module_loaded", module="dummy", count=2)

    first, second = env.history()
    assert (first["seq"], second["seq"]) == (0, 1)
    assert first["sections"][".text"] == f"{BASE_A:#x}"
    assert second["sections"][".text"] == f"{BASE_B:#x}"
    assert first["unloaded"] is not None and second["unloaded"] is None
    check_history([first, second])

    a_text, a_data, a_init = BASE_A + 0x10, BASE_A + 0x2042, BASE_A + 0x100010
    b_text, b_data = BASE_B + 0x10, BASE_B + 0x2042
    kernel = env.tree.text + 0x1234
    during_first = (ts(first, "loaded") + ts(first, "unloaded_after")) // 2
    between = ts(first, "unloaded")
    after_reload = ts(second, "loaded") + 1000

    r = env.resolve(during_first, a_text, a_data, b_text, a_init, kernel)
    assert [(x.get("image"), x.get("section"), x.get("offset"), x.get("seq")) for x in r] == [
        ("dummy", ".text", "0x10", 0),
        ("dummy", ".data", "0x42", 0),
        (None, None, None, None),
        # Init text of a module first seen live was freed before anyone could sample it.
        (None, None, None, None),
        ("kernel", ".text", "0x1234", None),
    ]
    assert r[0]["base"] == f"{BASE_A:#x}"

    r = env.resolve(between, a_text, b_text)
    assert [x.get("image") for x in r] == [None, None]

    r = env.resolve(after_reload, a_text, b_text, b_data)
    assert [(x.get("image"), x.get("section"), x.get("offset"), x.get("seq")) for x in r] == [
        (None, None, None, None),
        ("dummy", ".text", "0x10", 1),
        ("dummy", ".data", "0x42", 1),
    ]
    assert r[1]["base"] == f"{BASE_B:#x}"

    # The same question on the realtime clock, with the first incarnation's realtime stamps.
    rt = (ts(first, "loaded", "realtime") + ts(first, "unloaded_after", "realtime")) // 2
    r = env.resolve(rt, a_text, b_text, clock="realtime")
    assert [(x.get("image"), x.get("seq")) for x in r] == [("dummy", 0), (None, None)]

    assert [m["seq"] for m in env.modules("--at", str(during_first))] == [0]
    assert d.stop() == 0


# -- bursts ------------------------------------------------------------------------------


def test_burst_of_250_modules_loaded_then_unloaded(env: Env) -> None:
    names = [f"burst{i:03d}" for i in range(250)]
    d = env.start()
    for i, n in enumerate(names):
        env.load(n, BASE_A + i * 0x10000)
    if env.method == "poll":
        # Polling only sees what outlives an interval: let it see the loads first.
        wait_until("250 loads", lambda: len(loads_of(d.events(), set(names))) >= 250, 60)
    for n in names:
        env.unload(n)
    wait_until("250 unloads", lambda: len(unloads_of(d.events(), set(names))) >= 250, 60)
    # Anything late (a duplicate) comes before the tracker's second idle check from now.
    wait_for_turns(env.socket, "tracker_idle_checks")
    hist = env.history()
    check_history(hist)
    assert sorted(i["name"] for i in hist) == names, "one incarnation per load"
    assert all(i["unloaded"] is not None for i in hist)
    read = [i for i in hist if not came_and_went(i)]
    assert [i["name"] for i in read] == sorted(i["name"] for i in read), "in load order"
    if env.method == "poll":
        assert len(read) == 250
        assert all(".text" in i["sections"] for i in read)
    for i in read:
        k = names.index(i["name"])
        if ".text" in i["sections"]:
            assert i["sections"][".text"] == f"{BASE_A + k * 0x10000:#x}"
        else:
            assert i["faults"], i  # read while it went: what was missed is said
    assert env.modules() == []
    assert env.ask_daemon("modules") == []
    assert len(loads_of(d.events())) == 250
    assert d.stop() == 0


def test_bursts_of_short_lived_loads_beside_a_real_sized_kallsyms_all_get_their_sections(
    ienv: Env,
) -> None:
    """20 loads, their 20 unloads 100 ms later, 10 times over, while kallsyms has
    122,000 lines: every load is recorded with its section bases.  The symbol
    capture each burst sets off never keeps the tracker from reading sysfs
    before the modules go (it used to parse all of kallsyms per burst, and a
    third of such loads came out "gone before it could be read").  (bench/
    bench_modules.py runs the same with 50 ms, 30 times; 100 ms here leaves
    room for a test machine's scheduler.)"""
    env = ienv
    env.tree.grow_kallsyms(122_000)
    d = env.start()
    d.wait_for("kernel_symbols", timeout=60)
    names: list[str] = []
    for cycle in range(10):
        burst = [f"churn{cycle:02d}_{i:02d}" for i in range(20)]
        for i, n in enumerate(burst):
            env.load(n, BASE_A + (cycle * 20 + i) * 0x10000)
        time.sleep(0.1)
        for n in burst:
            env.unload(n)
        names += burst
    wait_until("200 unloads", lambda: len(unloads_of(d.events(), set(names))) >= 200, 60)
    hist = env.history()
    check_history(hist)
    assert sorted(i["name"] for i in hist) == names, "one incarnation per load"
    lost = [i["name"] for i in hist if ".text" not in i["sections"]]
    assert lost == [], f"{len(lost)} of 200 loads recorded without section bases"
    for i in hist:
        k = names.index(i["name"])
        assert i["sections"][".text"] == f"{BASE_A + k * 0x10000:#x}"
    assert d.stop() == 0


def test_flapping_module_250_times_loses_nothing(ienv: Env) -> None:
    env = ienv
    d = env.start()
    env.load("steady", BASE_B)
    d.wait_for("module_loaded", module="steady")
    for k in range(250):
        env.load("flap", BASE_A + (k % 7) * 0x10000)
        env.unload("flap")
    wait_until("250 flap unloads", lambda: len(unloads_of(d.events(), {"flap"})) >= 250, 60)
    wait_for_turns(env.socket, "tracker_idle_checks")  # anything late comes before
    hist = env.history()
    check_history(hist)
    flaps = [i for i in hist if i["name"] == "flap"]
    assert len(flaps) == 250
    assert all(i["unloaded"] is not None for i in flaps)
    # Whatever was read of a flap is one of the addresses it had; a read cut short
    # by the unload says what it missed.
    allowed = {f"{BASE_A + j * 0x10000:#x}" for j in range(7)}
    for i in flaps:
        if ".text" in i["sections"]:
            assert i["sections"][".text"] in allowed
        else:
            assert i["faults"], i
    [steady] = env.modules()
    assert (steady["name"], steady["seq"]) == ("steady", 0)
    assert env.ask_daemon("modules") == [steady]
    assert len(loads_of(d.events(), {"flap"})) == 250
    assert d.stop() == 0


# -- restarts ----------------------------------------------------------------------------


def test_kill_9_mid_burst_then_restart_keeps_history_whole(ienv: Env) -> None:
    env = ienv
    pre = [f"pre{i:02d}" for i in range(40)]
    burst = [f"burst{i:03d}" for i in range(200)]
    for i, n in enumerate(pre):
        env.load(n, BASE_B + i * 0x10000)
    d1 = env.start()

    killed = threading.Event()
    errors: list[BaseException] = []

    def run_burst() -> None:
        try:
            for i, n in enumerate(burst):
                if i == 150:
                    killed.wait(60)  # the rest of the burst happens while kreld is down
                env.load(n, BASE_A + i * 0x10000)
                if i % 4 == 1 and i // 4 < 20:
                    env.unload(pre[i // 4])  # some pre-loaded ones go during the burst
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run_burst)
    t.start()
    try:
        wait_until(
            "part of the burst recorded", lambda: len(loads_of(d1.events(), set(burst))) >= 20, 60
        )
        assert d1.stop(signal.SIGKILL) == -signal.SIGKILL
    finally:
        killed.set()
        t.join()
    assert not errors

    before = env.history()  # read from the store: the daemon is dead
    check_history(before)
    assert len(pre) + 20 <= len(before) < len(pre) + len(burst)
    open_before = {i["name"]: i for i in before if i["unloaded"] is None}
    # While kreld is down: some modules it knew go, more come.
    gone_while_down = sorted(open_before)[:15]
    for n in gone_while_down:
        env.unload(n)
    late = [f"late{i}" for i in range(5)]
    for i, n in enumerate(late):
        env.load(n, BASE_A + (300 + i) * 0x10000)
    present = set(os.listdir(env.tree.root / "sys/module"))
    assert len(present) == len(pre) + len(burst) + len(late) - 20 - len(gone_while_down)

    d2 = env.start()
    startup = d2.wait_for("modules_startup")
    after = env.history()
    check_history(after)

    # History whole: what was recorded is still there, same seq, same load.
    for old in before:
        new = after[old["seq"]]
        for key in ("name", "loaded", "seen_by", "sections", "build_id"):
            assert new[key] == old[key], (old["seq"], key)
        if old["unloaded"] is not None:
            assert new == old
    # Nothing duplicated: every module ever seen is exactly one incarnation,
    # and every module present now is open.
    names = [i["name"] for i in after]
    assert len(names) == len(set(names))
    assert {i["name"] for i in after if i["unloaded"] is None} == present
    assert set(names) == {i["name"] for i in before} | present
    # Still loaded: continued, not re-opened.
    for n, old in open_before.items():
        if n in present:
            assert after[old["seq"]]["unloaded"] is None
    # Gone while down (those unloaded above, and the burst's own unloads kreld missed):
    # closed by the startup scan with an honest window.
    closed_at_startup = [n for n in open_before if n not in present]
    assert set(gone_while_down) <= set(closed_at_startup)
    for n in closed_at_startup:
        inc = after[open_before[n]["seq"]]
        assert inc["unload_seen_by"] == "startup"
        assert ts(inc, "loaded") <= ts(inc, "unloaded_after") < ts(inc, "unloaded")
    # New while down: opened by the startup scan.
    new_ones = after[len(before) :]
    assert new_ones and all(i["seen_by"] == "startup" for i in new_ones)
    assert {i["name"] for i in new_ones} >= set(late)
    assert startup["continued"] == len([n for n in open_before if n in present])
    assert startup["closed_while_down"] == len(closed_at_startup)
    assert startup["opened"] == len(new_ones)
    assert env.ask_daemon("modules") == env.modules()
    assert d2.stop() == 0


def test_startup_twice_on_the_same_boot_does_not_duplicate(ienv: Env) -> None:
    env = ienv
    for i, n in enumerate(("alpha", "beta", "gamma")):
        env.load(n, BASE_A + i * 0x100000)
    env.tree.add_builtin("printk")
    d1 = env.start()
    first = env.history()
    assert [(i["name"], i["seen_by"], i["unloaded"]) for i in first] == [
        ("alpha", "startup", None),
        ("beta", "startup", None),
        ("gamma", "startup", None),
    ]
    assert d1.stop(signal.SIGTERM) == 0

    for _ in range(2):
        d = env.start()
        s = d.wait_for("modules_startup")
        assert (s["continued"], s["opened"], s["closed_while_down"]) == (3, 0, 0)
        assert d.stop(signal.SIGTERM) == 0
    assert env.history() == first
    assert len(env.ctl("boots")) == 1


def test_sigterm_exits_zero_and_is_not_an_unload(ienv: Env) -> None:
    env = ienv
    d = env.start()
    env.load("dummy", BASE_A)
    d.wait_for("module_loaded", module="dummy")
    assert d.stop(signal.SIGTERM) == 0
    events = [e["event"] for e in d.events()]
    assert events[-1] == "stopped"
    assert "signal" in events[events.index("module_loaded") :]
    [m] = env.modules()
    assert m["unloaded"] is None


# -- bad directories, modules caught in their init --------------------------------------


def test_garbage_module_is_recorded_as_far_as_readable_and_kreld_goes_on(ienv: Env) -> None:
    env = ienv
    d = env.start()
    kernel_note = (env.tree.root / "sys/kernel/notes").read_bytes()
    env.load(
        "broken",
        BASE_A,
        extra_files={
            "notes/.note.gnu.build-id": kernel_note[:22],  # cut inside the descriptor
            "sections/.data": b"0xzzzz-not-hex\n",
            "coresize": b"a lot\n",
        },
    )
    d.wait_for("module_loaded", module="broken")
    faults = [e for e in d.events() if e.get("event") == "module_read_fault"]
    text = " | ".join(e["fault"] for e in faults)
    assert len(faults) == 3, text
    assert all(e["module"] == "broken" and e["seq"] == 0 for e in faults)
    assert "notes/.note.gnu.build-id" in text
    assert "sections/.data" in text
    assert "coresize" in text
    assert {e["level"] for e in faults} == {"warning"}

    env.load("good", BASE_B, build_id=BUILD_ID)
    d.wait_for("module_loaded", module="good")
    assert d.proc is not None and d.proc.poll() is None
    broken, good = env.modules()
    assert broken["name"] == "broken"
    assert broken["build_id"] is None
    assert broken["coresize"] is None
    assert broken["initsize"] == 0x1000
    assert ".data" not in broken["sections"]
    assert broken["sections"][".text"] == f"{BASE_A:#x}"
    assert broken["sections"][".rodata"] == f"{BASE_A + 0x3000:#x}"
    assert len(broken["faults"]) == 3
    assert (good["name"], good["build_id"], good["faults"]) == ("good", BUILD_ID, [])

    # What was read resolves; the unreadable section does not invent an address.
    r = env.resolve(ts(good, "loaded") + 1, BASE_A + 0x10, BASE_B + 0x3004)
    assert (r[0].get("image"), r[0]["section"], r[0].get("build_id")) == ("broken", ".text", None)
    assert (r[1].get("image"), r[1]["section"], r[1]["offset"]) == ("good", ".rodata", "0x4")
    assert d.stop() == 0


def test_module_first_seen_coming_has_live_init_text_until_init_done(env: Env) -> None:
    d = env.start()
    env.load("slow", BASE_A, initstate="coming", initsize=0x2000)
    d.wait_for("module_loaded", module="slow", initstate="coming")
    [m] = env.modules()
    assert (m["initstate"], m["init_live"], m["init_done"]) == ("coming", True, None)
    assert m["sections"][".init.text"] == f"{BASE_A + 0x100000:#x}"
    init_addr = BASE_A + 0x100000 + 0x123
    during_init = ts(m, "loaded") + 1

    # Its init returns: the kernel frees the init sections and says "live".
    env.tree.write("sys/module/slow/initstate", "live\n")
    m = wait_until(
        "init_done", lambda: next((x for x in env.modules() if x["init_done"]), None), 60
    )
    assert (m["seq"], m["initstate"], m["init_live"]) == (0, "live", True)
    assert ts(m, "loaded") < ts(m, "init_done")
    env.unload("slow")
    d.wait_for("module_unloaded", module="slow")
    assert len(env.history()) == 1

    r = env.resolve(during_init, init_addr, BASE_A + 0x20)
    assert [(x.get("image"), x["section"], x["offset"], x["seq"]) for x in r] == [
        ("slow", ".init.text", "0x123", 0),
        ("slow", ".text", "0x20", 0),
    ]
    r = env.resolve(ts(m, "init_done"), init_addr, BASE_A + 0x20)
    assert r[0].get("image") is None
    assert (r[1].get("image"), r[1]["section"]) == ("slow", ".text")
    assert d.stop() == 0


# -- the reconciler alone, in this process: what no source reports ------------------------


@pytest.fixture
def tracker_on(fast_dir: Path) -> Iterator[Callable[..., tuple[ModuleTracker, Store, FakeTree]]]:
    """A real ModuleTracker on a real store and tree, with no event source at all."""
    running: list[tuple[threading.Event, threading.Thread, Store]] = []

    def make(
        setup: Callable[[FakeTree], None], heartbeat: float
    ) -> tuple[ModuleTracker, Store, FakeTree]:
        tree = FakeTree(fast_dir / "root")
        setup(tree)
        store = Store(fast_dir / "state")
        log = structlog.wrap_logger(
            structlog.PrintLogger(io.StringIO()), processors=[structlog.processors.JSONRenderer()]
        )
        tracker = ModuleTracker(
            store,
            Root(tree.root),
            tree.boot_id,
            log,
            recheck_interval=0.05,
            heartbeat_interval=heartbeat,
        )
        tracker.startup()
        stop = threading.Event()
        t = threading.Thread(target=tracker.run, args=(stop,), daemon=True)
        t.start()
        running.append((stop, t, store))
        return tracker, store, tree

    yield make
    for stop, t, store in running:
        stop.set()
        t.join(10)
        store.close()


def test_a_late_hint_paired_in_a_batch_with_nothing_to_write_is_not_paired_again(
    fast_dir: Path,
) -> None:
    """A full look records a load before its event comes; the event then pairs
    with it in a batch that has nothing to write.  That pairing is kept: the
    next load, which came and went, is still recorded.  (It was once forgotten
    and the next load's event taken for the late one, so a flapping module lost
    loads whenever kreld fell behind: 244 of 250 under a CPU-bound neighbour.)"""
    tree = FakeTree(fast_dir / "root")
    add, remove = Hint(SeenBy.INOTIFY, "add", "flap"), Hint(SeenBy.INOTIFY, "remove", "flap")
    log = structlog.wrap_logger(structlog.PrintLogger(io.StringIO()))
    with Store(fast_dir / "state") as store:
        tracker = ModuleTracker(store, Root(tree.root), tree.boot_id, log)
        tracker.startup()
        tree.add_module("flap", BASE_A)
        tracker.reconcile([])  # the full look finds it before its event
        tracker.reconcile([add])  # its event: pairs, nothing to write
        tree.remove_module("flap")
        tree.add_module("flap", BASE_A + 0x10000)  # tmpfs: a new inode, as kernfs gives
        tree.remove_module("flap")
        tracker.reconcile([remove, add, remove])
        first, second = store.incarnations(tree.boot_id)
    assert first.state.sections[".text"] == BASE_A and first.unloaded is not None
    assert second.seq == 1 and second.unloaded is not None
    assert second.state.faults == ("gone before it could be read",)


def test_periodic_full_look_finds_what_no_source_reported(
    tracker_on: Callable[..., tuple[ModuleTracker, Store, FakeTree]],
) -> None:
    tracker, store, tree = tracker_on(lambda t: t.add_module("early", BASE_B), 0.2)
    assert [i.name for i in tracker.loaded()] == ["early"]
    # Loaded after the startup scan, and no source says so (as if its event came
    # before the watcher started, or was lost in an overflow).
    tree.add_module("late", BASE_A)
    wait_until("late found", lambda: "late" in {i.name for i in tracker.loaded()}, 15)
    tree.remove_module("early")
    wait_until(
        "early closed",
        lambda: [i.name for i in store.modules.open_incarnations(tree.boot_id)] == ["late"],
        60,
    )
    early, late = store.incarnations(tree.boot_id)
    assert (early.name, early.seq, early.unload_seen_by) == ("early", 0, SeenBy.POLL)
    assert (late.name, late.seq, late.seen_by, late.unloaded) == ("late", 1, SeenBy.POLL, None)
    assert late.state.sections[".text"] == BASE_A


def test_heartbeat_goes_on_while_a_module_stays_incomplete(
    tracker_on: Callable[..., tuple[ModuleTracker, Store, FakeTree]],
) -> None:
    # A module whose init never returns is re-read again and again; the heartbeat
    # that bounds unload windows across a restart must still be written.
    tracker, store, tree = tracker_on(
        lambda t: t.add_module("stuck", BASE_A, initstate="coming"), 0.2
    )
    [inc] = tracker.loaded()
    assert inc.state.initstate == "coming"
    first = store.modules.last_watched(tree.boot_id)
    assert first is not None
    wait_until(
        "a heartbeat",
        lambda: (
            (w := store.modules.last_watched(tree.boot_id)) is not None
            and w.monotonic > first.monotonic
        ),
        15,
    )
    assert [i.seq for i in tracker.loaded()] == [0]
