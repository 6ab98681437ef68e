"""How soon a module load is visible in the store, told by an event
against found by the look at ``sys/module``.

On a real host kreld learns of a load from the module tracepoints (the
record is written before the module's init runs), from the kernel's uevent
(after it), or from its look at ``sys/module`` (every ``poll_interval``
seconds where nothing else tells, every ``poll_interval_events`` where an
event source follows).  This machine has no loadable modules and no module
tracepoints, and a kernel uevent cannot be forged (libudev drops any not sent
by the kernel), so the kernel's part is stood in for, and kreld's own part is
real:

* a fake tree (``tests/support/faketree.py``) with 100 modules loaded, a real
  store, kreld's real :class:`~kreld.tracker.modules.ModuleTracker` on its
  thread, and kreld's real sources feeding it, wired as the daemon wires them;
* a load is ``FakeTree.add_module`` (its directory renamed into
  ``sys/module``); the clock starts just before the rename, and stops at the
  first read of the store (a read transaction of the bench's thread, every
  0.5 ms) that shows it;
* tracepoint path: :class:`~kreld.tracker.modevents.TracepointSource` with a
  stand-in for its rings that yields the ``module_load`` record the kernel
  would have written, stamped at the rename; the bench drains it (``step()``:
  the source reads the module's sections at once and hands the hint on) right
  after the rename, where the source's thread would wake on its ring (that
  wake-up, microseconds, is left out); the look at ``sys/module`` runs at the
  slow interval, as when events flow;
* uevent path: kreld's :class:`~kreld.tracker.sources.UeventSource` (its
  netlink socket open) is handed the datagram the kernel sends for a load,
  parsed, right after the rename (``handle()``, the step after the socket);
  the look runs at the slow interval;
* poll path: no event source; the look (watchdog's polling observer over
  ``sys/module``, ``watch = "poll"`` as on sysfs) runs at the default
  ``poll_interval``.  Loads come a random 0-1 interval after the last was
  seen (just after a look), so they fall evenly over the interval's phases.
  Events come 0-20 ms after the last was seen.

Figures: load -> visible p50 and p99 per path, with the ratio events / poll;
and how far the recorded load time lies from the true one (the rename): for
a tracepoint kreld keeps the record's time (the stand-in stamps it at the
rename, so its figure shows only that kreld keeps it), for the others the
time the reconciliation that found the load began.

With ``--vm`` the same question is asked of the real kernel: a Debian cloud
kernel booted under QEMU (tests/support/harness.py, one VM at a time under
its lock; ``scripts/setup-vm`` installs what it needs) runs
bench/guest_module_events.py, in which three kreld daemons in turn (``--root
/``, each with its own store) follow ``dummy`` by the module tracepoints
alone, by uevents alone, and by the look at sys/module alone (``watch =
"poll"``, every ``poll_interval`` = 1 s); each gets the same number of real
``modprobe dummy`` / ``rmmod dummy``, and a load is timed from modprobe's start
(and from its return) to the ``load`` reply of a ``Subscribe`` on kreld's
socket.  Figures: p50 and p99 per path, ratio events / poll; how many loads
were visible before modprobe returned; the recorded load time against
modprobe's start.  Under emulation everything is some 20x slower than on
hardware; the ratios are the point.

Run alone: ``.venv/bin/python bench/bench_module_events.py [--quick] [--vm]``
(``bench/run`` runs the host stand-in only).
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from bench_modules import StoreTail, rename_stamps
from common import (
    Result,
    bench_main,
    load_faketree,
    load_harness,
    log,
    percentile,
    venv_python,
)

from kreld.core import consts
from kreld.kernel.info import Root
from kreld.kernel.modtrace import Drained, ModuleTrace, TraceEvent
from kreld.kernel.modules_sysfs import read_proc_modules
from kreld.store import Store
from kreld.tracker.modevents import TracepointSource
from kreld.tracker.modules import ModuleTracker
from kreld.tracker.sources import UeventSource, WatchSource, parse_uevent

BACKGROUND = 100
SLOW = consts.DEFAULT_POLL_INTERVAL_EVENTS
FAST = consts.DEFAULT_POLL_INTERVAL


class RingStandIn:
    """Stands in for the module tracepoints' rings (kreld.kernel.modtrace) on a
    fake tree: a drain yields the ``module_load`` records pushed since the last."""

    def __init__(self) -> None:
        self._pending: list[ModuleTrace] = []
        self._lock = threading.Lock()  # the bench pushes, the tracker may drain

    def push(self, name: str, at_ns: int) -> None:
        with self._lock:
            self._pending.append(ModuleTrace(at_ns, 0, TraceEvent.LOAD, name, 0))

    def drain(self) -> Drained:
        with self._lock:
            out, self._pending = self._pending, []
        return Drained(out, 0, 0)

    def cpus(self) -> int:
        return 1

    def close(self) -> None:
        pass


def uevent_datagram(name: str, seq: int) -> bytes:
    """What the kernel sends on NETLINK_KOBJECT_UEVENT for a module load."""
    props = ["ACTION=add", f"DEVPATH=/module/{name}", "SUBSYSTEM=module", f"SEQNUM={seq}"]
    return b"".join(p.encode() + b"\0" for p in [f"add@/module/{name}", *props])


class Tracked:
    """kreld's module tracker on a fake tree, fed by one path's sources."""

    def __init__(self, work: Path, path: str) -> None:
        ft = load_faketree()
        self.tree = ft.FakeTree(work / "root")
        for i in range(BACKGROUND):
            self.tree.add_module(f"bg{i:03d}", 0xFFFFFFFFC0000000 + i * 0x100000)
        self.log = structlog.wrap_logger(structlog.PrintLogger(io.StringIO()))
        self.store = Store(work / "state")
        root = Root(self.tree.root)
        self.tracker = ModuleTracker(self.store, root, self.tree.boot_id, self.log)
        self.tracker.startup()
        self.stop = threading.Event()
        self.announce: Callable[[str, int], None] = lambda _name, _t: None
        self.sources: list[Any] = []
        if path == "tracepoint":
            rings = RingStandIn()
            tp = TracepointSource(rings, None, self.log)  # type: ignore[arg-type]
            addresses = self.tracker.addresses
            tp.read = lambda name: addresses.read([name], read_proc_modules(root)).get(name)
            tp.bind(self.tracker.notify_all)
            self.tracker.catch_up = tp.step  # as the daemon wires a source that follows

            def drained(name: str, t: int) -> None:
                rings.push(name, t)
                tp.step()

            self.announce = drained
        elif path == "uevent":
            ue = UeventSource(self.tracker.notify, self.log)
            ue.start(self.stop)
            self.sources.append(ue)
            seq = iter(range(1, 1 << 30))

            def told(name: str, _t: int) -> None:
                ev = parse_uevent(uevent_datagram(name, next(seq)))
                if ev is not None:
                    ue.handle(ev)

            self.announce = told
        interval = FAST if path == "poll" else SLOW
        sysmod = str(self.tree.root / consts.SYS_MODULE)
        watch = WatchSource(self.tracker.notify, sysmod, "poll", interval, self.log)
        watch.start(self.stop)
        self.sources.append(watch)
        self.thread = threading.Thread(target=self.tracker.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        for s in self.sources:
            s.stop()
        self.thread.join(10)
        self.store.close()


def latency_run(tmp: Path, path: str, loads: int, seed: int) -> dict[str, Any]:
    """*loads* loads one at a time, each timed from its rename to the store."""
    work = tmp / path
    work.mkdir()
    t = Tracked(work, path)
    try:
        tail = StoreTail(t.store, t.tree.boot_id)  # LMDB: one environment a process
        tail()
        sysmod = t.tree.root / consts.SYS_MODULE
        rng = random.Random(seed)
        spread = FAST if path == "poll" else 0.02
        lat, skew, missed = [], [], 0
        for k in range(loads):
            time.sleep(rng.uniform(0, spread))
            name = f"bench{k:04d}"
            with rename_stamps(sysmod) as stamps:
                t.tree.add_module(name, 0xFFFFFFFFD0000000 + k * 0x100000)
            t0 = stamps[0]
            t.announce(name, t0)
            deadline = t0 + int((10 + 3 * FAST) * 1e9)
            seen = None
            while seen is None and time.monotonic_ns() < deadline:
                seen = next((i for i in tail() if i.name == name), None)
                if seen is None:
                    time.sleep(0.0005)
            if seen is None:
                missed += 1
                continue
            lat.append(time.monotonic_ns() - t0)
            skew.append(seen.loaded.monotonic - t0)
            if (k + 1) % 25 == 0:
                log(f"module_events/{path}: {k + 1}/{loads} loads")
        return {"lat": lat, "skew": skew, "missed": missed, "loads": loads}
    finally:
        t.close()


def run(quick: bool) -> list[Result]:
    """Load -> visible with a tracepoint, a uevent and the look alone."""
    if time.get_clock_info("perf_counter").implementation != "clock_gettime(CLOCK_MONOTONIC)":
        log("module_events: perf_counter is not CLOCK_MONOTONIC here; skew figures may be off")
    tmp = Path(tempfile.mkdtemp(prefix="kreld-bench-modev-", dir="/tmp"))
    events, polls = (20, 8) if quick else (100, 40)
    try:
        got = {}
        paths = [("tracepoint", events), ("uevent", events), ("poll", polls)]
        for k, (path, n) in enumerate(paths):
            log(f"module_events: {path} path, {n} loads")
            try:
                got[path] = latency_run(tmp, path, n, 29 + k)
            except (OSError, ImportError) as e:  # no netlink here: say so, measure the rest
                log(f"module_events: {path} path not measured: {e}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results(got)


def results(got: dict[str, dict[str, Any]]) -> list[Result]:
    poll = got["poll"]
    desc = (
        f"the same loads found by kreld's look at sys/module alone (watch = poll, every "
        f"{FAST:g} s, the default poll_interval), no event source"
    )
    res = []
    for path in ("tracepoint", "uevent"):
        if path not in got:
            continue
        g = got[path]
        for p in (50, 99):
            res.append(
                Result(
                    f"module load -> visible in store, {path} (look every {SLOW:g} s), p{p}",
                    percentile(g["lat"], p), "ns", percentile(poll["lat"], p), "poll",
                    desc if path == "tracepoint" and p == 50 else "",
                )
            )  # fmt: skip
        res.append(
            Result(
                f"  recorded load time - true load time, {path}, p50",
                percentile(g["skew"], 50), "ns", percentile(poll["skew"], 50), "poll",
            )
        )  # fmt: skip
    for r in res[:1]:
        r.notes.append(
            "module events: "
            + "; ".join(
                f"{path} {len(g['lat'])}/{g['loads']} loads seen (missed {g['missed']}), "
                f"max {max(g['lat'], default=0) / 1e6:.1f} ms"
                for path, g in got.items()
            )
            + f"; fake tree of {BACKGROUND} modules, real store and tracker in one process;"
            " the kernel's part stood in for (see bench_module_events.py)"
        )
    for r in res:
        r.bench = "module_events"
    return res


# -- on the real kernel, in QEMU (--vm) -------------------------------------------------

VM_PATHS = ("tracepoints", "uevents")


def run_vm(quick: bool) -> list[Result]:
    """Load -> visible over the socket on the real kernel in QEMU: tracepoints,
    uevents, the look alone."""
    harness = load_harness()
    why = harness.missing()
    if why:
        raise SystemExit(f"module_events --vm: {why} (run scripts/setup-vm)")
    loads = 8 if quick else 30
    tmp = Path(tempfile.mkdtemp(prefix="kreld-bench-modev-vm-", dir="/tmp"))
    try:
        out = tmp / "out"
        guest = Path(__file__).resolve().parent / "guest_module_events.py"
        log(f"module_events --vm: booting {harness.find_kernel()}, {loads} loads a path")
        ran = harness.run_in_guest(
            f"{venv_python()} {guest} {out} {loads}", tmp, timeout=2400, name="module-events"
        )
        facts = json.loads((out / "results.json").read_text()) if out.exists() else {}
        if ran.status != 0 or not facts:
            raise RuntimeError(f"the guest failed ({ran.status}): {ran.stderr[-3000:]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"module_events --vm: the boot took {ran.elapsed:.0f} s")
    return vm_results(facts, ran.elapsed)


def vm_results(facts: dict[str, Any], elapsed: float) -> list[Result]:
    modes = facts["modes"]

    def lat(path: str, origin: str) -> list[int]:
        return [r["visible"] - r[origin] for r in modes[path]["loads"]]

    desc = (
        f"the same real loads found by kreld's look at sys/module alone (watch = poll, every "
        f"{facts['poll_interval']:g} s), no event source"
    )
    res = []
    for path in VM_PATHS:
        for p in (50, 99):
            res.append(
                Result(
                    f"real kernel: modprobe -> visible over the socket, {path}, p{p}",
                    percentile(lat(path, "start"), p), "ns",
                    percentile(lat("poll", "start"), p), "real-poll",
                    desc if path == VM_PATHS[0] and p == 50 else "",
                )
            )  # fmt: skip
        res.append(
            Result(
                f"  modprobe returned -> visible, {path}, p50",
                percentile(lat(path, "returned"), 50), "ns",
                percentile(lat("poll", "returned"), 50), "real-poll",
            )
        )  # fmt: skip
    res[0].notes.append(
        f"module events on the real kernel ({facts['release']} under QEMU without KVM, module "
        f"tracepoints {'present' if facts['tracepoints'] else 'absent'}; the boot and three "
        f"kreld runs took {elapsed:.0f} s): "
        + "; ".join(_vm_note(path, m) for path, m in modes.items())
    )
    for r in res:
        r.bench = "module_events"
    return res


def _vm_note(path: str, mode: dict[str, Any]) -> str:
    loads = mode["loads"]
    early = sum(1 for r in loads if r["visible"] <= r["returned"])
    inside = sum(1 for r in loads if r["start"] <= (r["recorded"] or 0) <= r["returned"])
    seen = sorted({str(r["seen_by"]) for r in loads})
    return (
        f"{path}: {len(loads)} loads of dummy, {early} visible before modprobe returned, "
        f"{inside} recorded at a time between modprobe's start and return, seen by "
        f"{'/'.join(seen)}"
    )


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if "--vm" in sys.argv[1:]:
        sys.argv.remove("--vm")
        sys.exit(bench_main("module_events", run_vm))
    sys.exit(bench_main("module_events", run))
