"""Kreld with a store of 1,000 boots and 100,000 module incarnations.

The store is built directly with :class:`kreld.store.Store`, as years of a
host's life would leave it: 1,000 boots (distinct boot-ids, one a day; a new
kernel build every 25 boots, each boot its own KASLR slide), 100
incarnations per boot (90 modules loaded all boot long, 5 unloaded and
loaded again), 20 sections each.  Each boot is two transactions, as the
daemon writes it: ``record_boot``, then one ``apply_module_changes`` with
its 100 incarnations; at the end the open index of the finished boots is
dropped (``close_other_boots``), as the next boot's daemon does.  Symbol
tables are not in it (``bench_symbols`` measures what they add per boot).

The daemon then runs on that store with a fake tree (``tests/support/faketree.py``)
that is a new boot with 100 modules, ``kreld --root TREE --state-dir STORE
--socket S`` as a real subprocess.  Figures, each against a baseline of the
same run:

* resident memory (``VmRSS`` / ``VmHWM`` of ``/proc/PID/status``) once the
  daemon said ``READY=1``, and after a few hundred ``Resolve`` /
  ``GetModules`` / ``ListBoots`` calls; baseline: the same daemon on an empty
  store, doing the same calls;
* startup time from spawn to ``READY=1`` received on a datagram
  ``NOTIFY_SOCKET`` the bench binds; baseline: the same on an empty store;
  for context ``python -c pass`` and ``python -c 'import kreld.daemon'``
  with the same interpreter.  Each start is a new boot of the fake tree;
* store bytes per boot: ``data.mdb`` size and LMDB pages in use (every
  database's branch + leaf + overflow pages) over the number of boots;
  baseline: the keys and values themselves (the records as kreld stores them);
* ``ListBoots`` and ``GetModules --all`` of an old boot at that scale,
  against the same calls on a small store (10 boots of the same shape).

``--quick`` builds 200 boots instead of 1,000 (building dominates).
Run alone: ``.venv/bin/python bench/bench_scale.py [--quick]``.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
from common import (
    Result,
    bench_main,
    load_faketree,
    log,
    median,
    now_ns,
    percentile,
    proc_memory,
    venv_python,
    venv_tool,
)

from kreld.client import Client
from kreld.core.model import (
    Anchors,
    BootSnapshot,
    Incarnation,
    KaslrOffset,
    ModuleState,
    OffsetSource,
    SeenBy,
    Timestamp,
)
from kreld.store import Store

# What the kreld entry point imports, in a process it made lean first.
LEAN_DAEMON_IMPORT = "import kreld.programs as p; p.lean_process(); import kreld.daemon"

N_BOOTS = 1000
N_BOOTS_QUICK = 200
SMALL_BOOTS = 10
INCS_PER_BOOT = 100  # 90 loaded all boot + 5 loaded, unloaded, loaded again
RELOADED = 5
BOOTS_PER_BUILD = 25
FAKE_MODULES = 100
DAY_NS = 86_400 * 10**9

SECTIONS = (
    ".text",
    ".data",
    ".rodata",
    ".bss",
    ".init.text",
    ".exit.text",
    ".gnu.linkonce.this_module",
    ".note.gnu.build-id",
    ".note.Linux",
    "__ksymtab",
    "__ksymtab_gpl",
    "__ksymtab_strings",
    "__kcrctab",
    "__param",
    "__bug_table",
    "__jump_table",
    ".altinstructions",
    ".orc_unwind",
    ".orc_unwind_ip",
    ".rodata.str1.1",
)
assert len(SECTIONS) == 20


def _sections(base: int) -> dict[str, int]:
    out = {}
    for i, name in enumerate(SECTIONS):
        out[name] = base + 0x100000 if name.startswith(".init") else base + i * 0x400
    return out


# -- building the store ------------------------------------------------------------------------


def _hex(seed: str, n: int) -> str:
    return hashlib.sha256(seed.encode()).hexdigest()[:n]


def boot_records(
    i: int, rng: random.Random, t0_real: int
) -> tuple[BootSnapshot, list[Incarnation]]:
    """Boot number *i* (one a day from *t0_real*) and its 100 incarnations."""
    build = i // BOOTS_PER_BUILD
    build_id = _hex(f"build{build}", 40)
    boot_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
    slide = rng.randrange(1, 512) * 0x200000
    text = 0xFFFFFFFF81000000 + slide
    mono0 = rng.randrange(2, 9) * 10**9  # kreld starts a few seconds into the boot
    real0 = t0_real + i * DAY_NS + rng.randrange(0, 3600) * 10**9
    first_seen = Timestamp(mono0, mono0 + 1000, real0)
    snap = BootSnapshot(
        boot_id=boot_id,
        release=f"6.{build % 20}.{build // 20}-{build}-generic",
        version=f"#{build} SMP PREEMPT_DYNAMIC Mon Jan  1 00:00:00 UTC 2024",
        build_id=build_id,
        anchors=Anchors(text, text, text + 0x1000000, text + 0x3000000, text + 0x3100000),
        kaslr=KaslrOffset(slide, OffsetSource.VMCOREINFO, "/proc/kcore"),
        restricted=False,
        restricted_reason=None,
        kptr_restrict=1,
        first_seen=first_seen,
    )
    names = [f"mod{k:03d}" for k in rng.sample(range(130), INCS_PER_BOOT - RELOADED)]
    mod_base = 0xFFFFFFFFC0000000 + rng.randrange(0, 0x30) * 0x1000000  # below 2**64
    incs: list[Incarnation] = []

    def inc(name: str, j: int, t: Timestamp, gone: Timestamp | None, by: SeenBy) -> Incarnation:
        base = mod_base + j * 0x40000
        state = ModuleState(
            name=name,
            build_id=_hex(f"{build}/{name}", 40),
            sections=_sections(base),
            coresize=0x20000 + int(_hex(name, 4), 16),
            initsize=0x1000,
            initstate="live",
            srcversion=_hex(f"src/{build}/{name}", 23).upper(),
            taint="",
            core_base=base,
            restricted=False,
            inode=rng.randrange(10_000, 10_000_000),
        )
        return Incarnation(
            boot_id=boot_id,
            seq=-1,
            state=state,
            loaded=t,
            seen_by=by,
            init_live=False,
            init_done=t,
            unloaded=gone,
            unloaded_after=Timestamp(gone.monotonic - 10**9, gone.boottime - 10**9,
                                     gone.realtime - 10**9) if gone else None,
            unload_seen_by=by if gone else None,
        )  # fmt: skip

    def ts(mono: int) -> Timestamp:
        return Timestamp(mono, mono + 1000, real0 + (mono - mono0))

    for j, name in enumerate(names):
        incs.append(inc(name, j, ts(mono0 + j * 1000), None, SeenBy.STARTUP))
    for r, name in enumerate(names[:RELOADED]):
        # Unloaded an hour in, loaded again elsewhere: the first load is closed.
        k = names.index(name)
        gone = ts(mono0 + 3600 * 10**9 + r * 10**6)
        incs[k] = inc(name, k, incs[k].loaded, gone, SeenBy.STARTUP)
        incs.append(inc(name, len(names) + r, ts(gone.monotonic + 10**6), None, SeenBy.INOTIFY))
    return snap, incs


def build_store(path: Path, n_boots: int, seed: int) -> dict[str, Any]:
    """Write *n_boots* boots into a new store at *path*; returns timings and boot-ids."""
    rng = random.Random(seed)
    t0_real = time.time_ns() - (n_boots + 10) * DAY_NS
    gen_ns = write_ns = 0
    ids: list[str] = []
    store = Store(path)
    try:
        for i in range(n_boots):
            t = now_ns()
            snap, incs = boot_records(i, rng, t0_real)
            gen_ns += now_ns() - t
            t = now_ns()
            _, added, _ = store.boots.record_boot(snap)
            assert added, snap.boot_id
            store.modules.apply_module_changes(snap.boot_id, incs, [], [], snap.first_seen)
            write_ns += now_ns() - t
            ids.append(snap.boot_id)
            if (i + 1) % 200 == 0:
                log(f"scale: {path.name}: {i + 1}/{n_boots} boots written")
        t = now_ns()
        dropped = store.modules.close_other_boots(str(uuid.UUID(int=0)))
        write_ns += now_ns() - t
        counts = store.boots.counts()
    finally:
        store.close()
    return {"ids": ids, "gen_s": gen_ns / 1e9, "write_s": write_ns / 1e9,
            "dropped_open": dropped, "counts": counts}  # fmt: skip


def store_usage(path: Path) -> dict[str, Any]:
    """Pages in use by every database (the main one too), payload, file size."""
    env = lmdb.open(str(path), readonly=True, max_dbs=16, subdir=True, lock=False)
    pages = payload = 0
    per_db: dict[str, tuple[int, int, int]] = {}
    try:
        st = env.stat()
        psize = int(st["psize"])
        pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        with env.begin() as txn:
            names = [bytes(k) for k, _ in txn.cursor()]
        for name in names:
            db = env.open_db(name, create=False)
            with env.begin() as txn:
                s = txn.stat(db)
                n = s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]
                pay = sum(len(k) + len(v) for k, v in txn.cursor(db=db))
                per_db[name.decode()] = (n, s["entries"], pay)
                pages += n
                payload += pay
        last_pg = int(env.info()["last_pgno"])
    finally:
        env.close()
    return {
        "psize": psize,
        "used": pages * psize,
        "payload": payload,
        "file": (path / "data.mdb").stat().st_size,
        "last_pgno": last_pg,
        "per_db": per_db,
    }


# -- the daemon, started with a NOTIFY_SOCKET ----------------------------------------------------


class Notify:
    """A datagram socket in a temp dir, as systemd's NOTIFY_SOCKET.

    A thread reads every message as it comes, as systemd does: a receive
    queue left full (``net.unix.max_dgram_qlen`` datagrams, 10 by default)
    would block the daemon's next ``sd_notify()`` (its STATUS= every 10 s).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: queue.SimpleQueue[tuple[int, bytes]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="notify", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if select.select([self.sock], [], [], 0.1)[0]:
                msg = self.sock.recv(65536)
                self.messages.put((now_ns(), msg))

    def drain(self) -> None:
        while not self.messages.empty():
            self.messages.get_nowait()

    def wait_ready(self, proc: subprocess.Popen[bytes], timeout: float = 120) -> int:
        """perf_counter_ns when READY=1 arrived."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                t, msg = self.messages.get(timeout=0.05)
            except queue.Empty:
                if proc.poll() is not None:
                    raise RuntimeError(f"kreld exited {proc.returncode} before READY=1") from None
                continue
            if b"READY=1" in msg.split(b"\n"):
                return t
        raise RuntimeError(f"no READY=1 within {timeout} s")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


class Daemon:
    def __init__(self, proc: subprocess.Popen[bytes], sock: Path, spawned: int, ready: int) -> None:
        self.proc = proc
        self.sock = sock
        self.startup_ns = ready - spawned

    def status(self) -> dict[str, int]:
        """VmRSS, VmHWM, RssAnon, RssFile of the daemon (bytes)."""
        return proc_memory(self.proc.pid)

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_daemon(
    root: Path, state: Path, sock: Path, cfg: Path, notify: Notify, log_path: Path
) -> Daemon:
    env = dict(os.environ, NOTIFY_SOCKET=str(notify.path))
    for k in ("LISTEN_FDS", "LISTEN_PID", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM"):
        env.pop(k, None)
    argv = [venv_tool("kreld"), "--config", str(cfg), "--root", str(root),
            "--state-dir", str(state), "--socket", str(sock),
            "--log-format", "json", "--log-level", "warning"]  # fmt: skip
    notify.drain()
    with open(log_path, "ab") as logf:
        t0 = now_ns()
        proc = subprocess.Popen(argv, env=env, stdout=logf, stderr=logf, start_new_session=True)
    try:
        ready = notify.wait_ready(proc)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        raise
    return Daemon(proc, sock, t0, ready)


def spawn_ns(argv: list[str]) -> int:
    t0 = now_ns()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return now_ns() - t0


LOADER = r"""
import sys, time
from kreld.client import Client
c = Client(sys.argv[1], timeout=120)
end = time.monotonic() + float(sys.argv[2])
n = 0
print("go", flush=True)
while time.monotonic() < end:
    c.call("ListBoots")
    n += 1
