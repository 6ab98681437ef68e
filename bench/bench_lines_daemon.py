"""Source lines through the daemon: Resolve with ``lines`` over its socket.

kreld runs as a real subprocess on a fake tree whose kernel is Debian's
6.1.0-57-cloud-amd64 (the build-id of its -dbg vmlinux, ``_text`` at a KASLR
address of its own), with ``[kernel] debuginfo_dirs`` naming the extracted
-dbg files (bench_lines.py fetches them once into /var/cache/kreld-vm/dbg).
The same random ``.text`` addresses as a profiler would send them: 10,000,
then 100,000, with inline frames.

* cold: the first Resolve of the build, its table built by the daemon's
  builder thread from the vmlinux and kept: wall time of the call (retried
  while the answer is "being built") against ``llvm-symbolizer --inlines``'s
  total for the 10,000 (goal within 2x); the daemon's peak RSS meanwhile
  (goal <= 512 MiB: the daemon's own footprint is part of it), the peak of
  the DWARF reader's process the daemon starts (as the daemon logs it, goal
  <= 512 MiB), and the two sampled together every 5 ms (their sum's peak);
* warm: the 100,000 again, over the socket, the reply decoded by the client
  (kreld's ``Client.call``, its columns not spelt out into a dict per frame):
  addresses/s against llvm-symbolizer's loaded rate (its 100,000 minus its
  10,000; goal >= 5x); the 10,000 too;
* the table kept in the store against vmlinux's .debug_* sections (<= 1/4);
* answers equal to llvm-symbolizer's (function, normalized file, line, every
  frame) where it names a function; drgn's 10,000 beside (bench_lines.py
  installs it from pyproject's ``bench`` extra);
* the same for two modules of the package, brd.ko and xfs.ko, loaded in the
  fake tree with their build-ids, each code section at a base of its own:
  random (section, offset) of their code (1,000, then 10,000), asked as
  runtime addresses, against ``eu-addr2line -i -f -j SECTION`` on the same
  offsets (cold: its 1,000; warm: its loaded rate).  Where the two differ
  (some 0.2 % of xfs.ko's ``.text``: eu's first line and its ``-i`` lines
  name two chains, or it leaves out an inlined level), llvm-symbolizer on
  ``.text`` past the other code sections, where it is sure of the section,
  decides (its outermost name excepted: it takes it from a symbol table
  whose sections all start at 0).  The address sampling and
  the references' runs are bench_lines.py's.

Run alone: ``.venv/bin/python bench/bench_lines_daemon.py [--quick]``.
"""

from __future__ import annotations

import mmap
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench_lines import (
    MIB,
    MODULES,
    RELEASE,
    VMLINUX,
    Frames,
    Sample,
    code_sections,
    compare,
    drgn_frames,
    dwarf_bytes,
    ensure_debug_files,
    eu_settled,
    inner_missing,
    module_sample,
    no_line_only,
    text_range,
    vmlinux_sample,
)
from common import Kreld, Result, bench_main, load_faketree, log

from kreld.client import Client, resolutions
from kreld.debuginfo.lines_reloc import symbol_value
from kreld.kernel.elf import fd_build_id

RUNTIME_TEXT = 0xFFFFFFFF9D000000


def _build_id(path: Path) -> str:
    with open(path, "rb") as f:
        found = fd_build_id(f.fileno())
    if not found:
        raise RuntimeError(f"{path} has no build-id")
    return found


def _link_text(path: Path) -> int:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        text = symbol_value(m, str(path), "_text")
    if text is None:
        raise RuntimeError(f"{path} has no _text")
    return text


def _vm(pid: int, what: str = "VmHWM") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(what + ":"):
            return int(line.split()[1]) * 1024
    return 0


# Where the fake tree loads each module (its code sections one after the other).
MODULE_BASES = {"brd": 0xFFFFFFFFC0200000, "xfs": 0xFFFFFFFFC1000000}


class _JointRss:
    """The peak of a process's RSS plus its children's, sampled every 5 ms
    on a thread of the bench while the block runs; and of their RssAnon
    (the heap, without the file pages a reader maps)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.peak_anon = pid, 0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _rss(self, pid: int, what: str = "VmRSS") -> int:
        try:
            return _vm(pid, what)
        except (OSError, ValueError):
            return 0

    def _children(self) -> list[int]:
        out: list[int] = []
        for task in Path(f"/proc/{self.pid}/task").glob("*/children"):
            try:
                out += [int(p) for p in task.read_text().split()]
            except OSError:
                continue
        return out

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            pids = [self.pid, *self._children()]
            self.peak = max(self.peak, sum(self._rss(p) for p in pids))
            self.peak_anon = max(self.peak_anon, sum(self._rss(p, "RssAnon") for p in pids))

    def __enter__(self) -> _JointRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def _reader_peak(k: Kreld, build_id: str) -> int:
    """The DWARF reader's peak RSS for *build_id*, as the daemon logged it."""
    for e in k.events():
        if e.get("event") == "line_table" and e.get("build_id") == build_id:
            return int(e.get("reader_peak_rss") or 0)
    return 0


