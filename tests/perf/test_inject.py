"""``kreldctl inject``: judged by the real perf.

A fake machine whose kernel is this machine's own (its kallsyms and its build-id
note), so that a real ``perf record`` here matches the boot kreld records on it.
While perf records a workload, kreld sees the module ``brd`` load; afterwards
``after`` loads (too late for the recording).  There are no real modules here,
so samples in ``brd`` are spliced into the recordings (copies of a real sample
with another ip and time, placed right after the sample they follow in time).
Then ``perf report --stdio --symfs=<empty> --kallsyms=<export --for OUT>`` of
OUT names the ``brd`` samples that the report of IN leaves ``[unknown]``, agrees
on every other line, and ``perf script`` of OUT says no warning.  File mode, pipe
mode, ``perf record -z`` and a system-wide recording of two events (sample_id
with CPU, ID and IDENTIFIER) are each recorded once.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zstandard

from kreld.core.errors import ExitCode
from kreld.perf.inject import inject as inject_file
from kreld.store import Store

from support.perftool import perf as perf
from support.perftool import perf_env
from support.run import Daemon, kreldctl
from support.symbols import BASE_A, BASE_B, Machine
from support.symbols import daemons as daemons
from support.symbols import sock_dir as sock_dir
from support.wait import wait_until

WORK = ["dd", "if=/dev/zero", "of=/dev/null", "bs=512", "count=2500000"]
# (how perf record is told, file name): each recorded once, side by side
KINDS = {
    "file": ["-e", "cpu-clock", "-k", "monotonic"],
    "pipe": ["-e", "cpu-clock", "-k", "monotonic"],
    "zstd": ["-e", "cpu-clock", "-k", "monotonic", "-z"],
    "wide": ["-a", "-e", "cpu-clock", "-e", "task-clock", "-k", "monotonic"],
}
# Offsets in brd's .text (tests/support/symbols.py MOD): open, read, ioctl, exit.
IN_BRD = {0x10: "brd_open", 0x90: "brd_read", 0x1C4: "brd_ioctl", 0x1810: "brd_exit"}
REPORT_LINE = re.compile(r"^\s*([0-9.]+)%\s+(\S+)\s+\[(.)\]\s+(\S+)\s*$")


def real_core() -> list[str]:
    return [ln for ln in Path("/proc/kallsyms").read_text().splitlines() if "\t[" not in ln]


@dataclass
class World:
    m: Machine
    d: Path
    home: Path
    empty: Path
    recs: dict[str, Path]  # kind -> IN, samples in brd spliced in
    load_ns: int
    after_ns: int
    absent_ns: int  # brd's loaded_after: the tracker's look before the one that found it

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return kreldctl(*args, "--state-dir", str(self.m.state), check=check)


def perf_record(perf: str, kind: str, out: Path, home: Path) -> subprocess.Popen[bytes]:
    target = ["-o", "-"] if kind == "pipe" else ["-o", str(out)]
    cmd = [perf, "record", "-N", "-q", *KINDS[kind], *target, "--", *WORK]
    stdout = out.open("wb") if kind == "pipe" else subprocess.DEVNULL
    return subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, env=perf_env(home))


def workload_running(p: subprocess.Popen[bytes]) -> bool:
    """A child of *p* has exec'd the workload (dd)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            comm_end = (s := stat.read_text()).rindex(")")
        except (OSError, ValueError):
            continue  # gone meanwhile
        ppid = int(s[comm_end + 2 :].split()[1])
        if ppid == p.pid and s[s.index("(") + 1 : comm_end] == WORK[0]:
            return True
    return False


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory, sock_dir: Path, daemons: list[Daemon]
) -> Iterator[World]:
    if shutil.which("perf") is None or os.geteuid() != 0:
        pytest.skip("needs perf and root (see test_perf.py)")
    d = tmp_path_factory.mktemp("inject")
    m = Machine(d / "machine", sock_dir / "inject.sock", daemons)
    m.core = real_core()
    m.write_kallsyms()
    shutil.copy("/sys/kernel/notes", m.tree.root / "sys/kernel/notes")
    m.tree.write("proc/sys/kernel/osrelease", os.uname().release + "\n")  # pipe mode's match
    home, empty = d / "home", d / "empty"
    empty.mkdir()
    k = m.start()
    k.wait_for("kernel_symbols")
    k.wait_for("modules_startup")
    raw = {kind: d / f"{kind}.raw" for kind in KINDS}
    procs = {kind: perf_record("perf", kind, raw[kind], home) for kind in KINDS}
    # perf enables its events when the workload execs: each dd running means each
    # perf is recording.
    wait_until("perf's workloads running", lambda: all(workload_running(p) for p in procs.values()))
    m.load("brd", BASE_A)
    k.wait_for("module_loaded", module="brd")
    k.wait_for("module_symbols", module="brd")
    for kind, p in procs.items():
        _, err = p.communicate(timeout=120)
        if p.returncode != 0:
            pytest.skip(f"perf record {kind} fails here: {err.decode()[-300:]}")
    m.load("after", BASE_B)
    k.wait_for("module_loaded", module="after")
    k.wait_for("module_symbols", module="after")
    assert k.stop() == 0
    history = {h["name"]: h for h in m.history()}
    hist = {name: int(h["loaded"]["monotonic"]) for name, h in history.items()}
    absent = int(history["brd"]["loaded_after"]["monotonic"])
    recs = {kind: splice(raw[kind], d / f"{kind}.data", hist["brd"]) for kind in KINDS}
    yield World(m, d, home, empty, recs, hist["brd"], hist["after"], absent)


