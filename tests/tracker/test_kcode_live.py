"""Kernel code followed on this machine's own kernel: real perf side-band rings,
real BPF programs loaded with bpf(2), the daemon as a subprocess on the real
root.  Each test skips, saying why, where perf_event_open or the BPF load is
refused (not root, perf_event_paranoid, no CAP_BPF)."""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from kreld.client import Client
from kreld.core import consts
from kreld.core.errors import KernelReadError
from kreld.core.kernel_code import CodeSeen, LossReason
from kreld.core.model import Clock
from kreld.kernel.bpfinfo import bpf_functions, bpf_programs
from kreld.kernel.info import Root, read_boot_id
from kreld.kernel.kallsyms import KallsymsText
from kreld.kernel.perfring import SidebandRings, online_cpus
from kreld.kernel.sideband import merge_by_time
from kreld.store import Store
from kreld.tracker.kernel_code import KernelCodeFollower, stamper
from kreld.tracker.kernel_code_plan import CodeState

from support.bpfprog import load_socket_filter, wait_freed
from support.run import ctl_json, kreldctl
from support.wait import wait_until

ROOT = Root(Path("/"))


def need_rings() -> SidebandRings:
    try:
        return SidebandRings(ROOT)
    except KernelReadError as e:
        pytest.skip(f"perf_event_open is refused here: {e}")


def need_program(name: str) -> int:
    try:
        return load_socket_filter(name)
    except OSError as e:
        pytest.skip(f"cannot load a BPF program here: {e}")


def test_real_rings_see_a_program_load_and_unload_as_one_record_with_its_id() -> None:
    rings = need_rings()
    try:
        assert sorted(rings.rings) == online_cpus(ROOT)
        fd = need_program("kreldring")
        os.close(fd)
        wait_freed("kreldring")
        streams = [r.drain().records for r in rings.rings.values()]
        st = CodeState("boot", 0, [])
        ch = st.apply(merge_by_time(streams), stamper(), 0)
    finally:
        rings.close()
    ours = [c for c in ch.written.values() if c.name.endswith("_kreldring")]
    assert len(ours) == 1, ch.written
    (code,) = ours
    assert code.prog_id is not None and code.tag is not None and code.length
    assert code.unloaded is not None and code.unload_seen_by is CodeSeen.KSYMBOL
    assert code.loaded.monotonic < code.unloaded.monotonic


def test_an_overflowing_ring_is_a_loss_window_and_nothing_is_recorded_wrong(
    tmp_path: Path,
) -> None:
    """One page a CPU, 150 programs loaded and unloaded before the rings are read:
    records are lost, the follower records the window with the kernel's count,
    looks at kallsyms again, and no record claims a program certainly present
    where it was not."""
    need_rings().close()
    follower = KernelCodeFollower(ROOT, _NullLog(), pages=1)
    if follower.rings is None:
        pytest.skip(f"perf_event_open is refused here: {follower.reason}")
    boot_id = read_boot_id(ROOT)
    try:
        with Store(tmp_path / "st") as store:
            follower.begin(store, boot_id, KallsymsText.read(ROOT))
            start = time.monotonic_ns()
            for i in range(150):
                os.close(need_program(f"kreldlost{i}"))
            wait_freed(*(f"kreldlost{i}" for i in range(150)))
            end = time.monotonic_ns()
            follower.step()
            if follower.rings.counts_lost:
                assert follower.state is not None and follower.state.lost > 0
            assert follower.state is not None and follower.state.need_look
            follower.look(None)
            losses = store.kernel_code.losses(boot_id)
            codes = store.kernel_code.codes(boot_id)
    finally:
        follower.stop()
    assert any(w.reason is LossReason.LOST_RECORDS and w.lost > 0 for w in losses), losses
    ours = [c for c in codes if "_kreldlost" in c.name]
    for c in ours:
        # Certain only inside the burst, and never two programs certain at one address.
        for t in (c.loaded.monotonic, (c.unloaded or c.loaded).monotonic - 1):
            if c.certain_at(Clock.MONOTONIC, t):
                assert start <= t <= end, c
                rivals = [
                    o
                    for o in codes
                    if o is not c and o.addr == c.addr and o.certain_at(Clock.MONOTONIC, t)
                ]
                assert not rivals, (c, rivals)
    assert all(c.unloaded is not None for c in ours)  # the look closed what was left open
    # Every program was closed before *end*: none may be certain there (a look
    # bounds what it closes by the loss's start, not by its own time).
    assert not [c for c in ours if c.certain_at(Clock.MONOTONIC, end)]