def _module_layout(path: Path, base: int) -> dict[str, int]:
    """Each code section of *path* at its own page-aligned base from *base*."""
    out, at = {}, base
    for sec, size in code_sections(path).items():
        out[sec] = at
        at += (size + 0xFFF) & ~0xFFF
    return out


def _start(work: Path, link_text: int, text_end: int) -> tuple[Kreld, Path]:
    """kreld on a fake tree whose kernel is the -dbg vmlinux's build, with
    brd and xfs of the same -dbg package loaded (their build-ids, their code
    sections at MODULE_BASES)."""
    faketree = load_faketree()
    tree = faketree.FakeTree(
        work / "root", text=RUNTIME_TEXT, build_id=_build_id(VMLINUX), release=RELEASE
    )
    for name, path in MODULES.items():
        layout = _module_layout(path, MODULE_BASES[name])
        size = max(layout.values()) + 0x1000 - MODULE_BASES[name]
        tree.add_module(name, MODULE_BASES[name], build_id=_build_id(path), sections=layout,
                        coresize=size + 0x1000)  # fmt: skip
    # kallsyms spanning the real .text, so every address asked lies in the image.
    end = RUNTIME_TEXT + (text_end - link_text)
    tree.write("proc/kallsyms", f"{RUNTIME_TEXT:016x} T _text\n{RUNTIME_TEXT:016x} T _stext\n"
                                f"{end:016x} T _etext\n")  # fmt: skip
    cfg = work / "kreld.toml"
    cfg.write_text(f'[kernel]\ndebuginfo_dirs = ["{VMLINUX.parents[1]}"]\n')
    sock = work / "k.sock"
    k = Kreld(["--config", str(cfg), "--root", str(tree.root), "--state-dir",
               str(work / "state"), "--socket", str(sock)], work / "kreld.log")  # fmt: skip
    k.wait_for("ready", timeout=90)
    return k, sock


def _frames(results: list[dict[str, Any]]) -> list[Frames]:
    return [[(f["function"], f["file"], f["line"]) for f in r["frames"]] for r in results]


def _timed(c: Client, hexes: list[str]) -> tuple[float, list[dict[str, Any]]]:
    """The call's wall time (sent, answered, the reply decoded: what a
    profiler reading the columns pays), and its answers spelt out."""
    t0 = time.perf_counter()
    reply = c.call("Resolve", addresses=hexes, lines=True)
    dt = time.perf_counter() - t0
    return dt, resolutions(hexes, reply)