# -- splicing samples into a real recording ----------------------------------------------


def _records(data: bytes, start: int, end: int) -> list[tuple[int, int, int]]:
    out, pos = [], start
    while pos + 8 <= end:
        rtype, _misc, size = struct.unpack_from("<IHH", data, pos)
        out.append((pos, rtype, size))
        pos += size
        if rtype == 66 and start == 16:  # pipe mode: tracing data follows
            n = struct.unpack_from("<I", data, pos - size + 8)[0]
            pos += n + (-n % 8)
    return out


def _time_offset(sample_type: int) -> int:
    return 8 + 8 * sum(1 for bit in (1 << 16, 1, 2) if sample_type & bit)


def splice(src: Path, dst: Path, load_ns: int, ips: list[tuple[int, int]] | None = None) -> Path:
    """*src* with copies of its first sample after *load_ns*, right after it, one
    per (ip, ns later) of *ips* (default: each address of IN_BRD, 1..4 ns later),
    each a kernel sample."""
    if ips is None:
        ips = [(BASE_A + off, 1 + i) for i, off in enumerate(IN_BRD)]
    data = src.read_bytes()
    pipe = struct.unpack_from("<Q", data, 8)[0] == 16
    if pipe:
        recs = _records(data, 16, len(data))
        attr = next(data[p + 8 : p + s] for p, t, s in recs if t == 64)
        start, end = 16, len(data)
    else:
        a_off, _a, start, dsize = struct.unpack_from("<QQQQ", data, 24)
        attr, end = data[a_off:], start + dsize
        recs = _records(data, start, end)
    sample_type = struct.unpack_from("<Q", attr, 24)[0]
    toff = _time_offset(sample_type)
    ip_off = 8 + (8 if sample_type & (1 << 16) else 0)
    samples = [(data[p : p + s], p + s) for p, t, s in recs if t == 9]
    if not samples:  # perf record -z: the samples are in compressed records
        samples = _inflated_samples(data, recs)
    # After a kernel sample too: perf gives kallsyms lines only to modules whose
    # maps have no symbols loaded yet when it first reads the kernel's.
    kernel = [struct.unpack_from("<Q", r, toff)[0] for r, _ in samples if r[4] & 7 == 1]
    since = max(load_ns, min(kernel))
    after = [(r, at) for r, at in samples if struct.unpack_from("<Q", r, toff)[0] > since]
    template, at = min(after, key=lambda ra: struct.unpack_from("<Q", ra[0], toff)[0])
    t0 = struct.unpack_from("<Q", template, toff)[0]
    (dst.parent / f"{dst.name}.t0").write_text(str(t0))
    extra = b""
    for ip, later in ips:
        rec = bytearray(template)
        misc = struct.unpack_from("<H", rec, 4)[0]
        struct.pack_into("<H", rec, 4, misc & ~7 | 1)  # PERF_RECORD_MISC_KERNEL
        struct.pack_into("<Q", rec, ip_off, ip)
        struct.pack_into("<Q", rec, toff, t0 + later)
        extra += bytes(rec)
    out = data[:at] + extra + data[at:]
    if not pipe:
        out = _shift_features(out, start, dsize, len(extra))
    dst.write_bytes(out)
    return dst