@pytest.mark.parametrize("looked_by", ["the run loop", "stop"])
def test_a_burst_while_a_step_is_paused_after_its_drain_is_closed_by_the_look_it_asks_for(
    tmp_path: Path, looked_by: str
) -> None:
    """kreld may be stopped anywhere in a step (SIGSTOP, a loaded host): here 150
    programs come and go right after the last ring's drain, as if it paused
    there, and overflow one-page rings.  The records written before the loss
    must be drained before the look the loss asks for, so that the look closes
    every program whose unregister was lost; none may stay open.  A stop before
    the look was due looks first."""
    need_rings().close()
    follower = KernelCodeFollower(ROOT, _NullLog(), pages=1)
    if follower.rings is None:
        pytest.skip(f"perf_event_open is refused here: {follower.reason}")
    boot_id = read_boot_id(ROOT)
    rings = follower.rings
    last = list(rings.rings.values())[-1]
    drain = last.drain
    span: list[int] = []

    def drain_then_burst(layout: Any = None) -> Any:
        parsed = drain(layout)
        if not span:
            span.append(time.monotonic_ns())
            for i in range(150):
                os.close(need_program(f"kreldpause{i}"))
            wait_freed(*(f"kreldpause{i}" for i in range(150)))
            span.append(time.monotonic_ns())
        return parsed

    last.drain = drain_then_burst  # type: ignore[method-assign]
    try:
        with Store(tmp_path / "st") as store:
            follower.begin(store, boot_id, KallsymsText.read(ROOT))
            for _ in range(4):  # the run loop: a step, and the look a loss asks for
                follower.step()
                assert follower.state is not None
                if follower.state.need_look and looked_by == "the run loop":
                    follower.look(None)
            if looked_by == "stop":
                assert follower.state is not None and follower.state.need_look
                follower.stop()
            losses = store.kernel_code.losses(boot_id)
            codes = store.kernel_code.codes(boot_id)
    finally:
        follower.stop()
    assert any(w.reason is LossReason.LOST_RECORDS and w.lost > 0 for w in losses), losses
    ours = [c for c in codes if "_kreldpause" in c.name]
    assert ours, [c.name for c in codes]
    left = [c for c in ours if c.unloaded is None]
    assert not left, left
    assert not [c for c in ours if c.certain_at(Clock.MONOTONIC, span[1])]


def test_a_ring_the_kernel_turned_off_is_opened_again_behind_a_cpu_hotplug_window(
    tmp_path: Path,
) -> None:
    """A CPU that goes offline leaves its event OFF for good, even once it is back
    (tests/vm/test_kcode_vm.py offlines one for real).  Here the event of one CPU
    is put in that state with PERF_EVENT_IOC_DISABLE: a program loaded on that
    CPU then goes untold; the checks find the stopped ring, open a new one,
    record a ``cpu_hotplug`` window over the gap, and the next program loaded
    there is told by its own records."""
    need_rings().close()
    follower = KernelCodeFollower(ROOT, _NullLog())
    if follower.rings is None:
        pytest.skip(f"perf_event_open is refused here: {follower.reason}")
    boot_id = read_boot_id(ROOT)
    cpu = max(follower.rings.rings)
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})  # the programs' records go to this CPU's ring
    try:
        with Store(tmp_path / "st") as store:
            follower.begin(store, boot_id, KallsymsText.read(ROOT))
            old = follower.rings.rings[cpu]
            fcntl.ioctl(old.fd, 0x2401, 0)  # PERF_EVENT_IOC_DISABLE: the event OFF
            gap = time.monotonic_ns()
            os.close(need_program("kreldoff"))
            wait_freed("kreldoff")
            follower.check_cpus()  # the event accrued enabled time before the ioctl
            assert follower.rings.rings[cpu] is old
            follower.check_cpus()  # and none since the last check: stopped
            assert follower.rings.rings[cpu] is not old
            os.close(need_program("kreldback"))
            wait_freed("kreldback")
            follower.step()
            losses = store.kernel_code.losses(boot_id)
            codes = store.kernel_code.codes(boot_id)
    finally:
        os.sched_setaffinity(0, affinity)
        follower.stop()
    (w,) = [w for w in losses if w.reason is LossReason.CPU_HOTPLUG]
    assert w.covers(Clock.MONOTONIC, gap), (w, gap)
    assert not [c for c in codes if c.name.endswith("_kreldoff") and c.seen_by is CodeSeen.KSYMBOL]
    (back,) = [c for c in codes if c.name.endswith("_kreldback")]
    assert back.seen_by is CodeSeen.KSYMBOL and back.unload_seen_by is CodeSeen.KSYMBOL
    assert back.loaded.monotonic > w.end.monotonic


