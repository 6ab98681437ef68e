"""A module load kreld knows only as an interval (seen by a look, not by the
tracepoint: absent at ``loaded_after``, there at ``loaded``) names the samples
of a recording that fall inside it, in ``symbolize --for`` (marked possible,
as Resolve marks it) and in ``inject`` (mapped from the interval's start),
so that no sample is left unnamed because kreld learnt of the load late.

The store is written here (a snapshot of a fake tree, then the load and its
symbol table as the daemon records them); the recordings are perf.data files
written here (tests/support/perffile.py)."""

from __future__ import annotations

import json
import struct
import subprocess
import time
from pathlib import Path

from kreld.core.model import Incarnation, ModuleState, SeenBy, Timestamp
from kreld.core.record import replace
from kreld.core.symtab import module_symbol_key, module_table
from kreld.perf.reader import read_perf_header
from kreld.store import Store

from support.faketree import FakeTree
from support.inject import TEXT
from support.perffile import FINISHED_INIT, MISC_KERNEL, PerfFile, record, sample
from support.run import bin_path, kreldctl

BASE = 0xFFFFFFFFC0400000
SECTIONS = {".text": BASE, ".data": BASE + 0x2000, ".init.text": BASE + 0x100000}
BUILD = "1a7e" * 10
S = 1_000_000_000
AFTER, LOADED = 10 * S, 40 * S  # absent at 10 s, seen loaded at 40 s: 30 s unknown


def _ts(t: int) -> Timestamp:
    return Timestamp(t, t, t)


def late_store(
    tmp_path: Path, neighbour: bool = False, exact: bool = False
) -> tuple[list[str], FakeTree]:
    """A boot on which ``late`` was seen loaded at 40 s by a look that did not
    see it at 10 s; its init still running when seen.  With *neighbour*,
    ``kvm`` recorded before it (:func:`neighbour`); with *exact*, late's load
    seen by the tracepoint at 10 s instead, its init done at 30 s."""
    tree = FakeTree(tmp_path / "root", text=TEXT)
    opts = ["--root", str(tree.root), "--state-dir", str(tmp_path / "state")]
    kreldctl(*opts, "snapshot")
    loads = [neighbour_load(tree.boot_id)] if neighbour else []
    state = ModuleState(
        name="late", build_id=BUILD, sections=SECTIONS, coresize=0x4000, initsize=0x1000,
        initstate="coming", srcversion=None, taint=None, core_base=BASE, restricted=False,
        inode=1,
    )  # fmt: skip
    inc = Incarnation(tree.boot_id, len(loads), state, _ts(LOADED), SeenBy.POLL, init_live=True,
                      loaded_after=_ts(AFTER))  # fmt: skip
    if exact:
        inc = replace(inc, loaded=_ts(10 * S), loaded_after=None, seen_by=SeenBy.TRACEPOINT,
                      init_done=_ts(30 * S))  # fmt: skip
    table = module_table([(BASE, b"t", b"late_fn"), (BASE + 0x100000, b"t", b"late_init")],
                         SECTIONS, {})  # fmt: skip
    assert table is not None
    loads.append((inc, module_symbol_key(BUILD, "late", None), table))
    with Store(tmp_path / "state") as store:
        store.modules.apply_module_changes(tree.boot_id, [i for i, _, _ in loads], [], [], None)
        for _, key, packed in loads:
            assert key is not None
            store.symbols.put_table(key, packed)
    return opts, tree


NEIGHBOUR = BASE - 0x400000  # a module loaded long before, below late
# Its .orc_header lies outside its text allocation (Linux 6.4 on), so its extent
# is bounded by the module's size alone: past late's .text and init text.
NEIGHBOUR_SECTIONS = {".text": NEIGHBOUR, ".orc_header": NEIGHBOUR + 0x3F0000}
ORC = NEIGHBOUR_SECTIONS[".orc_header"]