def _inflated_samples(data: bytes, recs: list[tuple[int, int, int]]) -> list[tuple[bytes, int]]:
    """Each sample inside the compressed records, with the end of the record holding it."""
    sink = io.BytesIO()
    stream = zstandard.ZstdDecompressor().stream_writer(sink, write_return_read=True)
    out, pending = [], b""
    for p, t, s in recs:
        if t not in (81, 83):
            continue
        body = data[p + 8 : p + s] if t == 81 else data[p + 16 : p + 16 + _u64(data, p + 8)]
        stream.write(body)
        stream.flush()
        buf = pending + sink.getvalue()
        sink.seek(0)
        sink.truncate()
        pos = 0
        while pos + 8 <= len(buf):
            rtype, _misc, size = struct.unpack_from("<IHH", buf, pos)
            if pos + size > len(buf):
                break
            if rtype == 9:
                out.append((buf[pos : pos + size], p + s))
            pos += size
        pending = buf[pos:]
    return out


def _u64(data: bytes, at: int) -> int:
    return int(struct.unpack_from("<Q", data, at)[0])


def _shift_features(out: bytes, start: int, dsize: int, grown: int) -> bytes:
    b = bytearray(out)
    struct.pack_into("<Q", b, 48, dsize + grown)
    flags = struct.unpack_from("<4Q", b, 72)
    nbits = sum(bin(f).count("1") for f in flags)
    table = start + dsize + grown
    for i in range(nbits):
        off, n = struct.unpack_from("<QQ", b, table + 16 * i)
        struct.pack_into("<QQ", b, table + 16 * i, off + grown, n)
    return bytes(b)


# -- the reports ---------------------------------------------------------------------------


def run_perf(w: World, *args: str) -> subprocess.CompletedProcess[str]:
    cp = subprocess.run(
        ["perf", *args], capture_output=True, text=True, timeout=120, env=perf_env(w.home),
        check=False,
    )  # fmt: skip
    assert cp.returncode == 0, cp.stderr
    return cp


def report(w: World, data: Path, kallsyms: Path) -> dict[tuple[str, str], str]:
    """(dso, symbol) -> overhead, of every line of perf report --sort dso,sym."""
    cp = run_perf(
        w, "report", "-i", str(data), "--stdio", "--sort", "dso,sym", f"--symfs={w.empty}",
        f"--kallsyms={kallsyms}",
    )  # fmt: skip
    out: dict[tuple[str, str], str] = {}
    for line in cp.stdout.splitlines():
        if m := REPORT_LINE.match(line):
            key = (m.group(2), m.group(4))
            out[key] = f"{float(out.get(key, '0')) + float(m.group(1)):.2f}"
    return out


def inject(w: World, kind: str) -> Path:
    out = w.d / f"{kind}.out"
    if not out.exists():
        cp = w.ctl("inject", "-i", str(w.recs[kind]), "-o", str(out))
        assert "1 module loads mapped" in cp.stderr, cp.stderr
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_report_of_out_names_the_samples_in_a_module_loaded_mid_recording(
    world: World, kind: str
) -> None:
    """Every brd sample that IN's report leaves [unknown] is named in OUT's, from
    kreld's kallsyms alone (--symfs empty); every other line is the same."""
    w = world
    out = inject(w, kind)
    ks = w.d / f"{kind}.kallsyms"
    w.ctl("export", "kallsyms", "--for", str(out), "-o", str(ks))
    assert "\t[brd]" in ks.read_text()
    before, after = report(w, w.recs[kind], ks), report(w, out, ks)
    unknown = {k for k in before if k[1].startswith("0xffffffffc")}
    assert len(unknown) == len(IN_BRD), before
    named = {k: v for k, v in after.items() if k[0] == "[brd]"}
    assert {s for _, s in named} == set(IN_BRD.values()), after
    assert sum(map(float, named.values())) == pytest.approx(
        sum(float(before[k]) for k in unknown), abs=0.02 * len(IN_BRD)
    )
    rest_in = {k: v for k, v in before.items() if k not in unknown}
    rest_out = {k: v for k, v in after.items() if k[0] != "[brd]"}
    assert rest_out == rest_in
    assert len(rest_in) >= 3  # the workload's own kernel and user frames are there