def _wait_symbols(c: Client, hexes: list[str], timeout: float = 120) -> None:
    """Until each of *hexes* is named by a symbol."""
    deadline = time.monotonic() + timeout
    while not all("symbol" in r for r in c.resolve(hexes)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no symbols at {hexes} after {timeout} s")
        time.sleep(0.2)


def _cold(c: Client, hexes: list[str]) -> tuple[float, list[dict[str, Any]]]:
    """The first Resolve with lines of a build, asked again while its table
    is being built: the time until the answer, and the answer."""
    t0 = time.perf_counter()
    while True:
        _, got = _timed(c, hexes)
        if not any("being built" in r.get("no_lines", "") for r in got):
            return time.perf_counter() - t0, got


def _wait_kept(c: Client, build_id: str, timeout: float = 120) -> None:
    """Until the table of *build_id* is kept: completed by the builder once
    the first call is answered (kreld.server.linebuild), so that the warm
    calls measure the table built, not the builder's last reading beside."""
    deadline = time.monotonic() + timeout
    while not any(t["build_id"] == build_id for t in c.call("Status")["line_tables"]["kept"]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the table of {build_id} not kept after {timeout} s")
        time.sleep(0.1)


def _warm(c: Client, hexes: list[str], reps: int = 5) -> tuple[float, list[dict[str, Any]]]:
    """The median time of *reps* Resolve with lines of *hexes*, and an answer."""
    runs = [_timed(c, hexes) for _ in range(reps)]
    return sorted(dt for dt, _ in runs)[reps // 2], runs[0][1]


def run(quick: bool) -> list[Result]:
    """Resolve with lines over the daemon's socket against llvm-symbolizer
    (vmlinux), eu-addr2line (brd.ko, xfs.ko) and drgn."""
    if not ensure_debug_files():
        log("no -dbg files: nothing measured")
        return []
    ref = vmlinux_sample(quick)
    mods = {name: module_sample(name, path, quick) for name, path in MODULES.items()}
    lo, size = text_range(VMLINUX, ".text")
    link_text = _link_text(VMLINUX)
    runtime = lambda addrs: [f"{RUNTIME_TEXT + a - link_text:#018x}" for a in addrs]  # noqa: E731
    placed = {name: _module_layout(path, MODULE_BASES[name]) for name, path in MODULES.items()}
    at = lambda name, picks: [f"{placed[name][s] + o:#018x}" for s, o in picks]  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="bench-lines-daemon-") as tmp:
        k, sock = _start(Path(tmp), link_text, lo + size)
        try:
            assert k.proc is not None
            with Client(str(sock)) as c:
                c.sock.settimeout(600)
                # The modules' symbol tables are captured (from their .ko)
                # first, so that the build's peak is the build's own.
                texts = [next(p for p in m.small if p[0] == ".text") for m in mods.values()]
                _wait_symbols(c, [at(n, [p])[0] for n, p in zip(mods, texts, strict=True)])
                base_rss = _vm(k.proc.pid, "VmRSS")
                log("cold: the first Resolve with lines builds the table")
                with _JointRss(k.proc.pid) as joint:
                    cold_dt, cold = _cold(c, runtime(ref.small))
                hwm = _vm(k.proc.pid)
                reader = _reader_peak(k, _build_id(VMLINUX))
                _wait_kept(c, _build_id(VMLINUX))
                log("warm: the 10,000 and the 100,000 again, five times each")
                w10, _ = _warm(c, runtime(ref.small))
                wbig, warm = _warm(c, runtime(ref.big))
                m_cold = {name: _cold(c, at(name, m.small)) for name, m in mods.items()}
                for path in MODULES.values():
                    _wait_kept(c, _build_id(path))
                log("modules warm")
                m_warm = {name: _warm(c, at(name, m.big)) for name, m in mods.items()}
                kept = c.call("Status")["line_tables"]["kept"]
                rss_after = _vm(k.proc.pid, "VmRSS")
                hwm_all = _vm(k.proc.pid)
                readers_all = max(int(e.get("reader_peak_rss") or 0) for e in k.events()
                                  if e.get("event") == "line_table")  # fmt: skip
        finally:
            k.stop()
    rss = (base_rss, hwm, rss_after, reader, joint.peak, joint.peak_anon)
    results = _vmlinux_results(ref, cold_dt, cold, w10, wbig, warm, rss)
    by_build = {t["build_id"]: t["size"] for t in kept}
    results.append(
        Result("daemon's kept table bytes, vs vmlinux's DWARF sections",
               by_build.get(_build_id(VMLINUX), 0), "", dwarf_bytes(VMLINUX), "dwarf",
               ".debug_* sections of vmlinux", "<= 1/4",
               by_build.get(_build_id(VMLINUX), 0) * 4 <= dwarf_bytes(VMLINUX))
    )  # fmt: skip
    for name, m in mods.items():
        results += _module_results(name, m, m_cold[name], m_warm[name])
    results.append(Result("daemon peak RSS (MiB) through every build", hwm_all / MIB, "",
                          goal="<= 512 MiB", met=hwm_all <= 512 * MIB))  # fmt: skip
    results.append(Result("the DWARF reader's peak RSS (MiB) through every build",
                          readers_all / MIB, "", goal="<= 512 MiB",
                          met=0 < readers_all <= 512 * MIB))  # fmt: skip
    return results


def _vmlinux_results(
    ref: Sample,
    cold_dt: float,
    cold: list[dict[str, Any]],
    w10: float,
    wbig: float,
    warm: list[dict[str, Any]],
    rss: tuple[int, int, int, int, int, int],
) -> list[Result]:
    base_rss, hwm, rss_after, reader, joint, joint_anon = rss
    small, big, l10 = ref.small, ref.big, ref.t_small
    ours_small, ours_big = _frames(cold), _frames(warm)
    eq_s, n_s = compare(ours_small, ref.refs_small, "vmlinux", small)
    eq_b, n_b = compare(ours_big, ref.refs_big, "vmlinux", big)
    nl_b = no_line_only(ours_big, ref.refs_big)
    log("drgn, the 10,000")
    lo, size = text_range(VMLINUX, ".text")
    d_dt, _ = drgn_frames(VMLINUX, small, lo, lo + size)
    warm_rate = len(big) / wbig
    llvm_desc = "llvm-symbolizer --inlines on the same addresses, same run"
    return [
        Result("daemon cold: first Resolve+lines of 10,000 (table built), vs llvm 10,000",
               cold_dt * 1e9, "ns", l10 * 1e9, "llvm", llvm_desc, "<= 2x", cold_dt <= 2 * l10),
        Result("daemon peak RSS (MiB) through the build, vs before it", hwm / MIB, "",
               base_rss / MIB, "before", "the daemon's RSS before the first build (the "
               "modules' symbols captured)", "<= 512 MiB", hwm <= 512 * MIB),
        Result("the DWARF reader's peak RSS (MiB) through the build, its own process", reader / MIB,
               "", goal="<= 512 MiB", met=0 < reader <= 512 * MIB),
        Result("daemon + reader RSS (MiB) sampled together every 5 ms, peak", joint / MIB, ""),
        Result("  the same of RssAnon (MiB): without the reader's map of vmlinux's DWARF",
               joint_anon / MIB, ""),
        Result("daemon RSS (MiB) after the builds and the warm calls, vs before the build",
               rss_after / MIB, "", base_rss / MIB, "before"),
        Result(f"daemon warm: addresses/s, Resolve+lines of {len(big)} over the socket",
               warm_rate, "", ref.loaded_rate, "llvm-loaded",
               "llvm-symbolizer: (N - 10,000) / (t(N) - t(10,000))", ">= 5x",
               warm_rate >= 5 * ref.loaded_rate),
        Result("daemon warm: Resolve+lines of 10,000 over the socket (s), vs llvm 10,000",
               w10 * 1e9, "ns", l10 * 1e9, "llvm", llvm_desc),
        Result(f"daemon answers equal to llvm-symbolizer, {n_s} named of 10,000 (cold)", eq_s,
               "", n_s, "named", "addresses llvm-symbolizer names a function at", "all",
               eq_s == n_s),
        Result(f"daemon answers equal to llvm-symbolizer, {n_b} named of {len(big)} (warm)",
               eq_b, "", n_b, "named", "", "all", eq_b == n_b),
        Result("  of the rest: the reference's function, no line (line program only)", nl_b, "",
               n_b - eq_b, "differing", "addresses where the answers differ"),
        Result("  of the rest: the reference's chain without its innermost frames (a .cold start)",
               inner_missing(ours_big, ref.refs_big), "", n_b - eq_b, "differing"),
        Result("drgn 10,000 (s), vs llvm-symbolizer 10,000", d_dt * 1e9, "ns", l10 * 1e9,
               "llvm", llvm_desc),
    ]  # fmt: skip


def _module_results(
    name: str,
    ref: Sample,
    cold: tuple[float, list[dict[str, Any]]],
    warm: tuple[float, list[dict[str, Any]]],
) -> list[Result]:
    keys = list(range(len(ref.big)))
    eq, n = compare(_frames(warm[1]), ref.refs_big, name, keys)
    nl = no_line_only(_frames(warm[1]), ref.refs_big)
    eq_c, n_c = compare(_frames(cold[1]), ref.refs_small, name, keys[: len(ref.small)])
    differ, odd, settled = eu_settled(MODULES[name], _frames(warm[1]), ref, ref.refs_big, ref.big)
    rate = len(ref.big) / warm[0]
    desc = "eu-addr2line -i -f -j SECTION, one run per section, same offsets, same run"
    return [
        Result(f"daemon {name}.ko cold: first Resolve+lines of {len(ref.small)} (table built), "
               f"vs eu {len(ref.small)}", cold[0] * 1e9, "ns", ref.t_small * 1e9, "eu", desc,
               "<= 2x", cold[0] <= 2 * ref.t_small),
        Result(f"daemon {name}.ko warm: addresses/s, Resolve+lines of {len(ref.big)}", rate, "",
               ref.loaded_rate, "eu-loaded", "eu-addr2line: (N - n) / (t(N) - t(n))", ">= 5x",
               rate >= 5 * ref.loaded_rate),
        Result(f"daemon {name}.ko answers equal to eu-addr2line (or where not, to llvm-"
               f"symbolizer), {n} named of {len(ref.big)} (warm)", eq + settled, "", n, "named",
               "offsets eu-addr2line names a function at", "all", eq + settled == n,
               notes=[f"{name} over the socket: equal to eu-addr2line at {eq} of {n}; at {nl} of "
                      f"the {differ} others, the reference's function without a line (line "
                      f"program only); at {odd} of them eu-addr2line's first line and its -i "
                      f"lines name other chains; at {settled} kreld's chain is llvm-symbolizer's "
                      "(on .text past the other code sections, the outermost name from the "
                      f"DWARF); cold answers equal at {eq_c} of {n_c}"]),
    ]  # fmt: skip


if __name__ == "__main__":
    sys.exit(bench_main("lines-daemon", run))