print(n, flush=True)
"""


def head_of_line(client: Client, sock: Path, seconds: float) -> dict[str, Any]:
    """GetBoot latency on *client*'s connection, alone and while another
    process calls ListBoots in a loop on another connection."""

    def sample(until: Callable[[], bool]) -> list[int]:
        out = []
        while not until():
            t0 = now_ns()
            client.call("GetBoot")
            out.append(now_ns() - t0)
            time.sleep(0.005)
        return out

    end = time.monotonic() + seconds / 2
    quiet = sample(lambda: time.monotonic() >= end)
    loader = subprocess.Popen(
        [venv_python(), "-c", LOADER, str(sock), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert loader.stdout is not None
    loader.stdout.readline()  # "go": connected
    loaded = sample(lambda: loader.poll() is not None)
    n = int(loader.stdout.read().strip() or 0)
    loader.wait()
    return {"quiet": quiet, "loaded": loaded, "listboots": n, "seconds": seconds}


def evict(path: Path) -> None:
    """Drop data.mdb's pages from the page cache (that file only)."""
    fd = os.open(path / "data.mdb", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# -- the bench -------------------------------------------------------------------------------------


def run(quick: bool) -> list[Result]:
    """Memory, startup, store size and ListBoots/GetModules with 1,000 boots in the store."""
    tmp = Path(tempfile.mkdtemp(prefix="kreld-bench-scale-", dir="/tmp"))
    try:
        return _run(quick, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(quick: bool, tmp: Path) -> list[Result]:
    n_boots = N_BOOTS_QUICK if quick else N_BOOTS
    rounds = 3 if quick else 7
    call_rounds = 40 if quick else 100
    hol_s = 3.0 if quick else 5.0
    notes: list[str] = []

    # -- 1: the stores ---------------------------------------------------------
    large, small = tmp / "large", tmp / "small"
    log(f"scale: building a store of {n_boots} boots x {INCS_PER_BOOT} incarnations")
    t = time.monotonic()
    big = build_store(large, n_boots, seed=8)
    build_s = time.monotonic() - t
    usage = store_usage(large)
    log(f"scale: built in {build_s:.1f} s; data.mdb {usage['file'] / 2**20:.1f} MiB")
    little = build_store(small, SMALL_BOOTS, seed=9)
    usage_small = store_usage(small)
    c = big["counts"]
    notes.append(
        f"store: {c['boots']} boots, {c['builds']} builds, {c['incarnations']} incarnations "
        f"({len(SECTIONS)} sections each), built in {build_s:.1f} s ({big['gen_s']:.1f} s "
        f"making the records, {big['write_s']:.1f} s in record_boot + apply_module_changes, "
        f"2 synced transactions per boot); close_other_boots dropped {big['dropped_open']} "
        f"open-index entries; no symbol tables (bench_symbols measures those)"
    )

    # -- the fake tree: a new boot with 100 modules ------------------------------
    ft = load_faketree()
    tree = ft.FakeTree(tmp / "root")
    for i in range(FAKE_MODULES):
        base = 0xFFFFFFFFC1000000 + i * 0x40000
        tree.add_module(f"fake{i:03d}", base, sections=_sections(base))
    cfg = tmp / "kreld.toml"
    cfg.write_text("")  # defaults, whatever /etc/kreld holds
    notify = Notify(tmp / "notify.sock")
    daemon_log = tmp / "kreld.log"
    daemons: list[Daemon] = []
    try:
        # -- 2: startup to READY=1 ---------------------------------------------
        log(f"scale: {rounds} rounds of startups (empty, large, large cold, python)")
        py = venv_python()
        starts: dict[str, list[int]] = {k: [] for k in ("empty", "large", "cold", "pass", "import")}
        for r in range(rounds):
            for variant in ("empty", "large", "cold", "pass", "import"):
                if variant == "pass":
                    starts[variant].append(spawn_ns([py, "-c", "pass"]))
                    continue
                if variant == "import":
                    starts[variant].append(spawn_ns([py, "-c", LEAN_DAEMON_IMPORT]))
                    continue
                tree.new_boot()
                state = tmp / f"empty{r}" if variant == "empty" else large
                if variant == "cold":
                    evict(large)
                d = start_daemon(tree.root, state, tmp / "s.sock", cfg, notify, daemon_log)
                starts[variant].append(d.startup_ns)
                rc = d.stop()
                if rc != 0:
                    raise RuntimeError(f"kreld exited {rc} on SIGTERM: {daemon_log.read_text()}")
            log(f"scale: startup round {r + 1}/{rounds} done")

        # -- 3: memory and calls, three daemons on one new boot -------------------
        tree.new_boot()
        log("scale: memory: daemons on an empty, a small and the large store")
        run_dirs = {"empty": tmp / "empty-mem", "small": small, "large": large}
        mem: dict[str, dict[str, dict[str, int]]] = {}
        clients: dict[str, Client] = {}
        for name, state in run_dirs.items():
            d = start_daemon(tree.root, state, tmp / f"{name}.sock", cfg, notify, daemon_log)
            daemons.append(d)
            mem[name] = {"ready": d.status()}
            clients[name] = Client(str(d.sock), timeout=120)
        current = clients["large"].call("GetBoot")["boot"]
        text = int(current["anchors"]["text"], 16)
        rng = random.Random(8)
        addrs = [hex(text + rng.randrange(0x1000000)) for _ in range(8)]
        addrs += [hex(0xFFFFFFFFC1000000 + rng.randrange(FAKE_MODULES * 0x40000)) for _ in range(8)]
        # Old boots: distinct ones in turn, so GetModules' cache of 9 boots rarely helps.
        olds = {
            "large": big["ids"][: n_boots // 2],
            "small": little["ids"],
            "empty": [current["boot_id"]],
        }
        lat: dict[str, dict[str, list[int]]] = {k: {} for k in run_dirs}
        sizes: dict[str, dict[str, int]] = {k: {} for k in run_dirs}

        def timed(name: str, what: str, fn: Callable[[], dict[str, Any]]) -> None:
            t0 = now_ns()
            out = fn()
            lat[name].setdefault(what, []).append(now_ns() - t0)
            if what not in sizes[name]:
                sizes[name][what] = len(next(iter(out.values())))

        for i in range(call_rounds):
            for name in ("large", "small", "empty"):
                cl = clients[name]
                old = olds[name][i % len(olds[name])]
                timed(name, "resolve", lambda cl=cl: cl.call("Resolve", addresses=addrs))
                timed(
                    name,
                    "resolve-old",
                    lambda cl=cl, old=old: cl.call("Resolve", addresses=addrs, boot_id=old),
                )
                timed(
                    name,
                    "modules-old",
                    lambda cl=cl, old=old: cl.call("GetModules", boot_id=old, all=True),
                )
                timed(name, "modules", lambda cl=cl: cl.call("GetModules"))
                timed(name, "listboots", lambda cl=cl: cl.call("ListBoots"))  # fmt: skip
        for name, d in zip(run_dirs, daemons, strict=True):
            mem[name]["after"] = d.status()
            mem[name]["threads"] = {"n": d.threads()}
        n_calls = call_rounds * 5
        # -- 4: one client's ListBoots against another's GetBoot ----------------
        hol: dict[str, dict[str, Any]] = {}
        for name in ("large", "small"):
            log(f"scale: GetBoot while another client calls ListBoots ({name} store)")
            hol[name] = head_of_line(clients[name], tmp / f"{name}.sock", hol_s)
        for cl in clients.values():
            cl.close()
        rcs = [d.stop() for d in daemons]
        daemons.clear()
        warnings = _warnings(daemon_log)
    finally:
        for d in daemons:
            d.stop()
        notify.close()

    # -- results ----------------------------------------------------------------
    res: list[Result] = []
    mib = 2**20
    scale = f"{n_boots:,} boots / {n_boots * INCS_PER_BOOT:,} incarnations"
    mtag, mdesc = "empty", "the same daemon (same fake tree, same calls) on an empty store"
    el, ee = mem["large"], mem["empty"]
    mem_rows = (
        ("ready", "VmRSS", f"kreld VmRSS once READY=1, {scale} (MiB)"),
        ("after", "VmRSS", f"kreld VmRSS after {n_calls} calls, {scale} (MiB)"),
        ("after", "VmHWM", f"kreld VmHWM after {n_calls} calls, {scale} (MiB)"),
        ("after", "RssAnon", "  of which RssAnon (heap, not the LMDB map) after the calls (MiB)"),
        ("after", "RssFile", "  of which RssFile (LMDB map pages + code) after the calls (MiB)"),
    )
    for when, key, label in mem_rows:
        res.append(Result(label, el[when][key] / mib, "", ee[when][key] / mib, mtag, mdesc))
    notes.append(
        "memory (MiB; VmRSS/VmHWM/RssAnon/RssFile): "
        + "; ".join(
            f"{k} store: ready {_m(v['ready'])}, after the calls {_m(v['after'])}, "
            f"{v['threads']['n']} threads"
            for k, v in mem.items()
        )
        + f"; calls per daemon: {call_rounds} rounds of Resolve ({len(addrs)} addresses, "
        "current boot), Resolve on an old boot, GetModules --all of an old boot (distinct "
        "old boots in turn), GetModules, ListBoots; memory read from /proc/PID/status"
    )

    stag, sdesc = "empty-start", "the same kreld start (new boot, 100 modules) on an empty store"
    p50 = {k: median(v) for k, v in starts.items()}
    res.append(Result(f"startup to READY=1, {scale}, p50", p50["large"], "ns",
                      p50["empty"], stag, sdesc))  # fmt: skip
    res.append(Result(f"startup to READY=1, {scale}, max", max(starts["large"]), "ns",
                      max(starts["empty"]), stag))  # fmt: skip
    res.append(Result("startup to READY=1, that store evicted from the page cache, p50",
                      p50["cold"], "ns", p50["empty"], stag))  # fmt: skip
    ptag, pdesc = "py-start", "`python -c pass` with the same venv interpreter"
    res.append(Result("startup to READY=1, empty store, p50 (vs python startup)", p50["empty"],
                      "ns", p50["pass"], ptag, pdesc))  # fmt: skip
    res.append(Result("  python -c 'import kreld.daemon' p50 (imports alone)", p50["import"], "ns",
                      p50["pass"], ptag))  # fmt: skip
    notes.append(
        f"startup: {rounds} rounds, variants interleaved; each kreld start is a new boot of "
        f"the fake tree ({FAKE_MODULES} modules, {len(SECTIONS)} sections each) and ends "
        "with SIGTERM; the empty-store start gets a fresh state dir each round; 'evicted' "
        "drops data.mdb from the page cache first (posix_fadvise DONTNEED); all samples (ms): "
        + "; ".join(f"{k} {' '.join(f'{x / 1e6:.0f}' for x in v)}" for k, v in starts.items())
    )

    btag, bdesc = "payload", "the keys + values of the records kreld stored, per boot"
    per = usage["payload"] / n_boots
    res.append(Result(f"store bytes per boot, data.mdb size / {n_boots:,}", usage["file"] / n_boots,
                      "B", per, btag, bdesc))  # fmt: skip
    res.append(Result(f"store bytes per boot, LMDB pages in use / {n_boots:,}",
                      usage["used"] / n_boots, "B", per, btag))  # fmt: skip
    inc_pages, inc_n, inc_pay = usage["per_db"].get("incarnations", (0, 0, 0))
    notes.append(
        f"store size: data.mdb {usage['file']} B ({usage['last_pgno'] + 1} pages of "
        f"{usage['psize']} B, {usage['used'] // usage['psize']} of them in use by the databases), "
        f"{usage['payload']} B of keys+values; small store ({SMALL_BOOTS} boots): "
        f"data.mdb {usage_small['file']} B, {usage_small['used'] / SMALL_BOOTS:.0f} B per boot "
        f"in pages, {usage_small['payload'] / SMALL_BOOTS:.0f} B payload per boot; "
        f"incarnation records {inc_pay / max(inc_n, 1):.0f} B each (key + value), their "
        f"pages {100 * inc_pay / max(inc_pages * usage['psize'], 1):.0f} % filled; per "
        "database (pages, entries, B of keys+values): "
        + ", ".join(
            f"{k} {n} p / {e} / {pay}"
            for k, (n, e, pay) in sorted(usage["per_db"].items(), key=lambda kv: -kv[1][0])
        )
    )

    qtag, qdesc = "small", f"the same call on a daemon whose store holds {SMALL_BOOTS} boots"
    for what, label in (("listboots", "ListBoots"), ("modules-old", "GetModules --all, old boot"),
                        ("resolve-old", "Resolve 16 addresses, old boot")):  # fmt: skip
        a, b = lat["large"][what], lat["small"][what]
        res.append(Result(f"{label}, {scale}, p50", median(a), "ns", median(b), qtag, qdesc))
        res.append(Result(f"{label}, {scale}, p99", percentile(a, 99), "ns",
                          percentile(b, 99), qtag))  # fmt: skip
    etag, edesc = "empty-calls", "the same call on the daemon with an empty store"
    for what, label in (("resolve", "Resolve 16 addresses, current boot"),
                        ("modules", "GetModules, current boot")):  # fmt: skip
        a, b = lat["large"][what], lat["empty"][what]
        res.append(Result(f"{label}, {scale}, p50", median(a), "ns", median(b), etag, edesc))
    htag, hdesc = "alone", "GetBoot on the same daemon, with no other client"
    for name in ("large", "small"):
        h = hol[name]
        label = scale if name == "large" else f"{SMALL_BOOTS} boots"
        res.append(
            Result(f"GetBoot p50 while another client loops on ListBoots, {label}",
                   median(h["loaded"]), "ns", median(h["quiet"]), htag, hdesc)
        )  # fmt: skip
        res.append(
            Result(f"GetBoot p99 while another client loops on ListBoots, {label}",
                   percentile(h["loaded"], 99), "ns", percentile(h["quiet"], 99), htag)
        )  # fmt: skip
    notes.append(
        "head of line: GetBoot every 5 ms on one connection, first alone, then for "
        f"{hol_s:.0f} s while another process calls ListBoots back to back on another "
        f"connection ({hol['large']['listboots']} ListBoots on the large store, "
        f"{hol['small']['listboots']} on the small one); ListBoots runs on kreld's worker "
        "thread, GetBoot on its event loop: what remains is the two threads sharing the GIL"
    )
    notes.append(
        f"calls: {call_rounds} of each per daemon, the three daemons in turn; ListBoots "
        f"returned {sizes['large']['listboots']} boots (large) vs {sizes['small']['listboots']} "
        f"(small); GetModules --all of an old boot {sizes['large']['modules-old']} "
        f"incarnations on both; daemon exits {rcs}"
        + (f"; daemon warnings: {warnings}" if warnings else "")
    )
    res[0].notes = notes
    for r in res:
        r.bench = "scale"
    return res


def _m(st: dict[str, int]) -> str:
    return "/".join(f"{st[k] / 2**20:.1f}" for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"))


_HOST_WARNINGS = ("socket_group_missing", "allowed_group_missing")


def _warnings(path: Path) -> str:
    counts: dict[str, int] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        ev = str(e.get("event"))
        if e.get("level") in ("warning", "error", "critical") and ev not in _HOST_WARNINGS:
            counts[ev] = counts.get(ev, 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))


if __name__ == "__main__":
    sys.exit(bench_main("scale", run))