@pytest.mark.parametrize("kind", list(KINDS))
def test_perf_script_of_out_warns_nothing_and_maps_brd_from_when_it_was_last_seen_absent(
    world: World, kind: str
) -> None:
    """OUT's map of brd begins where brd's code may first have run: not at the load
    kreld recorded (which comes after the module's init, and later on a busy host)
    but at the look before, when brd was absent (the recording began earlier)."""
    w = world
    out = inject(w, kind)
    cp = run_perf(w, "script", "-i", str(out), "--show-mmap-events", f"--symfs={w.empty}")
    assert cp.stderr.strip() == "", cp.stderr
    maps = [ln for ln in cp.stdout.splitlines() if "PERF_RECORD_MMAP" in ln and "[brd]" in ln]
    # the announcement among perf's records of the start (no size), then the map at the load
    assert len(maps) == 2, maps
    assert f"[{BASE_A:#x}(0) @ 0]" in maps[0]
    assert f"[{BASE_A:#x}(0x2000) @ 0]" in maps[1]
    secs, frac = re.search(r"\s(\d+)\.(\d+): PERF_RECORD_MMAP", maps[1]).groups()  # type: ignore[union-attr]
    mapped = int(secs) * 10**9 + int(frac.ljust(9, "0"))
    assert w.absent_ns < w.load_ns
    assert w.absent_ns - 10**6 < mapped < w.load_ns - 10**6
    assert "[after]" not in cp.stdout  # loaded after the recording ended


def strip_kernel_maps(src: Path, dst: Path) -> Path:
    """*src* (file mode) as perf writes it at kptr_restrict=2, where it reads zeros
    for every kernel address: without its kernel maps (the kernel MMAPs of pid -1,
    ``[kernel.kallsyms]_text`` and one per module)."""
    data = src.read_bytes()
    start, dsize = struct.unpack_from("<QQ", data, 40)
    drop = [
        (p, s)
        for p, t, s in _records(data, start, start + dsize)
        if t in (1, 10) and data[p + 4] & 7 == 1 and struct.unpack_from("<i", data, p + 8)[0] == -1
    ]
    assert drop and b"[kernel.kallsyms]" in data[drop[0][0] : drop[0][0] + drop[0][1]]
    out, pos = b"", 0
    for p, s in drop:
        out, pos = out + data[pos:p], p + s
    out += data[pos:]
    dst.write_bytes(_shift_features(out, start, dsize, -sum(s for _, s in drop)))
    return dst


def test_a_recording_perf_made_with_kernel_pointers_hidden_gets_perfs_own_kernel_maps(
    world: World,
) -> None:
    """perf at kptr_restrict=2 writes no kernel map, so no tool names a kernel
    sample of it, whatever kallsyms it is given.  kreld finds its boot by its
    clock data and adds the kernel map and the start's module maps: OUT's report
    with ``export --for OUT`` is the report of the same samples that perf
    recorded with its maps (tests/vm/test_seethrough_vm.py does this on a real
    kernel at kptr_restrict=2)."""
    w = world
    full = inject(w, "file")
    hidden = strip_kernel_maps(w.recs["file"], w.d / "hidden.data")
    blind = report(w, hidden, Path("/proc/kallsyms"))
    assert blind and all(s.startswith("0x") for (dso, s) in blind if dso == "[unknown]")
    assert not [k for k in blind if k[0] == "[kernel.kallsyms]"], blind
    out = w.d / "hidden.out"
    cp = w.ctl("inject", "-i", str(hidden), "-o", str(out))
    assert "the kernel and" in cp.stderr and "1 module loads mapped" in cp.stderr, cp.stderr
    ks_full, ks_out = w.d / "full.kallsyms", w.d / "hidden.kallsyms"
    w.ctl("export", "kallsyms", "--for", str(full), "-o", str(ks_full))
    w.ctl("export", "kallsyms", "--for", str(out), "-o", str(ks_out))
    assert ks_out.read_text() == ks_full.read_text()
    named = report(w, out, ks_out)
    assert named == report(w, full, ks_full)
    assert [k for k in named if k[0] == "[kernel.kallsyms]"] and [
        k for k in named if k[0] == "[brd]"
    ]
    kmap = [
        ln for ln in run_perf(w, "script", "-i", str(out), "--show-mmap-events").stdout.splitlines()
        if "PERF_RECORD_MMAP" in ln and "[kernel.kallsyms]_text" in ln
    ]  # fmt: skip
    text = int(next(ln for ln in real_core() if ln.endswith(" _text")).split()[0], 16)
    assert len(kmap) == 1 and f"@ {text:#x}]" in kmap[0], kmap