def _without_perf_caps() -> None:
    """In the child before exec: CAP_SYS_ADMIN and CAP_PERFMON out of the bounding
    set (root's permitted set after exec is the bounding set; CapInh is empty)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (21, 38):  # CAP_SYS_ADMIN, CAP_PERFMON
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")


def test_where_perf_event_open_is_refused_status_says_why_and_kreld_keeps_serving(
    daemon_factory: Any, tmp_path: Path, sockdir: Path
) -> None:
    """Root without CAP_PERFMON and CAP_SYS_ADMIN at perf_event_paranoid 1 and
    above (Debian's 3) may not open the side-band events: Status says the source
    is unavailable with the errno, the paranoid level and the capability it
    needs; kreld serves."""
    paranoid = int(Path("/proc/sys/kernel/perf_event_paranoid").read_text())
    if paranoid < 1:
        pytest.skip(f"perf_event_paranoid={paranoid}: anyone may open the events")
    if "CapInh:\t0000000000000000" not in Path("/proc/self/status").read_text():
        pytest.skip("a non-empty inheritable set would give the capabilities back")
    need_rings().close()  # as this test runs the events open: the refusal is the caps'
    sock = str(sockdir / "kreld.sock")
    d = daemon_factory("--root", "/", "--state-dir", str(tmp_path / "st"), "--socket", sock)
    d.start(timeout=60, preexec=_without_perf_caps)
    assert d.proc is not None
    caps = re.search(r"CapEff:\t([0-9a-f]+)", Path(f"/proc/{d.proc.pid}/status").read_text())
    assert caps is not None and not int(caps.group(1), 16) & (1 << 21 | 1 << 38)
    status = ctl_json("status", "--socket", sock)
    kc = status["kernel_code"]
    assert kc["state"] == "unavailable" and kc["cpus"] == 0, kc
    assert "EACCES" in kc["reason"] and f"perf_event_paranoid={paranoid}" in kc["reason"], kc
    assert "CAP_PERFMON" in kc["reason"], kc
    assert d.wait_for("kernel_code_unfollowed")["reason"] == kc["reason"]
    text = next(
        ln for ln in Path("/proc/kallsyms").read_text().splitlines() if ln.endswith(" _text")
    )
    (r,) = ctl_json("resolve", text.split()[0], "--socket", sock)
    assert (r["image"], r["section"], r["base"]) == ("kernel", ".text", r["address"]), r
    assert d.stop() == 0


def test_bpf_tells_each_loaded_programs_id_tag_and_function_as_kallsyms_places_it() -> None:
    fd = need_program("kreldinfo")
    try:
        programs = bpf_programs()
        if programs is None:
            pytest.skip("bpf(BPF_PROG_GET_NEXT_ID) is refused here")
        line = next(
            ln for ln in Path("/proc/kallsyms").read_text().splitlines() if "_kreldinfo\t" in ln
        )
    finally:
        os.close(fd)
    addr, name = int(line.split()[0], 16), line.split()[2]
    (prog,) = [p for p in programs if any(a == addr for a, _ in p.funcs)]
    assert name == f"bpf_prog_{prog.tag}_kreldinfo" and prog.prog_id > 0
    assert bpf_functions(programs)[addr] == (prog.funcs[0][1], prog) and prog.funcs[0][1] > 0


def test_a_program_loaded_before_kreld_started_gets_its_length_id_and_tag_at_the_first_look(
    tmp_path: Path,
) -> None:
    """kallsyms gives a program kreld did not see load an address and no more:
    the start-up look asks bpf(2) for its length, id and tag, so that Resolve
    bounds it and inject can map it."""
    need_rings().close()
    fd = need_program("kreldearly")
    try:
        programs = bpf_programs()
        if programs is None:
            pytest.skip("bpf(BPF_PROG_GET_NEXT_ID) is refused here")
        follower = KernelCodeFollower(ROOT, _NullLog())
        boot_id = read_boot_id(ROOT)
        try:
            with Store(tmp_path / "st") as store:
                follower.begin(store, boot_id, KallsymsText.read(ROOT))
                codes = store.kernel_code.open_codes(boot_id)
        finally:
            follower.stop()
    finally:
        os.close(fd)
    (c,) = [c for c in codes if c.name.endswith("_kreldearly")]
    length, prog = bpf_functions(programs)[c.addr]
    assert c.seen_by is CodeSeen.KALLSYMS and c.loaded_after is not None
    assert (c.length, c.prog_id, c.tag) == (length, prog.prog_id, prog.tag) and length > 0


def test_follow_code_false_opens_nothing_records_nothing_and_status_says_off(
    daemon_factory: Any, tmp_path: Path, sockdir: Path
) -> None:
    """[kernel] follow_code = false: no perf event is opened (none among the
    daemon's descriptors), a program loaded meanwhile is not recorded, and Status
    says ``off`` with the setting; with the default the same daemon opens one per CPU."""
    need_rings().close()
    conf = tmp_path / "kreld.toml"
    conf.write_text("[kernel]\nfollow_code = false\n")
    sock = str(sockdir / "kreld.sock")

    def perf_fds(pid: int) -> int:
        fds = Path(f"/proc/{pid}/fd")
        return sum(1 for f in fds.iterdir() if "perf_event" in os.readlink(f))

    for follow in (False, True):
        args = ["--root", "/", "--state-dir", str(tmp_path / f"st{follow}"), "--socket", sock]
        d = daemon_factory(*args, *(() if follow else ("--config", str(conf))))
        d.start(timeout=60)
        assert d.proc is not None
        os.close(need_program("kreldoffcfg"))
        wait_freed("kreldoffcfg")  # told to a follower, had there been one
        kc = ctl_json("status", "--socket", sock)["kernel_code"]
        codes = ctl_json("code", "--all", "--socket", sock)["code"]
        ours = [c for c in codes if c["name"].endswith("_kreldoffcfg")]
        if follow:
            # (Python's mmap holds a second descriptor of each ring's event)
            assert kc["state"] == "open" and perf_fds(d.proc.pid) >= kc["cpus"] > 0, kc
            wait_until("the program recorded", lambda: [
                c for c in ctl_json("code", "--all", "--socket", sock)["code"]
                if c["name"].endswith("_kreldoffcfg")
            ], timeout=10)  # fmt: skip
        else:
            assert kc["state"] == "off" and "follow_code" in kc["reason"], kc
            assert perf_fds(d.proc.pid) == 0 and not ours and kc["records"] == 0, (kc, ours)
        assert d.stop() == 0


def test_a_daemon_on_this_kernel_names_a_bpf_program_at_its_time_and_not_after(
    daemon_factory: Any, tmp_path: Path, sockdir: Path
) -> None:
    """Status says the source is open on every CPU; Subscribe tells the program's
    load and unload; kreldctl code lists it with its id and both times; resolve
    --at names it while it was loaded, and not once it was gone."""
    need_rings().close()
    sock = str(sockdir / "kreld.sock")
    d = daemon_factory("--root", "/", "--state-dir", str(tmp_path / "st"), "--socket", sock)
    d.start(timeout=60)
    common = ("--socket", sock)
    status = ctl_json("status", *common)["kernel_code"]
    assert status["state"] == "open" and status["cpus"] == len(online_cpus(ROOT)), status
    sub = Client(sock, timeout=20)
    events = sub.stream("Subscribe")
    assert next(events)["event"] == "snapshot"
    fd = need_program("kreldlive")
    told: list[tuple[str, bool]] = []
    while len(told) < 2:  # Subscribe tells the load (with its id) and the unload
        ev = next(events)
        if ev.get("code", {}).get("name", "").endswith("_kreldlive"):
            told.append((ev["event"], ev["code"]["prog_id"] is not None))
            if len(told) == 1:
                os.close(fd)  # unloaded once its load is told
    sub.close()
    assert told == [("code_load", True), ("code_unload", True)]

    def gone() -> dict[str, Any] | None:
        reply = ctl_json("code", "--all", *common)
        done = [c for c in reply["code"] if c["name"].endswith("_kreldlive") and c["unloaded"]]
        return done[0] if done else None

    code = wait_until("the program's unload recorded", gone, timeout=20)
    assert code["prog_id"] is not None and code["seen_by"] == "ksymbol"
    loaded, unloaded = code["loaded"]["monotonic"], code["unloaded"]["monotonic"]
    addr = hex(int(code["address"], 16) + 4)
    (during,) = ctl_json("resolve", addr, "--at", str((loaded + unloaded) // 2), *common)
    assert during["symbol"] == code["name"] and during["symbol_offset"] == "0x4", during
    assert during["image"] == "[bpf]" and during["section"] == "bpf_program"
    cp = kreldctl("resolve", addr, "--at", str(unloaded + 1), "--json", *common, check=False)
    (after,) = json.loads(cp.stdout)  # exit 1: nothing held it
    assert cp.returncode == 1 and after.get("symbol") != code["name"], after
    mid = str((loaded + unloaded) // 2)
    exported = kreldctl("export", "kallsyms", "--at", mid, *common).stdout
    assert f"{int(code['address'], 16):016x} t {code['name']}\t[bpf]" in exported
    assert d.stop() == 0


def test_subscribes_first_reply_lists_the_kernel_code_live_then_as_code_lists_it(
    daemon_factory: Any, tmp_path: Path, sockdir: Path
) -> None:
    """A program loaded (and recorded) before Subscribe is in the snapshot's
    ``kernel_code``, with its id, as ``kreldctl code`` lists it; its unload
    comes as the next event about it."""
    need_rings().close()
    sock = str(sockdir / "kreld.sock")
    d = daemon_factory("--root", "/", "--state-dir", str(tmp_path / "st"), "--socket", sock)
    d.start(timeout=60)
    fd = need_program("kreldsnap")

    def listed() -> dict[str, Any] | None:
        got = [c for c in ctl_json("code", "--socket", sock)["code"] if "_kreldsnap" in c["name"]]
        return got[0] if got else None

    code = wait_until("the program's load recorded", listed, timeout=20)
    sub = Client(sock, timeout=20)
    events = sub.stream("Subscribe")
    try:
        first = next(events)
        assert first["event"] == "snapshot" and isinstance(first["modules"], list)
        assert code in first["kernel_code"] and code["prog_id"] is not None
        assert all(c["unloaded"] is None for c in first["kernel_code"])  # live ones only
        os.close(fd)
        ev = next(events)
        while ev.get("code", {}).get("seq") != code["seq"]:
            ev = next(events)
        assert ev["event"] == "code_unload"
    finally:
        sub.close()
    assert d.stop() == 0


class _NullLog:
    """A logger that drops everything (the follower logs through structlog's API)."""

    def __getattr__(self, _name: str) -> Any:
        return lambda *a, **k: None


WORKLOAD = Path(__file__).resolve().parent / "kcode_workload"
_FRAME = re.compile(r"^\s+([0-9a-f]{16}) (\S+) \((\S+)\)$", re.M)


class Recording(NamedTuple):
    perf: str
    data: Path
    state: str
    env: dict[str, str]
    script: str  # perf script of the recording
    unknown: list[str]  # the addresses of its [unknown] frames in kernel code


@pytest.fixture
def filter_recording(daemon_factory: Any, tmp_path: Path, sockdir: Path) -> Recording:
    """kreld on the real root while a per-task ``perf record -k monotonic`` records a
    task that runs a BPF filter another process loads and unloads mid-recording
    (tests/tracker/kcode_workload/): such a recording gets no KSYMBOL record."""
    perf = shutil.which("perf")
    if perf is None:
        pytest.skip("perf is not installed (Debian package linux-perf)")
    need_rings().close()
    sock = str(sockdir / "kreld.sock")
    state = str(tmp_path / "st")
    daemon_factory("--root", "/", "--state-dir", state, "--socket", sock).start(timeout=60)
    work, data = tmp_path / "w", tmp_path / "perf.data"
    work.mkdir()
    env = {**os.environ, "HOME": str(tmp_path)}
    loader = subprocess.Popen([sys.executable, str(WORKLOAD / "loader.py"), str(work), "kreldsym"])
    try:
        rec = subprocess.run(
            [perf, "record", "-q", "-N", "-k", "monotonic", "-e", "cpu-clock", "-g",
             "-o", str(data), "--", sys.executable, str(WORKLOAD / "sender.py"), str(work)],
            capture_output=True, text=True, timeout=120, env=env, check=False,
        )  # fmt: skip
    finally:
        assert loader.wait(timeout=60) == 0
    if rec.returncode != 0:
        pytest.skip(f"perf record fails here: {rec.stderr.strip()[-300:]}")

    def recorded() -> bool:
        codes = ctl_json("code", "--all", "--socket", sock)["code"]
        return any(c["name"].endswith("_kreldsym") and c["unloaded"] for c in codes)

    wait_until("the program's unload recorded", recorded, timeout=20)
    script = subprocess.run(
        [perf, "script", "-i", str(data)], capture_output=True, text=True, env=env, check=True
    ).stdout
    lo, hi = consts.KERNEL_CODE_AREA
    unknown = [
        m[1] for m in _FRAME.finditer(script) if m[2] == "[unknown]" and lo <= int(m[1], 16) < hi
    ]
    assert unknown, "no sample landed in the filter: nothing to name"
    return Recording(perf, data, state, env, script, unknown)


def test_symbolize_for_names_every_unknown_frame_of_a_program_another_process_loaded(
    filter_recording: Recording,
) -> None:
    """``perf script`` leaves the filter's frames ``[unknown]``; ``kreldctl
    symbolize --for`` names every one of them after the program."""
    r = filter_recording
    out = subprocess.run(
        [str(Path(sys.executable).parent / "kreldctl"), "symbolize", "--for", str(r.data),
         "--state-dir", r.state],
        input=r.script, capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    frames = {m[1]: (m[2], m[3]) for m in _FRAME.finditer(out) if m[1] in set(r.unknown)}
    assert all(
        sym.startswith("bpf_prog_") and sym.split("+")[0].endswith("_kreldsym") and dso == "[bpf]"
        for sym, dso in frames.values()
    ), frames
    named = [m[1] for m in _FRAME.finditer(out) if "_kreldsym+0x" in m[2]]
    assert len(named) == len(r.unknown)


def test_inject_adds_the_programs_ksymbols_and_perf_script_of_out_names_every_frame(
    filter_recording: Recording, tmp_path: Path
) -> None:
    """``kreldctl inject`` (its BPF half) writes a KSYMBOL register and
    unregister for the filter: ``perf script`` of OUT, with no warning, names
    every frame it left ``[unknown]`` in IN, and only those changed."""
    r = filter_recording
    out = tmp_path / "out.data"
    subprocess.run(
        [str(Path(sys.executable).parent / "kreldctl"), "inject", "-i", str(r.data),
         "-o", str(out), "--state-dir", r.state],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    cp = subprocess.run(
        [r.perf, "script", "-i", str(out)], capture_output=True, text=True, env=r.env, check=True
    )
    assert cp.stderr.strip() == "", cp.stderr
    before = [(m[1], m[2]) for m in _FRAME.finditer(r.script)]
    after = [(m[1], m[2]) for m in _FRAME.finditer(cp.stdout)]
    assert [a for a, _ in before] == [a for a, _ in after]  # the same frames, in order
    wanted = set(r.unknown)
    changed = [(a, s0, s1) for (a, s0), (_, s1) in zip(before, after, strict=True) if s0 != s1]
    assert {a for a, _, _ in changed} == wanted
    assert all(s1.split("+")[0].endswith("_kreldsym") for _, _, s1 in changed), changed[:3]