def neighbour_load(boot_id: str) -> tuple[Incarnation, str | None, bytes]:
    """``kvm``, loaded at 1 s (seen by the tracepoint) below ``late``, its last
    section's bound reaching over late's text and init text."""
    state = ModuleState(
        name="kvm", build_id="c0de" * 10, sections=NEIGHBOUR_SECTIONS, coresize=0x180000,
        initsize=0, initstate="live", srcversion=None, taint=None, core_base=NEIGHBOUR,
        restricted=False, inode=2,
    )  # fmt: skip
    kvm = Incarnation(boot_id, 0, state, _ts(S), SeenBy.TRACEPOINT, init_live=False)
    table = module_table([(NEIGHBOUR, b"t", b"kvm_fn"), (ORC, b"r", b"orc_header")],
                         NEIGHBOUR_SECTIONS, {})  # fmt: skip
    assert table is not None
    return kvm, module_symbol_key("c0de" * 10, "kvm", None), table


def recording(tree: FakeTree, path: Path, times: list[int], clock_at: int = 15 * S) -> Path:
    """A perf.data on CLOCK_MONOTONIC whose kernel samples come at *times*: its
    one synthesized record, the kernel's map, with the sample_id its attr asks
    for (pid, tid, time), so that the recording spans exactly *times*."""
    clock = (1, time.time_ns(), clock_at)
    f = PerfFile(text=TEXT, kernel_build_id=tree.build_id, osrelease=tree.release,
                 clock=clock, sample_time=(min(times), max(times)))  # fmt: skip
    name = b"[kernel.kallsyms]_text\0"
    body = struct.pack("<iIQQQ", -1, 0, TEXT, 0x1269A88, TEXT) + name.ljust(
        -(-len(name) // 8) * 8, b"\0"
    )
    kernel_map = record(1, MISC_KERNEL, body + struct.pack("<iiQ", -1, -1, min(times)))
    data = kernel_map + FINISHED_INIT + b"".join(sample(TEXT + 0x10, t) for t in times)
    return f.write(path, data=data)


def script(*samples: tuple[int, int]) -> str:
    out = []
    for t, ip in samples:
        sec, ns = divmod(t, S)
        out.append(f"  dd   322 [000] {sec:>6}.{ns // 1000:06d}:    1003009 cpu-clock: \n")
        out.append(f"\t{ip:16x} [unknown] ([unknown])\n\n")
    return "".join(out)


def symbolize(
    opts: list[str], data: Path, text: str, *more: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([bin_path("kreldctl"), "symbolize", "--for", str(data), *opts, *more],
                          input=text, capture_output=True, text=True, check=True)  # fmt: skip


def test_symbolize_for_names_a_sample_inside_a_late_seen_loads_interval_as_possible(
    tmp_path: Path,
) -> None:
    """20 s before kreld saw the load (far past the window a recorded load's
    init is looked for in), in its text and in its init text: named, marked
    possible; before the interval: nothing; after the load: named, certain."""
    opts, tree = late_store(tmp_path)
    data = recording(tree, tmp_path / "perf.data", [5 * S, 50 * S])
    text = script((5 * S, BASE + 0x10), (20 * S, BASE + 0x10), (20 * S, BASE + 0x100004),
                  (50 * S, BASE + 0x10))  # fmt: skip
    cp = symbolize(opts, data, text)
    frames = [ln for ln in cp.stdout.splitlines() if ln.startswith("\t")]
    assert frames == [
        f"\t{BASE + 0x10:16x} [unknown] ([unknown])",
        f"\t{BASE + 0x10:16x} late_fn+0x10 (possible) ([late])",
        f"\t{BASE + 0x100004:16x} late_init+0x4 (possible) ([late])",
        f"\t{BASE + 0x10:16x} late_fn+0x10 ([late])",
    ]
    assert "named 3 of 4 unknown kernel frames, 2 of them possible" in cp.stderr


def test_with_lines_the_json_marks_a_possible_frame(tmp_path: Path) -> None:
    opts, tree = late_store(tmp_path)
    data = recording(tree, tmp_path / "perf.data", [5 * S, 50 * S])
    empty = tmp_path / "empty"
    empty.mkdir()
    text = script((20 * S, BASE + 0x10), (50 * S, BASE + 0x10))
    cp = symbolize(opts, data, text, "--lines", "--json", "--debuginfo-dir", str(empty))
    inside, after = (s["kernel_frames"][0] for s in json.loads(cp.stdout))
    assert inside["symbol"] == "late_fn+0x10" and inside["possible"] is True
    assert after["symbol"] == "late_fn+0x10" and "possible" not in after
    assert f"debuginfo for build {BUILD}" in inside["no_lines"]


def test_without_lines_the_json_is_the_lines_json_without_the_frames(tmp_path: Path) -> None:
    """``symbolize --for --json`` alone: the objects of ``--lines --json``, each
    sample with its time and kernel frames (possible marked), without
    ``frames`` and ``no_lines``; not perf script's text."""
    opts, tree = late_store(tmp_path)
    data = recording(tree, tmp_path / "perf.data", [5 * S, 50 * S])
    empty = tmp_path / "empty"
    empty.mkdir()
    text = script((20 * S, BASE + 0x10), (50 * S, BASE + 0x10))
    plain = json.loads(symbolize(opts, data, text, "--json").stdout)
    with_lines = symbolize(opts, data, text, "--lines", "--json", "--debuginfo-dir", str(empty))
    expected = json.loads(with_lines.stdout)
    for one in expected:
        for frame in one["kernel_frames"]:
            assert frame.pop("no_lines") and frame.pop("frames") == []
    assert plain == expected and len(plain) == 2
    assert [s["time"] for s in plain] == [20 * S, 50 * S]
    assert plain[0]["kernel_frames"][0]["possible"] is True


def test_inject_maps_a_late_seen_load_from_its_intervals_start_and_says_possible(
    tmp_path: Path,
) -> None:
    """The recording runs 20 to 45 s, kreld saw ``late`` at 40 s, absent at
    10 s: its samples from 20 s on may be late's, so OUT maps it from 10 s or
    the recording's start, marked possible in the summary, and lists it in
    export kallsyms --for OUT."""
    opts, tree = late_store(tmp_path)
    src = recording(tree, tmp_path / "in.data", [20 * S, 45 * S])
    out = tmp_path / "out.data"
    cp = kreldctl("inject", "-i", str(src), "-o", str(out), "--json", *opts)
    (mapped,) = json.loads(cp.stdout)["modules"]
    assert mapped["name"] == "late" and mapped["possible"] is True
    assert AFTER <= mapped["time"] <= 20 * S and mapped["loaded"] == LOADED
    assert "1 module loads mapped (1 from before kreld saw them: possible there)" in cp.stderr
    kallsyms = kreldctl("export", "kallsyms", "--for", str(out), *opts).stdout
    assert any(ln.endswith(" late_fn\t[late]") for ln in kallsyms.splitlines())


def test_export_for_out_lists_a_load_its_two_maps_name_once(tmp_path: Path) -> None:
    """OUT of a recording that began after ``late`` was loaded maps it twice
    before the first sample (inject's map from the load, and the map of no size
    among perf's start records): ``export kallsyms --for OUT`` lists the load's
    lines once, as the kernel does."""
    opts, tree = late_store(tmp_path)
    src = recording(tree, tmp_path / "in.data", [20 * S, 45 * S])
    out = tmp_path / "out.data"
    kreldctl("inject", "-i", str(src), "-o", str(out), *opts)
    maps = [m for m in read_perf_header(out).modules if m.name == "late"]
    assert len(maps) == 2 and {m.start for m in maps} == {BASE}
    kallsyms = kreldctl("export", "kallsyms", "--for", str(out), *opts).stdout
    assert [ln for ln in kallsyms.splitlines() if ln.endswith("\t[late]")] == [
        f"{BASE:016x} t late_fn\t[late]"
    ]


def test_inject_leaves_out_a_load_absent_until_after_the_recording_ended(tmp_path: Path) -> None:
    opts, tree = late_store(tmp_path)
    src = recording(tree, tmp_path / "in.data", [2 * S, 8 * S], clock_at=S)
    cp = kreldctl("inject", "-i", str(src), "-o", str(tmp_path / "out.data"), "--json", *opts)
    assert json.loads(cp.stdout)["modules"] == []


def _ksymbols(path: Path) -> list[tuple[int, int, int, str]]:
    """(addr, len, flags, name) of each PERF_RECORD_KSYMBOL in a file-mode perf.data."""
    buf = path.read_bytes()
    off, size = struct.unpack_from("<QQ", buf, 40)  # the header's data section
    out, pos = [], off
    while pos < off + size:
        rtype, _misc, rsize = struct.unpack_from("<IHH", buf, pos)
        if rtype == 17:
            addr, length, _kind, flags = struct.unpack_from("<QIHH", buf, pos + 8)
            name = buf[pos + 24 : pos + rsize].split(b"\0", 1)[0].decode()
            out.append((addr, length, flags, name))
        pos += rsize
    return out


def test_inject_names_the_init_text_of_a_load_mapped_mid_recording_while_its_init_ran(
    tmp_path: Path,
) -> None:
    """perf maps a module by one range, and its init text lies apart: each of
    its functions is registered as code of its own (KSYMBOL) from the module's
    map on, and unregistered when kreld saw the init done."""
    opts, tree = late_store(tmp_path)
    src = recording(tree, tmp_path / "in.data", [20 * S, 45 * S])
    out = tmp_path / "out.data"
    cp = kreldctl("inject", "-i", str(src), "-o", str(out), "--json", *opts)
    assert json.loads(cp.stdout)["ksymbols"] == 1, cp.stderr
    assert _ksymbols(out) == [(BASE + 0x100000, 0x1000, 0, "late_init")]
    with Store(tmp_path / "state") as store:
        (inc,) = store.incarnations(tree.boot_id)
        done = replace(inc, init_done=_ts(42 * S))
        store.modules.apply_module_changes(tree.boot_id, [], [done], [], None)
    kreldctl("inject", "-i", str(src), "-o", str(tmp_path / "out2.data"), *opts)
    assert _ksymbols(tmp_path / "out2.data") == [
        (BASE + 0x100000, 0x1000, 0, "late_init"),
        (BASE + 0x100000, 0x1000, 1, "late_init"),  # PERF_RECORD_KSYMBOL_FLAGS_UNREGISTER
    ]


def test_symbolize_for_names_by_the_nearest_base_where_a_neighbours_extent_is_a_bound(
    tmp_path: Path,
) -> None:
    """sysfs gives section bases, not sizes: kvm's ``.orc_header`` may reach as
    far as its module's size, over late's text and init text.  The two were
    loaded at once, so they did not overlap: late's addresses are late's, its
    init text while its init ran; kvm's own still kvm's."""
    opts, tree = late_store(tmp_path, neighbour=True, exact=True)
    data = recording(tree, tmp_path / "perf.data", [5 * S, 50 * S])
    text = script((20 * S, BASE + 0x10), (20 * S, BASE + 0x100004), (20 * S, ORC + 8),
                  (40 * S, BASE + 0x100004))  # fmt: skip
    frames = [ln for ln in symbolize(opts, data, text).stdout.splitlines() if ln.startswith("\t")]
    assert frames == [
        f"\t{BASE + 0x10:16x} late_fn+0x10 ([late])",
        f"\t{BASE + 0x100004:16x} late_init+0x4 ([late])",
        f"\t{ORC + 8:16x} orc_header+0x8 ([kvm])",
        # init done: the address is no more late's; kvm's bound is all that is left
        f"\t{BASE + 0x100004:16x} orc_header+{BASE + 0x100004 - ORC:#x} ([kvm])",
    ]


def test_symbolize_for_names_a_possible_load_above_a_neighbours_bound_as_possible(
    tmp_path: Path,
) -> None:
    opts, tree = late_store(tmp_path, neighbour=True)
    data = recording(tree, tmp_path / "perf.data", [5 * S, 50 * S])
    text = script((20 * S, BASE + 0x10), (20 * S, BASE + 0x100004))
    frames = [ln for ln in symbolize(opts, data, text).stdout.splitlines() if ln.startswith("\t")]
    assert frames == [
        f"\t{BASE + 0x10:16x} late_fn+0x10 (possible) ([late])",
        f"\t{BASE + 0x100004:16x} late_init+0x4 (possible) ([late])",
    ]