def test_in_is_left_whole_and_out_lists_brd_in_its_build_id_table(world: World) -> None:
    w = world
    src = w.recs["file"]
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    out = inject(w, "file")
    again = w.d / "again.out"
    w.ctl("inject", "-i", str(src), "-o", str(again))
    assert hashlib.sha256(src.read_bytes()).hexdigest() == digest
    assert again.read_bytes() == out.read_bytes()
    ids = run_perf(w, "buildid-list", "-i", str(out)).stdout
    brd = hashlib.sha1(b"brd").hexdigest()
    assert f"{brd} [brd]" in ids
    assert run_perf(w, "buildid-list", "-i", str(src)).stdout in ids
    assert out.stat().st_mode & 0o777 == 0o600


def test_a_recording_of_no_recorded_boot_exits_3_and_writes_nothing(
    world: World, tmp_path: Path
) -> None:
    w = world
    other = tmp_path / "other.data"
    data = bytearray(w.recs["file"].read_bytes())
    i = data.find(b"[kernel.kallsyms]_text")
    struct.pack_into("<Q", data, i - 8, 0xFFFFFFFF8F000000)  # another _text (pgoff)
    other.write_bytes(bytes(data))
    out = tmp_path / "out.data"
    cp = w.ctl("inject", "-i", str(other), "-o", str(out), check=False)
    assert cp.returncode == 3, cp.stderr
    assert "no recorded boot matches" in cp.stderr
    assert list(tmp_path.iterdir()) == [other]


def test_an_output_that_is_a_symlink_is_refused_and_left_alone(
    world: World, tmp_path: Path
) -> None:
    w = world
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    link = tmp_path / "out.data"
    link.symlink_to(victim)
    cp = w.ctl("inject", "-i", str(w.recs["file"]), "-o", str(link), check=False)
    assert cp.returncode == ExitCode.OUTPUT, cp.stderr
    assert "symbolic link" in cp.stderr
    assert victim.read_text() == "keep me" and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.data", "victim"]


BPF = 0xFFFFFFFFA0001000
BPF_NAME = "bpf_prog_6deef7357e7b4530_vfs_read"


@pytest.mark.parametrize("kind", ["bpf", "ool"])
def test_ksymbol_records_name_bpf_code_in_perf_while_it_was_loaded(world: World, kind: str) -> None:
    """The seam for BPF symbols (and out-of-line code: a module's init text): a
    KSYMBOL registered at a program's load names the samples in it (perf
    script), until the one unregistering it."""
    w = world
    src = splice(w.d / "file.raw", w.d / "bpf.data", w.load_ns,
                 [(BPF + 0x10, 1), (BPF + 0x20, 2), (BPF + 0x30, 4)])  # fmt: skip
    t0 = int((w.d / "bpf.data.t0").read_text())
    out = w.d / "bpf.out"
    err = io.StringIO()
    with Store(str(w.m.state), readonly=True) as store:
        prog = [(BPF, 0x100, kind, BPF_NAME, t0 - 50, t0 + 3)]
        res = inject_file(store, str(src), str(out), err, ksyms=lambda m: prog)
    assert res["ksymbols"] == 2, err.getvalue()
    cp = run_perf(w, "script", "-i", str(out), "-F", "ip,sym", f"--symfs={w.empty}")
    assert cp.stderr.strip() == "", cp.stderr
    named = {ln.split()[0]: ln.split()[1] for ln in cp.stdout.splitlines() if "ffffffffa000" in ln}
    assert named == {
        f"{BPF + 0x10:x}": BPF_NAME,
        f"{BPF + 0x20:x}": BPF_NAME,
        f"{BPF + 0x30:x}": "[unknown]",  # after the unregister
    }, cp.stdout[-2000:]
    raw = run_perf(w, "script", "-i", str(src), "-F", "ip,sym", f"--symfs={w.empty}").stdout
    assert f"{BPF + 0x10:x} [unknown]" in raw


def test_json_with_output_to_stdout_puts_the_summary_on_stderr(world: World) -> None:
    """With -o - stdout carries the (pipe-mode) perf.data, byte for byte what
    -o FILE writes; --json's summary then goes to stderr instead of being dropped."""
    w = world
    exe = str(Path(sys.executable).with_name("kreldctl"))
    argv = [exe, "inject", "-i", str(w.recs["pipe"]), "-o", "-", "--json"]
    cp = subprocess.run([*argv, "--state-dir", str(w.m.state)], capture_output=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == inject(w, "pipe").read_bytes()
    summary = json.loads(cp.stderr[cp.stderr.index(b"{") :])
    assert summary and isinstance(summary, dict)


# -- the same recording through symbolize --for: lines, possible answers ------------------

_KERNEL_FRAME = re.compile(r"(?<![0-9a-f])(ffff[0-9a-f]{12}) (\S+)(?: \(possible\))? \(([^()]*)\)")


def symbolize_for(w: World, data: Path, script: str, *more: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "DEBUGINFOD_URLS"}
    return subprocess.run(
        [str(Path(sys.executable).parent / "kreldctl"), "symbolize", "--for", str(data),
         "--state-dir", str(w.m.state), "--config", str(w.m.config), *more],
        input=script, capture_output=True, text=True, check=True, timeout=300, env=env,
    ).stdout  # fmt: skip


def test_symbolize_for_lines_answers_every_kernel_frame_of_real_perf_script_output(
    world: World,
) -> None:
    """perf script of a real recording (this kernel, brd's samples spliced in)
    through ``symbolize --for --lines``: the text is ``symbolize --for``'s with
    an answer under each kernel frame; with ``--json`` every kernel frame has
    one, brd's named, and (no debuginfo for this kernel here) each keeps its
    symbol and says why it has no lines."""
    w = world
    data = w.recs["file"]
    script = run_perf(w, "script", "-i", str(data), f"--symfs={w.empty}").stdout
    none = w.d / "no-debuginfo"
    none.mkdir(exist_ok=True)
    plain = symbolize_for(w, data, script)
    text = symbolize_for(w, data, script, "--lines", "--debuginfo-dir", str(none))
    added = [ln for ln in text.splitlines() if ln.startswith("\t" + " " * 17)]
    assert [ln for ln in text.splitlines() if ln not in added] == plain.splitlines()
    samples = json.loads(
        symbolize_for(w, data, script, "--lines", "--json", "--debuginfo-dir", str(none))
    )
    frames = [f for s in samples for f in s["kernel_frames"]]
    assert len(frames) == len(_KERNEL_FRAME.findall(plain)) == len(added) > 100
    assert [(f["address"][2:], f["symbol"], f["dso"]) for f in frames] == _KERNEL_FRAME.findall(
        plain
    )
    brd = {f["symbol"].split("+")[0] for f in frames if f["dso"] == "[brd]"}
    assert brd == set(IN_BRD.values())
    assert all(f["frames"] == [] and "debuginfo for build" in f["no_lines"] for f in frames)


def test_brd_samples_before_kreld_saw_its_load_are_named_possible(world: World) -> None:
    """brd's samples spliced in just after the look that saw brd absent, before
    the one that found it: ``symbolize --for`` names each, marked possible, and
    ``inject`` maps brd from that look, marking its map possible, and the real
    ``perf report`` of its output names each."""
    w = world
    src = splice(w.d / "file.raw", w.d / "possible.data", w.absent_ns + 1000)
    script = run_perf(w, "script", "-i", str(src), f"--symfs={w.empty}").stdout
    out = symbolize_for(w, src, script)
    named = re.findall(r" (brd_\w+)\+0x[0-9a-f]+ \(possible\) \(\[brd\]\)", out)
    assert set(named) == set(IN_BRD.values()), out[-2000:]
    out_data = w.d / "possible.out"
    cp = w.ctl("inject", "-i", str(src), "-o", str(out_data), "--json")
    (brd,) = (p for p in json.loads(cp.stdout)["modules"] if p["name"] == "brd")
    assert brd["possible"] is True and brd["time"] < w.load_ns
    ks = w.d / "possible.kallsyms"
    w.ctl("export", "kallsyms", "--for", str(out_data), "-o", str(ks))
    named_by_perf = {s for dso, s in report(w, out_data, ks) if dso == "[brd]"}
    assert named_by_perf == set(IN_BRD.values())
